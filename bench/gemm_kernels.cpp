// The float32 matrix products of the MLP and of ResNet-50 (batch 8) on one thread, product by
// product, on each kernel this build can run them on: OpenBLAS's sgemm (what Tessera's gemm calls
// above 2^20 multiply-adds), Tessera's unpacked AVX-512 kernel (what the convolutions call,
// kernels/cpu/gemm_unpacked.hpp; a transposed B as gemm takes it: swapped, c^T = b a^T, for a
// Linear layer's forward at batch 64 to 128, gemm_swapped_bt_avx512, else as dot products,
// gemm_dot_bt_avx512), Tessera's packed kernel (what gemm calls above 2^20 multiply-adds in place
// of OpenBLAS: gemm_packed_avx512, or gemm_packed_avx2 without AVX-512) and oneDNN's sgemm
// (dnnl_sgemm, which Tessera does not call for float32: it allocates inside every call). On a CPU
// with AVX2 but no AVX-512 (a Zen 3), "unpacked" is the 8-lane kernel (gemm_unpacked_avx2: Winograd
// calls it there, and gemm on products with few rows or steps) on the products without a transposed
// B, and the 8-lane dot products (gemm_dot_bt_avx2) on the transposed ones gemm gives them. Each
// kernel's GFLOP/s is given next to the core's register-only FMA rate (12 independent chains of
// 512-bit FMAs, or 256-bit ones without AVX-512; no memory), and its heap allocations per call are
// counted (alloc_counter.hpp).
//
//   ./gemm_kernels [--runs=41]
//
// The kernels take turns within each run (a noisy machine slows all of them alike); medians. One
// thread: OpenMP's team is set to 1, so oneDNN's sgemm runs on one thread as the others do.
// Beside the products, the MLP step's SGD update alone (mlp_sgd_update_seconds), the part of that
// step no product kernel can speed up.
// Prints one JSON object (stdout) and a table (stderr). Never a timed test. bench/README.md,
// "Where the float32 products stand", has what it measured.

#include <immintrin.h>
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "tessera/kernels/cpu/gemm_packed_avx512.hpp"
#include "tessera/tessera.hpp"

#include "alloc_counter.hpp"

// OpenBLAS's Fortran interface (column-major), as kernels/cpu/gemm.hpp declares it.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);
extern "C" void openblas_set_num_threads(int threads);

using namespace tessera;

