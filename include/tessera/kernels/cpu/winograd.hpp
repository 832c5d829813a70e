// 3x3 stride-1 convolution by Winograd's minimal filtering F(2x2, 3x3) (Lavin & Gray, "Fast
// Algorithms for Convolutional Neural Networks", 2016), NCHW, forward and both gradients.
//
// One 4x4 input tile d of a channel and one 3x3 filter g give a 2x2 output tile
//   Y = A^T [ (G g G^T) (.) (B^T d B) ] A          (.) elementwise over the 16 positions xi
//   B^T = | 1  0 -1  0 |    G = | 1    0    0  |    A^T = | 1  1  1  0 |
//         | 0  1  1  0 |        | 1/2  1/2  1/2|          | 0  1 -1 -1 |
//         | 0 -1  1  0 |        | 1/2 -1/2  1/2|
//         | 0  1  0 -1 |        | 0    0    1  |
// Summed over input channels, position by position, that is 16 matrix products per block of tiles:
//   U[xi] (K, C) = (G w[k, c] G^T)[xi]      V[xi] (C, T) = (B^T d[c, t] B)[xi]
//   M[xi] (K, T) = U[xi] V[xi]              y[k, tile t] = A^T M[., k, t] A
// 16 C K multiply-adds per 4 outputs instead of 36 C K (im2col's 9 C K per output): 2.25x fewer,
// for 3 additions-only transforms that cost O(C + K) per tile, not O(C K).
//
// Backward, both exact adjoints of the same arithmetic:
//   dx: correlating dy with the filter flipped in space and transposed in channels,
//       w'[c, k, i, j] = w[k, c, 2 - i, 2 - j], with padding 2 - p gives dx; it is this same
//       forward algorithm (a gather: no two tiles write the same dx, so blocks run in parallel).
//   dw: y is linear in U, so dU[xi] (K, C) = sum over tiles of dM[xi] V[xi]^T with
//       dM = A dY A^T (the 2x2 dy tile, zero past the edge), and dw = G^T dU G.
// The entries of A, B, G are 0, +-1 and +-1/2: the transforms round no worse than the sums of an
// im2col product, and float64 gradient checks still agree with central differences.
//
// Work: blocks of whole samples or bands of tile rows (Conv2dBlocking, chosen in
// kernels/conv2d_geometry.hpp), each transformed into a per-thread V and M that stay in the L2
// cache, multiplied with the single-threaded gemm. A block's input rows are first split into their
// even and odd columns (`band`, zero in the padding), so the tile loops read whole vectors of
// tiles without bounds checks.
// Measured (bench/train_throughput, 2 threads, AMD EPYC Zen 4): a ResNet-20 step 1.2x faster, a
// 64-channel 56x56 layer's forward + backward 1.5-1.7x; at batch 1 a 512-channel 7x7 layer is 3x
// slower (transforming 512 x 512 filters costs more than its 16 tiles save), hence
// kWinogradMinSaving.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "tessera/device/cpu.hpp"
#include "tessera/kernels/conv2d_geometry.hpp"
#include "tessera/kernels/cpu/gemm.hpp"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tessera {

namespace detail {

// One vector of S (the target's widest: 64, 32 or 16 bytes; the GCC/Clang vector extension: + and - act
// lane by lane) for the tile loops, which run over tiles t, tiles contiguous in memory. GCC left
// them scalar when written as plain loops (16 output streams and small local arrays defeat its
// vectorizer). Loads read whole vectors past the last tile (the buffers carry kWinogradSlack
// elements of slack; the extra lanes are never stored); stores of the last partial vector write
// its first n lanes only.
// (Wider than the target's registers would change the ABI of these helpers: -Wpsabi.)
#if defined(__AVX512F__)
constexpr int kWinogradVectorBytes = 64;
#elif defined(__AVX__)
constexpr int kWinogradVectorBytes = 32;
#else
constexpr int kWinogradVectorBytes = 16;
#endif
template <class S>
struct WinogradVector {
  typedef S V __attribute__((vector_size(kWinogradVectorBytes)));
  static constexpr std::int64_t width = kWinogradVectorBytes / sizeof(S);
  static V load(const S* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static void store(S* p, V v, std::int64_t n) {
    if (n >= width) {
      std::memcpy(p, &v, sizeof v);
      return;
    }
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<S, float>) {
      _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1u), reinterpret_cast<__m512>(v));
      return;
    }
#endif
    for (std::int64_t i = 0; i < n; ++i) p[i] = v[i];
  }
};

