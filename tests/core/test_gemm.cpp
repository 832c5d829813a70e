// gemm(Cpu, ...), the one CPU matrix product: every transpose combination, alpha and beta, row
// strides wider than the rows, on products below and above 2^20 multiply-adds (where a build with
// OpenBLAS hands each thread's product to it; Eigen below), called from outside a parallel region
// (split over the team) and from inside one (each thread its own product), against a float64 loop.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "tessera/core/tensor.hpp"
#include "tessera/device/cpu.hpp"
#include "tessera/kernels/cpu/gemm_bf16.hpp"
#include "tessera/kernels/cpu/gemm_packed_avx2.hpp"
#include "tessera/kernels/cpu/gemm_packed_avx512.hpp"
#include "tessera/kernels/cpu/gemm_unpacked.hpp"
#include "tessera/kernels/cpu/gemm_unpacked_avx2.hpp"
#include "tessera/kernels/cpu/winograd.hpp"
#include "tessera/kernels/gemm.hpp"

using namespace tessera;

namespace {

struct GemmCase {
  std::int64_t m, n, k;
};

// Deterministic values in [-1, 1).
double pseudo_random(std::uint64_t& state) {
  state = state * 6364136223846793005ull + 1442695040888963407ull;
  return static_cast<double>(state >> 11) / static_cast<double>(1ull << 53) * 2.0 - 1.0;
}

// Max over C's entries of |got - want| / (1 + sum over p of |alpha a b| + |beta c|): the error
// relative to the magnitudes the entry was summed from.
template <class S>
double worst_relative_error(bool ta, bool tb, const GemmCase& g, double alpha, double beta, const std::vector<S>& a,
                            std::int64_t lda, const std::vector<S>& b, std::int64_t ldb, const std::vector<S>& c0,
                            const std::vector<S>& c, std::int64_t ldc) {
  double worst = 0;
  for (std::int64_t i = 0; i < g.m; ++i)
    for (std::int64_t j = 0; j < g.n; ++j) {
      double sum = 0, scale = 1;
      for (std::int64_t p = 0; p < g.k; ++p) {
        const double av = ta ? a[p * lda + i] : a[i * lda + p], bv = tb ? b[j * ldb + p] : b[p * ldb + j];
        sum += av * bv;
        scale += std::abs(alpha * av * bv);
      }
      const double want = alpha * sum + beta * c0[i * ldc + j];
      scale += std::abs(beta * c0[i * ldc + j]);
      worst = std::max(worst, std::abs(static_cast<double>(c[i * ldc + j]) - want) / scale);
    }
  return worst;
}

}  // namespace