namespace {

// One row-major product C (m, n) = op(A) (m, k) op(B) (k, n), and where a network runs it.
struct Product {
  const char* name;
  bool trans_a, trans_b;
  int m, n, k;
};

// The MLP of bench/compare_pytorch.py (784-512-256-10, batch 128; bench/gemm_ceiling.py lists
// the same) and ResNet-50's convolutions at batch 8 as Tessera runs them: a 1x1 layer C -> K on a
// block of `cols` output pixels is forward W (K, C) x (C, cols), input gradient W^T dY and weight
// gradient dY X^T; a strided 3x3 layer goes through im2col (C 9 rows).
const Product kProducts[] = {
    {"mlp forward 784->512", false, true, 128, 512, 784},
    {"mlp weight grad 784->512", true, false, 512, 784, 128},
    {"mlp forward 512->256", false, true, 128, 256, 512},
    {"mlp weight grad 512->256", true, false, 256, 512, 128},
    {"mlp input grad 512->256", false, false, 128, 512, 256},
    {"conv fwd 1x1 64->256 56x56", false, false, 256, 3136, 64},
    {"conv fwd 1x1 256->64 56x56", false, false, 64, 3136, 256},
    {"conv fwd 1x1 512->128 28x28", false, false, 128, 784, 512},
    {"conv fwd 1x1 1024->256 14x14 b8", false, false, 256, 1568, 1024},
    {"conv fwd 1x1 2048->512 7x7 b8", false, false, 512, 392, 2048},
    {"conv fwd 3x3/2 128 im2col 28x28", false, false, 128, 784, 1152},
    {"conv dx 1x1 256->64 56x56", true, false, 256, 3136, 64},
    {"conv dx 1x1 2048->512 7x7 b8", true, false, 2048, 392, 512},
    // thin input gradients (one block of 1 or 5 samples): a, the weights, over 1 MiB
    {"conv dx 1x1 1024->256 14x14 1 img", true, false, 1024, 196, 256},
    {"conv dx 3x3 512 im2col 7x7 5 img", true, false, 4608, 245, 512},
    {"conv dW 1x1 64->256 56x56", false, true, 256, 64, 3136},
    {"conv dW 1x1 1024->256 14x14 b8", false, true, 256, 1024, 1568},
    // LeNet-5's weight gradients (batch 64; blocks of 6 and 8 samples): a few rows, b transposed
    {"lenet conv dW 5x5 1->6 28x28 6 img", false, true, 6, 25, 4704},
    {"lenet conv dW 5x5 6->16 10x10 8 img", false, true, 16, 150, 800},
    // LeNet-5's second convolution forward and dx, and the MLP's last layer (10 classes): on AVX2
    // CPUs gemm gives these to the 8-lane kernels (gemm.hpp, unpacked_suits_avx2)
    {"lenet conv fwd 5x5 6->16 10x10 8 img", false, false, 16, 800, 150},
    {"lenet conv dx 5x5 6->16 10x10 8 img", true, false, 150, 800, 16},
    {"mlp forward 256->10", false, true, 128, 10, 256},
    {"mlp weight grad 256->10", true, false, 10, 256, 128},
    {"mlp input grad 256->10", false, false, 128, 256, 10},
};

// /proc/cpuinfo's first "vendor_id", "cpu family", "model" and "model name": the JSON names its CPU.
std::string cpu_description() {
  std::string out;
  for (const std::string key : {"vendor_id", "cpu family", "model", "model name"}) {
    std::ifstream f("/proc/cpuinfo");
    for (std::string line; std::getline(f, line);) {
      const std::size_t colon = line.find(':');
      if (colon == std::string::npos || line.substr(0, line.find_last_not_of(" \t", colon - 1) + 1) != key) continue;
      out += (out.empty() ? "" : ", ") + key + " " + line.substr(std::min(line.size(), colon + 2));
      break;
    }
  }
  return out;
}

enum Kernel { kOpenBlas, kUnpacked, kPacked, kOneDnn, kKernels };
const char* const kKernelNames[kKernels] = {"openblas", "unpacked", "packed", "onednn"};

// Floating-point operations per second of 12 independent chains of FMAs, 512-bit (__m512) or
// 256-bit (__m256, on a CPU without AVX-512), 2 FLOPs per FMA per lane: the most any kernel can
// reach on this core. Best of 5.
// (A macro, not a template: the body must be compiled under each function's own target attribute.)
#define TESSERA_FMA_PEAK_BODY(V, lanes, fmadd, set1, sum_lanes)                                \
  constexpr int kChains = 12;                                                                   \
  constexpr long kRounds = 4000000;                                                             \
  double best = 1e30;                                                                           \
  float sink = 0;                                                                               \
  for (int trial = 0; trial < 5; ++trial) {                                                     \
    V acc[kChains];                                                                             \
    for (int i = 0; i < kChains; ++i) acc[i] = set1(1.0f + 1e-7f * i);                          \
    const V scale = set1(0.9999999f), shift = set1(1e-7f);                                      \
    const auto t0 = std::chrono::steady_clock::now();                                           \
    for (long r = 0; r < kRounds; ++r) {                                                        \
      _Pragma("GCC unroll 12") for (int i = 0; i < kChains; ++i) {                              \
        acc[i] = fmadd(acc[i], scale, shift);                                                   \
        asm volatile("" : "+v"(acc[i])); /* each FMA is executed, none folded away */           \
      }                                                                                         \
    }                                                                                           \
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()); \
    for (int i = 0; i < kChains; ++i) sink += sum_lanes(acc[i]);                                \
  }                                                                                             \
  if (sink == 12345.0f) std::fprintf(stderr, " "); /* keeps the chains live */                  \
  return 2.0 * (lanes) * kChains * kRounds / best / 1e9;

__attribute__((target("avx512f"), noinline)) double fma_peak_gflops_avx512() {
  TESSERA_FMA_PEAK_BODY(__m512, 16, _mm512_fmadd_ps, _mm512_set1_ps, _mm512_reduce_add_ps)
}

__attribute__((target("avx2,fma"), noinline)) float sum_first_last(__m256 a) {
  return _mm256_cvtss_f32(a) + _mm256_cvtss_f32(_mm256_permute2f128_ps(a, a, 1));
}