// even[q] = src[2 q], odd[q] = src[2 q + 1] for q < pairs; entries of src outside [lo, hi) read
// as 0 and are not touched (src may point before an input row: its zero border). The tile loops
// then read each tile column as a contiguous vector: a tile starts every second column, and
// strided loads kept the compiler from vectorizing the transforms.
template <class S>
void deinterleave(const S* src, std::int64_t lo, std::int64_t hi, std::int64_t pairs, S* even, S* odd) {
  std::int64_t q = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<S, float>) {
    const __m512i even_lanes = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd_lanes = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const auto below = [](std::int64_t k) {  // lanes [0, k) of 16
      return static_cast<__mmask16>(k >= 16 ? 0xFFFF : k <= 0 ? 0 : (1u << k) - 1u);
    };
    for (; q < pairs; q += 16) {
      const std::int64_t i = 2 * q;
      const __mmask16 first = below(hi - i) & static_cast<__mmask16>(~below(lo - i));
      const __mmask16 second = below(hi - i - 16) & static_cast<__mmask16>(~below(lo - i - 16));
      const __m512 a = _mm512_maskz_loadu_ps(first, src + i);
      const __m512 b = _mm512_maskz_loadu_ps(second, src + i + 16);
      const __mmask16 out = below(pairs - q);
      _mm512_mask_storeu_ps(even + q, out, _mm512_permutex2var_ps(a, even_lanes, b));
      _mm512_mask_storeu_ps(odd + q, out, _mm512_permutex2var_ps(a, odd_lanes, b));
    }
    return;
  }
#endif
  for (; q < pairs; ++q) {
    even[q] = 2 * q >= lo && 2 * q < hi ? src[2 * q] : S(0);
    odd[q] = 2 * q + 1 >= lo && 2 * q + 1 < hi ? src[2 * q + 1] : S(0);
  }
}

// dst[2 q] = even[q], dst[2 q + 1] = odd[q], for the n entries of dst only.
template <class S>
void interleave(const S* even, const S* odd, std::int64_t n, S* dst) {
  std::int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<S, float>) {
    const __m512i low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i high = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    const auto lanes = [](std::int64_t k) {
      return static_cast<__mmask16>(k >= 16 ? 0xFFFF : k <= 0 ? 0 : (1u << k) - 1u);
    };
    for (; i < n; i += 32) {
      const std::int64_t left = n - i;
      const __mmask16 in = lanes((left + 1) / 2);
      const __m512 e = _mm512_maskz_loadu_ps(in, even + i / 2);
      const __m512 o = _mm512_maskz_loadu_ps(in, odd + i / 2);
      _mm512_mask_storeu_ps(dst + i, lanes(left), _mm512_permutex2var_ps(e, low, o));
      _mm512_mask_storeu_ps(dst + i + 16, lanes(left - 16), _mm512_permutex2var_ps(e, high, o));
    }
    return;
  }
#endif
  for (; i < n; ++i) dst[i] = i % 2 == 0 ? even[i / 2] : odd[i / 2];
}

constexpr std::int64_t kWinogradPositions = 16;  // the 4x4 xi of F(2x2, 3x3)
// Elements after each buffer that whole-vector loads may read past its end (never used).
constexpr std::int64_t kWinogradSlack = 16;

// One pass of the tiled algorithm: `in` (channels_in, in_h, in_w) planes to `out` (channels_out,
// out_h, out_w) planes, tile (tr, tc) reading input rows 2 tr - pad_h ... + 3.
struct WinogradPass {
  std::int64_t in_h, in_w, out_h, out_w, pad_h, pad_w;
  std::int64_t tiles_h() const { return (out_h + 1) / 2; }
  std::int64_t tiles_w() const { return (out_w + 1) / 2; }
  std::int64_t bands(std::int64_t rows) const { return (out_h + rows - 1) / rows; }
};