TEMPLATE_TEST_CASE("gemm matches a float64 loop for every transpose, alpha, beta and stride", "[core][capability]", float, double) {
  using S = TestType;
  // Rounding of k products: far below what a wrong transpose, stride or scalar gives (order 1).
  const double tolerance = std::is_same_v<S, float> ? 2e-5 : 1e-12;
  // Below and above 2^20 multiply-adds; a single row and a single column among the large ones.
  // With AVX-512, alpha 1 and beta 0 or 1, float products with a small operand run on the
  // unpacked kernel (gemm.hpp, unpacked_suits); with b transposed, up to 32 rows, as dot products
  // (gemm_dot_bt_avx512): {24, 600, 1100} in two depth blocks of 560 and 540 steps (a masked last
  // vector), {6, 25, 70} in edge tiles of 2 rows and 1 column, {100, 10, 90} (more rows, few
  // columns) in tiles of 4 rows and a last one of 2 columns. With b transposed, 64 to 128 rows and
  // 256 or more columns and steps (gemm.hpp, swapped_bt_suits): c^T = b a^T on the unpacked kernel,
  // {96, 320, 272} in whole 16 x 16 transposes, {100, 300, 260} with edges in both.
  const GemmCase cases[] = {{3, 5, 7},       {130, 97, 100}, {64, 300, 70}, {1, 1200, 1000},
                            {1500, 1, 800}, {24, 600, 1100}, {6, 25, 70},  {100, 10, 90},
                            {96, 320, 272}, {100, 300, 260}};
  const double scalars[][2] = {{1, 0}, {1, 1}, {0.5, 1}, {-2, 0.25}};
  std::uint64_t state = 42;
  INFO("gemm kernel: " << cpu_gemm_kernel());
  for (const auto& g : cases)
    for (int t = 0; t < 4; ++t)
      for (const auto& ab : scalars) {
        const bool ta = t & 1, tb = t & 2;
        const double alpha = ab[0], beta = ab[1];
        // Strides wider than the stored rows (a BLAS needs them at least as wide).
        const std::int64_t lda = (ta ? g.m : g.k) + 3, ldb = (tb ? g.k : g.n) + 5, ldc = g.n + 2;
        std::vector<S> a((ta ? g.k : g.m) * lda), b((tb ? g.n : g.k) * ldb), c0(g.m * ldc);
        for (auto& v : a) v = static_cast<S>(pseudo_random(state));
        for (auto& v : b) v = static_cast<S>(pseudo_random(state));
        for (auto& v : c0) v = static_cast<S>(pseudo_random(state));
        INFO("m " << g.m << " n " << g.n << " k " << g.k << " trans_a " << ta << " trans_b " << tb << " alpha " << alpha
                  << " beta " << beta);

        std::vector<S> c = c0;  // from outside a parallel region: split over the team
        gemm(Cpu{}, ta, tb, g.m, g.n, g.k, static_cast<S>(alpha), a.data(), lda, b.data(), ldb, static_cast<S>(beta),
             c.data(), ldc);
        CHECK(worst_relative_error(ta, tb, g, alpha, beta, a, lda, b, ldb, c0, c, ldc) <= tolerance);
        bool padding_kept = true;  // entries past n in each row of C are not C's
        for (std::int64_t i = 0; i < g.m; ++i)
          for (std::int64_t j = g.n; j < ldc; ++j) padding_kept = padding_kept && c[i * ldc + j] == c0[i * ldc + j];
        CHECK(padding_kept);

        // From inside a parallel region: each thread runs the whole product on its own C (only the
        // threads the team really got are checked).
        std::vector<std::vector<S>> per_thread(2, c0);
        int team = 1;
#pragma omp parallel num_threads(2)
        {
          const int me = Cpu::thread_index();
          if (me == 0) team = Cpu::team_size();
          if (me < 2)
            gemm(Cpu{}, ta, tb, g.m, g.n, g.k, static_cast<S>(alpha), a.data(), lda, b.data(), ldb,
                 static_cast<S>(beta), per_thread[me].data(), ldc);
        }
        for (int me = 0; me < std::min(team, 2); ++me)
          CHECK(worst_relative_error(ta, tb, g, alpha, beta, a, lda, b, ldb, c0, per_thread[me], ldc) <= tolerance);
      }
}

TEST_CASE("gemm's swapped b-transposed products: which products take them", "[core]") {
  // An MLP's forward at batch 128 (x (128, 784) w^T, w (512, 784)); a classifier at batch 8 stays
  // on the dot products, wider or deeper products and a transposed a on OpenBLAS or Eigen.
  CHECK(detail::swapped_bt_suits(false, true, 128, 512, 784));
  CHECK(detail::swapped_bt_suits(false, true, 64, 256, 256));
  CHECK_FALSE(detail::swapped_bt_suits(false, true, 8, 1000, 2048));
  CHECK_FALSE(detail::swapped_bt_suits(false, true, 256, 1024, 1024));
  CHECK_FALSE(detail::swapped_bt_suits(false, true, 128, 512, 3136));
  CHECK_FALSE(detail::swapped_bt_suits(false, true, 128, 120, 400));
  CHECK_FALSE(detail::swapped_bt_suits(true, true, 128, 512, 784));
  CHECK_FALSE(detail::swapped_bt_suits(false, false, 128, 512, 784));
}

