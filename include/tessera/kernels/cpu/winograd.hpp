// 3x3 stride-1 convolution by Winograd's minimal filtering F(4x4, 3x3) (Lavin & Gray, "Fast
// Algorithms for Convolutional Neural Networks", 2016), NCHW, forward and both gradients.
//
// One 6x6 input tile d of a channel and one 3x3 filter g give a 4x4 output tile
//   Y = A^T [ (G g G^T) (.) (B^T d B) ] A          (.) elementwise over the 36 positions xi
//   B^T = | 4  0 -5  0  1  0 |   G = |  1/4     0     0  |   A^T = | 1  1  1  1  1  0 |
//         | 0 -4 -4  1  1  0 |       | -1/6  -1/6  -1/6  |         | 0  1 -1  2 -2  0 |
//         | 0  4 -4 -1  1  0 |       | -1/6   1/6  -1/6  |         | 0  1  1  4  4  0 |
//         | 0 -2 -1  2  1  0 |       |  1/24  1/12  1/6  |         | 0  1 -1  8 -8  1 |
//         | 0  2 -1 -2  1  0 |       |  1/24 -1/12  1/6  |
//         | 0  4  0 -5  0  1 |       |  0     0     1    |
// Summed over input channels, position by position, that is 36 matrix products per block of tiles:
//   U[xi] (K, C) = (G w[k, c] G^T)[xi]      V[xi] (C, T) = (B^T d[c, t] B)[xi]
//   M[xi] (K, T) = U[xi] V[xi]              y[k, tile t] = A^T M[., k, t] A
// 36 C K multiply-adds per 16 outputs instead of 144 C K (im2col's 9 C K per output): 4x fewer
// (less where the image is not a multiple of 4 wide: 7x7 takes 2x2 tiles, 2.9 C K per output),
// for additions-mostly transforms that cost O(C + K) per tile, not O(C K).
// (F(2x2, 3x3), 16 positions for 4 outputs, saves 2.25x; measured here on a ResNet-20 training
// step it gained clearly less over im2col than F(4x4, 3x3) does.)
//
// Backward, both exact adjoints of the same arithmetic:
//   dx: correlating dy with the filter flipped in space and transposed in channels,
//       w'[c, k, i, j] = w[k, c, 2 - i, 2 - j], with padding 2 - p gives dx; it is this same
//       forward algorithm (a gather: no two tiles write the same dx, so blocks run in parallel).
//   dw: y is linear in U, so dU[xi] (K, C) = sum over tiles of dM[xi] V[xi]^T with
//       dM = A dY A^T (the 4x4 dy tile, zero past the edge), and dw = G^T dU G.
// Rounding: the transforms scale by up to 8 and 1/24, so float32 results carry a few times the
// error of im2col's (tests: within 2e-6 of the float64 result in norm, and within PyTorch's
// float32 tolerance); float64 gradient checks agree with central differences.
//
// Work: blocks of whole samples or bands of tile rows (Conv2dBlocking, chosen in
// kernels/conv2d_geometry.hpp), each transformed into a per-thread V and M that stay in the L2
// cache, multiplied with the single-threaded gemm. A block's input rows are first split into the
// columns 4t + j of every tile t (`band`, zero in the padding), so the tile loops read whole
// vectors of tiles without bounds checks. When C and K are multiples of the vector width, the
// channel-blocked path below replaces that split (vectors of channels, tile-major V and M, and its
// own unpacked product); the results are the same up to rounding.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "tessera/device/cpu.hpp"
#include "tessera/kernels/conv2d_geometry.hpp"
#include "tessera/kernels/cpu/conv_epilogue.hpp"
#include "tessera/kernels/cpu/gemm.hpp"
#include "tessera/kernels/cpu/gemm_unpacked.hpp"
#include "tessera/kernels/cpu/gemm_unpacked_avx2.hpp"
#include "tessera/kernels/cpu/short_rows.hpp"

#include "tessera/kernels/cpu/capability.hpp"
#include "tessera/kernels/cpu/simd_diagnostics.hpp"

TESSERA_SIMD_CODE_BEGIN

namespace tessera {

namespace detail {

// One vector of S (the target's widest: 64, 32 or 16 bytes; the GCC/Clang vector extension: + and - act
// lane by lane) for the tile loops, which run over tiles t, tiles contiguous in memory. GCC left
// them scalar when written as plain loops (16 output streams and small local arrays defeat its
// vectorizer). Loads read whole vectors past the last tile (the buffers carry kWinogradSlack
// elements of slack; the extra lanes are never stored); stores of the last partial vector write
// its first n lanes only.
// (Wider than the target's registers would change the ABI of these helpers: -Wpsabi.)
// The width is the compile-time target's, so this layout and the 16-lane helpers written for it
// (the masked store below, to_channel_block's transposition) stay under the compiler's own AVX-512 macro; the
// kernels that do not depend on it are chosen at run time (kernels/cpu/capability.hpp).
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
      _mm512_mask_storeu_ps(p, lanes16(n), reinterpret_cast<__m512>(v));
      return;
    }
#endif
    for (std::int64_t i = 0; i < n; ++i) p[i] = v[i];
  }
};

// out[j][t] = row[4 t + j] for t < count and each j < 6 whose out[j] is not null, and the same
// into also[j] where not null; entries of row outside [lo, hi) read as 0 and are not touched (row may point before an input row: its zero
// border). The tile loops then read each tile column as a contiguous vector: a tile starts every
// fourth column, and strided loads kept the compiler from vectorizing the transforms. With
// AVX-512, 16 tiles' columns come from four masked loads and two rounds of permutes, all in
// registers (splitting through memory in two passes stalled on store-to-load forwarding, which
// masked stores do not get on Zen 4: a large share of a forward pass).
#if TESSERA_X86_DISPATCH
TESSERA_TARGET_AVX512 inline void split_columns4_avx512(const float* row, std::int64_t lo, std::int64_t hi, std::int64_t count,
                                                      float* const (&out)[6], float* const (&also)[6]) {
  std::int64_t t = 0;
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const auto load = [&](std::int64_t i) TESSERA_TARGET_AVX512 {  // row[i, i + 16), zero outside [lo, hi)
    return _mm512_maskz_loadu_ps(lanes16(hi - i) & static_cast<__mmask16>(~lanes16(lo - i)), row + i);
  };
  // The columns 4t + j0 and 4t + j0 + 2, and 4t + j0 + 1 and 4t + j0 + 3, of 16 tiles from t0.
  const auto split = [&](std::int64_t i, __m512& c0, __m512& c1, __m512& c2, __m512& c3) TESSERA_TARGET_AVX512 {
    const __m512 a = load(i), b = load(i + 16), c = load(i + 32), d = load(i + 48);
    const __m512 even_ab = _mm512_permutex2var_ps(a, even, b), odd_ab = _mm512_permutex2var_ps(a, odd, b);
    const __m512 even_cd = _mm512_permutex2var_ps(c, even, d), odd_cd = _mm512_permutex2var_ps(c, odd, d);
    c0 = _mm512_permutex2var_ps(even_ab, even, even_cd);
    c2 = _mm512_permutex2var_ps(even_ab, odd, even_cd);
    c1 = _mm512_permutex2var_ps(odd_ab, even, odd_cd);
    c3 = _mm512_permutex2var_ps(odd_ab, odd, odd_cd);
  };
  for (; t < count; t += 16) {
    const __mmask16 lanes = lanes16(count - t);
    __m512 c[6], unused_c6, unused_c7;  // the second split's 4t + 6 and 4t + 7 columns
    split(4 * t, c[0], c[1], c[2], c[3]);
    if (out[4] || out[5] || also[4] || also[5]) split(4 * t + 4, c[4], c[5], unused_c6, unused_c7);
    for (int j = 0; j < 6; ++j) {
      if (out[j]) _mm512_mask_storeu_ps(out[j] + t, lanes, c[j]);
      if (also[j]) _mm512_mask_storeu_ps(also[j] + t, lanes, c[j]);
    }
  }
}
#endif