inline WinogradPass winograd_forward_pass(const Conv2dGeometry& g) {
  return {g.height, g.width, g.out_height, g.out_width, g.pad_h, g.pad_w};
}
// dx from dy: the flipped filter with padding 2 - p maps H' back onto H.
inline WinogradPass winograd_input_grad_pass(const Conv2dGeometry& g) {
  return {g.out_height, g.out_width, g.height, g.width, 2 - g.pad_h, 2 - g.pad_w};
}

// A block of a pass: samples [n0, n0 + count) and tile rows [tr0, tr1) of each.
struct WinogradBlock {
  std::int64_t n0, count, tr0, tr1;
  std::int64_t tiles(const WinogradPass& p) const { return count * (tr1 - tr0) * p.tiles_w(); }
};

inline WinogradBlock winograd_block(const WinogradPass& p, const Conv2dBlocking& b, std::int64_t batch,
                                    std::int64_t index) {
  const std::int64_t bands = p.bands(b.rows), group = index / bands, band = index % bands;
  const std::int64_t n0 = group * b.samples, oh0 = band * b.rows, oh1 = std::min(oh0 + b.rows, p.out_h);
  return {n0, std::min(b.samples, batch - n0), oh0 / 2, (oh1 + 1) / 2};
}

// U[xi] (rows, cols) from 3x3 filters: U[xi][r][q] = (G f G^T)[xi] with f = w[r, q] or, when
// `flipped`, the dx filter w'[r, q] = w[q, r] rotated by 180 degrees (w is (cols, rows, 3, 3) then).
// Rows r in [r0, r1) only, so that a team can split them.
template <class S>
void winograd_filter_transform(const S* w, std::int64_t rows, std::int64_t cols, bool flipped, std::int64_t r0,
                               std::int64_t r1, S* u) {
  const std::int64_t plane = rows * cols;
  for (std::int64_t r = r0; r < r1; ++r) {
#pragma omp simd
    for (std::int64_t q = 0; q < cols; ++q) {
      const S* f = flipped ? w + (q * rows + r) * 9 : w + (r * cols + q) * 9;
      S g[3][3];
      for (int i = 0; i < 3; ++i)
        for (int j = 0; j < 3; ++j) g[i][j] = flipped ? f[(2 - i) * 3 + (2 - j)] : f[i * 3 + j];
      S h[4][3];  // G g
      for (int j = 0; j < 3; ++j) {
        h[0][j] = g[0][j];
        h[1][j] = S(0.5) * (g[0][j] + g[1][j] + g[2][j]);
        h[2][j] = S(0.5) * (g[0][j] - g[1][j] + g[2][j]);
        h[3][j] = g[2][j];
      }
      S* out = u + r * cols + q;
      for (int i = 0; i < 4; ++i) {  // (G g) G^T
        out[(i * 4 + 0) * plane] = h[i][0];
        out[(i * 4 + 1) * plane] = S(0.5) * (h[i][0] + h[i][1] + h[i][2]);
        out[(i * 4 + 2) * plane] = S(0.5) * (h[i][0] - h[i][1] + h[i][2]);
        out[(i * 4 + 3) * plane] = h[i][2];
      }
    }
  }
}