__attribute__((target("avx2,fma"), noinline)) double fma_peak_gflops_avx2() {
  TESSERA_FMA_PEAK_BODY(__m256, 8, _mm256_fmadd_ps, _mm256_set1_ps, sum_first_last)
}

double fma_peak_gflops() { return cpu_avx512() ? fma_peak_gflops_avx512() : fma_peak_gflops_avx2(); }

// C = op(A) op(B) (beta 0) by one kernel; false where the kernel does not take this product.
bool run(Kernel kernel, const Product& p, const float* a, const float* b, float* c) {
  const int lda = p.trans_a ? p.m : p.k, ldb = p.trans_b ? p.k : p.n, ldc = p.n;
  switch (kernel) {
    case kOpenBlas: {  // row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T
      const char ta = p.trans_a ? 'T' : 'N', tb = p.trans_b ? 'T' : 'N';
      const float one = 1, zero = 0;
      sgemm_(&tb, &ta, &p.n, &p.m, &p.k, &one, b, &ldb, a, &lda, &zero, c, &ldc);
      return true;
    }
    case kUnpacked:
      if (!cpu_avx512()) {  // AVX2: the 8-lane kernel; b transposed, its dot products where gemm takes them
        if (p.trans_b) {
          if (p.trans_a || !detail::unpacked_suits_avx2(p.trans_a, p.trans_b, p.m, p.n, p.k)) return false;
          detail::gemm_dot_bt_avx2(p.m, p.n, p.k, a, lda, b, ldb, 0.0f, c, ldc);
          return true;
        }
        detail::gemm_unpacked_avx2(p.trans_a, p.m, p.n, p.k, a, lda, b, ldb, 0.0f, c, ldc,
                                   detail::unpacked_depth_block(p.n));
        return true;
      }
      if (p.trans_b && p.trans_a) return false;
      if (p.trans_b) {  // as gemm picks: swapped (c^T = b a^T) where swapped_bt_suits, else dot products
        if (detail::swapped_bt_suits(p.trans_a, p.trans_b, p.m, p.n, p.k)) {
          thread_local std::vector<float> at, ct;  // grown on the warm-up call, before the timing
          at.resize(static_cast<std::size_t>(p.k) * p.m);
          ct.resize(static_cast<std::size_t>(p.n) * p.m);
          detail::gemm_swapped_bt_avx512(p.m, p.n, p.k, a, lda, b, ldb, 0.0f, c, ldc, at.data(), ct.data());
        }
        else
          detail::gemm_dot_bt_avx512(p.m, p.n, p.k, a, lda, b, ldb, 0.0f, c, ldc);
        return true;
      }
      // conv_gemm's depth blocks (kernels/cpu/conv2d.hpp): thin products take deeper ones.
      detail::gemm_unpacked_avx512(p.trans_a, p.m, p.n, p.k, a, lda, b, ldb, 0.0f, c, ldc,
                                   detail::unpacked_depth_block(p.n));
      return true;
    case kPacked: {  // Tessera's packed kernel, in the buffers gemm would give it (grown on the warm-up call)
      thread_local Tensor<float, Cpu> packed_a(Shape{1}), packed_b(Shape{1});
      const bool wide = cpu_avx512();
      const std::int64_t a_floats = wide ? detail::packed_avx512_a_floats(p.m, p.k) : detail::packed_avx2_a_floats(p.m, p.k);
      const std::int64_t b_floats = wide ? detail::packed_avx512_b_floats(p.n, p.k) : detail::packed_avx2_b_floats(p.n, p.k);
      if (packed_a.numel() < a_floats) packed_a = Tensor<float, Cpu>(Shape{a_floats});
      if (packed_b.numel() < b_floats) packed_b = Tensor<float, Cpu>(Shape{b_floats});
      (wide ? detail::gemm_packed_avx512 : detail::gemm_packed_avx2)(p.trans_a, p.trans_b, p.m, p.n, p.k, 1.0f, a, lda,
                                                                    b, ldb, 0.0f, c, ldc, packed_a.data(),
                                                                    packed_b.data());
      return true;
    }
    case kOneDnn:
      return dnnl_sgemm(p.trans_a ? 'T' : 'N', p.trans_b ? 'T' : 'N', p.m, p.n, p.k, 1.0f, a, lda, b, ldb, 0.0f, c,
                        ldc) == dnnl_success;
    default: return false;
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Row {
  const Product* product;
  double gflops[kKernels];  // 0: the kernel does not take this product
  double allocations_per_call[kKernels];
  double max_difference[kKernels];  // against OpenBLAS's C, relative to max |C|
};

Row measure(const Product& p, int runs) {
  Rng rng(7);
  const std::int64_t a_size = std::int64_t{p.m} * p.k, b_size = std::int64_t{p.k} * p.n, c_size = std::int64_t{p.m} * p.n;
  Tensor<float, Cpu> a(Shape{a_size}), b(Shape{b_size});
  uniform_(a, -1.0, 1.0, rng);
  uniform_(b, -1.0, 1.0, rng);
  std::vector<std::vector<float>> c(kKernels, std::vector<float>(static_cast<std::size_t>(c_size)));
  std::vector<std::vector<double>> seconds(kKernels);
  Row row{&p, {}, {}, {}};
  bool takes[kKernels];
  for (int kernel = 0; kernel < kKernels; ++kernel)  // warm-up: oneDNN generates its kernels here
    takes[kernel] = run(static_cast<Kernel>(kernel), p, a.data(), b.data(), c[kernel].data());
  long allocations[kKernels] = {};
  for (int r = 0; r < runs; ++r) {
    for (int kernel = 0; kernel < kKernels; ++kernel) {
      if (!takes[kernel]) continue;
      g_allocations = 0;
      g_counting = true;
      const auto t0 = std::chrono::steady_clock::now();
      run(static_cast<Kernel>(kernel), p, a.data(), b.data(), c[kernel].data());
      const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      g_counting = false;
      allocations[kernel] += g_allocations.load();
      seconds[kernel].push_back(took);
    }
  }
  double scale = 0;
  for (float v : c[kOpenBlas]) scale = std::max(scale, static_cast<double>(std::fabs(v)));
  const double flops = 2.0 * p.m * p.n * p.k;
  for (int kernel = 0; kernel < kKernels; ++kernel) {
    if (!takes[kernel]) continue;
    row.gflops[kernel] = flops / median(seconds[kernel]) / 1e9;
    row.allocations_per_call[kernel] = static_cast<double>(allocations[kernel]) / runs;
    double diff = 0;
    for (std::int64_t i = 0; i < c_size; ++i)
      diff = std::max(diff, static_cast<double>(std::fabs(c[kernel][i] - c[kOpenBlas][i])));
    row.max_difference[kernel] = diff / std::max(scale, 1e-30);
    // Same products, summed in another order: a kernel that disagrees beyond rounding is wrong,
    // and its speed means nothing.
    TESSERA_CHECK(row.max_difference[kernel] < 1e-4, Error,
                  std::string(kKernelNames[kernel]) + " disagrees with OpenBLAS on " + p.name);
  }
  return row;
}

// The MLP step's other floor: its SGD update (momentum 0.9, weight decay 1e-4, as train_throughput
// steps it) over the 535,818 parameters, tensor by tensor as Sgd calls it. Each element reads the
// weight, its gradient and its momentum and writes two back, 20 bytes, 10.7 MB a step: more than a
// core's L2, so a 16 MB pass evicts them before each timed update, as the step's products do.
// Median seconds of `runs` updates.
double mlp_sgd_update_seconds(int runs, std::int64_t& parameters) {
  const std::int64_t sizes[] = {512 * 784, 512, 256 * 512, 256, 10 * 256, 10};
  std::vector<std::vector<float>> weight, grad, momentum;
  parameters = 0;
  for (std::int64_t n : sizes) {
    weight.emplace_back(static_cast<std::size_t>(n), 0.5f);
    grad.emplace_back(static_cast<std::size_t>(n), 0.01f);
    momentum.emplace_back(static_cast<std::size_t>(n), 0.02f);
    parameters += n;
  }
  std::vector<float> evict(std::size_t{4} << 20, 1.0f);
  const SgdStep step{.lr = 0.01, .momentum = 0.9, .dampening = 0, .weight_decay = 1e-4, .nesterov = false,
                     .first_step = false};
  std::vector<double> seconds;
  float sink = 0;
  for (int r = 0; r < runs + 1; ++r) {  // the first update warms pages and is not timed
    for (std::size_t i = 0; i < evict.size(); i += 16) sink += evict[i];
    evict[static_cast<std::size_t>(r) % evict.size()] = sink;
    const auto t0 = std::chrono::steady_clock::now();
    for (std::size_t t = 0; t < weight.size(); ++t)
      sgd_update(Cpu{}, sizes[t], weight[t].data(), grad[t].data(), momentum[t].data(), step);
    if (r > 0) seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return median(seconds);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Flags flags(argc, argv);
    const int runs = flags.get("runs", 41, {.min = 1});
    flags.finish();
    TESSERA_CHECK(cpu_avx2(), Error,
                  "gemm_kernels measures the AVX-512 and AVX2 kernels; this CPU has neither (or "
                  "TESSERA_CPU_CAPABILITY=default)");
    Cpu::set_num_threads(1);
    const std::string blas = cpu_gemm_kernel();  // OpenBLAS's core checked (and replaced) first
    openblas_set_num_threads(1);
    const double peak = fma_peak_gflops();
    std::vector<Row> rows;
    std::fprintf(stderr, "one thread; register-only FMA rate %.1f GFLOP/s\n%-34s %9s %9s %9s %9s   allocations/call\n",
                 peak, "product (m x n x k)", "openblas", "unpacked", "packed", "onednn");
    for (const Product& p : kProducts) {
      rows.push_back(measure(p, runs));
      const Row& r = rows.back();
      std::fprintf(stderr, "%-34s", p.name);
      for (int kernel = 0; kernel < kKernels; ++kernel)
        r.gflops[kernel] > 0 ? std::fprintf(stderr, " %9.1f", r.gflops[kernel]) : std::fprintf(stderr, " %9s", "-");
      std::fprintf(stderr, "   %.0f / %.0f / %.0f / %.0f\n", r.allocations_per_call[0], r.allocations_per_call[1],
                   r.allocations_per_call[2], r.allocations_per_call[3]);
    }
    std::int64_t parameters = 0;
    const double sgd_s = mlp_sgd_update_seconds(runs, parameters);
    const double sgd_bytes = 20.0 * static_cast<double>(parameters);
    std::fprintf(stderr, "MLP's SGD update (%lld parameters, %.1f MB streamed): %.1f us, %.1f GB/s\n",
                 static_cast<long long>(parameters), sgd_bytes / 1e6, sgd_s * 1e6, sgd_bytes / sgd_s / 1e9);
    std::printf("{\"benchmark\": \"gemm_kernels\", \"cpu\": \"%s\", \"threads\": 1, \"runs\": %d, \"gemm\": \"%s\", "
                "\"unpacked_kernel\": \"%s\", "
                "\"onednn\": \"%s\", \"fma_peak_gflops\": %.2f, \"mlp_sgd_update\": {\"parameters\": %lld, "
                "\"bytes_streamed\": %.0f, \"median_us\": %.2f, \"gb_per_s\": %.2f}, \"products\": [",
                cpu_description().c_str(), runs, blas.c_str(), cpu_avx512() ? "avx512" : "avx2 (no AVX-512 here)",
                onednn_version().c_str(), peak,
                static_cast<long long>(parameters), sgd_bytes, sgd_s * 1e6, sgd_bytes / sgd_s / 1e9);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      std::printf("%s{\"name\": \"%s\", \"trans_a\": %s, \"trans_b\": %s, \"m\": %d, \"n\": %d, \"k\": %d", i ? ", " : "",
                  r.product->name, r.product->trans_a ? "true" : "false", r.product->trans_b ? "true" : "false",
                  r.product->m, r.product->n, r.product->k);
      for (int kernel = 0; kernel < kKernels; ++kernel) {
        if (r.gflops[kernel] <= 0) continue;
        std::printf(", \"%s\": {\"gflops\": %.2f, \"of_fma_peak\": %.3f, \"allocations_per_call\": %.2f, "
                    "\"max_relative_difference\": %.2e}",
                    kKernelNames[kernel], r.gflops[kernel], r.gflops[kernel] / peak, r.allocations_per_call[kernel],
                    r.max_difference[kernel]);
      }
      std::printf("}");
    }
    std::printf("]}\n");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
