// gemm_packed_avx2: c (m, n) = beta c + alpha op(a) op(b), beta 0 or 1, float, on one thread, for
// CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 2 and 3, Intel Haswell to Alder Lake), where it
// takes the products that OpenBLAS ran before (kernels/cpu/gemm.hpp, gemm_serial): op(a)(i, p) =
// a[i lda + p], or a[p lda + i] with trans_a; op(b)(p, j) = b[p ldb + j], or b[j ldb + p] with
// trans_b; c row-major.
//
// The Goto / BLIS blocking. Columns of C in blocks of kPackedNc; steps in blocks of kPackedKc,
// each packing op(b)'s kc x nc block into panels of 16 columns (kc x 16, 16 KiB: half of a 32 KiB
// L1, where the panel stays while the 6-row panels of a stream past it); rows in blocks of kPackedMc,
// each packing op(a)'s mc x kc block into panels of 6 rows (kc x 6; the block, 144 KiB, stays in a
// 512 KiB L2). The tile is 6 rows x 2 vectors (16 columns): 12 accumulators, 2 vectors of b and 1
// broadcast of a in 16 registers, the shape of OpenBLAS's Haswell / Zen kernel; each step loads 2
// vectors and broadcasts 6 floats for 12 multiply-adds, so the two FMA pipes set the pace.
//
// Why not OpenBLAS: with beta 0 it first zeroes c in a pass of its own (Tessera's scale_matrix
// did the same before calling it), where the first block of steps here writes c outright; and its
// driver costs more per call on the mid-sized products of a training step. On a Zen 3 a step ran
// 1.01 to 1.06 times faster (ResNet-50 b8), 1.05 to 1.11 (an MLP's; bench/README.md, "Figures behind
// design choices in the headers"); per product 0.9 to 1.13 times OpenBLAS's speed. Edge panels are
// packed with zeros, and their tiles go through a 6 x 16 scratch tile, so any m, n, k and stride
// work (k >= 1); the last 1 to 4 columns run as matrix-vector products (packed_columns_avx2).
#pragma once

#include <algorithm>
#include <cstdint>

#include "tessera/kernels/cpu/capability.hpp"
#include "tessera/kernels/cpu/short_rows.hpp"
#include "tessera/kernels/cpu/simd_diagnostics.hpp"

TESSERA_SIMD_CODE_BEGIN