template <class S>
void split_columns4(const S* row, std::int64_t lo, std::int64_t hi, std::int64_t count, S* const (&out)[6],
                    S* const (&also)[6]) {
  std::int64_t t = 0;
#if TESSERA_X86_DISPATCH
  if constexpr (std::is_same_v<S, float>) {
    if (cpu_avx512()) return split_columns4_avx512(row, lo, hi, count, out, also);
  }
#endif
  for (; t < count; ++t)
    for (int j = 0; j < 6; ++j) {
      const std::int64_t i = 4 * t + j;
      const S value = i >= lo && i < hi ? row[i] : S(0);
      if (out[j]) out[j][t] = value;
      if (also[j]) also[j][t] = value;
    }
}

// dst[4 t + j] = in[j][t] for the n entries of dst only: split_columns4 backwards, for output rows.
#if TESSERA_X86_DISPATCH
TESSERA_TARGET_AVX512 inline void merge_columns4_avx512(const float* const (&in)[4], std::int64_t n, float* dst) {
  std::int64_t i = 0;
  const __m512i low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i high = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (; i < n; i += 64) {
    const __mmask16 lanes = lanes16((n - i + 3) / 4);
    const std::int64_t t = i / 4;
    const __m512 c0 = _mm512_maskz_loadu_ps(lanes, in[0] + t), c1 = _mm512_maskz_loadu_ps(lanes, in[1] + t);
    const __m512 c2 = _mm512_maskz_loadu_ps(lanes, in[2] + t), c3 = _mm512_maskz_loadu_ps(lanes, in[3] + t);
    // p = columns 4t and 4t + 2 interleaved, q = 4t + 1 and 4t + 3; then p and q interleaved.
    const __m512 p_lo = _mm512_permutex2var_ps(c0, low, c2), p_hi = _mm512_permutex2var_ps(c0, high, c2);
    const __m512 q_lo = _mm512_permutex2var_ps(c1, low, c3), q_hi = _mm512_permutex2var_ps(c1, high, c3);
    _mm512_mask_storeu_ps(dst + i, lanes16(n - i), _mm512_permutex2var_ps(p_lo, low, q_lo));
    _mm512_mask_storeu_ps(dst + i + 16, lanes16(n - i - 16), _mm512_permutex2var_ps(p_lo, high, q_lo));
    _mm512_mask_storeu_ps(dst + i + 32, lanes16(n - i - 32), _mm512_permutex2var_ps(p_hi, low, q_hi));
    _mm512_mask_storeu_ps(dst + i + 48, lanes16(n - i - 48), _mm512_permutex2var_ps(p_hi, high, q_hi));
  }
}
#endif

template <class S>
void merge_columns4(const S* const (&in)[4], std::int64_t n, S* dst) {
  std::int64_t i = 0;
#if TESSERA_X86_DISPATCH
  if constexpr (std::is_same_v<S, float>) {
    if (cpu_avx512()) return merge_columns4_avx512(in, n, dst);
  }
#endif
  for (; i < n; ++i) dst[i] = in[i % 4][i / 4];
}

constexpr std::int64_t kWinogradTile = 4;        // m: a tile's outputs per side
constexpr std::int64_t kWinogradPositions = 36;  // the 6x6 xi of F(4x4, 3x3)
// Elements after each buffer that whole-vector loads may read past its end (never used).
constexpr std::int64_t kWinogradSlack = 16;

// The 1-D transforms, applied down the columns of a tile and then along its rows (or the other
// way: they commute), on scalars or on vectors of tiles (V); factored to share sums.
template <class S, class V>
inline void winograd_input_1d(const V (&x)[6], V (&t)[6]) {  // t = B^T x
  const V x42 = x[4] - x[2], x31 = x[3] - x[1];
  t[0] = S(4) * x[0] - S(5) * x[2] + x[4];
  t[1] = (x[3] + x[4]) - S(4) * (x[1] + x[2]);
  t[2] = (x[4] - x[3]) + S(4) * (x[1] - x[2]);
  t[3] = x42 + S(2) * x31;
  t[4] = x42 - S(2) * x31;
  t[5] = S(4) * x[1] - S(5) * x[3] + x[5];
}
template <class S, class V>
inline void winograd_output_1d(const V (&m)[6], V (&y)[4]) {  // y = A^T m
  const V s12 = m[1] + m[2], d12 = m[1] - m[2], s34 = m[3] + m[4], d34 = m[3] - m[4];
  y[0] = m[0] + s12 + s34;
  y[1] = d12 + S(2) * d34;
  y[2] = s12 + S(4) * s34;
  y[3] = d12 + S(8) * d34 + m[5];
}
template <class S, class V>
inline void winograd_output_gradient_1d(const V (&dy)[4], V (&e)[6]) {  // e = A dy
  const V s02 = dy[0] + dy[2], s13 = dy[1] + dy[3], a = dy[0] + S(4) * dy[2], b = S(2) * dy[1] + S(8) * dy[3];
  e[0] = dy[0];
  e[1] = s02 + s13;
  e[2] = s02 - s13;
  e[3] = a + b;
  e[4] = a - b;
  e[5] = dy[3];
}
template <class S, class V>
inline void winograd_filter_1d(const V (&g)[3], V (&u)[6]) {  // u = G g
  u[0] = g[0] / S(4);
  u[1] = -(g[0] + g[1] + g[2]) / S(6);
  u[2] = -(g[0] - g[1] + g[2]) / S(6);
  u[3] = g[0] / S(24) + g[1] / S(12) + g[2] / S(6);
  u[4] = g[0] / S(24) - g[1] / S(12) + g[2] / S(6);
  u[5] = g[2];
}
template <class S, class V>
inline void winograd_filter_gradient_1d(const V (&x)[6], V (&g)[3]) {  // g = G^T x
  g[0] = x[0] / S(4) - (x[1] + x[2]) / S(6) + (x[3] + x[4]) / S(24);
  g[1] = (x[2] - x[1]) / S(6) + (x[3] - x[4]) / S(12);
  g[2] = (x[3] + x[4] - x[1] - x[2]) / S(6) + x[5];
}

// One pass of the tiled algorithm: `in` (channels_in, in_h, in_w) planes to `out` (channels_out,
// out_h, out_w) planes, tile (tr, tc) reading input rows 4 tr - pad_h ... + 5.
struct WinogradPass {
  std::int64_t in_h, in_w, out_h, out_w, pad_h, pad_w;
  std::int64_t tiles_h() const { return (out_h + kWinogradTile - 1) / kWinogradTile; }
  std::int64_t tiles_w() const { return (out_w + kWinogradTile - 1) / kWinogradTile; }
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
  return {n0, std::min(b.samples, batch - n0), oh0 / kWinogradTile, (oh1 + kWinogradTile - 1) / kWinogradTile};
}

// One tap of P::width consecutive filters, `lane_stride` elements apart, as a vector (lanes past n
// zero): a hardware gather for float where the build has AVX2 (or AVX-512: 16 lanes), a loop
// elsewhere. The loop stored lanes one by one and read them back as a vector (a store-forwarding
// stall each time); with the gathers ResNet-50's 512-channel filter transform (36 x 512 x 512) ran
// twice as fast on one Zen 3 core, and no faster on two, where writing U's 37.7 MB bounds it
// (bench/README.md, "Figures behind design choices in the headers").
template <class S>
struct WinogradTapGather {
  using P = WinogradVector<S>;
  using V = typename P::V;
  std::int64_t lane_stride;
#if defined(__AVX512F__)
  __m512i index;
  explicit WinogradTapGather(std::int64_t stride)
      : lane_stride(stride), index(_mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                      _mm512_set1_epi32(static_cast<int>(stride)))) {}
