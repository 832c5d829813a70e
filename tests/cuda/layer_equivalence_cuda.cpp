// The CUDA half of the CPU-vs-CUDA equivalence test (see layer_equivalence.hpp): every case on
// Env<Cuda, LocalComm>, plus the dropout mask's own check.
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "cuda/layer_equivalence.hpp"
#include "tessera/comm/local_cuda.cuh"
#include "tessera/layers/dropout.hpp"
#include "tessera/train/grad_scaler.hpp"

namespace tessera::testing {

Outputs cuda_equivalence_case(std::string_view name) { return run_equivalence_case<CudaLocal>(name); }
Outputs cuda_equivalence_case_bf16(std::string_view name) { return run_equivalence_case<CudaLocalBf16>(name); }

int cuda_device_count() { return Cuda::device_count(); }

void cuda_set_cudnn_benchmark(bool on) { Cuda::set_cudnn_benchmark(on); }

// Dropout(p) on the GPU: every output is 0 or x / (1 - p), the kept fraction is 1 - p within
// 5 standard deviations, backward applies the same mask, and the same seed repeats the mask.
std::string cuda_dropout_check() {
  const double p = 0.3;
  const std::int64_t n = 100000;
  Rng rng(1);
  const auto x = seeded<float, Cuda>({n}, rng);
  const auto dy = seeded<float, Cuda>({n}, rng);
  auto run = [&](std::uint64_t seed, std::vector<double>& y, std::vector<double>& dx) {
    Dropout<CudaLocal> layer(p, seed);
    typename Dropout<CudaLocal>::Cache cache;
    y = host_values(layer.forward(x, cache));
    dx = host_values(layer.backward(dy, cache));
  };
  std::vector<double> y, dx, y_again, dx_again;
  run(42, y, dx);
  run(42, y_again, dx_again);
  const auto xh = host_values(x), dyh = host_values(dy);
  std::int64_t kept = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const bool keep = y[i] != 0;
    kept += keep;
    const double want_y = keep ? xh[i] / (1 - p) : 0, want_dx = keep ? dyh[i] / (1 - p) : 0;
    if (std::abs(y[i] - want_y) > 1e-5 * (1 + std::abs(want_y)))
      return detail::cat("dropout y[", i, "] = ", y[i], ", expected 0 or ", xh[i] / (1 - p));
    if (std::abs(dx[i] - want_dx) > 1e-5 * (1 + std::abs(want_dx)))
      return detail::cat("dropout dx[", i, "] = ", dx[i], ", expected ", want_dx, " (the forward mask)");
  }
  const double expected = (1 - p) * n, sigma = std::sqrt(n * p * (1 - p));
  if (std::abs(kept - expected) > 5 * sigma)
    return detail::cat("dropout kept ", kept, " of ", n, ", expected ", expected, " +- ", 5 * sigma);
  if (y != y_again) return "dropout with the same seed gave a different mask";
  return {};
}

namespace {
// One SGD step of a small ResNet on a seeded batch; returns the loss.
template <class Model>
double train_step(Model& model, Sgd<CudaLocal>& sgd, GradScaler<CudaLocal>* scaler, std::uint64_t seed) {
  Rng rng(seed);
  const auto x = seeded<float, Cuda>({8, 3, 16, 16}, rng);
  std::vector<std::int64_t> labels(8);
  for (auto& l : labels) l = static_cast<std::int64_t>(rng.uniform() * 10) % 10;
  typename Model::Cache cache{};
  CrossEntropyLoss<CudaLocal> loss;
  typename CrossEntropyLoss<CudaLocal>::Cache loss_cache;
  sgd.zero_grad();
  const double value = loss.forward(model.forward(x, cache), labels, loss_cache);
  const auto& dy = loss.backward(loss_cache);
  model.backward(scaler ? scaler->scale_gradient(dy) : dy, cache);
  if (scaler) scaler->step(sgd);
  else sgd.step();
  return value;
}
auto small_resnet() {
  return ResNet<CudaLocal, BasicBlock>({1, 1}, {8, 16}, false, ResNetOptions{.in_channels = 3, .num_classes = 10, .seed = 5});
}
}  // namespace