namespace tessera::detail {

constexpr std::int64_t kPackedMr = 6;     // a tile's rows
constexpr std::int64_t kPackedNr = 16;    // a tile's columns: 2 vectors of 8 floats
constexpr std::int64_t kPackedMc = 144;   // rows of a packed block of op(a): 144 x 256 floats, 144 KiB
constexpr std::int64_t kPackedKc = 256;   // steps per block: a panel of b, 256 x 16 floats, is 16 KiB
constexpr std::int64_t kPackedNc = 4080;  // columns per packed block of op(b): 4 MiB, 255 panels

// The packing buffers gemm_packed_avx2 needs for an (m, n, k) product, in floats: op(a)'s block
// (with 8 floats of slack for pack_a_panels' last 8-float store and packed_columns_avx2's last
// 8-float load, each 2 floats past the block) and
// op(b)'s. The caller's (gemm_serial: GemmWorkspace, grown once, so a steady step allocates
// nothing); b's must be 32-byte aligned (the kernel loads its panels aligned).
// One packed block's floats (both kernels): `extent` rows or columns rounded up to whole panels of
// `panel`, at most `block` of them, by at most `depth` of the k steps.
constexpr std::int64_t packed_block_floats(std::int64_t extent, std::int64_t k, std::int64_t panel, std::int64_t block,
                                           std::int64_t depth) {
  return std::min(block, (extent + panel - 1) / panel * panel) * std::min(depth, k);
}
constexpr std::int64_t packed_avx2_a_floats(std::int64_t m, std::int64_t k) {
  return packed_block_floats(m, k, kPackedMr, kPackedMc, kPackedKc) + 8;
}
constexpr std::int64_t packed_avx2_b_floats(std::int64_t n, std::int64_t k) {
  return packed_block_floats(n, k, kPackedNr, kPackedNc, kPackedKc);
}

#if TESSERA_X86_DISPATCH
// c's 6 x 8 NV tile = (accumulate ? c : 0) + alpha ap bp over kc steps: ap a panel of a (kc x 6,
// step-major), bp one of b (kc x 16; NV 1 reads its first 8 columns: an edge of 5 to 8 columns,
// such as ResNet-50's 392 at batch 8, so half the multiply-adds of a whole tile are spent there
// instead of all; 1 to 4 go to packed_columns_avx2). Whole tiles store straight into c; an edge
// tile (rows < 6 or cols < 8 NV) goes through a scratch tile, of which only its rows and columns
// reach c.
template <bool Whole, int NV>
TESSERA_TARGET_AVX2 inline void packed_tile_avx2(std::int64_t kc, const float* __restrict ap,
                                                 const float* __restrict bp, float alpha, bool accumulate, float* c,
                                                 std::int64_t ldc, std::int64_t rows, std::int64_t cols) {
  static_assert(NV == 1 || NV == 2);
  __m256 acc[6][NV];
#pragma GCC unroll 6
  for (int r = 0; r < 6; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_ps();
  if constexpr (Whole)  // c's tile is read (accumulate) or written at the end: start bringing it in
    for (int r = 0; r < 6; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(c + r * ldc), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(c + r * ldc + 8 * NV - 1), _MM_HINT_T0);
    }
#pragma GCC unroll 4
  for (std::int64_t p = 0; p < kc; ++p) {
    _mm_prefetch(reinterpret_cast<const char*>(ap + 96), _MM_HINT_T0);  // 16 steps of a ahead
    __m256 bv[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) bv[v] = _mm256_load_ps(bp + 8 * v);
#pragma GCC unroll 6
    for (int r = 0; r < 6; ++r) {
      const __m256 av = _mm256_broadcast_ss(ap + r);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(av, bv[v], acc[r][v]);
    }
    ap += 6;
    bp += 16;
  }
  const __m256 scale = _mm256_set1_ps(alpha);
  if constexpr (Whole) {
#pragma GCC unroll 6
    for (int r = 0; r < 6; ++r)
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) {
        float* out = c + r * ldc + 8 * v;
        _mm256_storeu_ps(out, accumulate ? _mm256_fmadd_ps(acc[r][v], scale, _mm256_loadu_ps(out))
                                         : _mm256_mul_ps(acc[r][v], scale));
      }
  } else {
    alignas(32) float tile[6][16];
    for (int r = 0; r < 6; ++r)
      for (int v = 0; v < NV; ++v) _mm256_store_ps(tile[r] + 8 * v, _mm256_mul_ps(acc[r][v], scale));
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = 0; j < cols; ++j) c[r * ldc + j] = (accumulate ? c[r * ldc + j] : 0.0f) + tile[r][j];
  }
}