// dw[k, c] (+)= G^T (sum over `copies` of du[xi][k][c]) G for k in [k0, k1): the team's private
// dU accumulators, `stride` elements apart, reduced and mapped back to 3x3 filters.
template <class S>
void winograd_filter_gradient(const S* du, std::int64_t copies, std::int64_t stride, std::int64_t filters_k,
                              std::int64_t filters_c, std::int64_t k0, std::int64_t k1, S* dw) {
  const std::int64_t plane = filters_k * filters_c;
  for (std::int64_t k = k0; k < k1; ++k) {
#pragma omp simd
    for (std::int64_t c = 0; c < filters_c; ++c) {
      S x[4][4];
      for (int xi = 0; xi < 16; ++xi) {
        S sum = 0;
        for (std::int64_t t = 0; t < copies; ++t) sum += du[t * stride + xi * plane + k * filters_c + c];
        x[xi / 4][xi % 4] = sum;
      }
      S z[3][4];  // G^T x
      for (int j = 0; j < 4; ++j) {
        const S half_sum = S(0.5) * (x[1][j] + x[2][j]);
        z[0][j] = x[0][j] + half_sum;
        z[1][j] = S(0.5) * (x[1][j] - x[2][j]);
        z[2][j] = half_sum + x[3][j];
      }
      S* out = dw + (k * filters_c + c) * 9;
      for (int i = 0; i < 3; ++i) {  // (G^T x) G
        const S half_sum = S(0.5) * (z[i][1] + z[i][2]);
        out[i * 3 + 0] += z[i][0] + half_sum;
        out[i * 3 + 1] += S(0.5) * (z[i][1] - z[i][2]);
        out[i * 3 + 2] += half_sum + z[i][3];
      }
    }
  }
}

// The transforms run over all tiles of one sample's band at once, tile f = tr tw + t (tile row
// tr of the band, column t), as 64-byte vectors: on ResNet's 7- and 14-wide images a tile row
// alone is 4 or 7 tiles, a quarter or half of a vector.

// V[xi] (channels, T) of a block (T = blk.tiles(p), row stride T): B^T d B for each 4x4 input
// tile d. `band` holds, for one channel, the columns 2t + j (j = 0..3) of the band's even and of
// its odd input rows: cols[parity][j][r tw + t] = x[row 2 r + parity, column 2 t + j] (zero in the
// padding). Tile row tr's input row i is then parity i % 2 at offset (tr + i / 2) tw.
template <class S>
void winograd_input_transform(const WinogradPass& p, const WinogradBlock& blk, std::int64_t channels, const S* in,
                              S* v, S* band) {
  const std::int64_t tw = p.tiles_w(), tiles = blk.tiles(p), rows = blk.tr1 - blk.tr0, flat = rows * tw;
  const std::int64_t plane = channels * tiles, first_row = 2 * blk.tr0 - p.pad_h;
  const std::int64_t column_elements = (rows + 1) * tw + kWinogradSlack;
  S* cols[2][4];
  for (int parity = 0; parity < 2; ++parity)
    for (int j = 0; j < 4; ++j) cols[parity][j] = band + (parity * 4 + j) * column_elements;
  for (std::int64_t s = 0; s < blk.count; ++s)
    for (std::int64_t c = 0; c < channels; ++c) {
      const S* src = in + ((blk.n0 + s) * channels + c) * p.in_h * p.in_w;
      for (std::int64_t r = 0; r < 2 * rows + 2; ++r) {
        const std::int64_t ih = first_row + r, at = r / 2 * tw;
        S* const* out = cols[r % 2];
        if (ih < 0 || ih >= p.in_h) {
          for (int j = 0; j < 4; ++j) std::fill(out[j] + at, out[j] + at + tw, S(0));
          continue;
        }
        // Band column b is input column b - pad_w; columns 2t, 2t + 1, then 2t + 2, 2t + 3.
        const S* row = src + ih * p.in_w - p.pad_w;
        deinterleave(row, p.pad_w, p.pad_w + p.in_w, tw, out[0] + at, out[1] + at);
        deinterleave(row + 2, p.pad_w - 2, p.pad_w + p.in_w - 2, tw, out[2] + at, out[3] + at);
      }
      using P = WinogradVector<S>;
      using V = typename P::V;
      S* dst = v + c * tiles + s * flat;
      for (std::int64_t f = 0; f < flat; f += P::width) {
        const std::int64_t n = std::min(P::width, flat - f);
        V a[4][4];  // a[i][j]: row i, column j of the tiles
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < 4; ++j) a[i][j] = P::load(cols[i % 2][j] + i / 2 * tw + f);
        V d[4][4];  // B^T d down each column ...
        for (int j = 0; j < 4; ++j) {
          d[0][j] = a[0][j] - a[2][j];
          d[1][j] = a[1][j] + a[2][j];
          d[2][j] = a[2][j] - a[1][j];
          d[3][j] = a[1][j] - a[3][j];
        }
        for (int i = 0; i < 4; ++i) {  // ... then (B^T d) B along each row
          P::store(dst + (i * 4 + 0) * plane + f, d[i][0] - d[i][2], n);
          P::store(dst + (i * 4 + 1) * plane + f, d[i][1] + d[i][2], n);
          P::store(dst + (i * 4 + 2) * plane + f, d[i][2] - d[i][1], n);
          P::store(dst + (i * 4 + 3) * plane + f, d[i][1] - d[i][3], n);
        }
      }
    }
}

