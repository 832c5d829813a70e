// gemm_packed_avx512: c (m, n) = beta c + alpha op(a) op(b), beta 0 or 1, float, on one thread, for
// CPUs with AVX-512 (AMD Zen 4 and 5, Intel Skylake-SP to Sapphire Rapids), where it takes the
// products that OpenBLAS ran before (kernels/cpu/gemm.hpp, packed_avx512_suits). Operands as in
// gemm_packed_avx2: op(a)(i, p) = a[i lda + p], or a[p lda + i] with trans_a; op(b)(p, j) =
// b[p ldb + j], or b[j ldb + p] with trans_b; c row-major.
//
// The blocking of gemm_packed_avx2 (kernels/cpu/gemm_packed_avx2.hpp, whose packers it shares)
// with 16-float vectors: b's kc x nc block in panels of 32 columns (kc x 32: 32 KiB at kc 256, in
// a 48 KiB L1, where it stays while a's panels stream past), a's mc x kc block in panels of 8 rows
// (192 x 256 floats, 192 KiB, in a 1 or 2 MiB L2). The tile is 8 rows x 2 vectors: 16
// accumulators, 2 vectors of b and a broadcast of a in 19 of the 32 registers; each step loads 2
// vectors and broadcasts 8 floats for 16 multiply-adds, so the two FMA pipes set the pace, with 8
// independent chains per pipe to cover its 4-cycle latency. 8 rows divide every channel count of
// a ResNet (64 to 2048, and 9 x 64 for a 3x3 layer's im2col), so a's panels have no padding rows
// there, where the 6 rows of the AVX2 tile leave 4 of 64 to a padded panel.
//
// Why not OpenBLAS (whose SkylakeX / Cooperlake sgemm ran these products before): with beta 0 it
// zeroes c in a pass of its own first, where the first block of steps here writes c outright; its
// driver costs more per call on the mid-sized products of a training step; and edge columns go
// through AVX-512 masks here, one masked load and store per row of a tile, where OpenBLAS runs a
// narrower kernel. Figures in bench/README.md, "Figures behind design choices in the headers".
#pragma once

#include <algorithm>
#include <cstdint>

#include "tessera/kernels/cpu/capability.hpp"
#include "tessera/kernels/cpu/gemm_packed_avx2.hpp"
#include "tessera/kernels/cpu/simd_diagnostics.hpp"

TESSERA_SIMD_CODE_BEGIN