#elif defined(__AVX2__)
  __m256i index;
  explicit WinogradTapGather(std::int64_t stride)
      : lane_stride(stride),
        index(_mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int>(stride)))) {}
#else
  explicit WinogradTapGather(std::int64_t stride) : lane_stride(stride) {}
#endif
  template <class R>
  static V bits(R r) {
    static_assert(sizeof(R) == sizeof(V));
    V v;
    std::memcpy(&v, &r, sizeof v);
    return v;
  }
  V operator()(const S* first, std::int64_t n) const {
    if constexpr (std::is_same_v<S, float>) {
      if (n == P::width && lane_stride * P::width <= std::int64_t{1} << 30) {
#if defined(__AVX512F__)
        return bits(_mm512_i32gather_ps(index, first, 4));
#elif defined(__AVX2__)
        return bits(_mm256_i32gather_ps(first, index, 4));
#endif
      }
    }
    V v = {};
    for (std::int64_t l = 0; l < n; ++l) v[l] = first[l * lane_stride];
    return v;
  }
};

// U[xi] (rows, cols) from 3x3 filters: U[xi][r][q] = (G f G^T)[xi] with f = w[r, q], or w[q, r]
// when `transposed` (w is (cols, rows, 3, 3) then), rotated by 180 degrees when `rotated` (the dx
// filter). Rows r in [r0, r1) only, so that a team can split them. A vector of consecutive q at a
// time, so that each of the 36 planes of U is written in whole vectors (one float at a time, 36
// planes apart, was slower than the convolution it served on ResNet-50's 512-channel layers).
template <class S>
void winograd_filter_transform(const S* w, std::int64_t rows, std::int64_t cols, bool transposed, bool rotated,
                               std::int64_t r0, std::int64_t r1, S* u) {
  using P = WinogradVector<S>;
  using V = typename P::V;
  const std::int64_t plane = rows * cols;
  const std::int64_t lane_stride = transposed ? rows * 9 : 9;  // between filters q and q + 1
  const WinogradTapGather<S> gather(lane_stride);
  for (std::int64_t r = r0; r < r1; ++r)
    for (std::int64_t q0 = 0; q0 < cols; q0 += P::width) {
      const std::int64_t n = std::min(P::width, cols - q0);
      const S* f0 = transposed ? w + (q0 * rows + r) * 9 : w + (r * cols + q0) * 9;
      V tap[3][3];  // the filters' taps, lane = q - q0
      for (int i = 0; i < 3; ++i)
        for (int j = 0; j < 3; ++j) tap[i][j] = gather(f0 + (rotated ? (2 - i) * 3 + (2 - j) : i * 3 + j), n);
      V h[6][3];  // G f, column by column ...
      for (int j = 0; j < 3; ++j) {
        V column[3], out[6];
        for (int i = 0; i < 3; ++i) column[i] = tap[i][j];
        winograd_filter_1d<S>(column, out);
        for (int i = 0; i < 6; ++i) h[i][j] = out[i];
      }
      S* dst = u + r * cols + q0;
      for (int i = 0; i < 6; ++i) {  // ... then (G f) G^T, row by row
        V out[6];
        winograd_filter_1d<S>(h[i], out);
        for (int j = 0; j < 6; ++j) P::store(dst + (i * 6 + j) * plane, out[j], n);
      }
    }
}

// dw[k, c] (+)= G^T (sum over `copies` of du[xi][k][c]) G for k in [k0, k1): the team's private
// dU accumulators, `stride` elements apart, reduced and mapped back to 3x3 filters; a vector of
// consecutive c at a time.
template <class S>
void winograd_filter_gradient(const S* du, std::int64_t copies, std::int64_t stride, std::int64_t filters_k,
                              std::int64_t filters_c, std::int64_t k0, std::int64_t k1, S* dw) {
  using P = WinogradVector<S>;
  using V = typename P::V;
  const std::int64_t plane = filters_k * filters_c;
  for (std::int64_t k = k0; k < k1; ++k)
    for (std::int64_t c0 = 0; c0 < filters_c; c0 += P::width) {
      const std::int64_t n = std::min(P::width, filters_c - c0);
      const S* at = du + k * filters_c + c0;
      V z[3][6];  // G^T x, column by column ...
      for (int j = 0; j < 6; ++j) {
        V column[6], out[3];
        for (int i = 0; i < 6; ++i) {
          column[i] = P::load(at + (i * 6 + j) * plane);
          for (std::int64_t t = 1; t < copies; ++t) column[i] += P::load(at + t * stride + (i * 6 + j) * plane);
        }
        winograd_filter_gradient_1d<S>(column, out);
        for (int i = 0; i < 3; ++i) z[i][j] = out[i];
      }
      S taps[3][3][P::width];
      for (int i = 0; i < 3; ++i) {  // ... then (G^T x) G, row by row
        V out[3];
        winograd_filter_gradient_1d<S>(z[i], out);
        for (int j = 0; j < 3; ++j) P::store(taps[i][j], out[j], P::width);
      }
      for (std::int64_t l = 0; l < n; ++l) {
        S* dst = dw + (k * filters_c + c0 + l) * 9;
        for (int i = 0; i < 3; ++i)
          for (int j = 0; j < 3; ++j) dst[i * 3 + j] += taps[i][j][l];
      }
    }
}

// The transforms run over all tiles of a block at once, tile f = (s rows + tr) tw + t (sample s,
// tile row tr of the band, column t), as vectors: on ResNet's 7- and 14-wide images a tile row
// alone is 2 or 4 tiles, an eighth or a quarter of a vector, and a sample 4 or 16 tiles.

// V[xi] (channels, T) of a block (T = blk.tiles(p), row stride T): B^T d B for each 6x6 input
// tile d. `band` holds, for one channel, the columns 4t + j (j = 0..5) of the block's input rows:
//   rows[phase][j][(s rows + r) tw + t]  = x[sample s, row 4 r + phase,       column 4 t + j]
//   next[phase][j][(s rows + r) tw + t]  = x[sample s, row 4 (r + 1) + phase, column 4 t + j]
// (zero in the padding), so that tile f reads its input row i < 4 from rows[i][.][f] and row
// 4 + i from next[i][.][f]: every load of the transform is one vector of consecutive tiles.
template <class S>
void winograd_input_transform(const WinogradPass& p, const WinogradBlock& blk, std::int64_t channels, const S* in,
                              S* v, S* band) {
  const std::int64_t tw = p.tiles_w(), tiles = blk.tiles(p), rows = blk.tr1 - blk.tr0;
  const std::int64_t plane = channels * tiles, first_row = kWinogradTile * blk.tr0 - p.pad_h;
  const std::int64_t column_elements = tiles + kWinogradSlack;
  S* columns[6][6];  // [row i of the tile][column j]: rows[i] for i < 4, next[i - 4] for i = 4, 5
  for (int i = 0; i < 6; ++i)
    for (int j = 0; j < 6; ++j) columns[i][j] = band + (i * 6 + j) * column_elements;
  for (std::int64_t c = 0; c < channels; ++c) {
    for (std::int64_t s = 0; s < blk.count; ++s) {
      const S* src = in + ((blk.n0 + s) * channels + c) * p.in_h * p.in_w;
      // Band row q = 4 r + phase is row `phase` of tile row r and, for phase 0 and 1, row
      // 4 + phase of tile row r - 1.
      for (std::int64_t q = 0; q < 4 * rows + 2; ++q) {
        const std::int64_t ih = first_row + q, r = q / 4, phase = q % 4;
        S* targets[2][6] = {};  // (tile row r, row phase) and, for phase 0 and 1, (r - 1, row 4 + phase)
        for (int role = 0; role < 2; ++role) {
          const std::int64_t tile_row = role == 0 ? r : r - 1, i = role == 0 ? phase : 4 + phase;
          if (tile_row < 0 || tile_row >= rows || i >= 6) continue;
          const std::int64_t at = (s * rows + tile_row) * tw;
          for (int j = 0; j < 6; ++j) targets[role][j] = columns[i][j] + at;
        }
        if (ih < 0 || ih >= p.in_h) {
          for (const auto& out : targets)
            for (S* o : out)
              if (o) std::fill(o, o + tw, S(0));
        } else {  // band column b is input column b - pad_w
          split_columns4(src + ih * p.in_w - p.pad_w, p.pad_w, p.pad_w + p.in_w, tw, targets[0], targets[1]);
        }
      }
    }
    using P = WinogradVector<S>;
    using V = typename P::V;
    S* dst = v + c * tiles;
    for (std::int64_t f = 0; f < tiles; f += P::width) {
      const std::int64_t n = std::min(P::width, tiles - f);
      V d[6][6];  // B^T d, column by column ...
      for (int j = 0; j < 6; ++j) {
        V x[6], t[6];
        for (int i = 0; i < 6; ++i) x[i] = P::load(columns[i][j] + f);
        winograd_input_1d<S>(x, t);
        for (int i = 0; i < 6; ++i) d[i][j] = t[i];
      }
      for (int i = 0; i < 6; ++i) {  // ... then (B^T d) B, row by row
        V t[6];
        winograd_input_1d<S>(d[i], t);
        for (int j = 0; j < 6; ++j) P::store(dst + (i * 6 + j) * plane + f, t[j], n);
      }
    }
  }
}