TEST_CASE("gemm on AVX2 CPUs: which products take the 8-lane kernels", "[core]") {
  // detail::unpacked_suits_avx2 (kernels/cpu/gemm.hpp): LeNet-5's convolutions (6 and 16 output
  // channels: forward, dx over 16 steps, dW as dot products) and a classifier's gradients over 10
  // classes; OpenBLAS keeps products with many rows and steps, and those with a large b or c.
  CHECK(detail::unpacked_suits_avx2(false, false, 16, 800, 150));     // conv forward, 16 channels
  CHECK(detail::unpacked_suits_avx2(true, false, 150, 800, 16));      // its dx
  CHECK(detail::unpacked_suits_avx2(false, true, 16, 150, 800));      // its dW, dot products
  CHECK(detail::unpacked_suits_avx2(true, false, 10, 256, 128));      // a classifier's dW
  CHECK(detail::unpacked_suits_avx2(false, true, 128, 10, 256));      // its forward, 10 columns
  CHECK(detail::unpacked_suits_avx2(false, true, 8, 1000, 2048));     // ResNet-50's classifier at batch 8
  CHECK_FALSE(detail::unpacked_suits_avx2(false, true, 32, 1000, 2048));  // and at batch 32
  CHECK_FALSE(detail::unpacked_suits_avx2(false, false, 128, 512, 256));  // an MLP's dx
  CHECK_FALSE(detail::unpacked_suits_avx2(false, false, 8, 2048, 1000));  // 8 MB of b
  CHECK_FALSE(detail::unpacked_suits_avx2(true, false, 1000, 2048, 8));   // 8 MB of c
  CHECK_FALSE(detail::unpacked_suits_avx2(false, false, 16, 8, 150));     // under one panel of 16
  CHECK_FALSE(detail::unpacked_suits_avx2(false, false, 1, 800, 150));    // one row: gemm_one_row
  CHECK_FALSE(detail::unpacked_suits_avx2(true, true, 16, 150, 800));
}

TEST_CASE("the 8-lane dot products match a float64 loop", "[core][capability]") {
  // detail::gemm_dot_bt_avx2 (kernels/cpu/gemm_unpacked_avx2.hpp): c = beta c + a bt^T in tiles of
  // 4 rows x 3 columns; edge tiles of 1 to 3 rows and 1 or 2 columns; k of 1 to 7 (one masked
  // step), a multiple of 8, one past it, and 2500 in blocks of 840, 840 and 820 steps.
#if TESSERA_X86_DISPATCH
  if (!cpu_avx2()) {
    WARN("skipped: this CPU has no AVX2, where gemm never calls the 8-lane dot products");
    return;
  }
  std::uint64_t state = 5;
  for (std::int64_t m : {1, 3, 4, 5, 16, 31})
    for (std::int64_t n : {1, 2, 3, 4, 10, 25})
      for (std::int64_t k : {1, 7, 16, 17, 300, 2500})
        for (double beta : {0.0, 1.0}) {
          const GemmCase g{m, n, k};
          const std::int64_t lda = k + 3, ldb = k + 1, ldc = n + 2;
          std::vector<float> a(m * lda), b(n * ldb), c0(m * ldc);
          for (auto& v : a) v = static_cast<float>(pseudo_random(state));
          for (auto& v : b) v = static_cast<float>(pseudo_random(state));
          for (auto& v : c0) v = static_cast<float>(pseudo_random(state));
          INFO("m " << m << " n " << n << " k " << k << " beta " << beta);
          std::vector<float> c = c0;
          detail::gemm_dot_bt_avx2(m, n, k, a.data(), lda, b.data(), ldb, static_cast<float>(beta), c.data(), ldc);
          CHECK(worst_relative_error(false, true, g, 1.0, beta, a, lda, b, ldb, c0, c, ldc) <= 2e-5);
          bool padding_kept = true;
          for (std::int64_t i = 0; i < m; ++i)
            for (std::int64_t j = n; j < ldc; ++j) padding_kept = padding_kept && c[i * ldc + j] == c0[i * ldc + j];
          CHECK(padding_kept);
        }
#else
  WARN("skipped: built without x86 dispatch, where gemm never calls the 8-lane dot products");
#endif
}

