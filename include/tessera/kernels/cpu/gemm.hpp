// gemm: C = alpha * op(A) * op(B) + beta * C on row-major matrices, the one matrix product every
// CPU layer goes through (Linear directly; Conv2d after im2col).
//
// Shapes: op(A) is (m, k), op(B) is (k, n), C is (m, n); lda/ldb/ldc are row strides.
//
// The inner kernel is Eigen's blocked GEMM (gebp), called through general_matrix_matrix_product
// with packing buffers that this file owns, one pair per thread, grown once and then reused.
// Eigen's own entry point (`C.noalias() += A * B`) packs into the stack below 128 KiB and into a
// fresh heap block above it, i.e. several mallocs per product, which would break the "a steady-state
// training step allocates nothing" rule.
// Threads: called from outside a parallel region, a large product is split over the OpenMP team
// by rows or columns of C (whichever is longer); from inside one (Conv2d's per-thread blocks) it
// runs on the calling thread. Do not compile with EIGEN_USE_BLAS: Eigen would then route this call
// to the system BLAS with its own threads, which fight the OpenMP team (Debian's OpenBLAS on 2
// threads ran a (2048, 512) x (512, 49) product several times slower than Eigen split over the team).
//
// With TESSERA_OPENBLAS (the meson option openblas, on when libopenblas-dev is installed) the
// per-thread product is OpenBLAS's sgemm/dgemm, run on one thread: its AVX-512 kernels
// (Cooperlake/SkylakeX/SapphireRapids, picked at run time) beat Eigen's gebp on one Zen 4 core on
// every ResNet shape measured (bench/README.md, "GEMM"). The splitting over the team stays
// Tessera's; OpenBLAS's thread count is set to 1 once, on first use, and its idle pool stopped.
// With AVX-512, some short float products go to Tessera's unpacked kernel instead (unpacked_suits),
// and the other float products above 2^20 multiply-adds to its packed kernel (packed_avx512_suits):
// OpenBLAS 0.3.21 runs a Zen 5 on its AVX2 ("Haswell") kernels, at half the speed.
//
// With TESSERA_COMPILED_KERNELS (kernels/cpu/compiled.hpp) only the declaration below is visible:
// the float and double instances come from src/kernels_cpu.cpp, and Eigen is not parsed here.
#pragma once

#include <strings.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "tessera/kernels/cpu/capability.hpp"
#include "tessera/kernels/cpu/compiled.hpp"
#include "tessera/kernels/cpu/simd_diagnostics.hpp"  // before Eigen: its <immintrin.h> warnings
#if !TESSERA_CPU_KERNELS_EXTERN
#include <Eigen/Core>

#include "tessera/kernels/cpu/gemm_packed_avx2.hpp"
#include "tessera/kernels/cpu/gemm_packed_avx512.hpp"
#include "tessera/kernels/cpu/gemm_unpacked.hpp"
#include "tessera/kernels/cpu/gemm_unpacked_avx2.hpp"
#endif

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(TESSERA_OPENBLAS) && !TESSERA_CPU_KERNELS_EXTERN
#include <climits>
extern "C" {
// The Fortran interface (column-major), declared here rather than through cblas.h, whose
// location differs between OpenBLAS's pthread/openmp/serial flavours.
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
}
#endif