// out (count, channels, out_h, out_w) tiles of the block = A^T M A (+ bias[k]); the rows and
// columns of edge tiles past out_h, out_w are dropped. `temp` holds the 16 output positions of
// the block's tiles (16 T).
template <class S>
void winograd_output_transform(const WinogradPass& p, const WinogradBlock& blk, std::int64_t channels, const S* m,
                               const S* bias, S* out, S* temp) {
  const std::int64_t tw = p.tiles_w(), tiles = blk.tiles(p), plane = channels * tiles, rows = blk.tr1 - blk.tr0;
  S* y = temp;  // y[(i * 4 + j) T + f]: output row i, column j of tile f
  using P = WinogradVector<S>;
  using V = typename P::V;
  for (std::int64_t k = 0; k < channels; ++k) {
    const S add = bias ? bias[k] : S(0);
    const S* src = m + k * tiles;
    for (std::int64_t f = 0; f < tiles; f += P::width) {
      const std::int64_t n = std::min(P::width, tiles - f);
      V a[4][6];  // A^T M, column by column ...
      for (int j = 0; j < 6; ++j) {
        V x[6], t[4];
        for (int i = 0; i < 6; ++i) x[i] = P::load(src + (i * 6 + j) * plane + f);
        winograd_output_1d<S>(x, t);
        for (int i = 0; i < 4; ++i) a[i][j] = t[i];
      }
      for (int i = 0; i < 4; ++i) {  // ... then (A^T M) A, row by row
        V t[4];
        winograd_output_1d<S>(a[i], t);
        for (int j = 0; j < 4; ++j) P::store(y + (i * 4 + j) * tiles + f, t[j] + add, n);
      }
    }
    for (std::int64_t s = 0; s < blk.count; ++s) {
      S* dst = out + ((blk.n0 + s) * channels + k) * p.out_h * p.out_w;
      for (std::int64_t tr = 0; tr < rows; ++tr)
        for (int i = 0; i < 4; ++i) {
          const std::int64_t oh = kWinogradTile * (blk.tr0 + tr) + i;
          if (oh >= p.out_h) break;
          const S* yi = y + i * 4 * tiles + (s * rows + tr) * tw;
          const S* const columns[4] = {yi, yi + tiles, yi + 2 * tiles, yi + 3 * tiles};
          merge_columns4(columns, p.out_w, dst + oh * p.out_w);
        }
    }
  }
}

// dM[xi] (channels, T) of a block from the 4x4 dy tiles: A dY A^T, dy taken as 0 past the edge.
// `temp` as for winograd_output_transform.
template <class S>
void winograd_output_gradient_transform(const WinogradPass& p, const WinogradBlock& blk, std::int64_t channels,
                                        const S* dy, S* dm, S* temp) {
  const std::int64_t tw = p.tiles_w(), tiles = blk.tiles(p), plane = channels * tiles, rows = blk.tr1 - blk.tr0;
  S* g = temp;  // g[(i * 4 + j) T + f] = dy[row 4 tr + i, column 4 t + j] of tile f = (s rows + tr) tw + t
  using P = WinogradVector<S>;
  using V = typename P::V;
  for (std::int64_t k = 0; k < channels; ++k) {
    for (std::int64_t s = 0; s < blk.count; ++s) {
      const S* src = dy + ((blk.n0 + s) * channels + k) * p.out_h * p.out_w;
      for (std::int64_t tr = 0; tr < rows; ++tr)
        for (int i = 0; i < 4; ++i) {
          S* gi = g + i * 4 * tiles + (s * rows + tr) * tw;
          const std::int64_t oh = kWinogradTile * (blk.tr0 + tr) + i;
          if (oh >= p.out_h) {
            for (int j = 0; j < 4; ++j) std::fill(gi + j * tiles, gi + j * tiles + tw, S(0));
            continue;
          }
          S* const out[6] = {gi, gi + tiles, gi + 2 * tiles, gi + 3 * tiles, nullptr, nullptr};
          S* const none[6] = {};
          split_columns4(src + oh * p.out_w, 0, p.out_w, tw, out, none);
        }
    }
    S* dst = dm + k * tiles;
    for (std::int64_t f = 0; f < tiles; f += P::width) {
      const std::int64_t n = std::min(P::width, tiles - f);
      V e[6][4];  // A dY, column by column ...
      for (int j = 0; j < 4; ++j) {
        V x[4], t[6];
        for (int i = 0; i < 4; ++i) x[i] = P::load(g + (i * 4 + j) * tiles + f);
        winograd_output_gradient_1d<S>(x, t);
        for (int i = 0; i < 6; ++i) e[i][j] = t[i];
      }
      for (int i = 0; i < 6; ++i) {  // ... then (A dY) A^T, row by row
        V t[6];
        winograd_output_gradient_1d<S>(e[i], t);
        for (int j = 0; j < 6; ++j) P::store(dst + (i * 6 + j) * plane + f, t[j], n);
      }
    }
  }
}

// ---- The channel-blocked path: C and K multiples of the vector width L ----
//
// On ResNet's 28-, 14- and 7-wide images split_columns4 fills a vector of tiles from one input
// row, 7, 4 or 2 tiles of 16 lanes, a large share of a ResNet-20 training step. When both channel
// counts are multiples of L (ResNet: 16 to 512), a block is instead turned into L channels per
// pixel ("NCHW16c" inside the block only; the layers keep NCHW): whole planes are transposed in
// L x L register blocks with every lane used, whatever the width, and each tile's 36 values are
// then plain vector loads of L channels. V and M become tile-major, (36, T, C) and (36, T, K), so
// the products are taken the other way round:
//   M^T[xi] (T, K) = V^T[xi] (T, C) U[xi]^T        dU[xi] (K, C) += dM^T[xi]^T (K, T) V^T[xi] (T, C)
// and the output pixels go back to NCHW by the inverse transposition.

// The two transpositions below walk L consecutive pixels of a plane at a time, pixel j at
// frame row y, column x (x wrapping at the image width w). With AVX-512 (float) the L channels
// of those pixels are one 16 x 16 register transpose; its 16 vectors are stored (or loaded) one
// pixel at a time in a loop unrolled at compile time, so that each vector's index is a constant:
// through a table of destinations indexed at run time, clang kept the 16 vectors on the stack
// and a ResNet-20 step at one thread spent a fifth of its time here (bench/README.md, "The
// channel-blocked transposition under clang").
#if defined(__AVX512F__)
#define TESSERA_UNROLL16 _Pragma("GCC unroll 16")
#endif