// out (count, channels, out_h, out_w) tiles of the block = A^T M A (+ bias[k]); the second row or
// column of an edge tile is dropped when out_h or out_w is odd. `temp` holds 4 rows tw elements.
template <class S>
void winograd_output_transform(const WinogradPass& p, const WinogradBlock& blk, std::int64_t channels, const S* m,
                               const S* bias, S* out, S* temp) {
  const std::int64_t tw = p.tiles_w(), tiles = blk.tiles(p), plane = channels * tiles;
  const std::int64_t rows = blk.tr1 - blk.tr0, flat = rows * tw;
  S *y00 = temp, *y01 = temp + flat, *y10 = temp + 2 * flat, *y11 = temp + 3 * flat;
  using P = WinogradVector<S>;
  using V = typename P::V;
  for (std::int64_t s = 0; s < blk.count; ++s)
    for (std::int64_t k = 0; k < channels; ++k) {
      const S add = bias ? bias[k] : S(0);
      const S* src = m + k * tiles + s * flat;
      for (std::int64_t f = 0; f < flat; f += P::width) {
        const std::int64_t n = std::min(P::width, flat - f);
        V a[2][4];  // A^T M
        for (int j = 0; j < 4; ++j) {
          const V m0 = P::load(src + (0 + j) * plane + f), m1 = P::load(src + (4 + j) * plane + f),
                  m2 = P::load(src + (8 + j) * plane + f), m3 = P::load(src + (12 + j) * plane + f);
          a[0][j] = m0 + m1 + m2;
          a[1][j] = m1 - m2 - m3;
        }
        P::store(y00 + f, a[0][0] + a[0][1] + a[0][2] + add, n);  // (A^T M) A
        P::store(y01 + f, a[0][1] - a[0][2] - a[0][3] + add, n);
        P::store(y10 + f, a[1][0] + a[1][1] + a[1][2] + add, n);
        P::store(y11 + f, a[1][1] - a[1][2] - a[1][3] + add, n);
      }
      S* dst = out + ((blk.n0 + s) * channels + k) * p.out_h * p.out_w;
      for (std::int64_t tr = 0; tr < rows; ++tr) {
        S* y0 = dst + 2 * (blk.tr0 + tr) * p.out_w;
        interleave(y00 + tr * tw, y01 + tr * tw, p.out_w, y0);
        if (2 * (blk.tr0 + tr) + 1 < p.out_h) interleave(y10 + tr * tw, y11 + tr * tw, p.out_w, y0 + p.out_w);
      }
    }
}