namespace tessera::detail {

// The OpenBLAS core this CPU should run where OpenBLAS's detection fell back to a generic one, or
// nullptr. OpenBLAS knows CPUs by family and model: 0.3.21 (Debian 12) does not know Emerald Rapids
// (family 6, model 207) and runs it as "Prescott", its SSE3 fallback, whose sgemm does 4 float
// multiply-adds per instruction where the AVX-512 kernels do 16 (bench/README.md, "OpenBLAS on a
// CPU it does not know", has what it cost ResNet-50). So: a detected core without AVX2 kernels on
// a CPU with AVX-512 (F, BW, DQ, VL) becomes Cooperlake where the CPU has AVX512-BF16 (what
// OpenBLAS picks for Sapphire Rapids and AMD Zen 4/5) else SkylakeX; on a CPU with AVX2 and FMA,
// Haswell. A detected core with AVX2 or better, and any core the user forces with
// OPENBLAS_CORETYPE, stay as they are.
inline const char* openblas_better_core(const char* detected) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  // OpenBLAS's x86-64 cores without AVX2 kernels (its corename table, lower case).
  static const char* const generic[] = {"unknown",   "prescott", "core2",      "penryn",   "dunnington", "nehalem",
                                        "atom",      "nano",     "katmai",     "coppermine", "northwood", "banias",
                                        "athlon",    "opteron",  "opteron_sse3", "barcelona", "bobcat",   "sandybridge"};
  bool is_generic = false;
  for (const char* g : generic) is_generic = is_generic || strcasecmp(detected, g) == 0;
  if (!is_generic) return nullptr;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl"))
    return __builtin_cpu_supports("avx512bf16") ? "Cooperlake" : "SkylakeX";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
#else
  (void)detected;
#endif
  return nullptr;
}

}  // namespace tessera::detail

#if defined(TESSERA_OPENBLAS)
extern "C" {
char* openblas_get_corename(void);
// OpenBLAS's core selection, exported by its DYNAMIC_ARCH builds (Debian's) and absent from a
// build for one core, hence weak: quit forgets the core, init picks one again, reading
// OPENBLAS_CORETYPE first (driver/others/dynamic.c).
void gotoblas_dynamic_init(void) __attribute__((weak));
void gotoblas_dynamic_quit(void) __attribute__((weak));
void openblas_set_num_threads(int threads);
// Exported by OpenBLAS's threaded builds (pthread and OpenMP) and absent from the serial one, hence weak.
int blas_thread_shutdown_(void) __attribute__((weak));
}

namespace tessera::detail {

// Replaces a fallback core (openblas_better_core) once, before Tessera's first product, the way
// OPENBLAS_CORETYPE would have at load time: the variable is set, OpenBLAS's own selection runs
// again, and the variable is removed (child processes detect for themselves). Returns the name of
// the core it replaced ("" when none was). Nothing changes when OPENBLAS_CORETYPE is set, or in an
// OpenBLAS without run-time selection. Called under a static guard from the first gemm (before any
// Tessera thread is inside OpenBLAS) and from cpu_gemm_kernel; a second call finds the better core
// in place and changes nothing.
inline std::string openblas_core_checked() {
  static const std::string replaced = []() -> std::string {
    if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return "";
    if (gotoblas_dynamic_init == nullptr || gotoblas_dynamic_quit == nullptr) return "";
    const std::string detected = openblas_get_corename();
    const char* better = openblas_better_core(detected.c_str());
    if (better == nullptr) return "";
    setenv("OPENBLAS_CORETYPE", better, 0);
    gotoblas_dynamic_quit();
    gotoblas_dynamic_init();
    unsetenv("OPENBLAS_CORETYPE");
    return detected;
  }();
  return replaced;
}

// OpenBLAS to one thread per call, and its idle worker pool stopped. The pthread build starts that
// pool (cores - 1 threads) when the library loads, and each worker polls for work with sched_yield
// for 2^28 cycles (its THREAD_TIMEOUT, 0.1 to 0.3 s) before it sleeps. Tessera never hands the pool
// any work, but while the workers poll they take turns on the cores with the OpenMP team: on 2
// cores an MLP's first 40-odd steps ran at about half speed in some starts, and a 50-step
// benchmark's median with them (bench/README.md, "OpenBLAS's idle workers"). Stopping the pool is
// what OpenBLAS itself does before a fork; a later openblas_set_num_threads(n > 1) starts it again.
// Once, from the first product of any size, float (gemm, the only way into gemm_openblas) or
// bfloat16 (gemm_bf16, kernels/cpu/gemm_bf16.hpp, which never calls OpenBLAS): Tessera's team does
// the splitting, and a network whose products stay on Eigen, the unpacked kernel (LeNet-5's) or
// the bfloat16 kernel (a bfloat16 MLP's: bench/README.md, "On the AMD EPYC Zen 5, 2026-12-08")
// would still pay for the polling. Under the static guard no Tessera thread is inside OpenBLAS
// while the pool stops. Visible in compiled mode too (core/linkage.hpp): gemm_bf16 is compiled in
// the program, gemm in the library, and both share this one guard.
inline void openblas_single_threaded() {
  static const bool done = [] {
    openblas_core_checked();
    openblas_set_num_threads(1);
    if (blas_thread_shutdown_ != nullptr) blas_thread_shutdown_();
    return true;
  }();
  (void)done;
}

}  // namespace tessera::detail
#endif

