// gemm_unpacked_avx512: c (m, n) = beta c + op(a) b, beta 0 or 1, on one thread, float, AVX-512,
// reading both operands where they lie: op(a)(i, p) = a[i lda + p], or a[p lda + i] when trans_a;
// b (k, n) and c row-major. No packing: an R x NV block of c (R rows, NV vectors of 16 columns)
// stays in registers while p runs, each step one vector load of b per column vector and one
// broadcast of a per row; b's k x 16 NV panel is cut into pieces of `depth_block` steps (by
// default about 32 KiB, which stay in the L1 cache while the row blocks pass; a thin product,
// whose a comes from memory, takes deeper blocks: kernels/cpu/conv2d.hpp, kUnpackedThinDepth).
// A last vector narrower than 16 columns is loaded and stored under a mask, except 1 to 4 columns
// past the last whole vector when a is not transposed: dot products take those (kRestColumns).
//
// Who uses it: Winograd's 36 products (kernels/cpu/winograd.hpp), where Eigen's gebp packed both
// operands on every call (a third of their time at ResNet-20's depth and width 16-64), and the
// convolutions' wide products (kernels/cpu/conv2d.hpp, conv_gemm): there OpenBLAS packs the
// weights (a) again for every block of columns, and loses to this kernel once the block is wide
// (bench/README.md, "Figures behind design choices in the headers"); and gemm's short float
// products (kernels/cpu/gemm.hpp, unpacked_suits), those with b transposed as dot products
// (gemm_dot_bt_avx512, below).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "tessera/kernels/cpu/capability.hpp"
#include "tessera/kernels/cpu/short_rows.hpp"
#include "tessera/kernels/cpu/simd_diagnostics.hpp"

TESSERA_SIMD_CODE_BEGIN