#if TESSERA_X86_DISPATCH
// One packed kernel (gemm_packed_avx2 or gemm_packed_avx512, with its buffer sizes) on each case:
// each transpose, alpha 1 and -0.5, beta 0 and 1, strides wider than the rows, against a float64
// loop; c's padding past n untouched; with beta 0, c written and never read (a NaN there does not
// survive, as with BLAS's beta 0).
template <class Kernel, class AFloats, class BFloats>
void check_packed_kernel(const Kernel& kernel, const AFloats& a_floats, const BFloats& b_floats,
                         const std::vector<GemmCase>& cases) {
  std::uint64_t state = 9;
  for (const auto& g : cases)
    for (int t = 0; t < 4; ++t)
      for (const double alpha : {1.0, -0.5})
        for (const double beta : {0.0, 1.0}) {
          const bool ta = t & 1, tb = t & 2;
          const std::int64_t lda = (ta ? g.m : g.k) + 3, ldb = (tb ? g.k : g.n) + 5, ldc = g.n + 2;
          std::vector<float> a((ta ? g.k : g.m) * lda), b((tb ? g.n : g.k) * ldb), c0(g.m * ldc);
          for (auto& v : a) v = static_cast<float>(pseudo_random(state));
          for (auto& v : b) v = static_cast<float>(pseudo_random(state));
          for (auto& v : c0) v = static_cast<float>(pseudo_random(state));
          INFO("m " << g.m << " n " << g.n << " k " << g.k << " trans_a " << ta << " trans_b " << tb << " alpha "
                    << alpha << " beta " << beta);
          std::vector<float> c = c0;
          Tensor<float, Cpu> packed_a({a_floats(g.m, g.k)}), packed_b({b_floats(g.n, g.k)});  // 64-byte aligned
          kernel(ta, tb, g.m, g.n, g.k, static_cast<float>(alpha), a.data(), lda, b.data(), ldb,
                 static_cast<float>(beta), c.data(), ldc, packed_a.data(), packed_b.data());
          CHECK(worst_relative_error(ta, tb, g, alpha, beta, a, lda, b, ldb, c0, c, ldc) <= 2e-5);
          bool padding_kept = true;
          for (std::int64_t i = 0; i < g.m; ++i)
            for (std::int64_t j = g.n; j < ldc; ++j) padding_kept = padding_kept && c[i * ldc + j] == c0[i * ldc + j];
          CHECK(padding_kept);
          if (beta == 0.0) {
            std::vector<float> from_nan(c0.size(), std::numeric_limits<float>::quiet_NaN());
            kernel(ta, tb, g.m, g.n, g.k, static_cast<float>(alpha), a.data(), lda, b.data(), ldb, 0.0f,
                   from_nan.data(), ldc, packed_a.data(), packed_b.data());
            bool same = true;
            for (std::int64_t i = 0; i < g.m; ++i)
              for (std::int64_t j = 0; j < g.n; ++j) same = same && from_nan[i * ldc + j] == c[i * ldc + j];
            CHECK(same);
          }
        }
}
#endif

TEST_CASE("the packed AVX2 kernel matches a float64 loop across its blocks and edges", "[core][capability]") {
  // detail::gemm_packed_avx2 (kernels/cpu/gemm_packed_avx2.hpp), which gemm calls on CPUs with AVX2
  // but not AVX-512: tiles of 6 x 16, edge tiles of fewer rows or columns (of 9 to 15 columns on
  // two vectors: n 25, 28, 45; of 5 to 8 on one: n 40; of 1 to 4 as matrix-vector products: n 3,
  // 17, 18, 20, 33, 35, 49, 4100's last block of 20; steps not a multiple of their interleave of 4
  // (1 to 3 columns: k 5, 9, 41) or 2 (4 columns: k 7)), one block of steps
  // and several (kPackedKc 256: k 257 and 600), rows past one packed block (kPackedMc 144: m 150),
  // columns past one (kPackedNc 4080: n 4100), steps not a multiple of 8 (pack_b_panels'
  // transposes).
#if TESSERA_X86_DISPATCH
  if (!cpu_avx2()) {
    WARN("skipped: this CPU has no AVX2, where gemm never calls the packed AVX2 kernel");
    return;
  }
  check_packed_kernel(detail::gemm_packed_avx2, detail::packed_avx2_a_floats, detail::packed_avx2_b_floats,
                      {{6, 16, 8}, {7, 17, 3}, {5, 40, 19}, {150, 33, 300}, {12, 32, 257}, {13, 4100, 20},
                       {61, 45, 600}, {8, 49, 70}, {9, 28, 33}, {7, 25, 260}, {11, 18, 41}, {6, 35, 9},
                       {20, 3, 5}, {10, 20, 7}});
  // gemm takes it for the products OpenBLAS ran before: large ones, beta 0 or 1.
  CHECK(detail::packed_avx2_suits(128, 512, 784, 0.0f));
  CHECK(detail::packed_avx2_suits(256, 3136, 64, 1.0f));
  CHECK_FALSE(detail::packed_avx2_suits(64, 64, 64, 0.0f));       // 2^18 multiply-adds: Eigen
  CHECK_FALSE(detail::packed_avx2_suits(1, 4096, 4096, 0.0f));    // one row: gemm_one_row
  CHECK_FALSE(detail::packed_avx2_suits(512, 512, 512, 0.5f));    // other betas: OpenBLAS
#else
  WARN("skipped: built without x86 dispatch, where gemm never calls the packed AVX2 kernel");
#endif
}