#include "tessera/core/tensor.hpp"
#include "tessera/device/cpu.hpp"

namespace tessera {

// The scalars the CPU matrix product is built for.
template <class S>
concept GemmScalar = std::is_same_v<S, float> || std::is_same_v<S, double>;

namespace detail {

// c (m, n; rows ldc apart) *= beta, zeroed for beta 0 whatever c held.
template <class S>
void scale_matrix(std::int64_t m, std::int64_t n, S beta, S* c, std::int64_t ldc) {
  if (beta == S(1)) return;
  for (std::int64_t i = 0; i < m; ++i) {
    S* row = c + i * ldc;
    if (beta == S(0))
      std::fill(row, row + n, S(0));
    else
      for (std::int64_t j = 0; j < n; ++j) row[j] *= beta;
  }
}

// The threading of every CPU matrix product: C = beta C first, then C += alpha op(A) op(B) by
// `serial` (same arguments as gemm, minus the device and beta), which runs on one thread; a
// `serial` that takes beta too (before c, as gemm does) gets it and scales C itself, so that a
// kernel which writes C outright for beta 0 skips a pass of zeros over it. Called
// from outside a parallel region, a large product is split over the OpenMP team by rows of C
// when it is taller than wide, else by columns (in multiples of 16, one AVX-512 register of
// floats, so each thread's panel stays vector-aligned); inside one, or below ~2^20 multiply-adds
// (where the fork/join costs more than the second core gains), it runs whole on this thread.
template <class S, class Serial>
void gemm_split(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, S alpha, const S* a,
                std::int64_t lda, const S* b, std::int64_t ldb, S beta, S* c, std::int64_t ldc, const Serial& serial) {
  if (m == 0 || n == 0) return;
  constexpr bool takes_beta = std::is_invocable_v<const Serial&, bool, bool, std::int64_t, std::int64_t, std::int64_t,
                                                  S, const S*, std::int64_t, const S*, std::int64_t, S, S*, std::int64_t>;
  // C's rows [r0, r0 + rows), columns [c0, c0 + cols) = beta C + alpha op(A) op(B), on this thread.
  const auto part = [&](std::int64_t r0, std::int64_t c0, std::int64_t rows, std::int64_t cols, const S* a_part,
                        const S* b_part) {
    S* c_part = c + r0 * ldc + c0;
    if constexpr (takes_beta) {
      serial(trans_a, trans_b, rows, cols, k, alpha, a_part, lda, b_part, ldb, beta, c_part, ldc);
    } else {
      scale_matrix(rows, cols, beta, c_part, ldc);
      serial(trans_a, trans_b, rows, cols, k, alpha, a_part, lda, b_part, ldb, c_part, ldc);
    }
  };
  int threads = 1;
#if defined(_OPENMP)
  if (!omp_in_parallel() && m * n * k >= (1 << 20)) threads = omp_get_max_threads();
#endif
  if (k == 0) return scale_matrix(m, n, beta, c, ldc);
  if (threads <= 1) return part(0, 0, m, n, a, b);
#if defined(_OPENMP)
  const bool split_rows = m >= n;
  const std::int64_t extent = split_rows ? m : n;
  const std::int64_t grain = split_rows ? 4 : 16;
#pragma omp parallel num_threads(threads)
  {
    const std::int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
    std::int64_t chunk = (extent + team - 1) / team;
    chunk = (chunk + grain - 1) / grain * grain;
    const std::int64_t begin = std::min(extent, t * chunk), end = std::min(extent, begin + chunk);
    // Each thread scales its own part of C, just before its product reads it (in parallel, and
    // while it is in this core's cache; a serial pass first showed in ResNet-50's inference profile).
    if (begin < end && split_rows)  // rows of op(A)
      part(begin, 0, end - begin, n, trans_a ? a + begin : a + begin * lda, b);
    else if (begin < end)  // columns of op(B)
      part(0, begin, m, end - begin, a, trans_b ? b + begin * ldb : b + begin);
  }
#endif
}

// Which b-transposed float products (one thread's part, with AVX-512, alpha 1, beta 0 or 1)
// gemm_swapped_bt_avx512 runs as c^T = b a^T: kSwappedBtMinRows to kSwappedBtMaxRows rows, at least
// kSwappedBtMinSize columns, kSwappedBtMinSize to kSwappedBtMaxDepth steps, a^T of at most
// kSwappedBtMaxA bytes (the unpacked kernel's b, which then stays in L2). That is a Linear layer's
// forward at a batch of 64 to 128 (an MLP's, 128 x 512 x 784), and the weight gradients of
// convolutions with 64 to 128 output channels over blocks of up to 1,024 columns (ResNet-50's
// 64 x 256 x 448). Up to 32 rows go to the dot products first (unpacked_suits); 200 x 300 x 130
// and 256 x 1024 x 1024 ran slower swapped than on OpenBLAS, and stay there, as does all not measured.
constexpr std::int64_t kSwappedBtMinRows = 64;
constexpr std::int64_t kSwappedBtMaxRows = 128;
constexpr std::int64_t kSwappedBtMinSize = 256;
constexpr std::int64_t kSwappedBtMaxDepth = 1024;
constexpr std::int64_t kSwappedBtMaxA = std::int64_t{1} << 20;
constexpr bool swapped_bt_suits(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k) {
  return trans_b && !trans_a && m >= kSwappedBtMinRows && m <= kSwappedBtMaxRows && n >= kSwappedBtMinSize &&
         k >= kSwappedBtMinSize && k <= kSwappedBtMaxDepth && m * k * std::int64_t{sizeof(float)} <= kSwappedBtMaxA;
}

// Products of at most this many multiply-adds run on Eigen (or the unpacked kernel), not OpenBLAS:
// gemm_openblas.
constexpr std::int64_t kSmallGemm = std::int64_t{1} << 20;

// Which float products (one thread's part) the unpacked kernel (kernels/cpu/gemm_unpacked.hpp)
// runs instead of OpenBLAS or Eigen, with AVX-512 and alpha 1: at least two rows (one row:
// gemm_one_row), and
// - b as it lies, at least one vector of columns, a of at most kUnpackedGemmMaxA bytes (it stays
//   in L2 while the kernel reads it where it lies once for each panel of 64 columns), and either
//   beta 0 (an MLP's input gradient, a classifier's at any batch: OpenBLAS zeroes c in a pass of
//   its own first, the kernel writes it outright) or at most kSmallGemm multiply-adds (where
//   Eigen, which packs both operands, would run). The weight gradients (beta 1, a = dy^T) stay on
//   OpenBLAS, which ran them faster inside an MLP's training step, also with c's tile prefetched.
//   Above 512 KiB of a (ResNet-50's 1x1 layers' 1 and 4 MiB of weights) OpenBLAS packs a once and
//   wins.
// - b transposed and a not, at most kUnpackedBtMaxRows rows (LeNet-5's convolution weight
//   gradients, 6 or 16 rows; a classifier's forward at a small batch) or at most
//   kUnpackedBtMaxColumns columns with an a of at most kUnpackedGemmMaxA bytes (an MLP's last
//   layer, 10 classes): as dot products (gemm_dot_bt_avx512), where Eigen and OpenBLAS run such
//   short products at a fraction of their speed. The dot products read a once per 4 columns;
//   with more rows and columns (an MLP's forward, 128 x 512) they, and b copied into the kernel's
//   layout, both lost to OpenBLAS inside the training step.
// Figures in bench/README.md, "Figures behind design choices in the headers".
constexpr std::int64_t kUnpackedGemmMaxA = std::int64_t{1} << 19;
constexpr std::int64_t kUnpackedBtMaxRows = 32;
constexpr std::int64_t kUnpackedBtMaxColumns = 32;
constexpr bool unpacked_suits(bool trans_a, bool trans_b, bool beta_zero, std::int64_t m, std::int64_t n,
                              std::int64_t k) {
  const std::int64_t bytes = sizeof(float);
  if (m < 2) return false;
  if (trans_b)
    return !trans_a && (m <= kUnpackedBtMaxRows || (n <= kUnpackedBtMaxColumns && m * k * bytes <= kUnpackedGemmMaxA));
  if (n < 16) return false;
  return m * k * bytes <= kUnpackedGemmMaxA && (beta_zero || m * n * k <= kSmallGemm);
}

// The same choice on a CPU with AVX2 but not AVX-512 (kernels/cpu/gemm_unpacked_avx2.hpp), where
// OpenBLAS's Haswell and Zen kernels run most products faster than the 8-lane kernels: those with
// many rows and steps (an MLP's input gradient, 128 x 512 x 256), and those whose b or c is large,
// which the unpacked kernel walks in strips of 16 columns (ResNet-50's classifier gradients:
// 8 MB of weights or of dW, 0.3 to 0.65 of OpenBLAS's speed). The 8-lane kernels take:
// - b as it lies, at least 16 columns, at most kUnpackedAvx2Thin rows or steps, and a, b and c
//   within kUnpackedGemmMaxA, kUnpackedAvx2MaxBC and kUnpackedAvx2MaxBC bytes, beta 0 or 1: a
//   convolution with few output channels or a product over them (LeNet-5's 6 and 16; its dx over
//   16 steps), a classifier's input and weight gradients over 10 classes; 1.1 to 1.6 times
//   OpenBLAS or Eigen there, whose packing is most of such a product;
// - b transposed, at most kUnpackedAvx2Thin rows (the weight gradients of LeNet-5's convolutions,
//   1.5 and 2.1 times OpenBLAS; ResNet-50's classifier at batch 8, 1.7 times, but at batch 32 0.94)
//   or the dot products' rule above for few columns (an MLP's last layer), as dot products
//   (gemm_dot_bt_avx2).
// Figures in bench/README.md, "Figures behind design choices in the headers".
constexpr std::int64_t kUnpackedAvx2Thin = 16;
constexpr std::int64_t kUnpackedAvx2MaxBC = std::int64_t{1} << 21;
constexpr bool unpacked_suits_avx2(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k) {
  const std::int64_t bytes = sizeof(float);
  if (m < 2) return false;
  if (trans_b)
    return !trans_a && (m <= kUnpackedAvx2Thin || (n <= kUnpackedBtMaxColumns && m * k * bytes <= kUnpackedGemmMaxA));
  return n >= 16 && std::min(m, k) <= kUnpackedAvx2Thin && m * k * bytes <= kUnpackedGemmMaxA &&
         k * n * bytes <= kUnpackedAvx2MaxBC && m * n * bytes <= kUnpackedAvx2MaxBC;
}

// Which float products (one thread's part) Tessera's packed kernel (kernels/cpu/gemm_packed_avx2.hpp)
// runs on a CPU with AVX2 but not AVX-512, after the 8-lane kernels' share above: those that
// OpenBLAS ran before (more than kSmallGemm multiply-adds, at least two rows), beta 0 or 1, any
// alpha; in a build without OpenBLAS, those Eigen ran. Smaller products stay on Eigen: LeNet-5 and
// ResNet-20 steps ran no faster with them on the packed kernel.
constexpr bool packed_avx2_suits(std::int64_t m, std::int64_t n, std::int64_t k, float beta) {
  return m >= 2 && m * n * k > kSmallGemm && (beta == 0.0f || beta == 1.0f);
}

// The same on a CPU with AVX-512, for Tessera's 16-lane packed kernel
// (kernels/cpu/gemm_packed_avx512.hpp), after the unpacked and swapped kernels' share above. On a
// Zen 5 (family 26), which OpenBLAS 0.3.21 does not know and runs on its AVX2 kernels ("Haswell",
// not a fallback that openblas_better_core replaces), ResNet-50's and the MLP's products ran at
// about twice OpenBLAS's speed and a ResNet-50 training step faster by a fifth; against OpenBLAS's
// AVX-512 kernels (OPENBLAS_CORETYPE=Cooperlake) the products are level or faster and whole steps
// level (bench/README.md, "Figures behind design choices in the headers"). So the speed no longer
// depends on whether OpenBLAS knows the CPU.
constexpr bool packed_avx512_suits(std::int64_t m, std::int64_t n, std::int64_t k, float beta) {
  return packed_avx2_suits(m, n, k, beta);
}

}  // namespace detail

#if TESSERA_CPU_KERNELS_EXTERN
template <GemmScalar S>
void gemm(Cpu, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, S alpha, const S* a,
          std::int64_t lda, const S* b, std::int64_t ldb, S beta, S* c, std::int64_t ldc);
#else
namespace detail {

// Eigen's blocking descriptor pointing at caller-owned packing buffers.
template <class S>
class GemmBlocking : public Eigen::internal::level3_blocking<S, S> {
 public:
  // (m, n, k) of the row-major product; Eigen runs it as the column-major (n, m, k) product C^T.
  GemmBlocking(Eigen::Index m, Eigen::Index n, Eigen::Index k) {
    this->m_mc = n;
    this->m_nc = m;
    this->m_kc = k;
    Eigen::internal::computeProductBlockingSizes<S, S, 1>(this->m_kc, this->m_mc, this->m_nc, Eigen::Index{1});
  }
  std::int64_t size_a() const { return this->m_mc * this->m_kc; }
  std::int64_t size_b() const { return this->m_kc * this->m_nc; }
  void set_buffers(S* a, S* b) {
    this->m_blockA = a;
    this->m_blockB = b;
  }
};

// One thread's packing buffers (Eigen's path; the swapped products' a^T and c^T); they only ever grow,
// so steady state allocates nothing.
template <class S>
struct GemmWorkspace {
  Tensor<S> packed_a, packed_b;
  static GemmWorkspace& local() {
    thread_local GemmWorkspace workspace;
    return workspace;
  }
  // packed_a's and packed_b's data, each grown to at least its count of elements.
  S* a(std::int64_t elements) { return reserve(packed_a, elements); }
  S* b(std::int64_t elements) { return reserve(packed_b, elements); }