// frame (count, hb, wb, L) <- channels [c0, c0 + L) of `count` samples of in (count, channels, h, w):
//   frame[s][y][x][l] = in[s][c0 + l][y0 + y][x - x0], zero where that pixel lies outside the plane
// (a block's input rows with their padding; x0 >= 0). Each plane's rows [y0 + ya, y0 + yb) are
// contiguous, so they are transposed L pixels at a time whatever the width.
template <class S>
void to_channel_block(const S* in, std::int64_t count, std::int64_t channels, std::int64_t h, std::int64_t w,
                      std::int64_t c0, std::int64_t y0, std::int64_t x0, std::int64_t hb, std::int64_t wb, S* frame) {
  constexpr std::int64_t L = WinogradVector<S>::width;
  const std::int64_t ya = std::clamp<std::int64_t>(-y0, 0, hb), yb = std::clamp<std::int64_t>(h - y0, ya, hb);
  const std::int64_t xb = std::clamp<std::int64_t>(x0 + w, x0, wb);  // frame columns [x0, xb) have a pixel
  const std::int64_t row = wb * L, stride = h * w;
  for (std::int64_t s = 0; s < count; ++s) {
    S* f = frame + s * hb * row;
    std::fill(f, f + ya * row, S(0));
    std::fill(f + yb * row, f + hb * row, S(0));
    for (std::int64_t y = ya; y < yb; ++y) {
      std::fill(f + y * row, f + y * row + x0 * L, S(0));
      std::fill(f + y * row + xb * L, f + (y + 1) * row, S(0));
    }
    const S* plane = in + (s * channels + c0) * stride;
    const std::int64_t last = (y0 + yb) * w;
    std::int64_t y = ya, x = 0;  // frame row and source column of pixel q
    for (std::int64_t q = (y0 + ya) * w; q < last; q += L) {
      const std::int64_t n = std::min(L, last - q);
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<S, float>) {
        const __mmask16 m = lanes16(n);
        __m512i v[16];  // v[l]: channel c0 + l of the 16 pixels; after the transpose v[j]: pixel j's channels
        TESSERA_UNROLL16
        for (int l = 0; l < 16; ++l) v[l] = _mm512_castps_si512(_mm512_maskz_loadu_ps(m, plane + q + l * stride));
        transpose16(v);
        TESSERA_UNROLL16
        for (int j = 0; j < 16; ++j)
          if (j < n) {
            if (x0 + x < wb) _mm512_storeu_ps(f + y * row + (x0 + x) * L, _mm512_castsi512_ps(v[j]));
            if (++x == w) x = 0, ++y;
          }
        continue;
      }
#elif defined(__AVX__)
      if constexpr (std::is_same_v<S, float>) {
        // Whole vectors unmasked: VMASKMOVPS is slow on AMD, a store most of all (bench/README.md,
        // "Figures behind design choices in the headers").
        const __m256i m = lanes8(n);
        __m256 v[8];  // v[l]: channel c0 + l of the 8 pixels; after the transpose v[j]: pixel j's channels
#pragma GCC unroll 8
        for (int l = 0; l < 8; ++l)
          v[l] = n == 8 ? _mm256_loadu_ps(plane + q + l * stride) : _mm256_maskload_ps(plane + q + l * stride, m);
        transpose8(v);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j)
          if (j < n) {
            if (x0 + x < wb) _mm256_storeu_ps(f + y * row + (x0 + x) * L, v[j]);
            if (++x == w) x = 0, ++y;
          }
        continue;
      }
#endif
      for (std::int64_t j = 0; j < n; ++j) {
        if (x0 + x < wb)
          for (std::int64_t l = 0; l < L; ++l) f[y * row + (x0 + x) * L + l] = plane[q + l * stride + j];
        if (++x == w) x = 0, ++y;
      }
    }
  }
}

// out (count, channels, h, w) rows [y0, y0 + rows), channels [c0, c0 + L), all w columns <-
// frame (count, hb, wb, L) rows [0, rows): the inverse of to_channel_block (w <= wb).
template <class S>
void from_channel_block(const S* frame, std::int64_t count, std::int64_t hb, std::int64_t wb, std::int64_t rows,
                        std::int64_t channels, std::int64_t h, std::int64_t w, std::int64_t c0, std::int64_t y0,
                        S* out) {
  constexpr std::int64_t L = WinogradVector<S>::width;
  const std::int64_t stride = h * w;
  for (std::int64_t s = 0; s < count; ++s) {
    const S* f = frame + s * hb * wb * L;
    S* plane = out + (s * channels + c0) * stride;
    const std::int64_t last = (y0 + rows) * w;
    std::int64_t y = 0, x = 0;
    for (std::int64_t q = y0 * w; q < last; q += L) {
      const std::int64_t n = std::min(L, last - q);
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<S, float>) {
        __m512i v[16];  // v[j]: pixel j's channels; after the transpose v[l]: channel c0 + l of the 16 pixels
        TESSERA_UNROLL16
        for (int j = 0; j < 16; ++j) {
          v[j] = _mm512_setzero_si512();
          if (j < n) {
            v[j] = _mm512_castps_si512(_mm512_loadu_ps(f + (y * wb + x) * L));
            if (++x == w) x = 0, ++y;
          }
        }
        transpose16(v);
        const __mmask16 m = lanes16(n);
        TESSERA_UNROLL16
        for (int l = 0; l < 16; ++l) _mm512_mask_storeu_ps(plane + q + l * stride, m, _mm512_castsi512_ps(v[l]));
        continue;
      }
#elif defined(__AVX__)
      if constexpr (std::is_same_v<S, float>) {
        __m256 v[8];  // v[j]: pixel j's channels; after the transpose v[l]: channel c0 + l of the 8 pixels
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          v[j] = _mm256_setzero_ps();
          if (j < n) {
            v[j] = _mm256_loadu_ps(f + (y * wb + x) * L);
            if (++x == w) x = 0, ++y;
          }
        }
        transpose8(v);
        const __m256i m = lanes8(n);
#pragma GCC unroll 8
        for (int l = 0; l < 8; ++l) {
          if (n == 8) _mm256_storeu_ps(plane + q + l * stride, v[l]);
          else _mm256_maskstore_ps(plane + q + l * stride, m, v[l]);
        }
        continue;
      }
#endif
      for (std::int64_t j = 0; j < n; ++j) {
        for (std::int64_t l = 0; l < L; ++l) plane[q + l * stride + j] = f[(y * wb + x) * L + l];
        if (++x == w) x = 0, ++y;
      }
    }
  }
}
#if defined(__AVX512F__)
#undef TESSERA_UNROLL16
#endif

// Whether a convolution (or one pass of it) runs the channel-blocked path: both channel counts
// multiples of L.
template <class S>
bool winograd_channel_blocked(std::int64_t channels, std::int64_t out_channels) {
  constexpr std::int64_t L = WinogradVector<S>::width;
  return channels % L == 0 && out_channels % L == 0;
}

// Offset, in pixels of a frame of hb x wb per sample, of tile f = (s rows + r) tw + t: frame row
// 4 r of sample s, column 4 t.
inline std::int64_t tile_origin(std::int64_t f, std::int64_t tw, std::int64_t rows, std::int64_t hb,
                                std::int64_t wb) {
  const std::int64_t t = f % tw, sr = f / tw;
  return ((sr / rows) * hb + kWinogradTile * (sr % rows)) * wb + kWinogradTile * t;
}