namespace tessera::detail {

#if TESSERA_X86_DISPATCH
// How far ahead (steps of p) a panel's first tile prefetches b's rows (unpacked_tile, First).
constexpr std::int64_t kUnpackedPrefetchSteps = 16;

// One R x NV block; with Tail, the last vector's columns are those of `tail` (a lane mask). With
// First (the first tile of a panel's depth block), b's rows are prefetched kUnpackedPrefetchSteps
// ahead: its rows lie ldb apart, each in a page of its own, where the hardware prefetchers do not
// follow (the L1's stride prefetcher stops at 2 KiB, the L2's streamer at the page), so without it
// this tile waits on every row of b from L2 or L3; the later tiles find the rows in L1.
template <int R, int NV, bool Tail, bool First>
TESSERA_TARGET_AVX512 inline void unpacked_tile(std::int64_t rows, std::int64_t k, const float* a, std::int64_t a_rs,
                                                std::int64_t a_cs, const float* b, std::int64_t ldb, bool accumulate,
                                                float* c, std::int64_t ldc, __mmask16 tail) {
  const float* row[R];  // rows past `rows` repeat the last one (computed, never stored)
  for (int r = 0; r < R; ++r) row[r] = a + std::min<std::int64_t>(r, rows - 1) * a_rs;
  __m512 acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (std::int64_t p = 0; p < k; ++p) {
    if constexpr (First) {
      if (p + kUnpackedPrefetchSteps < k) {
        const char* ahead = reinterpret_cast<const char*>(b + (p + kUnpackedPrefetchSteps) * ldb);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) _mm_prefetch(ahead + 64 * v, _MM_HINT_T0);
      }
    }
    const std::int64_t at = p * a_cs;
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      bv[v] = Tail && v == NV - 1 ? _mm512_maskz_loadu_ps(tail, b + p * ldb + 16 * v) : _mm512_loadu_ps(b + p * ldb + 16 * v);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(row[r][at]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(av, bv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    if (r >= rows) break;
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      float* out = c + r * ldc + 16 * v;
      if (Tail && v == NV - 1)
        _mm512_mask_storeu_ps(out, tail, accumulate ? _mm512_add_ps(_mm512_maskz_loadu_ps(tail, out), acc[r][v]) : acc[r][v]);
      else
        _mm512_storeu_ps(out, accumulate ? _mm512_add_ps(_mm512_loadu_ps(out), acc[r][v]) : acc[r][v]);
    }
  }
}

// A tile of exactly `rows` (1 .. H) rows.
template <int H, int NV, bool Tail, bool First>
TESSERA_TARGET_AVX512 inline void unpacked_rows(std::int64_t rows, std::int64_t k, const float* a, std::int64_t a_rs,
                                                std::int64_t a_cs, const float* b, std::int64_t ldb, bool accumulate,
                                                float* c, std::int64_t ldc, __mmask16 tail) {
  if constexpr (H > 1) {
    if (rows < H)
      return unpacked_rows<H - 1, NV, Tail, First>(rows, k, a, a_rs, a_cs, b, ldb, accumulate, c, ldc, tail);
  }
  unpacked_tile<H, NV, Tail, First>(H, k, a, a_rs, a_cs, b, ldb, accumulate, c, ldc, tail);
}

// All m rows of one panel of NV vectors.
template <int NV, bool Tail>
TESSERA_TARGET_AVX512 void unpacked_panel(std::int64_t m, std::int64_t k, const float* a, std::int64_t a_rs,
                                          std::int64_t a_cs, const float* b, std::int64_t ldb, bool accumulate, float* c,
                                          std::int64_t ldc, __mmask16 tail, std::int64_t depth_block) {
  constexpr int R = NV == 4 ? 6 : 8;  // R NV accumulators + NV + 1 of the 32 registers
  // b's piece: kc x 16 NV floats, 32 KiB by default: two thirds of a 48 KiB L1, and half as
  // many passes over c as 16 KiB pieces (bench/README.md, "Figures behind design choices")
  const std::int64_t kc = depth_block > 0 ? depth_block : 512 / NV;
  // The rows split evenly into tiles of R or R - 1 rows (m = 28: 6, 6, 6, 5, 5): a full-height
  // tile over the last m % R rows would compute rows it does not store (ResNet-50's 28x28 layers
  // make Winograd blocks of 14 tiles: 18 rows computed for 14), and one short tile runs below the
  // kernel's best ratio of multiply-adds to loads.
  const std::int64_t tiles = (m + R - 1) / R, base = m / tiles, taller = m % tiles;
  for (std::int64_t k0 = 0; k0 < k; k0 += kc) {
    const std::int64_t depth = std::min(kc, k - k0);
    const bool acc = accumulate || k0 > 0;
    for (std::int64_t t = 0, i0 = 0; t < tiles; ++t) {
      const std::int64_t rows = base + (t < taller ? 1 : 0);
      const float* ai = a + i0 * a_rs + k0 * a_cs;
      if (t == 0)
        unpacked_rows<R, NV, Tail, true>(rows, depth, ai, a_rs, a_cs, b + k0 * ldb, ldb, acc, c + i0 * ldc, ldc, tail);
      else
        unpacked_rows<R, NV, Tail, false>(rows, depth, ai, a_rs, a_cs, b + k0 * ldb, ldb, acc, c + i0 * ldc, ldc, tail);
      i0 += rows;
    }
  }
}

// The columns' vectors in panels of at most 4, as even as they go (13 vectors: 4 3 3 3, not
// 4 4 4 1: a panel of one vector loads as much as it computes), each over all m rows and all k.
TESSERA_TARGET_AVX512 inline void unpacked_panels(std::int64_t m, std::int64_t n, std::int64_t k, const float* a,
                                                  std::int64_t a_rs, std::int64_t a_cs, const float* b,
                                                  std::int64_t ldb, bool accumulate, float* c, std::int64_t ldc,
                                                  std::int64_t depth_block) {
  const std::int64_t vectors = (n + 15) / 16, panels = (vectors + 3) / 4;
  for (std::int64_t p = 0, v0 = 0; p < panels; ++p) {
    const std::int64_t nv = (vectors - v0 + (panels - p) - 1) / (panels - p);
    const std::int64_t j0 = 16 * v0, width = std::min(n, 16 * (v0 + nv)) - j0;
    const __mmask16 tail = lanes16(width - 16 * (nv - 1));
    const float* bp = b + j0;
    float* cp = c + j0;
    if (width == 16 * nv) {
      switch (nv) {
        case 4: unpacked_panel<4, false>(m, k, a, a_rs, a_cs, bp, ldb, accumulate, cp, ldc, tail, depth_block); break;
        case 3: unpacked_panel<3, false>(m, k, a, a_rs, a_cs, bp, ldb, accumulate, cp, ldc, tail, depth_block); break;
        case 2: unpacked_panel<2, false>(m, k, a, a_rs, a_cs, bp, ldb, accumulate, cp, ldc, tail, depth_block); break;
        default: unpacked_panel<1, false>(m, k, a, a_rs, a_cs, bp, ldb, accumulate, cp, ldc, tail, depth_block); break;
      }
    } else {
      switch (nv) {
        case 4: unpacked_panel<4, true>(m, k, a, a_rs, a_cs, bp, ldb, accumulate, cp, ldc, tail, depth_block); break;
        case 3: unpacked_panel<3, true>(m, k, a, a_rs, a_cs, bp, ldb, accumulate, cp, ldc, tail, depth_block); break;
        case 2: unpacked_panel<2, true>(m, k, a, a_rs, a_cs, bp, ldb, accumulate, cp, ldc, tail, depth_block); break;
        default: unpacked_panel<1, true>(m, k, a, a_rs, a_cs, bp, ldb, accumulate, cp, ldc, tail, depth_block); break;
      }
    }
    v0 += nv;
  }
}

// A thin product (a depth_block given: conv_gemm's, below kUnpackedWideColumns columns) of more than
// one panel runs in blocks of kThinRowBlock rows by kThinDepthBlock steps of a, every panel inside
// each block. Panel by panel, each panel read all of a, the layer's weights, from memory again
// (ResNet-50's 512-channel 3x3 layer: 9.4 MB, four panels at batch 8); a 96 x 512 block (192 KiB)
// is read once and stays in the L2 cache while the panels pass. 96 rows are whole tiles of 6 and
// of 8. One panel (49 or 64 columns) keeps the deep blocks of unpacked_panel. Figures in
// bench/README.md, "Figures behind design choices in the headers".
constexpr std::int64_t kThinRowBlock = 96;
constexpr std::int64_t kThinDepthBlock = 512;

// A thin product whose transposed a has at least kThinPackMinA bytes and rows at least
// kThinPackMinLda floats (2 KiB) apart (the input gradient of ResNet-50's 14x14 and 7x7 layers: a is
// the weights, k x m with m up to 4608) copies each 96 x 512 block of a into a buffer of its own
// first, step by step (p major), and the tiles read it there. In place, a tile's six rows at step p
// are six floats of a's row p: a new page every step or two, and at lda = 1024 or 2048 floats all
// of a block's 512 rows fall in the same set of the L1 cache, and the tiles waited on a from L2 far
// longer than the copy takes. An a that stays in L2 is faster in place (the copy costs more than
// it saves at 512 x 196 x 128, a 256 KiB), and so are rows 1 KiB apart (256 x 3136 x 512). A wide
// product with such an a that would run panel by panel (below) takes the same blocks and copies.
// Figures in bench/README.md, "Figures behind design choices in the headers".
constexpr std::int64_t kThinPackMinA = std::int64_t{1} << 19;
constexpr std::int64_t kThinPackMinLda = 512;

// The calling thread's buffer for one block of a transposed a (kThinRowBlock x kThinDepthBlock
// floats, 192 KiB), made on its first use: steady state allocates nothing.
inline float* thin_pack_buffer() {
  thread_local std::unique_ptr<float[]> buffer;
  if (!buffer) buffer = std::make_unique<float[]>(kThinRowBlock * kThinDepthBlock);
  return buffer.get();
}

// A wide product whose b is small (k n floats, at most kWideRowBlockMaxB bytes: it stays in the L2
// cache) runs in blocks of kWideRowBlock rows, every panel inside each block. Panel by panel, each
// tile's stores to c land 16 NV floats into rows ldc apart, a new page for every row, which the L2
// streamer does not follow: the stores wait on c's lines from L3 (ResNet-50's 1x1 64-to-256 layer
// at 56x56, 256 x 1568 x 64, ran at little more than half the speed it has with c in cache). Row
// block by row block, each of the block's rows is written left to right, a stream the streamer does
// follow, and b is read again from L2 per block. Products of fewer than 4 blocks' rows gain nothing
// (their c is small) and keep the panels whole. 24 rows (4 tiles of 6, 3 of 8) beat 12, 48 and 96;
// above 1 MiB b no longer stays in L2 while the blocks pass, and panel by panel wins again. With a
// transposed, a block's rows are 24 floats of each of a's k rows, lda apart, parts of lines: above
// 1 MiB of a (ResNet-50's dx of the 2048-to-512 1x1 layer, 2048 x 392 x 512) those came from L3 at
// a cost the streams did not make up, slower even than panel by panel; there, with a's rows at
// least kThinPackMinLda apart, the product runs as a thin one does, in 96 x 512 blocks of a copied
// first, faster than both. Figures in bench/README.md, "Figures behind design choices in the headers".
constexpr std::int64_t kWideRowBlock = 24;
constexpr std::int64_t kWideRowBlockMaxB = std::int64_t{1} << 20;

TESSERA_TARGET_AVX512 inline void gemm_dot_bt_avx512(std::int64_t m, std::int64_t n, std::int64_t k, const float* a,
                                                     std::int64_t lda, const float* bt, std::int64_t ldb, float beta,
                                                     float* c, std::int64_t ldc);

// A product whose a is not transposed and whose last vector would hold 1 to kRestColumns columns
// (ResNet-50's 7x7 and 14x14 layers at batch 1: 49 and 196 columns) leaves those columns to dot
// products (gemm_dot_bt_avx512, below) over the same blocks of a while they are in cache: a masked
// last vector spends 16 lanes of multiply-adds on each of its rows' 1 to 4 columns (196 columns
// computed as 208, 49 as 64). The columns are first copied transposed (k floats each, contiguous),
// into the calling thread's buffer, made on its first use and grown to the largest k: steady state
// allocates nothing.
constexpr std::int64_t kRestColumns = 4;

inline float* rest_columns_buffer(std::int64_t elements) {
  thread_local std::vector<float> buffer;
  if (static_cast<std::int64_t>(buffer.size()) < elements) buffer.resize(static_cast<std::size_t>(elements));
  return buffer.data();
}

TESSERA_TARGET_AVX512 inline void gemm_unpacked_avx512(bool trans_a, std::int64_t m, std::int64_t n, std::int64_t k,
                                                       const float* a, std::int64_t lda, const float* b,
                                                       std::int64_t ldb, float beta, float* c, std::int64_t ldc,
                                                       std::int64_t depth_block = 0) {
  if (k == 0 || m == 0) {
    if (beta == 0)
      for (std::int64_t i = 0; i < m; ++i) std::fill(c + i * ldc, c + i * ldc + n, 0.0f);
    return;
  }
  const std::int64_t a_rs = trans_a ? 1 : lda, a_cs = trans_a ? lda : 1;
  const bool accumulate = beta != 0;
  // Columns [0, whole) on the kernel's panels; [whole, n) as dot products (kRestColumns), each
  // over the rows and steps of a that the panels have just read.
  const std::int64_t rest = n % 16, whole = n > 16 && !trans_a && rest <= kRestColumns ? n - rest : n;
  float* rest_bt = nullptr;  // (n - whole, k): b's last columns transposed
  if (whole < n) {
    rest_bt = rest_columns_buffer((n - whole) * k);
    for (std::int64_t p = 0; p < k; ++p)
      for (std::int64_t j = 0; j < n - whole; ++j) rest_bt[j * k + p] = b[p * ldb + whole + j];
  }
  const auto rest_dots = [&](std::int64_t m0, std::int64_t rows, std::int64_t k0, std::int64_t depth, bool acc) {
    if (rest_bt)
      gemm_dot_bt_avx512(rows, n - whole, depth, a + m0 * lda + k0, lda, rest_bt + k0, k, acc ? 1.0f : 0.0f,
                         c + m0 * ldc + whole, ldc);
  };
  const std::int64_t bytes = std::int64_t{sizeof(float)}, a_bytes = m * k * bytes;
  const bool row_blocks = m >= 4 * kWideRowBlock && k * n * bytes <= kWideRowBlockMaxB &&
                          (!trans_a || a_bytes <= kWideRowBlockMaxB);
  const bool pack_a = trans_a && a_bytes >= kThinPackMinA && lda >= kThinPackMinLda;
  if ((depth_block > 0 || (pack_a && !row_blocks)) && whole > 4 * 16) {  // more than one panel
    float* packed = pack_a ? thin_pack_buffer() : nullptr;
    for (std::int64_t k0 = 0; k0 < k; k0 += kThinDepthBlock) {
      const std::int64_t depth = std::min(kThinDepthBlock, k - k0);
      for (std::int64_t m0 = 0; m0 < m; m0 += kThinRowBlock) {
        const std::int64_t rows = std::min(kThinRowBlock, m - m0);
        const bool acc = accumulate || k0 > 0;
        if (packed) {  // op(a)(m0 + i, k0 + p) at packed[p rows + i]
          for (std::int64_t p = 0; p < depth; ++p) std::copy_n(a + (k0 + p) * lda + m0, rows, packed + p * rows);
          unpacked_panels(rows, whole, depth, packed, 1, rows, b + k0 * ldb, ldb, acc, c + m0 * ldc, ldc, depth);
        } else {
          unpacked_panels(rows, whole, depth, a + m0 * a_rs + k0 * a_cs, a_rs, a_cs, b + k0 * ldb, ldb, acc,
                          c + m0 * ldc, ldc, depth);
        }
        rest_dots(m0, rows, k0, depth, acc);
      }
    }
    return;
  }
  if (row_blocks) {
    // The last block also takes the m % kWideRowBlock rows left over (no short tile of its own).
    const std::int64_t blocks = m / kWideRowBlock;
    for (std::int64_t i = 0; i < blocks; ++i) {
      const std::int64_t m0 = i * kWideRowBlock, rows = i + 1 < blocks ? kWideRowBlock : m - m0;
      unpacked_panels(rows, whole, k, a + m0 * a_rs, a_rs, a_cs, b, ldb, accumulate, c + m0 * ldc, ldc, depth_block);
      rest_dots(m0, rows, 0, k, accumulate);
    }
    return;
  }
  unpacked_panels(m, whole, k, a, a_rs, a_cs, b, ldb, accumulate, c, ldc, depth_block);
  rest_dots(0, m, 0, k, accumulate);
}

// Mid-sized products with b transposed (a Linear layer's forward at a batch of 64 to 128:
// x (m, k) w^T, w (n, k)) computed swapped: c^T (n, m) = w x^T on the unpacked kernel, whose a is
// then w where it lies and whose b is x^T (k, m), small enough to stay in L2. OpenBLAS packs all of
// w into its panel layout on every call (an MLP's first layer: 1.6 MB), and the dot products
// (gemm_dot_bt_avx512) read x from L2 for every 4 columns; the two transposes here move x and c
// once each. gemm's rule (swapped_bt_suits, kernels/cpu/gemm.hpp) picks it; figures in
// bench/README.md, "Figures behind design choices in the headers".

// dst (cols, rows; row stride ldd) = src (rows, cols; row stride lds)^T, plus dst's own values when
// Add, in 16 x 16 blocks through registers (transpose16); the edges element by element.
template <bool Add>
TESSERA_TARGET_AVX512 inline void transpose_block16(std::int64_t rows, std::int64_t cols, const float* src,
                                                    std::int64_t lds, float* dst, std::int64_t ldd) {
  const std::int64_t rows16 = rows / 16 * 16, cols16 = cols / 16 * 16;
  for (std::int64_t i0 = 0; i0 < rows16; i0 += 16)
    for (std::int64_t j0 = 0; j0 < cols16; j0 += 16) {
      __m512i w[16];
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) w[r] = _mm512_castps_si512(_mm512_loadu_ps(src + (i0 + r) * lds + j0));
      transpose16(w);
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) {
        float* out = dst + (j0 + r) * ldd + i0;
        const __m512 v = _mm512_castsi512_ps(w[r]);
        _mm512_storeu_ps(out, Add ? _mm512_add_ps(_mm512_loadu_ps(out), v) : v);
      }
    }
  const auto one = [&](std::int64_t i, std::int64_t j) {
    float& out = dst[j * ldd + i];
    out = Add ? out + src[i * lds + j] : src[i * lds + j];
  };
  for (std::int64_t i = 0; i < rows16; ++i)
    for (std::int64_t j = cols16; j < cols; ++j) one(i, j);
  for (std::int64_t i = rows16; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) one(i, j);
}