namespace tessera::detail {

constexpr std::int64_t kPacked512Mr = 8;     // a tile's rows
constexpr std::int64_t kPacked512Nr = 32;    // a tile's columns: 2 vectors of 16 floats
constexpr std::int64_t kPacked512Mc = 192;   // rows of a packed block of op(a): 192 x 256 floats, 192 KiB
constexpr std::int64_t kPacked512Kc = 256;   // steps per block: a panel of b, 256 x 32 floats, is 32 KiB
constexpr std::int64_t kPacked512Nc = 4096;  // columns per packed block of op(b): 4 MiB, 128 panels

// The packing buffers gemm_packed_avx512 needs for an (m, n, k) product, in floats: op(a)'s block
// and op(b)'s (64-byte aligned: the tile loads b's panels aligned). The caller's (gemm_serial:
// GemmWorkspace, grown once, so a steady step allocates nothing).
constexpr std::int64_t packed_avx512_a_floats(std::int64_t m, std::int64_t k) {
  return packed_block_floats(m, k, kPacked512Mr, kPacked512Mc, kPacked512Kc);
}
constexpr std::int64_t packed_avx512_b_floats(std::int64_t n, std::int64_t k) {
  return packed_block_floats(n, k, kPacked512Nr, kPacked512Nc, kPacked512Kc);
}

#if TESSERA_X86_DISPATCH
// c's rows x cols tile (rows <= 8, cols <= 16 NV) = (accumulate ? c : 0) + alpha ap bp over kc
// steps: ap a panel of a (kc x 8, step-major), bp one of b (kc x 32; NV 1 reads its first 16
// columns, an edge of 1 to 16 columns). Whole tiles (8 x 32) store whole vectors; an edge tile's
// last vector goes through a mask of its columns, and only its rows are stored (the padded rows'
// sums, zero, are dropped).
template <bool Whole, int NV>
TESSERA_TARGET_AVX512 inline void packed_tile_avx512(std::int64_t kc, const float* __restrict ap,
                                                     const float* __restrict bp, float alpha, bool accumulate,
                                                     float* c, std::int64_t ldc, std::int64_t rows, std::int64_t cols) {
  static_assert(NV == 1 || NV == 2);
  constexpr int Mr = kPacked512Mr;
  __m512 acc[Mr][NV];
#pragma GCC unroll 8
  for (int r = 0; r < Mr; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  if constexpr (Whole)  // c's tile is read (accumulate) or written at the end: start bringing it in
    for (int r = 0; r < Mr; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(c + r * ldc), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(c + r * ldc + 16 * NV - 1), _MM_HINT_T0);
    }
#pragma GCC unroll 4
  for (std::int64_t p = 0; p < kc; ++p) {
    _mm_prefetch(reinterpret_cast<const char*>(ap + 16 * Mr), _MM_HINT_T0);  // 16 steps of a ahead
    __m512 bv[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) bv[v] = _mm512_load_ps(bp + 16 * v);
#pragma GCC unroll 8
    for (int r = 0; r < Mr; ++r) {
      const __m512 av = _mm512_set1_ps(ap[r]);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(av, bv[v], acc[r][v]);
    }
    ap += Mr;
    bp += kPacked512Nr;
  }
  const __m512 scale = _mm512_set1_ps(alpha);
  // The last vector's columns: all 16 in a whole tile, cols - 16 (NV - 1) in an edge one.
  const __mmask16 last = Whole ? __mmask16(0xFFFF) : __mmask16((1u << (cols - 16 * (NV - 1))) - 1u);
#pragma GCC unroll 8
  for (int r = 0; r < Mr; ++r) {
    if (!Whole && r >= rows) break;
    float* out = c + r * ldc;
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      const __mmask16 mask = v == NV - 1 ? last : __mmask16(0xFFFF);
      __m512 sum = _mm512_mul_ps(acc[r][v], scale);
      if (Whole || v < NV - 1) {
        if (accumulate) sum = _mm512_add_ps(sum, _mm512_loadu_ps(out + 16 * v));
        _mm512_storeu_ps(out + 16 * v, sum);
      } else {
        if (accumulate) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mask, out + 16 * v));
        _mm512_mask_storeu_ps(out + 16 * v, mask, sum);
      }
    }
  }
}

// packed_a and packed_b: packed_avx512_a_floats(m, k) and packed_avx512_b_floats(n, k) floats.
inline void gemm_packed_avx512(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                               float alpha, const float* a, std::int64_t lda, const float* b, std::int64_t ldb,
                               float beta, float* c, std::int64_t ldc, float* packed_a, float* packed_b) {
  gemm_packed_blocks<kPacked512Mr, kPacked512Nr, kPacked512Mc, kPacked512Kc, kPacked512Nc>(
      trans_a, trans_b, m, n, k, a, lda, b, ldb, beta, c, ldc, packed_a, packed_b,
      [&](std::int64_t kc, const float* ap, const float* bp, bool accumulate, float* tile, std::int64_t rows,
          std::int64_t cols) {
        if (rows == kPacked512Mr && cols == kPacked512Nr)
          packed_tile_avx512<true, 2>(kc, ap, bp, alpha, accumulate, tile, ldc, rows, cols);
        else if (cols <= kPacked512Nr / 2)
          packed_tile_avx512<false, 1>(kc, ap, bp, alpha, accumulate, tile, ldc, rows, cols);
        else
          packed_tile_avx512<false, 2>(kc, ap, bp, alpha, accumulate, tile, ldc, rows, cols);
      });
}
#endif  // TESSERA_X86_DISPATCH

}  // namespace tessera::detail

TESSERA_SIMD_CODE_END