// dM[xi] (channels, T) of a block from the 2x2 dy tiles: A dY A^T, dy taken as 0 past the edge.
// `temp` holds 4 rows tw elements.
template <class S>
void winograd_output_gradient_transform(const WinogradPass& p, const WinogradBlock& blk, std::int64_t channels,
                                        const S* dy, S* dm, S* temp) {
  const std::int64_t tw = p.tiles_w(), tiles = blk.tiles(p), plane = channels * tiles;
  const std::int64_t rows = blk.tr1 - blk.tr0, flat = rows * tw;
  S *g00 = temp, *g01 = temp + flat, *g10 = temp + 2 * flat, *g11 = temp + 3 * flat;
  using P = WinogradVector<S>;
  using V = typename P::V;
  for (std::int64_t s = 0; s < blk.count; ++s)
    for (std::int64_t k = 0; k < channels; ++k) {
      const S* src = dy + ((blk.n0 + s) * channels + k) * p.out_h * p.out_w;
      for (std::int64_t tr = 0; tr < rows; ++tr) {
        const std::int64_t oh = 2 * (blk.tr0 + tr);
        deinterleave(src + oh * p.out_w, 0, p.out_w, tw, g00 + tr * tw, g01 + tr * tw);
        if (oh + 1 < p.out_h) {
          deinterleave(src + (oh + 1) * p.out_w, 0, p.out_w, tw, g10 + tr * tw, g11 + tr * tw);
        } else {
          std::fill(g10 + tr * tw, g10 + tr * tw + tw, S(0));
          std::fill(g11 + tr * tw, g11 + tr * tw + tw, S(0));
        }
      }
      S* dst = dm + k * tiles + s * flat;
      for (std::int64_t f = 0; f < flat; f += P::width) {
        const std::int64_t n = std::min(P::width, flat - f);
        const V a00 = P::load(g00 + f), a01 = P::load(g01 + f), a10 = P::load(g10 + f), a11 = P::load(g11 + f);
        // e = A dY (4x2): rows dY0, dY0 + dY1, dY0 - dY1, -dY1; then e A^T likewise by columns.
        const V e[4][2] = {{a00, a01}, {a00 + a10, a01 + a11}, {a00 - a10, a01 - a11}, {-a10, -a11}};
        for (int i = 0; i < 4; ++i) {
          P::store(dst + (i * 4 + 0) * plane + f, e[i][0], n);
          P::store(dst + (i * 4 + 1) * plane + f, e[i][0] + e[i][1], n);
          P::store(dst + (i * 4 + 2) * plane + f, e[i][0] - e[i][1], n);
          P::store(dst + (i * 4 + 3) * plane + f, -e[i][1], n);
        }
      }
    }
}

// The per-thread buffers of Conv2dBlocking::thread_elements: V, M, then the padded band.
template <class S>
struct WinogradBuffers {
  S *v, *m, *pad;
  WinogradBuffers(const Conv2dGeometry& g, const Conv2dBlocking& b, S* thread_base) {
    const std::int64_t tile_matrix = b.winograd_tile_matrix_elements(g);
    v = thread_base;
    m = v + tile_matrix;
    pad = m + tile_matrix;
  }
};

// out = the convolution of a pass on one block: V from `in`, 16 products with u (out_ch, in_ch),
// then the output transform.
template <class S>
void winograd_block_product(const WinogradPass& p, const WinogradBlock& blk, std::int64_t in_ch, std::int64_t out_ch,
                            const S* in, const S* u, const S* bias, S* out, const WinogradBuffers<S>& buf) {
  const std::int64_t tiles = blk.tiles(p);
  winograd_input_transform(p, blk, in_ch, in, buf.v, buf.pad);
  for (std::int64_t xi = 0; xi < kWinogradPositions; ++xi)
    gemm(Cpu{}, false, false, out_ch, tiles, in_ch, S(1), u + xi * out_ch * in_ch, in_ch, buf.v + xi * in_ch * tiles,
         tiles, S(0), buf.m + xi * out_ch * tiles, tiles);
  winograd_output_transform(p, blk, out_ch, buf.m, bias, out, buf.pad);
}

// [begin, end) of n items for this thread of the team (all of them outside a team).
inline void team_share(std::int64_t n, std::int64_t& begin, std::int64_t& end) {
  const std::int64_t team = Cpu::team_size(), t = Cpu::thread_index();
  begin = n * t / team;
  end = n * (t + 1) / team;
}

}  // namespace detail

