// gemm_unpacked_avx2: the unpacked product of kernels/cpu/gemm_unpacked.hpp for CPUs with AVX2 and
// FMA but no AVX-512 (AMD Zen 2 and 3, Intel Haswell to Alder Lake): c (m, n) = beta c + op(a) b,
// beta 0 or 1, on one thread, float, both operands read where they lie: op(a)(i, p) = a[i lda + p],
// or a[p lda + i] when trans_a; b (k, n) and c row-major.
//
// Its registers are 16 of 8 floats, so a tile is 6 rows x 2 vectors (16 columns): 12 accumulators,
// 2 vectors of b and 1 broadcast of a, the shape of OpenBLAS's and BLIS's Haswell kernels. Each
// step loads 2 vectors of b and broadcasts 6 floats of a for 12 multiply-adds: the two FMA pipes
// are busier than the load ports, so the tile runs at the FMA rate while b's piece is in L1. A panel
// of one vector (the last 8 columns of an odd count) takes 8 rows. b's k x 16 panel is cut into
// pieces of `depth_block` steps (by default 16 KiB: half of a 32 KiB L1, Zen 3's and Haswell's;
// 32 KiB pieces were slower), and the columns past the last whole vector are loaded and stored
// under a lane mask (VMASKMOVPS does not fault on the lanes it leaves).
//
// Who uses it: where kernels/cpu/gemm_unpacked.hpp's AVX-512 kernel runs on an AVX-512 CPU,
// Winograd's 36 products (kernels/cpu/winograd.hpp); without it Eigen's gebp packed both operands
// on every call and zeroed c first (a quarter of a ResNet-20 training step on a Zen 3: bench/README.md,
// "Figures behind design choices in the headers"). And gemm's products with at most 16 rows or
// steps (kernels/cpu/gemm.hpp, unpacked_suits_avx2), with the dot products below (gemm_dot_bt_avx2)
// for a transposed b: LeNet-5's convolutions and a classifier's last layer, where OpenBLAS and
// Eigen spend most of such a product packing.
#pragma once

#include <algorithm>
#include <cstdint>

#include "tessera/kernels/cpu/capability.hpp"
#include "tessera/kernels/cpu/short_rows.hpp"
#include "tessera/kernels/cpu/simd_diagnostics.hpp"

TESSERA_SIMD_CODE_BEGIN

