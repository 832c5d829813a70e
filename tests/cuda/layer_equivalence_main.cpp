// CPU-vs-CUDA equivalence of every layer, loss and optimizer with a CUDA kernel (the CPU half is
// this translation unit; the CUDA half is layer_equivalence_cuda.cpp). Prints one line per case; exits 77 (skipped) without a GPU.
//
// Tolerance: float32 on both devices, relative 2e-4 of max(1, |cpu|) per element: cuBLAS and
// Eigen sum products in different orders, and the GPU's exp/erf differ from glibc's in the last
// bits; the differences are a few float ulps times the length of the longest sum. The bfloat16
// cases (kBf16Cases: CudaLocalBf16 against the CPU's float32) have bounds of their own, stated
// and derived there.
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <utility>

#include "cuda/layer_equivalence.hpp"
#include "tessera/comm/local.hpp"

namespace tessera::testing {
Outputs cpu_equivalence_case(std::string_view name) { return run_equivalence_case<CpuLocal>(name); }
}  // namespace tessera::testing

int main() {
  using namespace tessera::testing;
  if (cuda_device_count() == 0) {
    std::printf("no CUDA device: %zu equivalence cases, %zu bfloat16 cases and 3 GPU checks skipped\n",
                std::size(kEquivalenceCases), std::size(kBf16Cases));
    return 77;
  }
  int failed = 0;
  const auto compare = [&](std::string_view name, const char* label) {
    std::string problem;
    double worst = 0;
    try {
      const Outputs cpu = cpu_equivalence_case(name), gpu = cuda_equivalence_case(name);
      for (const auto& [key, want] : cpu) {
        const auto it = gpu.find(key);
        if (it == gpu.end() || it->second.size() != want.size()) {
          problem = "output '" + key + "' missing or of another size on the GPU";
          break;
        }
        for (std::size_t i = 0; i < want.size() && problem.empty(); ++i) {
          const double diff = std::abs(it->second[i] - want[i]) / std::max(1.0, std::abs(want[i]));
          worst = std::max(worst, diff);
          if (!(diff <= 2e-4))
            problem = key + "[" + std::to_string(i) + "]: cuda " + std::to_string(it->second[i]) + ", cpu " +
                      std::to_string(want[i]);
        }
        if (!problem.empty()) break;
      }
    } catch (const std::exception& e) {
      problem = std::string("threw: ") + e.what();
    }
    std::printf("%-26s %s (max rel diff %.2e)%s%s\n", (std::string(name) + label).c_str(),
                problem.empty() ? "ok" : "FAILED", worst, problem.empty() ? "" : ": ", problem.c_str());
    failed += !problem.empty();
  };
  // The default plans (cuDNN's heuristics); then the convolutions again with the algorithms that
  // cudnn.benchmark-style timing picks, which are other kernels (FFT, Winograd, non-deterministic
  // backward-filter sums) and must give the same answers.
  for (std::string_view name : kEquivalenceCases) compare(name, "");
  cuda_set_cudnn_benchmark(true);
  for (std::string_view name : kEquivalenceCases)
    if (name.starts_with("conv2d") || name.starts_with("resnet")) compare(name, " (benchmark)");
  cuda_set_cudnn_benchmark(false);
  // bfloat16 products: each output's largest difference as a fraction of its largest |value|
  // (the parameter gradients as one output), within the case's bound, and above zero: every case
  // here has products that bf16 changes (else Env<Cuda, ..., BFloat16> did not reach cuBLAS or
  // cuDNN).
  for (const auto& [name, bound] : kBf16Cases) {
    std::string problem;
    double worst = 0;
    try {
      const Outputs cpu = cpu_equivalence_case(name), gpu = cuda_equivalence_case_bf16(name);
      std::map<std::string, std::pair<double, double>> groups;  // output -> (largest |cpu|, largest difference)
      for (const auto& [key, want] : cpu) {
        const auto it = gpu.find(key);
        if (it == gpu.end() || it->second.size() != want.size()) {
          problem = "output '" + key + "' missing or of another size on the GPU";
          break;
        }
        auto& [scale, diff] = groups[key.starts_with("grad.") ? "gradients" : key];
        for (std::size_t i = 0; i < want.size(); ++i) {
          scale = std::max(scale, std::abs(want[i]));
          diff = std::max(diff, std::abs(it->second[i] - want[i]));
          if (!std::isfinite(it->second[i])) problem = key + "[" + std::to_string(i) + "] is not finite";
        }
      }
      for (const auto& [key, scale_diff] : groups) {
        const double relative = scale_diff.second / std::max(scale_diff.first, 1e-30);
        worst = std::max(worst, relative);
        if (problem.empty() && !(relative <= bound))
          problem = key + " differs from float32 by " + std::to_string(relative) + " of its largest value";
      }
      if (problem.empty() && worst == 0)
        problem = "equals float32 exactly: the bfloat16 products did not run";
    } catch (const std::exception& e) {
      problem = std::string("threw: ") + e.what();
    }
    std::printf("%-26s %s (max diff %.2e of scale, bound %.1e)%s%s\n", (std::string(name) + " (bf16)").c_str(),
                problem.empty() ? "ok" : "FAILED", worst, bound, problem.empty() ? "" : ": ", problem.c_str());
    failed += !problem.empty();
  }
  const std::pair<const char*, std::string (*)()> checks[] = {
      {"dropout (distribution)", cuda_dropout_check},
      {"mixed precision", cuda_mixed_precision_check},
      {"no cudaMalloc when warm", cuda_steady_state_allocation_check},
  };
  for (const auto& [what, check] : checks) {
    std::string problem;
    try {
      problem = check();
    } catch (const std::exception& e) {
      problem = std::string("threw: ") + e.what();
    }
    std::printf("%-26s %s%s\n", what, problem.empty() ? "ok" : "FAILED: ", problem.c_str());
    failed += !problem.empty();
  }
  return failed == 0 ? 0 : 1;
}