// y = conv3x3(x, w) + bias by F(2x2, 3x3); b.winograd is set (conv2d_blocking chose it for g).
template <class S>
void winograd_conv2d_forward(const Conv2dGeometry& g, const Conv2dBlocking& b, std::int64_t batch, const S* x,
                             const S* w, const S* bias, S* y, S* workspace) {
  const std::int64_t k = g.out_channels, c = g.channels;
  const detail::WinogradPass pass = detail::winograd_forward_pass(g);
  const std::int64_t blocks = b.groups(batch) * pass.bands(b.rows);
  S* u = workspace;
  const auto run = [&] {
    std::int64_t r0, r1;
    detail::team_share(k, r0, r1);
    detail::winograd_filter_transform(w, k, c, false, r0, r1, u);
#pragma omp barrier
    const detail::WinogradBuffers<S> buf(g, b, workspace + b.shared_elements(g) + Cpu::thread_index() * b.thread_elements(g));
#pragma omp for schedule(static)
    for (std::int64_t i = 0; i < blocks; ++i)
      detail::winograd_block_product(pass, detail::winograd_block(pass, b, batch, i), c, k, x, u, bias, y, buf);
  };
  detail::run_in_team_if(blocks > 1 && batch * g.out_plane() * k * c * 9 > detail::kParallelGrain, run);
}

// dw (K, C, 3, 3) += dL/dw and, unless dx is null, dx = dL/dx, by F(2x2, 3x3) (header comment).
template <class S>
void winograd_conv2d_backward(const Conv2dGeometry& g, const Conv2dBlocking& b, std::int64_t batch, const S* x,
                              const S* w, const S* dy, S* dw, S* dx, S* workspace) {
  const std::int64_t k = g.out_channels, c = g.channels, filters = detail::kWinogradPositions * k * c;
  const detail::WinogradPass fwd = detail::winograd_forward_pass(g), back = detail::winograd_input_grad_pass(g);
  const std::int64_t weight_blocks = b.groups(batch) * fwd.bands(b.rows);
  const std::int64_t input_blocks = dx ? b.groups(batch) * back.bands(b.rows) : 0;
  S* u_flipped = workspace;                                                     // (16, C, K)
  S* du = workspace + b.shared_elements(g) + b.threads * b.thread_elements(g);  // (team, 16, K, C)
  const auto run = [&] {
    const std::int64_t me = Cpu::thread_index(), team = Cpu::team_size();
    S* my_du = du + me * filters;
    std::fill(my_du, my_du + filters, S(0));
    if (dx) {
      std::int64_t r0, r1;
      detail::team_share(c, r0, r1);
      detail::winograd_filter_transform(w, c, k, true, r0, r1, u_flipped);
    }
#pragma omp barrier
    const detail::WinogradBuffers<S> buf(g, b, workspace + b.shared_elements(g) + me * b.thread_elements(g));
#pragma omp for schedule(static) nowait
    for (std::int64_t i = 0; i < input_blocks; ++i)
      detail::winograd_block_product(back, detail::winograd_block(back, b, batch, i), k, c, dy, u_flipped,
                                     static_cast<const S*>(nullptr), dx, buf);
#pragma omp for schedule(static)
    for (std::int64_t i = 0; i < weight_blocks; ++i) {
      const detail::WinogradBlock blk = detail::winograd_block(fwd, b, batch, i);
      const std::int64_t tiles = blk.tiles(fwd);
      detail::winograd_input_transform(fwd, blk, c, x, buf.v, buf.pad);
      detail::winograd_output_gradient_transform(fwd, blk, k, dy, buf.m, buf.pad);
      for (std::int64_t xi = 0; xi < detail::kWinogradPositions; ++xi)
        gemm(Cpu{}, false, true, k, c, tiles, S(1), buf.m + xi * k * tiles, tiles, buf.v + xi * c * tiles, tiles, S(1),
             my_du + xi * k * c, c);
    }
    // The loop's barrier has passed: every thread's dU is complete.
    std::int64_t k0, k1;
    detail::team_share(k, k0, k1);
    detail::winograd_filter_gradient(du, team, filters, k, c, k0, k1, dw);
  };
  detail::run_in_team_if(b.parallel_backward, run);
}

}  // namespace tessera