// Reduced-precision products stay close to float32, a ResNet trains under BFloat16 with a
// GradScaler (finite, decreasing loss), and the scaler skips a step with an inf gradient.
std::string cuda_mixed_precision_check() {
  struct Reset {
    ~Reset() { Cuda::set_math_precision(MathPrecision::Float32); }
  } reset;
  Rng init(1), rng(2);
  Linear<CudaLocal> layer(256, 128, init);
  Conv2d<CudaLocal> conv(32, 32, 3, init, 1, 1);
  const auto x = seeded<float, Cuda>({64, 256}, rng);
  const auto image = seeded<float, Cuda>({8, 32, 12, 12}, rng);
  typename Linear<CudaLocal>::Cache cache;
  typename Conv2d<CudaLocal>::Cache conv_cache;
  // Largest difference from float32, as a fraction of float32's largest |output|.
  const auto relative_error = [](const std::vector<double>& exact, const std::vector<double>& reduced) {
    double scale = 0, worst = 0;
    for (double v : exact) scale = std::max(scale, std::abs(v));
    for (std::size_t i = 0; i < exact.size(); ++i) worst = std::max(worst, std::abs(reduced[i] - exact[i]));
    return worst / scale;
  };
  Cuda::set_math_precision(MathPrecision::Float32);
  const auto exact = host_values(layer.forward(x, cache));
  const auto conv_exact = host_values(conv.forward(image, conv_cache));
  const std::pair<MathPrecision, const char*> precisions[] = {
      {MathPrecision::Float16, "Float16"}, {MathPrecision::BFloat16, "BFloat16"}, {MathPrecision::TensorFloat32, "TensorFloat32"}};
  for (const auto& [p, name] : precisions) {
    Cuda::set_math_precision(p);
    const double bound = p == MathPrecision::BFloat16 ? 3e-2 : 5e-3;  // 8 vs 11 significant bits (fp16, TF32)
    const double linear_error = relative_error(exact, host_values(layer.forward(x, cache)));
    if (!(linear_error <= bound))
      return detail::cat("Linear under ", name, " differs from float32 by ", linear_error, " of the output's range (bound ",
                         bound, ")");
    const double conv_error = relative_error(conv_exact, host_values(conv.forward(image, conv_cache)));
    if (!(conv_error <= bound))
      return detail::cat("Conv2d under ", name, " differs from float32 by ", conv_error, " of the output's range (bound ",
                         bound, ")");
  }
  // A precision that really reduces: TF32 products must differ from FMA float32 somewhere (else the
  // setting did not reach cuBLAS), yet stay within the bound above.
  Cuda::set_math_precision(MathPrecision::TensorFloat32);
  if (relative_error(exact, host_values(layer.forward(x, cache))) == 0)
    return "Linear under TensorFloat32 equals float32 exactly: TF32 did not reach cuBLAS";
  Cuda::set_math_precision(MathPrecision::BFloat16);
  auto model = small_resnet();
  auto named = named_tensors(model);
  Sgd<CudaLocal> sgd(named, {.lr = 0.05, .momentum = 0.9});
  GradScaler<CudaLocal> scaler(named, {});
  std::vector<double> losses;
  for (int step = 0; step < 6; ++step) losses.push_back(train_step(model, sgd, &scaler, 100));  // the same batch
  for (double l : losses)
    if (!std::isfinite(l)) return "a BFloat16 training step produced a non-finite loss";
  if (!(losses.back() < losses.front())) return detail::cat("BFloat16 training on one batch did not lower the loss: ",
                                                              losses.front(), " -> ", losses.back());
  if (sgd.steps() == 0) return "GradScaler skipped every step";
  const double before = scaler.scale();
  named.parameters.front().second->grad.fill(std::numeric_limits<float>::infinity());
  if (scaler.step(sgd)) return "GradScaler stepped on an inf gradient";
  if (scaler.scale() != before / 2) return detail::cat("GradScaler scale ", scaler.scale(), " after an overflow, expected ", before / 2);
  return {};
}

// After two warm-up steps, training steps call cudaMalloc zero times (the caching allocator,
// cached convolution plans and their shared workspace).
std::string cuda_steady_state_allocation_check() {
  auto model = small_resnet();
  auto named = named_tensors(model);
  Sgd<CudaLocal> sgd(named, {.lr = 0.05, .momentum = 0.9});
  for (int step = 0; step < 2; ++step) train_step(model, sgd, nullptr, 200 + step);
  const auto before = Cuda::allocator().stats().system_allocations;
  for (int step = 2; step < 5; ++step) train_step(model, sgd, nullptr, 200 + step);
  const auto after = Cuda::allocator().stats().system_allocations;
  if (after != before) return detail::cat(after - before, " cudaMalloc calls in 3 steady-state training steps");
  return {};
}

}  // namespace tessera::testing