TEST_CASE("the packed AVX-512 kernel matches a float64 loop across its blocks and edges", "[core][capability]") {
  // detail::gemm_packed_avx512 (kernels/cpu/gemm_packed_avx512.hpp), which gemm calls on CPUs with
  // AVX-512: tiles of 8 x 32; edge tiles of fewer rows (m 5, 7, 9, 13, 61, 203), of 17 to 31
  // columns (two vectors, the second masked: n 17, 25, 49), of 1 to 16 (one masked vector: n 3, 16,
  // 33, 40, and 4 in n 4100's second block); one block of steps and several (kPacked512Kc 256:
  // k 257 and 600); rows past one packed block (kPacked512Mc 192: m 203); columns past one
  // (kPacked512Nc 4096: n 4100); steps not a multiple of 8 (the packers' transposes: k 3, 5, 19, 41).
#if TESSERA_X86_DISPATCH
  if (!cpu_avx512()) {
    WARN("skipped: this CPU has no AVX-512, where gemm never calls the packed AVX-512 kernel");
    return;
  }
  check_packed_kernel(detail::gemm_packed_avx512, detail::packed_avx512_a_floats, detail::packed_avx512_b_floats,
                      {{8, 32, 8}, {7, 17, 3}, {5, 40, 19}, {203, 33, 300}, {16, 64, 257}, {13, 4100, 20},
                       {61, 49, 600}, {8, 16, 70}, {9, 25, 41}, {24, 3, 5}});
  CHECK(detail::packed_avx512_suits(128, 512, 784, 0.0f));
  CHECK_FALSE(detail::packed_avx512_suits(64, 64, 64, 0.0f));  // 2^18 multiply-adds: Eigen
  CHECK_FALSE(detail::packed_avx512_suits(512, 512, 512, 0.5f));  // other betas: OpenBLAS
#else
  WARN("skipped: built without x86 dispatch, where gemm never calls the packed AVX-512 kernel");
#endif
}

TEMPLATE_TEST_CASE("Winograd's unpacked product matches a float64 loop", "[core][conv]", float, double) {
  // detail::winograd_product (kernels/cpu/winograd.hpp): the channel-blocked Winograd path's 36
  // products, c = beta c + op(a) b with n a multiple of the vector width (16 with AVX-512, 8 with
  // AVX2). Rows that are not a whole micro-tile (5, 6 or 8), 1 to 5 vectors of columns (the 4-wide
  // panel and each narrower one; AVX2's panels of 2 and a last one of 1), depths across the pieces
  // of b (128 to 512 rows), both layouts of a, beta 0 and 1, strides wider than rows.
  using S = TestType;
  const double tolerance = std::is_same_v<S, float> ? 2e-5 : 1e-12;
  const GemmCase cases[] = {{1, 16, 1},    {5, 32, 16},    {6, 64, 64},  {7, 48, 180}, {7, 48, 65},
                            {49, 80, 300}, {100, 16, 520}, {13, 128, 9}, {9, 64, 0},
                            {11, 8, 40},   {29, 24, 300},  {6, 40, 520}};
  std::uint64_t state = 7;
  for (const auto& g : cases)
    for (bool ta : {false, true})
      for (double beta : {0.0, 1.0}) {
        const std::int64_t lda = (ta ? g.m : g.k) + 3, ldb = g.n + 16, ldc = g.n + 2;
        std::vector<S> a(std::max<std::int64_t>(1, (ta ? g.k : g.m) * lda)), b(std::max<std::int64_t>(1, g.k * ldb));
        std::vector<S> c0(g.m * ldc);
        for (auto& v : a) v = static_cast<S>(pseudo_random(state));
        for (auto& v : b) v = static_cast<S>(pseudo_random(state));
        for (auto& v : c0) v = static_cast<S>(pseudo_random(state));
        INFO("m " << g.m << " n " << g.n << " k " << g.k << " trans_a " << ta << " beta " << beta);
        std::vector<S> c = c0;
        detail::winograd_product(ta, g.m, g.n, g.k, a.data(), lda, b.data(), ldb, static_cast<S>(beta), c.data(), ldc);
        CHECK(worst_relative_error(ta, false, g, 1.0, beta, a, lda, b, ldb, c0, c, ldc) <= tolerance);
        bool padding_kept = true;
        for (std::int64_t i = 0; i < g.m; ++i)
          for (std::int64_t j = g.n; j < ldc; ++j) padding_kept = padding_kept && c[i * ldc + j] == c0[i * ldc + j];
        CHECK(padding_kept);
      }
}