// c (m, n) = beta c + op(a) b for the blocked path's 36 products, beta 0 or 1: on AVX-512 (float)
// the unpacked product of kernels/cpu/gemm_unpacked.hpp, on AVX2 its 8-lane form
// (kernels/cpu/gemm_unpacked_avx2.hpp; Eigen's gebp, the gemm below, packs both
// operands on every call and zeroes c first when beta is 0: on these products, depth and width
// 16-64 on ResNet-20, that was a third of their time).
template <class S>
void winograd_product(bool trans_a, std::int64_t m, std::int64_t n, std::int64_t k, const S* a, std::int64_t lda,
                      const S* b, std::int64_t ldb, S beta, S* c, std::int64_t ldc) {
#if TESSERA_X86_DISPATCH
  // The kernel's panels are whole vectors of 16 columns: n is a multiple of 16 when the blocked
  // path's vectors are 16 floats (a -march with AVX-512); a portable build's are narrower.
  if constexpr (std::is_same_v<S, float>) {
    if (n % 16 == 0 && cpu_avx512()) return gemm_unpacked_avx512(trans_a, m, n, k, a, lda, b, ldb, beta, c, ldc);
    if (cpu_avx2()) return gemm_unpacked_avx2(trans_a, m, n, k, a, lda, b, ldb, beta, c, ldc);
  }
#endif
  gemm(Cpu{}, trans_a, false, m, n, k, S(1), a, lda, b, ldb, beta, c, ldc);
}

// V^T[xi] (T, channels) of a block, row stride `channels`: B^T d B of each tile, L channels at a
// time from the block's frame (tile (s, r, t) reads frame rows 4 r .. 4 r + 5, columns 4 t .. 4 t + 5).
template <class S>
void winograd_input_transform_blocked(const WinogradPass& p, const WinogradBlock& blk, std::int64_t channels,
                                      const S* in, S* vt, S* frame) {
  using P = WinogradVector<S>;
  using V = typename P::V;
  constexpr std::int64_t L = P::width;
  const std::int64_t tw = p.tiles_w(), tiles = blk.tiles(p), rows = blk.tr1 - blk.tr0;
  const std::int64_t hb = 4 * rows + 2, wb = 4 * tw + 2, plane = tiles * channels;
  const S* first = in + blk.n0 * channels * p.in_h * p.in_w;
  for (std::int64_t c0 = 0; c0 < channels; c0 += L) {
    to_channel_block(first, blk.count, channels, p.in_h, p.in_w, c0, kWinogradTile * blk.tr0 - p.pad_h, p.pad_w, hb, wb,
                     frame);
    for (std::int64_t f = 0; f < tiles; ++f) {
      const S* base = frame + tile_origin(f, tw, rows, hb, wb) * L;
      V d[6][6];  // B^T d, column by column ...
      for (int j = 0; j < 6; ++j) {
        V x[6], u[6];
        for (int i = 0; i < 6; ++i) x[i] = P::load(base + (i * wb + j) * L);
        winograd_input_1d<S>(x, u);
        for (int i = 0; i < 6; ++i) d[i][j] = u[i];
      }
      S* dst = vt + f * channels + c0;
      for (int i = 0; i < 6; ++i) {  // ... then (B^T d) B, row by row
        V u[6];
        winograd_input_1d<S>(d[i], u);
        for (int j = 0; j < 6; ++j) P::store(dst + (i * 6 + j) * plane, u[j], L);
      }
    }
  }
}

// out (NCHW) tiles of the block = A^T M A (+ bias) from M^T[xi] (T, channels); through a frame of
// the block's 4 rows x 4 tw outputs per tile row, L channels at a time.
template <class S>
void winograd_output_transform_blocked(const WinogradPass& p, const WinogradBlock& blk, std::int64_t channels,
                                       const S* mt, const S* bias, S* out, S* frame) {
  using P = WinogradVector<S>;
  using V = typename P::V;
  constexpr std::int64_t L = P::width;
  const std::int64_t tw = p.tiles_w(), tiles = blk.tiles(p), rows = blk.tr1 - blk.tr0;
  const std::int64_t hq = 4 * rows, wq = 4 * tw, plane = tiles * channels;
  const std::int64_t y0 = kWinogradTile * blk.tr0, out_rows = std::min(p.out_h, kWinogradTile * blk.tr1) - y0;
  for (std::int64_t k0 = 0; k0 < channels; k0 += L) {
    V add{};
    if (bias) add = P::load(bias + k0);
    for (std::int64_t f = 0; f < tiles; ++f) {
      const S* src = mt + f * channels + k0;
      V a[4][6];  // A^T M, column by column ...
      for (int j = 0; j < 6; ++j) {
        V x[6], y[4];
        for (int i = 0; i < 6; ++i) x[i] = P::load(src + (i * 6 + j) * plane);
        winograd_output_1d<S>(x, y);
        for (int i = 0; i < 4; ++i) a[i][j] = y[i];
      }
      S* base = frame + tile_origin(f, tw, rows, hq, wq) * L;
      for (int i = 0; i < 4; ++i) {  // ... then (A^T M) A, row by row
        V y[4];
        winograd_output_1d<S>(a[i], y);
        for (int j = 0; j < 4; ++j) P::store(base + (i * wq + j) * L, y[j] + add, L);
      }
    }
    from_channel_block(frame, blk.count, hq, wq, out_rows, channels, p.out_h, p.out_w, k0, y0,
                       out + blk.n0 * channels * p.out_h * p.out_w);
  }
}

// dM^T[xi] (T, channels) of a block from its 4x4 dy tiles: A dY A^T, dy zero past the edge.
template <class S>
void winograd_output_gradient_transform_blocked(const WinogradPass& p, const WinogradBlock& blk,
                                                std::int64_t channels, const S* dy, S* dmt, S* frame) {
  using P = WinogradVector<S>;
  using V = typename P::V;
  constexpr std::int64_t L = P::width;
  const std::int64_t tw = p.tiles_w(), tiles = blk.tiles(p), rows = blk.tr1 - blk.tr0;
  const std::int64_t hq = 4 * rows, wq = 4 * tw, plane = tiles * channels;
  const S* first = dy + blk.n0 * channels * p.out_h * p.out_w;
  for (std::int64_t k0 = 0; k0 < channels; k0 += L) {
    to_channel_block(first, blk.count, channels, p.out_h, p.out_w, k0, kWinogradTile * blk.tr0, std::int64_t{0}, hq,
                     wq, frame);
    for (std::int64_t f = 0; f < tiles; ++f) {
      const S* base = frame + tile_origin(f, tw, rows, hq, wq) * L;
      V e[6][4];  // A dY, column by column ...
      for (int j = 0; j < 4; ++j) {
        V x[4], u[6];
        for (int i = 0; i < 4; ++i) x[i] = P::load(base + (i * wq + j) * L);
        winograd_output_gradient_1d<S>(x, u);
        for (int i = 0; i < 6; ++i) e[i][j] = u[i];
      }
      S* dst = dmt + f * channels + k0;
      for (int i = 0; i < 6; ++i) {  // ... then (A dY) A^T, row by row
        V u[6];
        winograd_output_gradient_1d<S>(e[i], u);
        for (int j = 0; j < 6; ++j) P::store(dst + (i * 6 + j) * plane, u[j], L);
      }
    }
  }
}

// The per-thread buffers of Conv2dBlocking::thread_elements: V, M, then the band (and temporaries).
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