// The last 1 to 4 columns of a 6-row panel as matrix-vector products along the panel's rows:
// each step loads the panel's 6 rows of a as one vector (lanes 6 and 7 are the next step's first
// rows, or the slack past the block: computed, never stored) and multiplies it by each column's
// broadcast. A one-vector tile spends 6 broadcasts and 6 multiply-adds a step on them whatever
// their number: ResNet-50's 49 columns at batch 1 end in 1 (a whole tile's worth of steps for a
// sixteenth of its work), its 196 in 4. U steps go to separate accumulators, so that the U x Cols
// chains of dependent multiply-adds keep both FMA pipes busy.
template <int Cols>
TESSERA_TARGET_AVX2 __attribute__((noinline)) void packed_columns_avx2(std::int64_t kc, const float* ap,
                                                                      const float* bp, float alpha, bool accumulate,
                                                                      float* c, std::int64_t ldc, std::int64_t rows) {
  static_assert(Cols >= 1 && Cols <= 4);
  constexpr int U = Cols <= 3 ? 4 : 2;
  __m256 acc[U][Cols];
#pragma GCC unroll 4
  for (int u = 0; u < U; ++u)
#pragma GCC unroll 4
    for (int j = 0; j < Cols; ++j) acc[u][j] = _mm256_setzero_ps();
  std::int64_t p = 0;
  for (; p + U <= kc; p += U)
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      const __m256 av = _mm256_loadu_ps(ap + (p + u) * 6);
#pragma GCC unroll 4
      for (int j = 0; j < Cols; ++j)
        acc[u][j] = _mm256_fmadd_ps(av, _mm256_broadcast_ss(bp + (p + u) * 16 + j), acc[u][j]);
    }
  for (; p < kc; ++p) {
    const __m256 av = _mm256_loadu_ps(ap + p * 6);
#pragma GCC unroll 4
    for (int j = 0; j < Cols; ++j) acc[0][j] = _mm256_fmadd_ps(av, _mm256_broadcast_ss(bp + p * 16 + j), acc[0][j]);
  }
  alignas(32) float sums[Cols][8];
#pragma GCC unroll 4
  for (int j = 0; j < Cols; ++j) {
    __m256 sum = acc[0][j];
#pragma GCC unroll 4
    for (int u = 1; u < U; ++u) sum = _mm256_add_ps(sum, acc[u][j]);
    _mm256_store_ps(sums[j], _mm256_mul_ps(sum, _mm256_set1_ps(alpha)));
  }
  for (std::int64_t r = 0; r < rows; ++r)
    for (int j = 0; j < Cols; ++j) c[r * ldc + j] = (accumulate ? c[r * ldc + j] : 0.0f) + sums[j][r];
}

// op(b)'s kc x nc block (its first element at `b`) into panels of Nr columns (16 here, 32 for
// gemm_packed_avx512), panel q at out + Nr q kc, step-major; the last panel's missing columns are zeros.
template <int Nr = kPackedNr>
TESSERA_TARGET_AVX2 inline void pack_b_panels(bool trans_b, std::int64_t kc, std::int64_t nc, const float* b,
                                              std::int64_t ldb, float* out) {
  static_assert(Nr % 8 == 0);
  for (std::int64_t j0 = 0; j0 < nc; j0 += Nr) {
    const std::int64_t width = std::min<std::int64_t>(Nr, nc - j0);
    float* o = out + j0 * kc;
    if (!trans_b) {  // op(b)(p, j) = b[p ldb + j]: each step's Nr columns lie together
      const float* src = b + j0;
      if (width == Nr) {
        for (std::int64_t p = 0; p < kc; ++p)
          for (int h = 0; h < Nr / 8; ++h) _mm256_store_ps(o + p * Nr + 8 * h, _mm256_loadu_ps(src + p * ldb + 8 * h));
      } else {
        for (std::int64_t p = 0; p < kc; ++p)
          for (std::int64_t j = 0; j < Nr; ++j) o[p * Nr + j] = j < width ? src[p * ldb + j] : 0.0f;
      }
      continue;
    }
    // op(b)(p, j) = b[j ldb + p]: 8 x 8 blocks (8 columns' runs of 8 steps) transposed in registers.
    const std::int64_t whole_steps = width == Nr ? kc / 8 * 8 : 0;
    for (std::int64_t p = 0; p < whole_steps; p += 8)
      for (int h = 0; h < Nr / 8; ++h) {
        __m256 v[8];
        for (int j = 0; j < 8; ++j) v[j] = _mm256_loadu_ps(b + (j0 + 8 * h + j) * ldb + p);
        transpose8(v);
        for (int q = 0; q < 8; ++q) _mm256_store_ps(o + (p + q) * Nr + 8 * h, v[q]);
      }
    for (std::int64_t j = 0; j < Nr; ++j) {
      const float* src = b + (j0 + j) * ldb;
      for (std::int64_t p = whole_steps; p < kc; ++p) o[p * Nr + j] = j < width ? src[p] : 0.0f;
    }
  }
}