TEST_CASE("Winograd's filter transform gathers the same taps as a float64 loop", "[core][conv]") {
  // detail::winograd_filter_transform (kernels/cpu/winograd.hpp) in float takes each tap of a
  // vector of consecutive filters with one hardware gather (WinogradTapGather, builds with AVX2 or
  // AVX-512) where the vector is whole; float64 always loops. Both layouts of w (transposed: the
  // channel-blocked path's), the flipped filter (rotated: dx), column counts of whole vectors and a
  // last partial one, a row range [r0, r1) of a team's share: the float result equals the float64
  // one rounded, up to the transform's own rounding.
  struct Case {
    std::int64_t rows, cols, r0, r1;
  };
  const Case cases[] = {{3, 5, 0, 3}, {4, 16, 0, 4}, {6, 37, 2, 5}, {20, 48, 0, 20}, {9, 130, 3, 9}};
  std::uint64_t state = 11;
  for (const auto& c : cases)
    for (bool transposed : {false, true})
      for (bool rotated : {false, true}) {
        const std::int64_t filters = c.rows * c.cols, plane = filters;
        std::vector<double> w64(filters * 9);
        for (auto& v : w64) v = pseudo_random(state);
        std::vector<float> w32(w64.begin(), w64.end());
        for (auto& v : w64) v = static_cast<double>(static_cast<float>(v));  // the same inputs
        std::vector<double> u64(36 * plane, 7.0);
        std::vector<float> u32(36 * plane, 7.0f);
        detail::winograd_filter_transform(w64.data(), c.rows, c.cols, transposed, rotated, c.r0, c.r1, u64.data());
        detail::winograd_filter_transform(w32.data(), c.rows, c.cols, transposed, rotated, c.r0, c.r1, u32.data());
        INFO("rows " << c.rows << " cols " << c.cols << " [" << c.r0 << ", " << c.r1 << ") transposed " << transposed
                     << " rotated " << rotated);
        double worst = 0;
        bool outside_kept = true;
        for (std::int64_t xi = 0; xi < 36; ++xi)
          for (std::int64_t r = 0; r < c.rows; ++r)
            for (std::int64_t q = 0; q < c.cols; ++q) {
              const std::int64_t at = xi * plane + r * c.cols + q;
              if (r < c.r0 || r >= c.r1) {
                outside_kept = outside_kept && u32[at] == 7.0f && u64[at] == 7.0;
                continue;
              }
              worst = std::max(worst, std::fabs(static_cast<double>(u32[at]) - u64[at]) / (1.0 + std::fabs(u64[at])));
            }
        CHECK(worst <= 1e-6);
        CHECK(outside_kept);
      }
}