 private:
  static S* reserve(Tensor<S>& buffer, std::int64_t elements) {
    if (buffer.numel() < elements) buffer.resize({elements});
    return buffer.data();
  }
};

template <class S, int LhsOrder, int RhsOrder>
void gemm_serial_ordered(std::int64_t m, std::int64_t n, std::int64_t k, S alpha, const S* a, std::int64_t lda,
                         const S* b, std::int64_t ldb, S* c, std::int64_t ldc) {
  GemmBlocking<S> blocking(m, n, k);
  auto& ws = GemmWorkspace<S>::local();
  blocking.set_buffers(ws.a(blocking.size_a()), ws.b(blocking.size_b()));
  Eigen::internal::general_matrix_matrix_product<Eigen::Index, S, LhsOrder, false, S, RhsOrder, false, Eigen::RowMajor,
                                                 1>::run(m, n, k, a, lda, b, ldb, c, 1, ldc, alpha, blocking, nullptr);
}

#if defined(TESSERA_OPENBLAS)
// C += alpha op(A) op(B) by OpenBLAS on the calling thread; false when a size does not fit its int.
// Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, and a row-major matrix read
// column-major is its transpose: so B goes first, each with its own transpose flag.
template <class S>
bool gemm_openblas(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, S alpha, const S* a,
                   std::int64_t lda, const S* b, std::int64_t ldb, S* c, std::int64_t ldc) {
  // Small products stay on Eigen: OpenBLAS 0.3.21 sends them to its AVX-512 "small matrix"
  // kernels, which malloc on every call (seen as 2 allocations per LeNet-5 step, from
  // sgemm_small_kernel_nn; none above this cut), and a steady training step must not allocate.
  if (m * n * k <= kSmallGemm) return false;
  for (std::int64_t v : {m, n, k, lda, ldb, ldc})
    if (v > INT_MAX) return false;
  // BLAS wants each stride to be at least the stored row's length; Eigen takes any stride.
  if (lda < std::max<std::int64_t>(1, trans_a ? m : k) || ldb < std::max<std::int64_t>(1, trans_b ? k : n) ||
      ldc < std::max<std::int64_t>(1, n))
    return false;
  const int mm = static_cast<int>(n), nn = static_cast<int>(m), kk = static_cast<int>(k);
  const int la = static_cast<int>(lda), lb = static_cast<int>(ldb), lc = static_cast<int>(ldc);
  const char ta = trans_a ? 'T' : 'N', tb = trans_b ? 'T' : 'N';
  const S one = 1;
  if constexpr (std::is_same_v<S, float>) sgemm_(&tb, &ta, &mm, &nn, &kk, &alpha, b, &lb, a, &la, &one, c, &lc);
  else dgemm_(&tb, &ta, &mm, &nn, &kk, &alpha, b, &lb, a, &la, &one, c, &lc);
  return true;
}
#endif

// c (1, n) += alpha op(a) (1, k) op(b) (k, n): one row of output (a Linear layer at batch 1), from
// the operands where they lie. OpenBLAS and Eigen pack all of b first: ResNet-50's classifier at
// batch 1 (1 x 1000 x 2048, split over the threads into halves that Eigen takes) packed its 8 MB of
// weights on every forward. With b transposed each output is a dot product of a with one of b's
// rows; otherwise c gets b's row p times alpha op(a)(0, p), row by row.
template <class S>
void gemm_one_row(bool trans_a, bool trans_b, std::int64_t n, std::int64_t k, S alpha, const S* a, std::int64_t lda,
                  const S* b, std::int64_t ldb, S* c) {
  const std::int64_t a_step = trans_a ? lda : 1;  // op(a)(0, p) = a[p a_step]
  if (trans_b) {
    for (std::int64_t j = 0; j < n; ++j) {
      const S* row = b + j * ldb;
      S sum = 0;
#pragma omp simd reduction(+ : sum)
      for (std::int64_t p = 0; p < k; ++p) sum += a[p * a_step] * row[p];
      c[j] += alpha * sum;
    }
    return;
  }
  for (std::int64_t p = 0; p < k; ++p) {
    const S scale = alpha * a[p * a_step];
    const S* row = b + p * ldb;
#pragma omp simd
    for (std::int64_t j = 0; j < n; ++j) c[j] += scale * row[j];
  }
}

// C = beta C + alpha op(A) op(B) on the calling thread.
template <class S>
void gemm_serial(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, S alpha, const S* a,
                 std::int64_t lda, const S* b, std::int64_t ldb, S beta, S* c, std::int64_t ldc) {
#if TESSERA_X86_DISPATCH
  if constexpr (std::is_same_v<S, float>) {
    if (alpha == 1 && (beta == 0 || beta == 1) && unpacked_suits(trans_a, trans_b, beta == 0, m, n, k) &&
        cpu_avx512()) {
      if (trans_b) return gemm_dot_bt_avx512(m, n, k, a, lda, b, ldb, beta, c, ldc);
      return gemm_unpacked_avx512(trans_a, m, n, k, a, lda, b, ldb, beta, c, ldc);
    }
    if (alpha == 1 && (beta == 0 || beta == 1) && swapped_bt_suits(trans_a, trans_b, m, n, k) && cpu_avx512()) {
      auto& ws = GemmWorkspace<float>::local();  // a^T and c^T, in the buffers Eigen's path packs into
      return gemm_swapped_bt_avx512(m, n, k, a, lda, b, ldb, beta, c, ldc, ws.a(k * m), ws.b(n * m));
    }
    if (alpha == 1 && (beta == 0 || beta == 1) && !cpu_avx512() && cpu_avx2() &&
        unpacked_suits_avx2(trans_a, trans_b, m, n, k)) {
      if (trans_b) return gemm_dot_bt_avx2(m, n, k, a, lda, b, ldb, beta, c, ldc);
      return gemm_unpacked_avx2(trans_a, m, n, k, a, lda, b, ldb, beta, c, ldc);
    }
    if (packed_avx512_suits(m, n, k, beta) && cpu_avx512()) {
      auto& ws = GemmWorkspace<float>::local();  // the packed blocks, in the buffers Eigen's path packs into
      return gemm_packed_avx512(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc,
                                ws.a(packed_avx512_a_floats(m, k)), ws.b(packed_avx512_b_floats(n, k)));
    }
    if (packed_avx2_suits(m, n, k, beta) && !cpu_avx512() && cpu_avx2()) {
      auto& ws = GemmWorkspace<float>::local();  // the packed blocks, in the buffers Eigen's path packs into
      return gemm_packed_avx2(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc,
                              ws.a(packed_avx2_a_floats(m, k)), ws.b(packed_avx2_b_floats(n, k)));
    }
  }
#endif
  scale_matrix(m, n, beta, c, ldc);
  if (m == 1) return gemm_one_row(trans_a, trans_b, n, k, alpha, a, lda, b, ldb, c);
#if defined(TESSERA_OPENBLAS)
  if (gemm_openblas(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, c, ldc)) return;
#endif
  // A row-major (m, k) is RowMajor; stored transposed, i.e. (k, m) row-major, it is (m, k) ColMajor.
  constexpr int R = Eigen::RowMajor, C = Eigen::ColMajor;
  if (!trans_a && !trans_b) gemm_serial_ordered<S, R, R>(m, n, k, alpha, a, lda, b, ldb, c, ldc);
  else if (trans_a && !trans_b) gemm_serial_ordered<S, C, R>(m, n, k, alpha, a, lda, b, ldb, c, ldc);
  else if (!trans_a && trans_b) gemm_serial_ordered<S, R, C>(m, n, k, alpha, a, lda, b, ldb, c, ldc);
  else gemm_serial_ordered<S, C, C>(m, n, k, alpha, a, lda, b, ldb, c, ldc);
}

}  // namespace detail

template <GemmScalar S>
void gemm(Cpu, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, S alpha, const S* a,
          std::int64_t lda, const S* b, std::int64_t ldb, S beta, S* c, std::int64_t ldc) {
#if defined(TESSERA_OPENBLAS)
  detail::openblas_single_threaded();
#endif
  detail::gemm_split(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, detail::gemm_serial<S>);
}
#endif  // TESSERA_CPU_KERNELS_EXTERN

// What runs the CPU gemm, for benchmark reports: "Eigen gebp" or "OpenBLAS <core>" (naming the
// core OpenBLAS detected where Tessera replaced it, detail::openblas_core_checked).
inline std::string cpu_gemm_kernel() {
  const std::string unpacked_note =
      TESSERA_X86_DISPATCH && cpu_avx512()
          ? "; float products with a small operand on Tessera's unpacked AVX-512 kernel, the others above 2^20 "
            "multiply-adds on its packed AVX-512 kernel"
          : TESSERA_X86_DISPATCH && cpu_avx2() ? "; float products above 2^20 multiply-adds on Tessera's packed AVX2 kernel"
                                               : "";
#if defined(TESSERA_OPENBLAS)
  const std::string replaced = detail::openblas_core_checked();
  return std::string("OpenBLAS ") + openblas_get_corename() +
         (replaced.empty() ? "" : " (in place of " + replaced + ", which OpenBLAS detected)") +
         ", one thread per call (Eigen gebp below 2^20 multiply-adds)" + unpacked_note;
#else
  return "Eigen gebp" + unpacked_note;
#endif
}

#define TESSERA_CPU_GEMM_INSTANCES(PREFIX, S)                                                                   \
  PREFIX template void gemm<S>(Cpu, bool, bool, std::int64_t, std::int64_t, std::int64_t, S, const S*, std::int64_t, \
                               const S*, std::int64_t, S, S*, std::int64_t);
TESSERA_CPU_KERNEL_INSTANCES(TESSERA_CPU_GEMM_INSTANCES)

}  // namespace tessera