namespace tessera::detail {

#if TESSERA_X86_DISPATCH
// One R x NV block of c; with Tail, the last vector's columns are those of `tail`. The first tile of
// a piece (First) prefetches b's rows kUnpackedAvx2PrefetchSteps ahead, as the AVX-512 kernel does:
// b's rows lie ldb apart, where the hardware prefetchers do not follow.
constexpr std::int64_t kUnpackedAvx2PrefetchSteps = 16;

template <int R, int NV, bool Tail, bool First>
TESSERA_TARGET_AVX2 inline void unpacked_tile_avx2(std::int64_t rows, std::int64_t k, const float* a,
                                                   std::int64_t a_rs, std::int64_t a_cs, const float* b,
                                                   std::int64_t ldb, bool accumulate, float* c, std::int64_t ldc,
                                                   __m256i tail) {
  const float* row[R];  // rows past `rows` repeat the last one (computed, never stored)
  for (int r = 0; r < R; ++r) row[r] = a + std::min<std::int64_t>(r, rows - 1) * a_rs;
  __m256 acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_ps();
#pragma GCC unroll 1
  for (std::int64_t p = 0; p < k; ++p) {
    if constexpr (First) {
      if (p + kUnpackedAvx2PrefetchSteps < k) {
        const char* ahead = reinterpret_cast<const char*>(b + (p + kUnpackedAvx2PrefetchSteps) * ldb);
        _mm_prefetch(ahead, _MM_HINT_T0);
        if (NV == 2) _mm_prefetch(ahead + 32, _MM_HINT_T0);  // the panel's 64 bytes may straddle two lines
      }
    }
    const std::int64_t at = p * a_cs;
    __m256 bv[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v)
      bv[v] = Tail && v == NV - 1 ? _mm256_maskload_ps(b + p * ldb + 8 * v, tail) : _mm256_loadu_ps(b + p * ldb + 8 * v);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(row[r] + at);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(av, bv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    if (r >= rows) break;
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      float* out = c + r * ldc + 8 * v;
      if (Tail && v == NV - 1)
        _mm256_maskstore_ps(out, tail, accumulate ? _mm256_add_ps(_mm256_maskload_ps(out, tail), acc[r][v]) : acc[r][v]);
      else
        _mm256_storeu_ps(out, accumulate ? _mm256_add_ps(_mm256_loadu_ps(out), acc[r][v]) : acc[r][v]);
    }
  }
}

// A tile of exactly `rows` (1 .. H) rows. Not inlined into the panel loop, and the tile's step loop
// not unrolled: with 16 registers there is no room for either. Inlined, clang kept the panel's
// values live across the tile and spilled accumulators to the stack; unrolled 8 times, the 8 steps'
// addresses of a's 6 rows spilled the general registers. Together they cost about half the
// kernel's speed on Winograd's products (bench/README.md, "Figures behind design choices in the
// headers").
template <int H, int NV, bool Tail, bool First>
TESSERA_TARGET_AVX2 __attribute__((noinline)) void unpacked_rows_avx2(std::int64_t rows, std::int64_t k, const float* a,
                                                   std::int64_t a_rs, std::int64_t a_cs, const float* b,
                                                   std::int64_t ldb, bool accumulate, float* c, std::int64_t ldc,
                                                   __m256i tail) {
  if constexpr (H > 1) {
    if (rows < H)
      return unpacked_rows_avx2<H - 1, NV, Tail, First>(rows, k, a, a_rs, a_cs, b, ldb, accumulate, c, ldc, tail);
  }
  unpacked_tile_avx2<H, NV, Tail, First>(H, k, a, a_rs, a_cs, b, ldb, accumulate, c, ldc, tail);
}

// All m rows of one panel of NV vectors, b's panel in pieces of kc steps; the rows split evenly
// into tiles of R or R - 1 rows, as in the AVX-512 kernel (no short tile below the best ratio of
// multiply-adds to loads).
template <int NV, bool Tail>
TESSERA_TARGET_AVX2 void unpacked_panel_avx2(std::int64_t m, std::int64_t k, const float* a, std::int64_t a_rs,
                                             std::int64_t a_cs, const float* b, std::int64_t ldb, bool accumulate,
                                             float* c, std::int64_t ldc, __m256i tail, std::int64_t depth_block) {
  constexpr int R = NV == 2 ? 6 : 8;
  const std::int64_t kc = depth_block > 0 ? depth_block : 512 / NV;  // 16 KiB of b: kc x 8 NV floats
  const std::int64_t tiles = (m + R - 1) / R, base = m / tiles, taller = m % tiles;
  for (std::int64_t k0 = 0; k0 < k; k0 += kc) {
    const std::int64_t depth = std::min(kc, k - k0);
    const bool acc = accumulate || k0 > 0;
    for (std::int64_t t = 0, i0 = 0; t < tiles; ++t) {
      const std::int64_t rows = base + (t < taller ? 1 : 0);
      const float* ai = a + i0 * a_rs + k0 * a_cs;
      if (t == 0)
        unpacked_rows_avx2<R, NV, Tail, true>(rows, depth, ai, a_rs, a_cs, b + k0 * ldb, ldb, acc, c + i0 * ldc, ldc,
                                              tail);
      else
        unpacked_rows_avx2<R, NV, Tail, false>(rows, depth, ai, a_rs, a_cs, b + k0 * ldb, ldb, acc, c + i0 * ldc, ldc,
                                               tail);
      i0 += rows;
    }
  }
}

TESSERA_TARGET_AVX2 inline void gemm_unpacked_avx2(bool trans_a, std::int64_t m, std::int64_t n, std::int64_t k,
                                                   const float* a, std::int64_t lda, const float* b, std::int64_t ldb,
                                                   float beta, float* c, std::int64_t ldc,
                                                   std::int64_t depth_block = 0) {
  if (k == 0 || m == 0) {
    if (beta == 0)
      for (std::int64_t i = 0; i < m; ++i) std::fill(c + i * ldc, c + i * ldc + n, 0.0f);
    return;
  }
  const std::int64_t a_rs = trans_a ? 1 : lda, a_cs = trans_a ? lda : 1;
  const bool accumulate = beta != 0;
  // Panels of 2 vectors (16 columns), the last one of 1 or 2 vectors, masked when n is not a
  // multiple of 8.
  for (std::int64_t j0 = 0; j0 < n; j0 += 16) {
    const std::int64_t width = std::min<std::int64_t>(16, n - j0);
    const float* bp = b + j0;
    float* cp = c + j0;
    if (width == 16) {
      unpacked_panel_avx2<2, false>(m, k, a, a_rs, a_cs, bp, ldb, accumulate, cp, ldc, lanes8(8), depth_block);
    } else if (width > 8) {
      unpacked_panel_avx2<2, true>(m, k, a, a_rs, a_cs, bp, ldb, accumulate, cp, ldc, lanes8(width - 8), depth_block);
    } else if (width == 8) {
      unpacked_panel_avx2<1, false>(m, k, a, a_rs, a_cs, bp, ldb, accumulate, cp, ldc, lanes8(8), depth_block);
    } else {
      unpacked_panel_avx2<1, true>(m, k, a, a_rs, a_cs, bp, ldb, accumulate, cp, ldc, lanes8(width), depth_block);
    }
  }
}

// c (m, n) = beta c + a bt^T, beta 0 or 1, one thread: a (m, k) and bt (n, k) row-major, as dot
// products along k (gemm_unpacked.hpp's gemm_dot_bt_avx512 in 8 lanes): a convolution's weight
// gradient dy (K, cols) col^T with few output channels (LeNet-5's 6 and 16), a classifier's last
// layer (10 columns). A tile is 4 rows of a x 3 rows of bt: 12 accumulators, 3 vectors of bt and one
// of a fill the 16 registers; each step of 8 loads 7 vectors for 12 multiply-adds. The sums are
// folded at the end of each block of kDotDepthAvx2 steps (4 KiB per row: the tile's 7 rows stay in
// L1), and the columns of c a tile leaves are taken by the next tile to the right.
constexpr std::int64_t kDotDepthAvx2 = 1024;

// One step of 8 (with Masked, the lanes of `lanes`: masked loads do not fault on the lanes they
// leave) of the tile's 12 dot products.
template <bool Masked>
TESSERA_TARGET_AVX2 inline __attribute__((always_inline)) void dot_step_avx2(__m256 (&acc)[12], const float* const (&ar)[4],
                                                                             const float* const (&br)[3], std::int64_t p,
                                                                             __m256i lanes) {
  __m256 bv[3];
#pragma GCC unroll 3
  for (int q = 0; q < 3; ++q) bv[q] = Masked ? _mm256_maskload_ps(br[q] + p, lanes) : _mm256_loadu_ps(br[q] + p);
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) {
    const __m256 av = Masked ? _mm256_maskload_ps(ar[r] + p, lanes) : _mm256_loadu_ps(ar[r] + p);
#pragma GCC unroll 3
    for (int q = 0; q < 3; ++q) acc[3 * r + q] = _mm256_fmadd_ps(av, bv[q], acc[3 * r + q]);
  }
}