TEST_CASE("the unpacked product handles widths that are not whole vectors", "[core][conv]") {
  // detail::gemm_unpacked_avx512 (kernels/cpu/gemm_unpacked.hpp), as conv_gemm calls it on blocks
  // of any width: a last vector of 1 to 15 columns under a mask, alone or after whole panels of
  // 1 to 4 vectors, or (a not transposed) 1 to 4 last columns as dot products; both layouts of a,
  // beta 0 and 1; k in the default blocks, in blocks of 5 steps (many, the last one short) and in
  // deep blocks of 1024 (a thin product's: k in one); a
  // tall product's rows in blocks. The entries past n in each row of c (the next block's) stay.
  // The same cases on detail::gemm_unpacked_avx2 (kernels/cpu/gemm_unpacked_avx2.hpp), Winograd's
  // product on AVX2 CPUs: panels of 2 vectors of 8, a last panel of 1 or 2 with 1 to 7 columns
  // masked; it runs on AVX-512 CPUs too, so both kernels are checked there.
#if TESSERA_X86_DISPATCH
  if (!cpu_avx2()) {
    WARN("skipped: this CPU has neither AVX-512 nor AVX2, where conv_gemm never calls the unpacked product");
    return;
  }
  const GemmCase cases[] = {{3, 1, 5}, {7, 7, 70}, {6, 17, 64}, {13, 49, 300}, {20, 63, 33},
                            {9, 65, 257}, {32, 196, 40}, {5, 300, 129}, {8, 208, 1100},
                            // thin products in blocks of 96 rows by 512 steps: a last short block of each
                            {200, 196, 1100}, {97, 80, 513},
                            // a transposed a of 1.25 MB, rows over 512 floats apart: its blocks copied (p major)
                            // before the tiles read them; one of 1.08 MB without a depth block, in the same blocks
                            {600, 100, 520}, {520, 130, 520},
                            // without a depth block, rows in blocks of 24 while b fits in 1 MiB (the last
                            // block 47 rows); a b of 1.2 MB in whole panels, and an a of 1.2 MB (whole
                            // panels when a is transposed)
                            {119, 40, 20}, {100, 300, 1000}, {300, 20, 1000},
                            // 1 to 4 columns past the last whole vector (dot products along k when a is
                            // not transposed): 17, 33, 49, 84 and 113 columns, k not a multiple of 16
                            {14, 17, 37}, {7, 33, 16}, {130, 49, 700}, {6, 84, 150}, {25, 115, 250},
                            // AVX2's panels: 8, 24 and 40 columns (a last panel of one whole vector),
                            // 12 and 29 (one of 1 or 2 vectors, the last masked)
                            {11, 8, 90}, {6, 24, 600}, {15, 40, 17}, {9, 12, 33}, {17, 29, 300}};
  using Kernel = void (*)(bool, std::int64_t, std::int64_t, std::int64_t, const float*, std::int64_t, const float*,
                          std::int64_t, float, float*, std::int64_t, std::int64_t);
  struct Named {
    const char* name;
    Kernel kernel;
  };
  std::vector<Named> kernels = {{"avx2", detail::gemm_unpacked_avx2}};
  if (cpu_avx512()) kernels.push_back({"avx512", detail::gemm_unpacked_avx512});
  std::uint64_t state = 11;
  for (const auto& [name, kernel] : kernels)
    for (const auto& g : cases)
      for (bool ta : {false, true})
        for (double beta : {0.0, 1.0})
          for (std::int64_t depth_block : {0, 5, 1024}) {
            const std::int64_t lda = (ta ? g.m : g.k) + 3, ldb = g.n + 5, ldc = g.n + 7;
            std::vector<float> a((ta ? g.k : g.m) * lda), b(g.k * ldb), c0(g.m * ldc);
            for (auto& v : a) v = static_cast<float>(pseudo_random(state));
            for (auto& v : b) v = static_cast<float>(pseudo_random(state));
            for (auto& v : c0) v = static_cast<float>(pseudo_random(state));
            INFO(name << ": m " << g.m << " n " << g.n << " k " << g.k << " trans_a " << ta << " beta " << beta
                      << " depth block " << depth_block);
            std::vector<float> c = c0;
            kernel(ta, g.m, g.n, g.k, a.data(), lda, b.data(), ldb, static_cast<float>(beta), c.data(), ldc, depth_block);
            CHECK(worst_relative_error(ta, false, g, 1.0, beta, a, lda, b, ldb, c0, c, ldc) <= 2e-5);
            bool padding_kept = true;
            for (std::int64_t i = 0; i < g.m; ++i)
              for (std::int64_t j = g.n; j < ldc; ++j) padding_kept = padding_kept && c[i * ldc + j] == c0[i * ldc + j];
            CHECK(padding_kept);
          }
#else
  WARN("skipped: built without x86 dispatch, where conv_gemm never calls the unpacked product");
#endif
}

// OpenBLAS's threaded builds export blas_server_avail: 1 while the worker pool they start at load
// runs (on more than one core). Weak: null in a build without OpenBLAS, or with its serial build.
extern "C" __attribute__((weak)) int blas_server_avail;