// c (m, n) = beta c + a bt^T, beta 0 or 1, one thread: a (m, k) and bt (n, k) row-major. The
// caller's buffers hold a^T (k m floats, `at`) and c^T (n m floats, `ct`): gemm gives its
// per-thread packing buffers (GemmWorkspace), so steady state allocates nothing.
TESSERA_TARGET_AVX512 inline void gemm_swapped_bt_avx512(std::int64_t m, std::int64_t n, std::int64_t k,
                                                        const float* a, std::int64_t lda, const float* bt,
                                                        std::int64_t ldb, float beta, float* c, std::int64_t ldc,
                                                        float* at, float* ct) {
  transpose_block16<false>(m, k, a, lda, at, m);
  gemm_unpacked_avx512(false, n, m, k, bt, ldb, at, m, 0.0f, ct, m);
  if (beta == 0) transpose_block16<false>(n, m, ct, m, c, ldc);
  else transpose_block16<true>(n, m, ct, m, c, ldc);
}

// Short products with b transposed (a few rows: LeNet-5's weight gradients, 6 x 25 x 4704; a
// classifier's forward at a small batch) as dot products: c(i, j) = a's row i . bt's row j, both
// contiguous along k. A 4 x 4 tile keeps 16 vectors of partial sums over a block of k (4 loads of
// a, 4 of bt, 16 multiply-adds per 16 steps) and folds them into 16 sums at the block's end
// (dot_fold16). Copying b transposed into the kernel's layout instead costs more than the product
// with few rows (its b is used by m / 6 tiles only), and the dot products lose with many: the
// rows of a stream from L2 for every 4 columns (bench/README.md, "Figures behind design choices in
// the headers").
constexpr std::int64_t kDotDepth = 1024;  // a tile's 8 rows of 4 KiB stay in L1 while the block runs