// out = the convolution of a pass on one block: V from `in`, 36 products with u (out_ch, in_ch),
// then the output transform.
template <class S>
void winograd_block_product(const WinogradPass& p, const WinogradBlock& blk, std::int64_t in_ch, std::int64_t out_ch,
                            const S* in, const S* u, const S* bias, S* out, const WinogradBuffers<S>& buf) {
  const std::int64_t tiles = blk.tiles(p);
  if (winograd_channel_blocked<S>(in_ch, out_ch)) {  // u is U^T: (36, in, out)
    winograd_input_transform_blocked(p, blk, in_ch, in, buf.v, buf.pad);
    for (std::int64_t xi = 0; xi < kWinogradPositions; ++xi)
      winograd_product(false, tiles, out_ch, in_ch, buf.v + xi * tiles * in_ch, in_ch, u + xi * in_ch * out_ch, out_ch,
                       S(0), buf.m + xi * tiles * out_ch, out_ch);
    winograd_output_transform_blocked(p, blk, out_ch, buf.m, bias, out, buf.pad);
    return;
  }
  winograd_input_transform(p, blk, in_ch, in, buf.v, buf.pad);
  for (std::int64_t xi = 0; xi < kWinogradPositions; ++xi)
    gemm(Cpu{}, false, false, out_ch, tiles, in_ch, S(1), u + xi * out_ch * in_ch, in_ch, buf.v + xi * in_ch * tiles,
         tiles, S(0), buf.m + xi * out_ch * tiles, tiles);
  winograd_output_transform(p, blk, out_ch, buf.m, bias, out, buf.pad);
}

// ---- Blocks split by position ----
//
// With few tiles against many channel pairs (ResNet-50's 512-channel 7x7 layers at batch 8: 32
// tiles, U 36 x 512 x 512 floats = 37.7 MB), the 36 products are weight-bound: each thread's block
// streams all of U (or dU) through the cache for a handful of tiles, and backward keeps one
// private dU per thread, zeroed, accumulated and reduced. When the team has exactly one block per
// thread (channel-blocked path), the work is instead split by position: every thread transforms
// its own block into its V (and dM), the team meets, each thread takes its share of the 36
// positions for every block (reading the other threads' V and M, written before the barrier),
// and after a second barrier each thread finishes its own block. U is then read once by the team,
// and dU is one shared copy written by products with beta 0: no zero fill and no reduction.
// Whether a pass runs so: detail::winograd_by_position (kernels/conv2d_geometry.hpp), which
// conv2d_blocking applies to the forward pass (Conv2dBlocking::winograd_by_position, and Auto
// then counts one dU, not one per thread) and the dx pass applies to its own blocks here.

// All tiles of a pass's blocks (a pass of `blocks` blocks).
inline std::int64_t winograd_pass_tiles(const WinogradPass& p, const Conv2dBlocking& b, std::int64_t batch,
                                        std::int64_t blocks) {
  std::int64_t tiles = 0;
  for (std::int64_t i = 0; i < blocks; ++i) tiles += winograd_block(p, b, batch, i).tiles(p);
  return tiles;
}

// out = a pass on the team's blocks, split by position (channel-blocked; block i on thread i;
// u is U^T (36, in_ch, out_ch)); then the epilogue, if any, on this thread's block's rows.
// Called by every thread of the team; `threads_base` is the first thread's buffers.
template <class S>
void winograd_pass_by_position(const Conv2dGeometry& g, const Conv2dBlocking& b, const WinogradPass& p,
                               std::int64_t batch, std::int64_t in_ch, std::int64_t out_ch, const S* in, const S* u,
                               const S* bias, S* out, S* threads_base, const ConvEpilogue<S>* e = nullptr) {
  const std::int64_t me = Cpu::thread_index(), team = Cpu::team_size();
  const auto buffers = [&](std::int64_t t) { return WinogradBuffers<S>(g, b, threads_base + t * b.thread_elements(g)); };
  const WinogradBlock mine = winograd_block(p, b, batch, me);
  winograd_input_transform_blocked(p, mine, in_ch, in, buffers(me).v, buffers(me).pad);
#pragma omp barrier
  std::int64_t x0, x1;
  team_share(kWinogradPositions, x0, x1);
  for (std::int64_t xi = x0; xi < x1; ++xi)
    for (std::int64_t t = 0; t < team; ++t) {  // U[xi] stays in cache over the blocks
      const std::int64_t tiles = winograd_block(p, b, batch, t).tiles(p);
      const WinogradBuffers<S> buf = buffers(t);
      winograd_product(false, tiles, out_ch, in_ch, buf.v + xi * tiles * in_ch, in_ch, u + xi * in_ch * out_ch, out_ch,
                       S(0), buf.m + xi * tiles * out_ch, out_ch);
    }
#pragma omp barrier
  winograd_output_transform_blocked(p, mine, out_ch, buffers(me).m, bias, out, buffers(me).pad);
  if (e) {
    const std::int64_t oh0 = kWinogradTile * mine.tr0, oh1 = std::min(p.out_h, kWinogradTile * mine.tr1);
    conv_epilogue_planes(*e, out, mine.n0, mine.count, out_ch, p.out_h * p.out_w, oh0 * p.out_w, (oh1 - oh0) * p.out_w);
  }
}

// dU (36, K, C) = the filter gradient of the team's blocks, split by position (as above): each
// position's products over the blocks, the first with beta 0, into the one shared dU.
template <class S>
void winograd_filter_gradient_by_position(const Conv2dGeometry& g, const Conv2dBlocking& b, const WinogradPass& p,
                                          std::int64_t batch, const S* x, const S* dy, S* du, S* threads_base) {
  const std::int64_t me = Cpu::thread_index(), team = Cpu::team_size(), k = g.out_channels, c = g.channels;
  const auto buffers = [&](std::int64_t t) { return WinogradBuffers<S>(g, b, threads_base + t * b.thread_elements(g)); };
  const WinogradBlock mine = winograd_block(p, b, batch, me);
  winograd_input_transform_blocked(p, mine, c, x, buffers(me).v, buffers(me).pad);
  winograd_output_gradient_transform_blocked(p, mine, k, dy, buffers(me).m, buffers(me).pad);
#pragma omp barrier
  std::int64_t x0, x1;
  team_share(kWinogradPositions, x0, x1);
  for (std::int64_t xi = x0; xi < x1; ++xi)
    for (std::int64_t t = 0; t < team; ++t) {
      const std::int64_t tiles = winograd_block(p, b, batch, t).tiles(p);
      const WinogradBuffers<S> buf = buffers(t);
      winograd_product(true, k, c, tiles, buf.m + xi * tiles * k, k, buf.v + xi * tiles * c, c, S(t == 0 ? 0 : 1),
                       du + xi * k * c, c);
    }
#pragma omp barrier
}

}  // namespace detail

// The transformed filter U of the forward pass, as winograd_conv2d_forward computes it first from w
// (K, C, 3, 3): (36, K, C), or U^T (36, C, K) for the channel-blocked path. 36 K C elements, four
// times the weights: a layer that runs forward only with fixed weights (Mode::Inference) computes
// it once and hands it to every forward (`prepared_filter`).
inline std::int64_t winograd_filter_elements(const Conv2dGeometry& g) {
  return detail::kWinogradPositions * g.out_channels * g.channels;
}
namespace detail {
// This thread's share of U's rows (all of them outside a team): the forward pass's filter
// transform, in winograd_conv2d_forward and winograd_prepare_filter alike.
template <class S>
void winograd_forward_filter_share(const Conv2dGeometry& g, const S* w, S* u) {
  const std::int64_t k = g.out_channels, c = g.channels;
  const bool blocked = winograd_channel_blocked<S>(c, k);
  std::int64_t r0, r1;
  team_share(blocked ? c : k, r0, r1);
  winograd_filter_transform(w, blocked ? c : k, blocked ? k : c, blocked, false, r0, r1, u);
}
}  // namespace detail

template <class S>
void winograd_prepare_filter(const Conv2dGeometry& g, const S* w, S* u) {
  detail::run_in_team_if(winograd_filter_elements(g) > detail::kParallelGrain,
                         [&] { detail::winograd_forward_filter_share(g, w, u); });
}

