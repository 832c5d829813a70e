// The CUDA half of the CPU-vs-CUDA equivalence test (see layer_equivalence.hpp), compiled by
// nvcc: every case on Env<Cuda, LocalComm>, plus the dropout mask's own check.
#include <cmath>

#include "cuda/layer_equivalence.hpp"
#include "tessera/device/cuda.cuh"
#include "tessera/layers/dropout.hpp"

namespace tessera::testing {

Outputs cuda_equivalence_case(std::string_view name) { return run_equivalence_case<CudaLocal>(name); }

int cuda_device_count() { return Cuda::device_count(); }

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

}  // namespace tessera::testing