// lane 4 r + q = the sum of acc[4 r + q]'s 16 lanes: pairs of vectors folded into one (unpack lo
// and hi, added), then pairs of those (shuffle_ps), then the 128-bit lanes twice (shuffle_f32x4):
// 45 instructions for 16 sums where 16 horizontal reductions take about 130.
TESSERA_TARGET_AVX512 inline __m512 dot_fold16(const __m512 (&acc)[16]) {
  __m512 x[8], y[4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // 128-bit group g of x[i]: a0+a2, b0+b2, a1+a3, b1+b3 of acc[2i], acc[2i+1]
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]), _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // group l of y[i]: acc[4i .. 4i+3] summed over group l's 4 lanes
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44), _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
}

// c's rows [0, rows) x columns [0, cols) (at most 4 x 4) += or = the tile's dot products over
// `depth` steps; rows and columns past the edge repeat the last one (computed, never stored).
TESSERA_TARGET_AVX512 inline void dot_tile(std::int64_t rows, std::int64_t cols, std::int64_t depth, const float* a,
                                           std::int64_t lda, const float* bt, std::int64_t ldb, bool accumulate,
                                           float* c, std::int64_t ldc) {
  const float* ar[4];
  const float* br[4];
  for (int r = 0; r < 4; ++r) ar[r] = a + std::min<std::int64_t>(r, rows - 1) * lda;
  for (int q = 0; q < 4; ++q) br[q] = bt + std::min<std::int64_t>(q, cols - 1) * ldb;
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (std::int64_t p = 0; p < depth; p += 16) {
    const __mmask16 lanes = depth - p >= 16 ? __mmask16(0xFFFF) : lanes16(depth - p);
    __m512 bv[4];
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) bv[q] = _mm512_maskz_loadu_ps(lanes, br[q] + p);
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const __m512 av = _mm512_maskz_loadu_ps(lanes, ar[r] + p);
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) acc[4 * r + q] = _mm512_fmadd_ps(av, bv[q], acc[4 * r + q]);
    }
  }
  const __m512 sums = dot_fold16(acc);
  const __mmask8 store = static_cast<__mmask8>((1u << cols) - 1);
  for (std::int64_t r = 0; r < rows; ++r) {
    const __m128 row = r == 0 ? _mm512_castps512_ps128(sums)
                       : r == 1 ? _mm512_extractf32x4_ps(sums, 1)
                       : r == 2 ? _mm512_extractf32x4_ps(sums, 2)
                                : _mm512_extractf32x4_ps(sums, 3);
    float* out = c + r * ldc;
    _mm_mask_storeu_ps(out, store, accumulate ? _mm_add_ps(_mm_maskz_loadu_ps(store, out), row) : row);
  }
}