// y = conv3x3(x, w) + bias by F(4x4, 3x3); b.winograd is set (conv2d_blocking chose it for g).
// With an epilogue e (bias then null), each block's output rows get it right after the output
// transform wrote them. With prepared_filter (winograd_prepare_filter of this w), U is not
// computed again.
template <class S>
void winograd_conv2d_forward(const Conv2dGeometry& g, const Conv2dBlocking& b, std::int64_t batch, const S* x,
                             const S* w, const S* bias, S* y, S* workspace, const ConvEpilogue<S>* e = nullptr,
                             const S* prepared_filter = nullptr) {
  const std::int64_t k = g.out_channels, c = g.channels;
  const detail::WinogradPass pass = detail::winograd_forward_pass(g);
  const std::int64_t blocks = b.groups(batch) * pass.bands(b.rows);
  // U (36, K, C), or U^T (36, C, K) for the channel-blocked path: given, or computed into the
  // workspace's shared part.
  const S* u = prepared_filter != nullptr ? prepared_filter : workspace;
  detail::StealRanges ranges(blocks);  // the blocks are independent (detail::stealing_for)
  const auto run = [&] {
    if (prepared_filter == nullptr) {
      detail::winograd_forward_filter_share(g, w, workspace);
#pragma omp barrier
    }
    S* threads_base = workspace + b.shared_elements(g);
    if (b.winograd_by_position && Cpu::team_size() == b.threads)
      return detail::winograd_pass_by_position(g, b, pass, batch, c, k, x, u, bias, y, threads_base, e);
    const detail::WinogradBuffers<S> buf(g, b, threads_base + Cpu::thread_index() * b.thread_elements(g));
    detail::stealing_for(ranges, blocks, [&](std::int64_t i) {
      const detail::WinogradBlock blk = detail::winograd_block(pass, b, batch, i);
      detail::winograd_block_product(pass, blk, c, k, x, u, bias, y, buf);
      if (e) {
        const std::int64_t oh0 = detail::kWinogradTile * blk.tr0;
        const std::int64_t oh1 = std::min(pass.out_h, detail::kWinogradTile * blk.tr1);
        detail::conv_epilogue_planes(*e, y, blk.n0, blk.count, k, pass.out_h * pass.out_w, oh0 * pass.out_w,
                                     (oh1 - oh0) * pass.out_w);
      }
    });
  };
  detail::run_in_team_if(blocks > 1 && batch * g.out_plane() * k * c * 9 > detail::kParallelGrain, run);
}

// dw (K, C, 3, 3) += dL/dw unless dw is null, and dx = dL/dx unless dx is null, by F(4x4, 3x3)
// (header comment).
template <class S>
void winograd_conv2d_backward(const Conv2dGeometry& g, const Conv2dBlocking& b, std::int64_t batch, const S* x,
                              const S* w, const S* dy, S* dw, S* dx, S* workspace) {
  const std::int64_t k = g.out_channels, c = g.channels, filters = detail::kWinogradPositions * k * c;
  const detail::WinogradPass fwd = detail::winograd_forward_pass(g), back = detail::winograd_input_grad_pass(g);
  const std::int64_t weight_blocks = dw ? b.groups(batch) * fwd.bands(b.rows) : 0;
  const std::int64_t input_blocks = dx ? b.groups(batch) * back.bands(b.rows) : 0;
  const bool blocked = detail::winograd_channel_blocked<S>(c, k);
  S* u_flipped = workspace;                                                     // see below
  S* du = workspace + b.shared_elements(g) + b.threads * b.thread_elements(g);  // (team, 36, K, C)
  detail::StealRanges ranges(input_blocks);
  const auto run = [&] {
    const std::int64_t me = Cpu::thread_index(), team = Cpu::team_size();
    S* threads_base = workspace + b.shared_elements(g);
    // Split by position: dw as the blocking says (its workspace then holds one dU; a team of another
    // size than the blocking's is a single thread, nested in another team, which needs one too), dx
    // wherever its own pass qualifies.
    const bool dx_by_position =
        blocked && dx &&
        detail::winograd_by_position(input_blocks, team, detail::winograd_pass_tiles(back, b, batch, input_blocks), k, c);
    const bool dw_by_position = dw && b.winograd_by_position && team == b.threads;
    S* my_du = du + me * filters;
    if (dw && !dw_by_position) std::fill(my_du, my_du + filters, S(0));
    if (dx) {  // the flipped filter (36, C, K), or its transpose (36, K, C) for the channel-blocked path
      std::int64_t r0, r1;
      const std::int64_t rows = blocked ? k : c;
      detail::team_share(rows, r0, r1);
      detail::winograd_filter_transform(w, rows, blocked ? c : k, !blocked, true, r0, r1, u_flipped);
    }
#pragma omp barrier
    const detail::WinogradBuffers<S> buf(g, b, threads_base + me * b.thread_elements(g));
    // Split by block on both passes: dw's blocks first, over the static split (each thread's dU
    // sums the same blocks in the same order every time: the same bits), then dx's, which any
    // thread may take (detail::stealing_for), so that one done early with dw takes the other's.
    const bool dx_stealing = !dx_by_position && !dw_by_position;
    const auto input_block = [&](std::int64_t i) {
      detail::winograd_block_product(back, detail::winograd_block(back, b, batch, i), k, c, dy, u_flipped,
                                     static_cast<const S*>(nullptr), dx, buf);
    };
    if (dx_by_position)
      detail::winograd_pass_by_position(g, b, back, batch, k, c, dy, u_flipped, static_cast<const S*>(nullptr), dx,
                                        threads_base);
    else if (!dx_stealing)
      detail::static_for(input_blocks, input_block, /*nowait=*/true);
    if (dw_by_position) {
      // Both barriers inside: dU (the first thread's copy) is complete after it.
      detail::winograd_filter_gradient_by_position(g, b, fwd, batch, x, dy, du, threads_base);
      std::int64_t k0, k1;
      detail::team_share(k, k0, k1);
      detail::winograd_filter_gradient(du, 1, filters, k, c, k0, k1, dw);
      return;
    }
    detail::static_for(weight_blocks, [&](std::int64_t i) {
      const detail::WinogradBlock blk = detail::winograd_block(fwd, b, batch, i);
      const std::int64_t tiles = blk.tiles(fwd);
      if (blocked) {
        detail::winograd_input_transform_blocked(fwd, blk, c, x, buf.v, buf.pad);
        detail::winograd_output_gradient_transform_blocked(fwd, blk, k, dy, buf.m, buf.pad);
        for (std::int64_t xi = 0; xi < detail::kWinogradPositions; ++xi)
          detail::winograd_product(true, k, c, tiles, buf.m + xi * tiles * k, k, buf.v + xi * tiles * c, c, S(1),
                                   my_du + xi * k * c, c);
        return;
      }
      detail::winograd_input_transform(fwd, blk, c, x, buf.v, buf.pad);
      detail::winograd_output_gradient_transform(fwd, blk, k, dy, buf.m, buf.pad);
      for (std::int64_t xi = 0; xi < detail::kWinogradPositions; ++xi)
        gemm(Cpu{}, false, true, k, c, tiles, S(1), buf.m + xi * k * tiles, tiles, buf.v + xi * c * tiles, tiles, S(1),
             my_du + xi * k * c, c);
    }, /*nowait=*/dx_stealing);
    if (dx_stealing) {
      detail::stealing_for(ranges, input_blocks, input_block);
      if (dw && team > 1) {
#pragma omp barrier
      }
    }
    if (!dw) return;  // dx only
    // A barrier has passed (static_for's, or the one after the stolen dx blocks): every thread's
    // dU is complete.
    std::int64_t k0, k1;
    detail::team_share(k, k0, k1);
    detail::winograd_filter_gradient(du, team, filters, k, c, k0, k1, dw);
  };
  detail::run_in_team_if(b.parallel_backward, run);
}

}  // namespace tessera

TESSERA_SIMD_CODE_END