// op(a)'s mc x kc block (its first element at `a`) into panels of Mr rows (6 here, 8 for
// gemm_packed_avx512), panel q at out + Mr q kc, step-major; the last panel's missing rows are
// zeros. Writes up to 8 ceil(Mr / 8) - Mr floats past the block (2 for 6 rows, none for 8).
template <int Mr = kPackedMr>
TESSERA_TARGET_AVX2 inline void pack_a_panels(bool trans_a, std::int64_t mc, std::int64_t kc, const float* a,
                                              std::int64_t lda, float* out) {
  constexpr int kGroups = (Mr + 7) / 8;  // runs of 8 rows, each transposed as an 8 x 8 block
  for (std::int64_t i0 = 0; i0 < mc; i0 += Mr) {
    const std::int64_t height = std::min<std::int64_t>(Mr, mc - i0);
    float* o = out + i0 * kc;
    if (trans_a) {  // op(a)(i, p) = a[p lda + i]: each step's Mr rows lie together
      const float* src = a + i0;
      if (height == Mr && Mr % 8 == 0) {  // whole vectors (8 rows: the AVX-512 kernel's panels)
        for (std::int64_t p = 0; p < kc; ++p)
          for (int h = 0; h < Mr / 8; ++h) _mm256_storeu_ps(o + p * Mr + 8 * h, _mm256_loadu_ps(src + p * lda + 8 * h));
        continue;
      }
      for (std::int64_t p = 0; p < kc; ++p)
        for (std::int64_t r = 0; r < Mr; ++r) o[p * Mr + r] = r < height ? src[p * lda + r] : 0.0f;
      continue;
    }
    const float* row[Mr];  // rows past the panel's repeat its last (never stored: see below)
    for (std::int64_t r = 0; r < Mr; ++r) row[r] = a + (i0 + std::min<std::int64_t>(r, height - 1)) * lda;
    std::int64_t p = 0;
    if (height == Mr) {
      // 8 steps at a time: each run of 8 rows (the last padded with zero rows) transposed, then
      // 8-float stores Mr apart, each one's padding lanes overwritten by the next (the last one's
      // by what follows). Each 16 steps prefetch the next panel's Mr lines there: a row's run of
      // a block is only kc floats (16 lines at 256), too short for the hardware's stream prefetch
      // to get ahead, and where a is the weights of a narrow product it comes from memory
      // (ResNet-50 inference at batch 1, 2 threads, on a Zen 3: 1.013 and 1.034 times faster in
      // paired forwards; b8 training 0.97 to 1.05, median of four runs 1.02).
      const bool ahead = i0 + 2 * Mr <= mc;
      for (; p + 8 <= kc; p += 8) {
        if (ahead && p % 16 == 0)
          for (int r = 0; r < Mr; ++r) _mm_prefetch(reinterpret_cast<const char*>(row[r] + Mr * lda + p), _MM_HINT_T0);
        __m256 v[kGroups][8];
        for (int g = 0; g < kGroups; ++g) {
          for (int j = 0; j < 8; ++j)
            v[g][j] = 8 * g + j < Mr ? _mm256_loadu_ps(row[8 * g + j] + p) : _mm256_setzero_ps();
          transpose8(v[g]);
        }
        for (int q = 0; q < 8; ++q)
          for (int g = 0; g < kGroups; ++g) _mm256_storeu_ps(o + (p + q) * Mr + 8 * g, v[g][q]);
      }
    }
    for (; p < kc; ++p)
      for (std::int64_t r = 0; r < Mr; ++r) o[p * Mr + r] = r < height ? row[r][p] : 0.0f;
  }
}

