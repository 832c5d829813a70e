// The layer written in docs/adding-a-layer.md compiles, satisfies the Layer concept, passes the
// float64 gradient check and composes in a Sequential.
#include <catch2/catch.hpp>

#include "../../docs/adding_a_layer/channel_scale.hpp"
#include "support/gradcheck.hpp"
#include "tessera/comm/local.hpp"
#include "tessera/layers/activation.hpp"
#include "tessera/layers/sequential.hpp"

using namespace tessera;

static_assert(Layer<ChannelScale<CpuLocal>>);

TEST_CASE("docs/adding-a-layer: ChannelScale passes the gradient check", "[layers]") {
  Rng rng(11);
  ChannelScale<CpuLocal64> scale(3);
  auto named = named_tensors(scale);
  for (auto& [n, p] : named.parameters) testing::normal_fill(p->value, rng);
  testing::check_gradients(scale, testing::random_tensor({2, 3, 4, 5}, rng), rng);
  Sequential seq{ChannelScale<CpuLocal64>(3), ReLU<CpuLocal64>()};
  testing::check_gradients(seq, testing::random_tensor({2, 3, 2, 2}, rng), rng);
  CHECK(named_tensors(seq).parameters[0].first == "0.alpha");
}