TEST_CASE("the first product stops OpenBLAS's idle worker pool, which polled the cores at start", "[core]") {
  if (&blas_server_avail == nullptr) {
    WARN("skipped: no threaded OpenBLAS in this program (Eigen's gebp or a serial OpenBLAS: no pool to stop)");
    return;
  }
  // Any product, however small (below 2^20 multiply-adds it stays on Eigen): the pool's polling
  // costs the same whether OpenBLAS computes or not (kernels/cpu/gemm.hpp).
  const float a[4] = {1, 2, 3, 4}, b[4] = {5, 6, 7, 8};
  float c[4] = {};
  gemm(Cpu{}, false, false, 2, 2, 2, 1.0f, a, 2, b, 2, 0.0f, c, 2);
  CHECK(c[0] == 19.0f);
  CHECK(c[3] == 50.0f);
  CHECK(blas_server_avail == 0);
}

// The same for a program whose first product is a bfloat16 one (a bfloat16 MLP's: every product on
// gemm_bf16's kernel, none through gemm). Hidden ([.]): it must be the first product of its
// process, which the test `openblas-pool-bf16` (tests/meson.build) runs with this tag alone.
TEST_CASE("the first bfloat16 product stops OpenBLAS's idle worker pool too", "[.][openblas-pool]") {
  if (&blas_server_avail == nullptr) {
    WARN("skipped: no threaded OpenBLAS in this program (Eigen's gebp or a serial OpenBLAS: no pool to stop)");
    return;
  }
  if (blas_server_avail == 0) {
    WARN("skipped: OpenBLAS started no pool in this process (one core, OPENBLAS_NUM_THREADS=1, or a product ran "
         "before this test)");
    return;
  }
  if (!cpu_bf16_active())
    WARN("this CPU computes gemm_bf16 in float (" << cpu_bf16_kernel() << "): the product goes through gemm");
  const float a[4] = {1, 2, 3, 4}, b[4] = {5, 6, 7, 8};
  float c[4] = {};
  gemm_bf16(Cpu{}, false, false, 2, 2, 2, 1.0f, a, 2, b, 2, 0.0f, c, 2);
  CHECK(c[0] == 19.0f);  // bfloat16 holds these integers exactly
  CHECK(c[3] == 50.0f);
  CHECK(blas_server_avail == 0);
}

// OpenBLAS 0.3.21 runs a CPU model it does not know (Emerald Rapids) on its SSE3 "Prescott" core;
// Tessera then chooses the core the CPU's vector units run (detail::openblas_better_core). The
// report names the core the products run on: never a fallback where a better one exists.
TEST_CASE("gemm runs OpenBLAS on a core with the CPU's vector width, not a fallback", "[core]") {
  const char* wide = detail::openblas_better_core("Prescott");
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl")) {
    REQUIRE(wide != nullptr);
    CHECK(std::string(wide) == (__builtin_cpu_supports("avx512bf16") ? "Cooperlake" : "SkylakeX"));
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    REQUIRE(wide != nullptr);
    CHECK(std::string(wide) == "Haswell");
  } else {
    CHECK(wide == nullptr);
  }
  // Cores with AVX2 kernels or better stay, in any spelling.
  for (const char* kept : {"Haswell", "SKYLAKEX", "Cooperlake", "Zen", "SapphireRapids"})
    CHECK(detail::openblas_better_core(kept) == nullptr);
  // After a product large enough for OpenBLAS (a of 1 MiB: not the unpacked kernel's, gemm.hpp's
  // unpacked_suits), the report names the core it runs.
  std::vector<float> a(512 * 512, 1.0f), b(512 * 512, 1.0f), c(512 * 512, 0.0f);
  gemm(Cpu{}, false, false, 512, 512, 512, 1.0f, a.data(), 512, b.data(), 512, 0.0f, c.data(), 512);
  CHECK(c[0] == 512.0f);
  const std::string kernel = cpu_gemm_kernel();
  INFO("gemm kernel: " << kernel);
  if (kernel.rfind("OpenBLAS ", 0) == 0 && std::getenv("OPENBLAS_CORETYPE") == nullptr) {
    const std::string core = kernel.substr(9, kernel.find_first_of(" ,", 9) - 9);
    CHECK(detail::openblas_better_core(core.c_str()) == nullptr);
  }
}