TESSERA_TARGET_AVX2 inline void packed_columns(std::int64_t cols, std::int64_t kc, const float* ap, const float* bp,
                                               float alpha, bool accumulate, float* c, std::int64_t ldc,
                                               std::int64_t rows) {
  switch (cols) {
    case 1: return packed_columns_avx2<1>(kc, ap, bp, alpha, accumulate, c, ldc, rows);
    case 2: return packed_columns_avx2<2>(kc, ap, bp, alpha, accumulate, c, ldc, rows);
    case 3: return packed_columns_avx2<3>(kc, ap, bp, alpha, accumulate, c, ldc, rows);
    default: return packed_columns_avx2<4>(kc, ap, bp, alpha, accumulate, c, ldc, rows);
  }
}

// The loops both packed kernels share (BLIS's): columns in blocks of Nc, steps in blocks of Kc
// (op(b)'s kc x nc block packed into panels of Nr columns), rows in blocks of Mc (op(a)'s mc x kc
// block packed into panels of Mr rows), then tile(kc, ap, bp, accumulate, c_tile, rows, cols) for
// each Mr x Nr tile of c (rows <= Mr, cols <= Nr at the edges). accumulate: beta 1, or a later
// block of steps; with beta 0 the first block writes c outright.
template <int Mr, int Nr, std::int64_t Mc, std::int64_t Kc, std::int64_t Nc, class Tile>
inline void gemm_packed_blocks(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                               const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
                               std::int64_t ldc, float* packed_a, float* packed_b, const Tile& tile) {
  for (std::int64_t j0 = 0; j0 < n; j0 += Nc) {
    const std::int64_t nc = std::min(Nc, n - j0);
    for (std::int64_t p0 = 0; p0 < k; p0 += Kc) {
      const std::int64_t kc = std::min(Kc, k - p0);
      const bool accumulate = beta != 0.0f || p0 > 0;
      pack_b_panels<Nr>(trans_b, kc, nc, trans_b ? b + j0 * ldb + p0 : b + p0 * ldb + j0, ldb, packed_b);
      for (std::int64_t i0 = 0; i0 < m; i0 += Mc) {
        const std::int64_t mc = std::min(Mc, m - i0);
        pack_a_panels<Mr>(trans_a, mc, kc, trans_a ? a + p0 * lda + i0 : a + i0 * lda + p0, lda, packed_a);
        // Columns outer: b's panel stays in L1 while a's panels (in L2) pass it.
        for (std::int64_t jr = 0; jr < nc; jr += Nr)
          for (std::int64_t ir = 0; ir < mc; ir += Mr)
            tile(kc, packed_a + ir * kc, packed_b + jr * kc, accumulate, c + (i0 + ir) * ldc + j0 + jr,
                 std::min<std::int64_t>(Mr, mc - ir), std::min<std::int64_t>(Nr, nc - jr));
      }
    }
  }
}

// packed_a and packed_b: packed_avx2_a_floats(m, k) and packed_avx2_b_floats(n, k) floats.
inline void gemm_packed_avx2(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                             const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
                             std::int64_t ldc, float* packed_a, float* packed_b) {
  gemm_packed_blocks<kPackedMr, kPackedNr, kPackedMc, kPackedKc, kPackedNc>(
      trans_a, trans_b, m, n, k, a, lda, b, ldb, beta, c, ldc, packed_a, packed_b,
      [&](std::int64_t kc, const float* ap, const float* bp, bool accumulate, float* tile, std::int64_t rows,
          std::int64_t cols) {
        if (rows == kPackedMr && cols == kPackedNr)
          packed_tile_avx2<true, 2>(kc, ap, bp, alpha, accumulate, tile, ldc, rows, cols);
        else if (cols <= 4)
          packed_columns(cols, kc, ap, bp, alpha, accumulate, tile, ldc, rows);
        else if (cols <= kPackedNr / 2)
          packed_tile_avx2<false, 1>(kc, ap, bp, alpha, accumulate, tile, ldc, rows, cols);
        else
          packed_tile_avx2<false, 2>(kc, ap, bp, alpha, accumulate, tile, ldc, rows, cols);
      });
}
#endif  // TESSERA_X86_DISPATCH

}  // namespace tessera::detail

TESSERA_SIMD_CODE_END
