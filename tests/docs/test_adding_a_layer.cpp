// The layers written in docs/adding-a-layer.md compile, satisfy the Layer concept, pass the
// float64 gradient check (the public one, tessera/testing/gradcheck.hpp) and compose in a
// Sequential.
#include <catch2/catch.hpp>

#include <cmath>

#include "../../docs/adding_a_layer/channel_scale.hpp"
#include "../../docs/adding_a_layer/swish.hpp"
#include "support/gradcheck.hpp"
#include "tessera/comm/local.hpp"
#include "tessera/layers/activation.hpp"
#include "tessera/layers/sequential.hpp"

using namespace tessera;

static_assert(check_layer<ChannelScale<CpuLocal>>());
static_assert(check_layer<Swish<CpuLocal>>());

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

namespace {
struct WrongSwishOp : SwishOp {
  double derivative(double x, double y) const { return 1.01 * SwishOp::derivative(x, y); }
};
}  // namespace

TEST_CASE("docs/adding-a-layer: Swish, a pointwise op with state, in a few lines", "[layers]") {
  Rng rng(12);
  Swish<CpuLocal64> silu;  // beta = 1: torch.nn.SiLU
  Swish<CpuLocal64> sharp({.beta = 2.5});
  const auto x = testing::random_tensor({3, 7}, rng, 2.0);
  Swish<CpuLocal64>::Cache c;
  const auto& y = sharp.forward(x, c);
  for (std::int64_t i = 0; i < x.numel(); ++i) CHECK(y[i] == Approx(x[i] / (1 + std::exp(-2.5 * x[i]))).epsilon(1e-14));
  testing::check_gradients(silu, x, rng);
  testing::check_gradients(sharp, x, rng);
  // The public checker says which tensor is wrong: a derivative off by 1% fails on dx.
  Pointwise<CpuLocal64, WrongSwishOp> wrong;
  const auto report = testing::gradient_check(wrong, x, rng);
  CHECK(!report.passed());
  CHECK_THAT(report.describe(), Catch::Contains("dx (3, 7) relative error") && Catch::Contains("FAILED"));
}
