// GradScaler (dynamic loss scaling) on the CPU, where its logic is the same as on a GPU: the loss
// gradient is multiplied by the scale, the parameter gradients divided by it before the step, an
// inf or NaN gradient skips the step and halves the scale, growth_interval clean steps double it,
// and its state survives a checkpoint round trip.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <map>
#include <string>

#include "tessera/comm/local.hpp"
#include "tessera/layers/linear.hpp"
#include "tessera/optim/sgd.hpp"
#include "tessera/train/grad_scaler.hpp"

using namespace tessera;

namespace {
struct IntegerState {
  std::map<std::string, std::int64_t> values;
  void integer(const std::string& name, std::int64_t& v) {
    if (values.count(name)) v = values[name];
    else values[name] = v;
  }
};
}  // namespace

TEST_CASE("GradScaler scales the loss gradient, unscales parameter gradients and steps on finite ones",
          "[train][grad_scaler]") {
  Rng rng(1);
  Linear<CpuLocal> layer(3, 2, rng);
  auto named = named_tensors(layer);
  Sgd<CpuLocal> sgd(named, {.lr = 0.5});
  GradScaler<CpuLocal> scaler(named, {.init_scale = 1024.0, .growth_interval = 2});

  const auto dy = Tensor<float>::from({1, 2}, {0.25f, -1.0f});
  const auto& scaled = scaler.scale_gradient(dy);
  CHECK(scaled[0] == 256.0f);
  CHECK(scaled[1] == -1024.0f);

  // Gradients as backward would leave them under scale 1024: the step must see them / 1024.
  const float w0 = layer.weight().value[0];
  layer.weight().grad.fill(1024.0f * 0.125f);
  layer.bias().grad.fill(1024.0f);
  CHECK(scaler.step(sgd));
  CHECK(layer.weight().value[0] == Approx(w0 - 0.5f * 0.125f));
  CHECK(layer.weight().grad[0] == 0.125f);
  CHECK(scaler.scale() == 1024.0);

  // A second clean step reaches growth_interval = 2: the scale doubles.
  sgd.zero_grad();
  CHECK(scaler.step(sgd));
  CHECK(scaler.scale() == 2048.0);
}

TEST_CASE("GradScaler skips the step and backs off on inf or NaN gradients", "[train][grad_scaler]") {
  Rng rng(2);
  Linear<CpuLocal> layer(4, 3, rng);
  auto named = named_tensors(layer);
  Sgd<CpuLocal> sgd(named, {.lr = 0.1});
  GradScaler<CpuLocal> scaler(named, {.init_scale = 65536.0, .growth_interval = 3});
  const Tensor<float> before = layer.weight().value;

  for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    layer.weight().grad.fill(1.0f);
    layer.bias().grad.fill(1.0f);
    layer.bias().grad[2] = bad;  // one bad element anywhere is enough
    CHECK_FALSE(scaler.step(sgd));
  }
  CHECK(scaler.scale() == 65536.0 / 4);
  CHECK(scaler.skipped_steps() == 2);
  for (std::int64_t i = 0; i < before.numel(); ++i) CHECK(layer.weight().value[i] == before[i]);  // untouched
  CHECK(sgd.steps() == 0);

  // A skip resets the growth counter: two clean steps are not yet three in a row.
  sgd.zero_grad();
  CHECK(scaler.step(sgd));
  CHECK(scaler.step(sgd));
  CHECK(scaler.scale() == 65536.0 / 4);
  CHECK(scaler.step(sgd));
  CHECK(scaler.scale() == 65536.0 / 2);
}

TEST_CASE("GradScaler state round-trips and disabled scaling is the identity", "[train][grad_scaler]") {
  Rng rng(3);
  Linear<CpuLocal> layer(2, 2, rng);
  auto named = named_tensors(layer);
  Sgd<CpuLocal> sgd(named, {.lr = 0.1});
  GradScaler<CpuLocal> scaler(named, {.init_scale = 8.0, .growth_interval = 5});
  layer.weight().grad.fill(std::numeric_limits<float>::infinity());
  scaler.step(sgd);  // scale 4
  sgd.zero_grad();
  scaler.step(sgd);  // one clean step
  IntegerState saved;
  scaler.visit_state(saved);
  GradScaler<CpuLocal> restored(named, {.init_scale = 8.0, .growth_interval = 5});
  restored.visit_state(saved);
  CHECK(restored.scale() == 4.0);
  for (int i = 0; i < 4; ++i) restored.step(sgd);  // 1 + 4 = 5 clean steps: grows
  CHECK(restored.scale() == 8.0);

  GradScaler<CpuLocal> off(named, {.enabled = false});
  CHECK(off.scale() == 1.0);
  layer.weight().grad.fill(std::numeric_limits<float>::infinity());
  CHECK(off.unscale());  // no checks when disabled, as torch's GradScaler(enabled=False)

  const GradScalerOptions zero_scale{.init_scale = 0.0};
  CHECK_THROWS_WITH((GradScaler<CpuLocal>(named, zero_scale)), Catch::Contains("init_scale=0"));
}
