// Fused scaled dot-product attention (ScaledDotProductAttention, kernels/cpu/attention.hpp): the time
// of a forward and of a backward, or the extra memory of one forward + backward, as JSON.
//
//   ./attention [--t=1024] [--batch=1] [--heads=12] [--head-dim=64] [--causal=true] [--threads=2]
//               [--steps=10] [--warmup=2]
//   ./attention --memory [--t=1024] ...
//
// Time: float32 q, k, v (B, H, T, d) of N(0, 1) values; `warmup` untimed forward + backward pairs,
// then `steps` timed ones; reports the medians of forward, backward and their sum, and the heap
// allocations the timed pairs made (alloc_counter.hpp; tests/bench/check_steady_allocations.py
// wants 0).
// --memory: one forward + backward in this fresh process. VmHWM (/proc/self/status) after q, k, v
// and the upstream gradient exist (the baseline) and after the backward; "extra" is the growth
// minus what the call must return (out, dq, dk, dv: 4 B H T d floats), i.e. the attention's own
// working memory: the per-row log-sum-exp and the per-thread tiles for the fused kernel (linear
// in T), a (B, H, T, T) score matrix for an unfused one. bench/compare_attention.py runs both next
// to PyTorch's matmul, mask, softmax, matmul. Never a timed test.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "tessera/tessera.hpp"

#include "alloc_counter.hpp"
#include "proc_status.hpp"

using namespace tessera;
using E = CpuLocal;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Flags flags(argc, argv);
    const bool memory = flags.get("memory", false);
    const std::int64_t t = flags.get("t", std::int64_t{1024}, {.min = 1});
    const std::int64_t batch = flags.get("batch", std::int64_t{1}, {.min = 1});
    const std::int64_t heads = flags.get("heads", std::int64_t{12}, {.min = 1});
    const std::int64_t head_dim = flags.get("head-dim", std::int64_t{64}, {.min = 1});
    const bool causal = flags.get("causal", true);
    const int threads = flags.threads("threads", 2);
    const int steps = flags.get("steps", 10, {.min = 1});
    const int warmup = flags.get("warmup", 2, {.min = 1});
    flags.finish();
    Cpu::set_num_threads(threads);

    const long long start = proc_status_bytes("VmHWM");
    Tensor<float> q({batch, heads, t, head_dim}), k(q.shape()), v(q.shape()), g(q.shape());
    Rng rng(5);
    for (Tensor<float>* x : {&q, &k, &v, &g}) normal_(*x, 0.0, 1.0, rng);
    ScaledDotProductAttention<E> attention(causal);
    ScaledDotProductAttention<E>::Cache cache;
    const long long operand_bytes = 4LL * q.numel() * static_cast<long long>(sizeof(float));
    std::printf("{\"framework\": \"tessera\", \"kernel\": \"fused tiled attention (online softmax)\", \"batch\": %lld, "
                "\"heads\": %lld, \"t\": %lld, \"head_dim\": %lld, \"causal\": %s, \"threads\": %d, \"gemm\": \"%s\", ",
                static_cast<long long>(batch), static_cast<long long>(heads), static_cast<long long>(t),
                static_cast<long long>(head_dim), causal ? "true" : "false", threads, cpu_gemm_kernel().c_str());
    if (memory) {
      const long long baseline = proc_status_bytes("VmHWM");
      attention.forward(q, k, v, cache);
      const auto grads = attention.backward(g, cache);
      const long long peak = proc_status_bytes("VmHWM");
      const long long returned = operand_bytes;  // out, dq, dk, dv
      std::printf("\"mode\": \"memory\", \"vmhwm_start_bytes\": %lld, \"vmhwm_baseline_bytes\": %lld, "
                  "\"vmhwm_after_backward_bytes\": %lld, \"returned_bytes\": %lld, \"extra_bytes\": %lld, "
                  "\"finite\": %s}\n",
                  start, baseline, peak, returned, std::max(0LL, peak - baseline - returned),
                  std::isfinite(grads.dq[0]) && std::isfinite(cache.out[0]) ? "true" : "false");
      return 0;
    }
    std::vector<double> forward_s, backward_s;
    forward_s.reserve(static_cast<std::size_t>(steps));  // the timed pairs' own allocations: none
    backward_s.reserve(static_cast<std::size_t>(steps));
    for (int i = 0; i < warmup + steps; ++i) {
      if (i == warmup) {
        g_allocations = 0;
        g_counting = true;
      }
      auto t0 = std::chrono::steady_clock::now();
      attention.forward(q, k, v, cache);
      const double f = seconds_since(t0);
      t0 = std::chrono::steady_clock::now();
      attention.backward(g, cache);
      const double b = seconds_since(t0);
      if (i >= warmup) {
        forward_s.push_back(f);
        backward_s.push_back(b);
      }
    }
    g_counting = false;
    std::vector<double> total_s(forward_s.size());
    for (std::size_t i = 0; i < total_s.size(); ++i) total_s[i] = forward_s[i] + backward_s[i];
    std::printf("\"mode\": \"time\", \"steps\": %d, \"median_forward_s\": %.6f, \"median_backward_s\": %.6f, "
                "\"median_forward_backward_s\": %.6f, \"allocations_in_timed_steps\": %ld, \"finite\": %s}\n",
                steps, median(forward_s), median(backward_s), median(total_s), g_allocations.load(),
                std::isfinite(cache.out[0]) ? "true" : "false");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