// c's rows [0, rows) x columns [0, cols) (at most 4 x 3) += or = the tile's dot products over
// `depth` steps; rows and columns past the edge repeat the last one (computed, never stored).
TESSERA_TARGET_AVX2 __attribute__((noinline)) inline void dot_tile_avx2(std::int64_t rows, std::int64_t cols,
                                                                        std::int64_t depth, const float* a,
                                                                        std::int64_t lda, const float* bt,
                                                                        std::int64_t ldb, bool accumulate, float* c,
                                                                        std::int64_t ldc) {
  const float* ar[4];
  const float* br[3];
  for (int r = 0; r < 4; ++r) ar[r] = a + std::min<std::int64_t>(r, rows - 1) * lda;
  for (int q = 0; q < 3; ++q) br[q] = bt + std::min<std::int64_t>(q, cols - 1) * ldb;
  __m256 acc[12];
#pragma GCC unroll 12
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_setzero_ps();
  const std::int64_t whole = depth / 8 * 8;
#pragma GCC unroll 1
  for (std::int64_t p = 0; p < whole; p += 8) dot_step_avx2<false>(acc, ar, br, p, __m256i{});
  if (whole < depth) dot_step_avx2<true>(acc, ar, br, whole, lanes8(depth - whole));
  // Three sums of a row at a time: horizontal adds pair the lanes, then the two 128-bit halves.
  for (std::int64_t r = 0; r < rows; ++r) {
    const __m256 h01 = _mm256_hadd_ps(acc[3 * r], acc[3 * r + 1]), h2 = _mm256_hadd_ps(acc[3 * r + 2], acc[3 * r + 2]);
    const __m256 h = _mm256_hadd_ps(h01, h2);  // lanes 0..3 and 4..7: sums of q = 0, 1, 2, 2 per half
    alignas(16) float sums[4];
    _mm_store_ps(sums, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    float* out = c + r * ldc;
    for (std::int64_t q = 0; q < cols; ++q) out[q] = accumulate ? out[q] + sums[q] : sums[q];
  }
}

TESSERA_TARGET_AVX2 inline void gemm_dot_bt_avx2(std::int64_t m, std::int64_t n, std::int64_t k, const float* a,
                                                 std::int64_t lda, const float* bt, std::int64_t ldb, float beta,
                                                 float* c, std::int64_t ldc) {
  if (k == 0) {
    if (beta == 0)
      for (std::int64_t i = 0; i < m; ++i) std::fill(c + i * ldc, c + i * ldc + n, 0.0f);
    return;
  }
  // Blocks of k as even as they go, whole vectors.
  const std::int64_t blocks = (k + kDotDepthAvx2 - 1) / kDotDepthAvx2;
  const std::int64_t depth_max = ((k + blocks - 1) / blocks + 7) / 8 * 8;
  for (std::int64_t k0 = 0; k0 < k; k0 += depth_max) {
    const std::int64_t depth = std::min(depth_max, k - k0);
    const bool accumulate = beta != 0 || k0 > 0;
    for (std::int64_t j0 = 0; j0 < n; j0 += 3)
      for (std::int64_t i0 = 0; i0 < m; i0 += 4)
        dot_tile_avx2(std::min<std::int64_t>(4, m - i0), std::min<std::int64_t>(3, n - j0), depth, a + i0 * lda + k0,
                      lda, bt + j0 * ldb + k0, ldb, accumulate, c + i0 * ldc + j0, ldc);
  }
}
#endif

}  // namespace tessera::detail

TESSERA_SIMD_CODE_END