// c (m, n) = beta c + a bt^T, beta 0 or 1, one thread: a (m, k) and bt (n, k) row-major.
TESSERA_TARGET_AVX512 inline void gemm_dot_bt_avx512(std::int64_t m, std::int64_t n, std::int64_t k, const float* a,
                                                     std::int64_t lda, const float* bt, std::int64_t ldb, float beta,
                                                     float* c, std::int64_t ldc) {
  if (k == 0) {
    if (beta == 0)
      for (std::int64_t i = 0; i < m; ++i) std::fill(c + i * ldc, c + i * ldc + n, 0.0f);
    return;
  }
  // Blocks of k as even as they go, whole vectors: 4704 steps in 3 of 1568.
  const std::int64_t blocks = (k + kDotDepth - 1) / kDotDepth, depth_max = ((k + blocks - 1) / blocks + 15) / 16 * 16;
  for (std::int64_t k0 = 0; k0 < k; k0 += depth_max) {
    const std::int64_t depth = std::min(depth_max, k - k0);
    const bool accumulate = beta != 0 || k0 > 0;
    for (std::int64_t j0 = 0; j0 < n; j0 += 4)
      for (std::int64_t i0 = 0; i0 < m; i0 += 4)
        dot_tile(std::min<std::int64_t>(4, m - i0), std::min<std::int64_t>(4, n - j0), depth, a + i0 * lda + k0, lda,
                 bt + j0 * ldb + k0, ldb, accumulate, c + i0 * ldc + j0, ldc);
  }
}
#endif

}  // namespace tessera::detail

TESSERA_SIMD_CODE_END
