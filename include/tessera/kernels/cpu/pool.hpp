// 2-D pooling on the CPU over `planes` independent (H, W) planes (planes = N C for NCHW tensors).
//
// Square window k, stride s, padding p (p <= k / 2); the layer fixes H' (floor or ceil mode, see
// layers/pool.hpp), and every window starts inside the image or its left/top padding. Window
// (oh, ow) covers rows [oh s - p, oh s - p + k) (likewise columns), clipped to the image:
//   max:  y[oh, ow] = max over the clipped window (padding acts as -inf);
//         argmax[oh, ow] = h W + w of the maximum (first one on ties, NaN wins, as in PyTorch).
//         dx[argmax[oh, ow]] += dy[oh, ow]
//   avg:  y[oh, ow] = sum over the clipped window / d(oh, ow), where (PyTorch's avg_pool2d)
//         d = divisor_override if set, else count_include_pad ? e_h(oh) e_w(ow) : c_h(oh) c_w(ow),
//         e_h(oh) = min(oh s - p + k, H + p) - (oh s - p) (the window cut at the end of the padded
//         input, padding counted: k except for a ceil-mode window running past it) and c_h(oh) the
//         number of image rows in the window.  dx[h, w] += dy[oh, ow] / d(oh, ow) for every window
//         covering (h, w). The default options give d = k^2 everywhere: the fast path.
//   adaptive average (output oh x ow of any size): window rows [floor(i H / oh), ceil((i + 1) H / oh)),
//         y = sum / rows / cols (PyTorch's rounding);  dx[h, w] += dy[i, j] / rows / cols.
//   global average: y (planes) = mean of each plane;  dx = dy / (H W) everywhere on the plane.
// Every plane is independent, so threads split the planes and backward needs no atomics.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "tessera/device/cpu.hpp"
#include "tessera/kernels/conv2d_geometry.hpp"
#include "tessera/kernels/cpu/capability.hpp"
#include "tessera/kernels/cpu/compiled.hpp"
#include "tessera/kernels/cpu/short_rows.hpp"

#include "tessera/kernels/cpu/simd_diagnostics.hpp"

TESSERA_SIMD_CODE_BEGIN

namespace tessera {

struct Pool2dGeometry {
  std::int64_t height = 0, width = 0;  // input H, W
  std::int64_t kernel = 1, stride = 1, pad = 0;
  std::int64_t out_height = 0, out_width = 0;  // H', W'
  bool count_include_pad = true;               // average pooling only
  std::int64_t divisor_override = 0;           // average pooling only; 0: none (torch forbids 0)
  // The planes are N C images' channels, p = n C + c. Contiguous (NCHW): plane p is a block of
  // rows x cols values; channels_last (NHWC): element (p, row, col) at ((n rows + row) cols + col) C + c.
  std::int64_t channels = 1;
  bool channels_last = false;

  // constexpr: callable from CUDA kernels too (nvcc --expt-relaxed-constexpr).
  constexpr std::int64_t in_plane() const { return height * width; }
  constexpr std::int64_t out_plane() const { return out_height * out_width; }

  // The memory position of element (p, row, col) of a rows x cols input or output.
  constexpr std::int64_t offset(std::int64_t p, std::int64_t row, std::int64_t col, std::int64_t rows,
                                std::int64_t cols) const {
    if (!channels_last) return (p * rows + row) * cols + col;
    return (((p / channels) * rows + row) * cols + col) * channels + p % channels;
  }
  constexpr std::int64_t in_offset(std::int64_t p, std::int64_t h, std::int64_t w) const {
    return offset(p, h, w, height, width);
  }
  constexpr std::int64_t out_offset(std::int64_t p, std::int64_t oh, std::int64_t ow) const {
    return offset(p, oh, ow, out_height, out_width);
  }
  // The inverse of offset: memory position e of a rows x cols array -> (p, row, col).
  constexpr void locate(std::int64_t e, std::int64_t rows, std::int64_t cols, std::int64_t& p, std::int64_t& row,
                        std::int64_t& col) const {
    if (!channels_last) {
      p = e / (rows * cols);
      row = e % (rows * cols) / cols;
      col = e % cols;
      return;
    }
    const std::int64_t pixel = e / channels, image = pixel / (rows * cols), within = pixel % (rows * cols);
    p = image * channels + e % channels;
    row = within / cols;
    col = within % cols;
  }

  // Average pooling's divisor factor along one axis for output index o over an input of extent
  // `in`: e(o) with count_include_pad, else c(o) (see the header comment).
  constexpr std::int64_t avg_extent(std::int64_t o, std::int64_t in) const {
    const std::int64_t start = o * stride - pad;
    const std::int64_t end = start + kernel < in + pad ? start + kernel : in + pad;
    if (count_include_pad) return end - start;
    return (end < in ? end : in) - (start > 0 ? start : 0);
  }
  // PyTorch's divide_factor of average-pooling window (oh, ow).
  constexpr std::int64_t avg_divisor(std::int64_t oh, std::int64_t ow) const {
    return divisor_override != 0 ? divisor_override : avg_extent(oh, height) * avg_extent(ow, width);
  }
  // True when every window has the same divisor (k^2, or the override): the default options,
  // where no window (the last one the furthest) runs past the padded input.
  constexpr bool uniform_avg_divisor() const {
    const std::int64_t last_end_h = (out_height - 1) * stride - pad + kernel;
    const std::int64_t last_end_w = (out_width - 1) * stride - pad + kernel;
    return divisor_override != 0 ||
           (count_include_pad && last_end_h <= height + pad && last_end_w <= width + pad);
  }
};

// Adaptive average pooling from (H, W) to any (H', W').
struct AdaptivePool2dGeometry {
  std::int64_t height = 0, width = 0;          // input H, W
  std::int64_t out_height = 1, out_width = 1;  // H', W'

  constexpr std::int64_t in_plane() const { return height * width; }
  constexpr std::int64_t out_plane() const { return out_height * out_width; }
  // Window of output index o along an axis: [floor(o in / out), ceil((o + 1) in / out)).
  static constexpr std::int64_t start(std::int64_t o, std::int64_t in, std::int64_t out) { return o * in / out; }
  static constexpr std::int64_t end(std::int64_t o, std::int64_t in, std::int64_t out) {
    return ((o + 1) * in + out - 1) / out;
  }
};

namespace detail {

constexpr std::int64_t kPoolParallelGrain = 32768;  // elements of work below which one thread does it

// Range [lo, hi) of output columns ow whose input column ow * stride + offset lies in [0, extent):
// the same arithmetic as a convolution tap's.
inline void pool_valid_range(std::int64_t offset, std::int64_t stride, std::int64_t extent, std::int64_t out,
                             std::int64_t& lo, std::int64_t& hi) {
  valid_output_range(offset, stride, extent, out, lo, hi);
}

// LeNet's and VGG's pooling: 2x2 windows, stride 2, no padding, every window inside the input
// (floor mode, or an even input with ceil mode).
inline bool max_pool_2x2_windows(const Pool2dGeometry& g) {
  return g.kernel == 2 && g.stride == 2 && g.pad == 0 && 2 * g.out_height <= g.height && 2 * g.out_width <= g.width;
}

#if TESSERA_X86_DISPATCH
// One output row of at most 16 windows (an input row of at most 32 values, LeNet's 28 and 10):
// both input rows loaded, split into even and odd columns by one permute each, the four taps
// compared lane-wise in scan order. Scalar, such a row cost several times as much per window.
TESSERA_TARGET_AVX512 inline void max_pool_2x2_row16(const float* r0, const float* r1, std::int64_t w, std::int64_t ow_count,
                               std::int32_t base, float* best, std::int32_t* at) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const auto low = static_cast<__mmask16>(w >= 16 ? 0xffff : (1u << w) - 1u);
  const auto high = static_cast<__mmask16>(w <= 16 ? 0 : (1u << (w - 16)) - 1u);
  const __m512 a0 = _mm512_maskz_loadu_ps(low, r0), a1 = _mm512_maskz_loadu_ps(high, r0 + 16);
  const __m512 b0 = _mm512_maskz_loadu_ps(low, r1), b1 = _mm512_maskz_loadu_ps(high, r1 + 16);
  const __m512 taps[4] = {_mm512_permutex2var_ps(a0, even, a1), _mm512_permutex2var_ps(a0, odd, a1),
                          _mm512_permutex2var_ps(b0, even, b1), _mm512_permutex2var_ps(b0, odd, b1)};
  const __m512i first = _mm512_add_epi32(_mm512_set1_epi32(base), _mm512_slli_epi32(_mm512_setr_epi32(
      0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 1));
  const std::int32_t offsets[4] = {0, 1, static_cast<std::int32_t>(w), static_cast<std::int32_t>(w) + 1};
  __m512 m = taps[0];
  __m512i a = first;
  for (int t = 1; t < 4; ++t) {
    // A later tap wins when greater, or when NaN (unordered with itself).
    const __mmask16 take = _mm512_cmp_ps_mask(taps[t], m, _CMP_GT_OQ) | _mm512_cmp_ps_mask(taps[t], taps[t], _CMP_UNORD_Q);
    m = _mm512_mask_blend_ps(take, m, taps[t]);
    a = _mm512_mask_blend_epi32(take, a, _mm512_add_epi32(first, _mm512_set1_epi32(offsets[t])));
  }
  const auto out = static_cast<__mmask16>((1u << ow_count) - 1u);
  _mm512_mask_storeu_ps(best, out, m);
  if (at != nullptr) _mm512_mask_storeu_epi32(at, out, a);
}

// AVX2: the same 8 windows at a time, from input columns [2 o0, 2 o0 + 16) of both rows (masked
// loads past w: nothing outside the row is read): shuffle_ps takes the even (odd) columns of each
// 128-bit half, and one cross-half permute puts them in order. The last 1 to 7 windows go through
// a buffer: VMASKMOVPS stores are slow on AMD.
TESSERA_TARGET_AVX2 inline void max_pool_2x2_row_avx2(const float* r0, const float* r1, std::int64_t w,
                                                      std::int64_t ow_count, std::int32_t base, float* best,
                                                      std::int32_t* at) {
  const std::int32_t offsets[4] = {0, 1, static_cast<std::int32_t>(w), static_cast<std::int32_t>(w) + 1};
  for (std::int64_t o0 = 0; o0 < ow_count; o0 += 8) {
    const std::int64_t c0 = 2 * o0, left = w - c0;  // input columns from c0 on
    const auto load = [&](const float* row, std::int64_t from) TESSERA_TARGET_AVX2 {
      return left - from >= 8 ? _mm256_loadu_ps(row + c0 + from) : _mm256_maskload_ps(row + c0 + from, lanes8(left - from));
    };
    const auto split = [](__m256 lo, __m256 hi, int pick) TESSERA_TARGET_AVX2 {
      const __m256 halves = pick == 0 ? _mm256_shuffle_ps(lo, hi, 0x88) : _mm256_shuffle_ps(lo, hi, 0xDD);
      return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(halves), 0xD8));
    };
    const __m256 a0 = load(r0, 0), a1 = load(r0, 8), b0 = load(r1, 0), b1 = load(r1, 8);
    const __m256 taps[4] = {split(a0, a1, 0), split(a0, a1, 1), split(b0, b1, 0), split(b0, b1, 1)};
    const __m256i first = _mm256_add_epi32(_mm256_set1_epi32(base + static_cast<std::int32_t>(c0)),
                                           _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    __m256 m = taps[0];
    __m256i a = first;
    for (int t = 1; t < 4; ++t) {
      // A later tap wins when greater, or when NaN (unordered with itself).
      const __m256 take = _mm256_or_ps(_mm256_cmp_ps(taps[t], m, _CMP_GT_OQ), _mm256_cmp_ps(taps[t], taps[t], _CMP_UNORD_Q));
      m = _mm256_blendv_ps(m, taps[t], take);
      a = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(a),
                                               _mm256_castsi256_ps(_mm256_add_epi32(first, _mm256_set1_epi32(offsets[t]))),
                                               take));
    }
    const std::int64_t n = std::min<std::int64_t>(8, ow_count - o0);
    if (n == 8) {
      _mm256_storeu_ps(best + o0, m);
      if (at != nullptr) _mm256_storeu_si256(reinterpret_cast<__m256i*>(at + o0), a);
    } else {
      alignas(32) float mb[8];
      alignas(32) std::int32_t ab[8];
      _mm256_store_ps(mb, m);
      _mm256_store_si256(reinterpret_cast<__m256i*>(ab), a);
      std::copy_n(mb, n, best + o0);
      if (at != nullptr) std::copy_n(ab, n, at + o0);
    }
  }
}
#endif

// max_pool2d_forward's loop, unrolled for 2x2 windows: the four taps in the same scan order with the
// same rule (a later tap wins when greater, or when NaN, as PyTorch's kernel), so values and
// argmax are identical; written as one branch-free pass per output row that the compiler
// vectorizes (the generic loop's stride-2 gathers per tap were a large share of a LeNet-5 step).
template <class S>
void max_pool2d_forward_2x2(const Pool2dGeometry& g, std::int64_t planes, const S* x, S* y, std::int32_t* argmax) {
  const std::int64_t work = planes * g.out_plane() * 4;
  const std::int64_t w = g.width, ow_count = g.out_width;
  detail::parallel_for(planes, work > kPoolParallelGrain, [&](std::int64_t p) {
    const S* in = x + p * g.in_plane();
    for (std::int64_t oh = 0; oh < g.out_height; ++oh) {
      const S* r0 = in + 2 * oh * w;
      const S* r1 = r0 + w;
      S* best = y + p * g.out_plane() + oh * ow_count;
      std::int32_t* at = argmax ? argmax + p * g.out_plane() + oh * ow_count : nullptr;
      const auto base = static_cast<std::int32_t>(2 * oh * w);
      const auto below = static_cast<std::int32_t>(w);
#if TESSERA_X86_DISPATCH
      if constexpr (std::is_same_v<S, float>) {
        if (w <= 32 && cpu_avx512()) {
          max_pool_2x2_row16(r0, r1, w, ow_count, base, best, at);
          continue;
        }
        if (w <= 32 && cpu_avx2()) {
          max_pool_2x2_row_avx2(r0, r1, w, ow_count, base, best, at);
          continue;
        }
      }
#endif
#pragma omp simd
      for (std::int64_t ow = 0; ow < ow_count; ++ow) {
        const auto i0 = base + static_cast<std::int32_t>(2 * ow);
        S m = r0[2 * ow];
        std::int32_t a = i0;
        const S v1 = r0[2 * ow + 1], v2 = r1[2 * ow], v3 = r1[2 * ow + 1];
        bool take = v1 > m || v1 != v1;
        m = take ? v1 : m;
        a = take ? i0 + 1 : a;
        take = v2 > m || v2 != v2;
        m = take ? v2 : m;
        a = take ? i0 + below : a;
        take = v3 > m || v3 != v3;
        m = take ? v3 : m;
        a = take ? i0 + below + 1 : a;
        best[ow] = m;
        if (at != nullptr) at[ow] = a;
      }
    }
  });
}

// The window loop with k and s known at compile time, for ResNet's 3x3 stride-2 stem pooling
// (112x112 -> 56x56). Each input row's k taps are compared in registers in one pass over the output
// row, where the generic loop makes one pass per tap and loads and stores the running maximum and
// argmax each time; with s known, the compiler loads row[ow s + j - p] as whole vectors and splits
// them by shuffles, where clang left the generic loop scalar and branchy for s = 2 (bench/README,
// "Figures behind design choices in the headers"). Taps are visited in the generic loop's order
// (h, then j), so values and argmax are identical. Columns with a tap in the padding go through the
// same comparisons one by one. Without argmax (null: Mode::Inference keeps none) the same passes
// leave it out, so the values are those with argmax, bit for bit.
template <int kKernel, int kStride, class S>
void max_pool2d_forward_fixed(const Pool2dGeometry& g, std::int64_t planes, const S* x, S* y, std::int32_t* argmax) {
  const std::int64_t pad = g.pad, width = g.width, ow_count = g.out_width;
  // Inner columns, every tap inside the row: ow s - p >= 0 and ow s - p + k <= W.
  const std::int64_t inner_lo = std::min(ow_count, (pad + kStride - 1) / kStride);
  const std::int64_t inner_hi =
      width + pad < kKernel ? inner_lo : std::clamp((width + pad - kKernel) / kStride + 1, inner_lo, ow_count);
  const std::int64_t work = planes * g.out_plane() * kKernel * kKernel;
  const auto pool = [&](auto with_argmax) {
    constexpr bool kArgmax = decltype(with_argmax)::value;
    detail::parallel_for(planes, work > kPoolParallelGrain, [&](std::int64_t p) {
      const S* in = x + p * g.in_plane();
      for (std::int64_t oh = 0; oh < g.out_height; ++oh) {
        S* best = y + p * g.out_plane() + oh * ow_count;
        std::int32_t* at = kArgmax ? argmax + p * g.out_plane() + oh * ow_count : nullptr;
        const std::int64_t h0 = std::max<std::int64_t>(oh * kStride - pad, 0);
        const std::int64_t h1 = std::min(oh * kStride - pad + kKernel, g.height);
        std::fill(best, best + ow_count, -std::numeric_limits<S>::infinity());
        if constexpr (kArgmax)
          for (std::int64_t ow = 0; ow < ow_count; ++ow)
            at[ow] = static_cast<std::int32_t>(h0 * width + std::max<std::int64_t>(ow * kStride - pad, 0));
        for (std::int64_t h = h0; h < h1; ++h) {
          const S* row = in + h * width;
          const auto edge_column = [&](std::int64_t ow) {
            for (std::int64_t j = 0; j < kKernel; ++j) {
              const std::int64_t iw = ow * kStride + j - pad;
              if (iw < 0 || iw >= width) continue;
              const S v = row[iw];
              if (v > best[ow] || v != v) {
                best[ow] = v;
                if constexpr (kArgmax) at[ow] = static_cast<std::int32_t>(h * width + iw);
              }
            }
          };
          for (std::int64_t ow = 0; ow < inner_lo; ++ow) edge_column(ow);
#pragma omp simd
          for (std::int64_t ow = inner_lo; ow < inner_hi; ++ow) {
            const S* window = row + ow * kStride - pad;
            const auto first = static_cast<std::int32_t>(h * width + ow * kStride - pad);
            S m = best[ow];
            std::int32_t a = kArgmax ? at[ow] : 0;
#if !defined(__CUDACC__)  // nvcc's front end, which sees this header through the CUDA launchers' declarations, warns
#pragma GCC unroll 16
#endif
            for (int j = 0; j < kKernel; ++j) {
              const S v = window[j];
              const bool take = v > m || v != v;
              m = take ? v : m;
              if constexpr (kArgmax) a = take ? first + j : a;
            }
            best[ow] = m;
            if constexpr (kArgmax) at[ow] = a;
          }
          for (std::int64_t ow = inner_hi; ow < ow_count; ++ow) edge_column(ow);
        }
      }
    });
  };
  if (argmax != nullptr) pool(std::true_type{});
  else pool(std::false_type{});
}

// Channels last (Pool2dGeometry::channels_last): output by output in memory order, each window
// visited in row-major order as the planar loops do, so the maxima, argmaxes and sums are theirs
// (the backward sums may add in another order). A reference for the CPU, where Tessera's
// convolutions are planar; the fast NHWC kernels are the GPU's (kernels/cuda/pool.cuh).
template <class S>
void max_pool2d_forward_channels_last(const Pool2dGeometry& g, std::int64_t planes, const S* x, S* y,
                                      std::int32_t* argmax) {
  const std::int64_t work = planes * g.out_plane() * g.kernel * g.kernel;
  detail::parallel_for(planes * g.out_plane(), work > kPoolParallelGrain, [&](std::int64_t o) {
    std::int64_t p, oh, ow;
    g.locate(o, g.out_height, g.out_width, p, oh, ow);
    const std::int64_t h0 = std::max<std::int64_t>(oh * g.stride - g.pad, 0), h1 = std::min(oh * g.stride - g.pad + g.kernel, g.height);
    const std::int64_t w0 = std::max<std::int64_t>(ow * g.stride - g.pad, 0), w1 = std::min(ow * g.stride - g.pad + g.kernel, g.width);
    S best = -std::numeric_limits<S>::infinity();
    auto at = static_cast<std::int32_t>(h0 * g.width + w0);
    for (std::int64_t h = h0; h < h1; ++h)
      for (std::int64_t w = w0; w < w1; ++w) {
        const S v = x[g.in_offset(p, h, w)];
        if (v > best || v != v) {
          best = v;
          at = static_cast<std::int32_t>(h * g.width + w);
        }
      }
    y[o] = best;
    if (argmax != nullptr) argmax[o] = at;
  });
}
// Each image's outputs are contiguous in both formats: images split over the threads.
template <class Body>
void pool_images(const Pool2dGeometry& g, std::int64_t planes, const Body& body) {
  const std::int64_t images = planes / g.channels;
  const std::int64_t work = planes * (g.in_plane() + g.out_plane() * g.kernel * g.kernel);
  parallel_for(images, work > kPoolParallelGrain, body);
}
}  // namespace detail

// y (planes, H', W') and argmax (planes, H', W') <- max pooling of x (planes, H, W); argmax may be
// null (Mode::Inference: the values only, the same as with it).
// Each output row is built tap by tap over all its columns at once: the inner loop runs along ow
// with no branches, so it vectorizes; taps are visited in row-major window order and only a
// strictly larger value (or a NaN) replaces the current maximum, which keeps PyTorch's argmax.
template <class S>
void max_pool2d_forward(Cpu, const Pool2dGeometry& g, std::int64_t planes, const S* x, S* y, std::int32_t* argmax) {
  if (g.channels_last) {
    detail::max_pool2d_forward_channels_last(g, planes, x, y, argmax);
    return;
  }
  const std::int64_t work = planes * g.out_plane() * g.kernel * g.kernel;
  if (detail::max_pool_2x2_windows(g)) {
    detail::max_pool2d_forward_2x2(g, planes, x, y, argmax);
    return;
  }
  if (g.kernel == 3 && g.stride == 2) {
    detail::max_pool2d_forward_fixed<3, 2>(g, planes, x, y, argmax);
    return;
  }
  detail::parallel_for(planes, work > detail::kPoolParallelGrain, [&](std::int64_t p) {
    const S* in = x + p * g.in_plane();
    for (std::int64_t oh = 0; oh < g.out_height; ++oh) {
      S* best = y + p * g.out_plane() + oh * g.out_width;
      std::int32_t* at = argmax ? argmax + p * g.out_plane() + oh * g.out_width : nullptr;
      const std::int64_t h0 = std::max<std::int64_t>(oh * g.stride - g.pad, 0);
      const std::int64_t h1 = std::min(oh * g.stride - g.pad + g.kernel, g.height);
      std::fill(best, best + g.out_width, -std::numeric_limits<S>::infinity());
      if (at != nullptr)
        for (std::int64_t ow = 0; ow < g.out_width; ++ow)
          at[ow] = static_cast<std::int32_t>(h0 * g.width + std::max<std::int64_t>(ow * g.stride - g.pad, 0));
      for (std::int64_t h = h0; h < h1; ++h) {
        const S* row = in + h * g.width;
        for (std::int64_t j = 0; j < g.kernel; ++j) {
          const std::int64_t offset = j - g.pad;  // iw = ow * stride + offset
          std::int64_t lo, hi;
          detail::pool_valid_range(offset, g.stride, g.width, g.out_width, lo, hi);
          const auto base = static_cast<std::int32_t>(h * g.width + offset);
          if (at == nullptr) {
            for (std::int64_t ow = lo; ow < hi; ++ow) {
              const S v = row[ow * g.stride + offset];
              best[ow] = v > best[ow] || v != v ? v : best[ow];
            }
            continue;
          }
          for (std::int64_t ow = lo; ow < hi; ++ow) {
            const S v = row[ow * g.stride + offset];
            const bool take = v > best[ow] || v != v;
            best[ow] = take ? v : best[ow];
            at[ow] = take ? base + static_cast<std::int32_t>(ow * g.stride) : at[ow];
          }
        }
      }
    }
  });
}

// dx (planes, H, W) = routing of dy (planes, H', W') to the argmax of each window (overwrites dx).
template <class S>
void max_pool2d_backward(Cpu, const Pool2dGeometry& g, std::int64_t planes, const S* dy, const std::int32_t* argmax,
                         S* dx) {
  if (g.channels_last) {
    detail::pool_images(g, planes, [&](std::int64_t i) {
      const std::int64_t c = g.channels, in = c * g.in_plane(), out = c * g.out_plane();
      std::fill(dx + i * in, dx + (i + 1) * in, S(0));
      for (std::int64_t o = i * out; o < (i + 1) * out; ++o)
        dx[i * in + std::int64_t{argmax[o]} * c + o % c] += dy[o];
    });
    return;
  }
  const std::int64_t work = planes * (g.in_plane() + g.out_plane());
  detail::parallel_for(planes, work > detail::kPoolParallelGrain, [&](std::int64_t p) {
    S* out = dx + p * g.in_plane();
    std::fill(out, out + g.in_plane(), S(0));
    const S* d = dy + p * g.out_plane();
    const std::int32_t* idx = argmax + p * g.out_plane();
    for (std::int64_t o = 0; o < g.out_plane(); ++o) out[idx[o]] += d[o];
  });
}

// y (planes, H', W') <- average pooling of x (planes, H, W); tap by tap over whole output rows
// like max_pool2d_forward, then each sum divided by its window's divisor: one multiplication by
// 1 / k^2 for the default options, else PyTorch's sum / d(oh, ow).
template <class S>
void avg_pool2d_forward(Cpu, const Pool2dGeometry& g, std::int64_t planes, const S* x, S* y) {
  const bool uniform = g.uniform_avg_divisor();
  const S scale = S(1) / static_cast<S>(g.avg_divisor(0, 0));
  if (g.channels_last) {
    detail::pool_images(g, planes, [&](std::int64_t i) {
      const std::int64_t out = g.channels * g.out_plane();
      for (std::int64_t o = i * out; o < (i + 1) * out; ++o) {
        std::int64_t p, oh, ow;
        g.locate(o, g.out_height, g.out_width, p, oh, ow);
        const std::int64_t h0 = std::max<std::int64_t>(oh * g.stride - g.pad, 0), h1 = std::min(oh * g.stride - g.pad + g.kernel, g.height);
        const std::int64_t w0 = std::max<std::int64_t>(ow * g.stride - g.pad, 0), w1 = std::min(ow * g.stride - g.pad + g.kernel, g.width);
        S sum = 0;
        for (std::int64_t h = h0; h < h1; ++h)
          for (std::int64_t w = w0; w < w1; ++w) sum += x[g.in_offset(p, h, w)];
        y[o] = uniform ? sum * scale : sum / static_cast<S>(g.avg_divisor(oh, ow));
      }
    });
    return;
  }
  const std::int64_t work = planes * g.out_plane() * g.kernel * g.kernel;
  detail::parallel_for(planes, work > detail::kPoolParallelGrain, [&](std::int64_t p) {
    const S* in = x + p * g.in_plane();
    for (std::int64_t oh = 0; oh < g.out_height; ++oh) {
      S* out = y + p * g.out_plane() + oh * g.out_width;
      std::fill(out, out + g.out_width, S(0));
      const std::int64_t h0 = std::max<std::int64_t>(oh * g.stride - g.pad, 0);
      const std::int64_t h1 = std::min(oh * g.stride - g.pad + g.kernel, g.height);
      for (std::int64_t h = h0; h < h1; ++h) {
        const S* row = in + h * g.width;
        for (std::int64_t j = 0; j < g.kernel; ++j) {
          const std::int64_t offset = j - g.pad;
          std::int64_t lo, hi;
          detail::pool_valid_range(offset, g.stride, g.width, g.out_width, lo, hi);
          for (std::int64_t ow = lo; ow < hi; ++ow) out[ow] += row[ow * g.stride + offset];
        }
      }
      if (uniform) {
        for (std::int64_t ow = 0; ow < g.out_width; ++ow) out[ow] *= scale;
      } else {
        for (std::int64_t ow = 0; ow < g.out_width; ++ow) out[ow] /= static_cast<S>(g.avg_divisor(oh, ow));
      }
    }
  });
}

// dx (planes, H, W) = dy (planes, H', W') spread evenly over each window (overwrites dx).
template <class S>
void avg_pool2d_backward(Cpu, const Pool2dGeometry& g, std::int64_t planes, const S* dy, S* dx) {
  const bool uniform = g.uniform_avg_divisor();
  const S scale = S(1) / static_cast<S>(g.avg_divisor(0, 0));
  if (g.channels_last) {
    detail::pool_images(g, planes, [&](std::int64_t i) {
      const std::int64_t in = g.channels * g.in_plane(), out = g.channels * g.out_plane();
      std::fill(dx + i * in, dx + (i + 1) * in, S(0));
      for (std::int64_t o = i * out; o < (i + 1) * out; ++o) {
        std::int64_t p, oh, ow;
        g.locate(o, g.out_height, g.out_width, p, oh, ow);
        const S share = uniform ? dy[o] * scale : dy[o] / static_cast<S>(g.avg_divisor(oh, ow));
        const std::int64_t h0 = std::max<std::int64_t>(oh * g.stride - g.pad, 0), h1 = std::min(oh * g.stride - g.pad + g.kernel, g.height);
        const std::int64_t w0 = std::max<std::int64_t>(ow * g.stride - g.pad, 0), w1 = std::min(ow * g.stride - g.pad + g.kernel, g.width);
        for (std::int64_t h = h0; h < h1; ++h)
          for (std::int64_t w = w0; w < w1; ++w) dx[g.in_offset(p, h, w)] += share;
      }
    });
    return;
  }
  const std::int64_t work = planes * g.out_plane() * g.kernel * g.kernel;
  detail::parallel_for(planes, work > detail::kPoolParallelGrain, [&](std::int64_t p) {
    S* out = dx + p * g.in_plane();
    std::fill(out, out + g.in_plane(), S(0));
    for (std::int64_t oh = 0; oh < g.out_height; ++oh) {
      const S* d = dy + p * g.out_plane() + oh * g.out_width;
      const std::int64_t h0 = std::max<std::int64_t>(oh * g.stride - g.pad, 0);
      const std::int64_t h1 = std::min(oh * g.stride - g.pad + g.kernel, g.height);
      if (!uniform) {
        // Divisors vary per window (ceil mode, count_include_pad=false): window by window.
        for (std::int64_t ow = 0; ow < g.out_width; ++ow) {
          const S share = d[ow] / static_cast<S>(g.avg_divisor(oh, ow));
          const std::int64_t w0 = std::max<std::int64_t>(ow * g.stride - g.pad, 0);
          const std::int64_t w1 = std::min(ow * g.stride - g.pad + g.kernel, g.width);
          for (std::int64_t h = h0; h < h1; ++h)
            for (std::int64_t w = w0; w < w1; ++w) out[h * g.width + w] += share;
        }
        continue;
      }
      for (std::int64_t h = h0; h < h1; ++h) {
        S* row = out + h * g.width;
        // Within one tap j, distinct ow hit distinct columns, so this loop has no dependences.
        for (std::int64_t j = 0; j < g.kernel; ++j) {
          const std::int64_t offset = j - g.pad;
          std::int64_t lo, hi;
          detail::pool_valid_range(offset, g.stride, g.width, g.out_width, lo, hi);
          for (std::int64_t ow = lo; ow < hi; ++ow) row[ow * g.stride + offset] += d[ow] * scale;
        }
      }
    }
  });
}

// y (planes, H', W') <- adaptive average pooling of x (planes, H, W).
template <class S>
void adaptive_avg_pool2d_forward(Cpu, const AdaptivePool2dGeometry& g, std::int64_t planes, const S* x, S* y) {
  using G = AdaptivePool2dGeometry;
  const std::int64_t work = planes * std::max(g.in_plane(), g.out_plane());
  detail::parallel_for(planes, work > detail::kPoolParallelGrain, [&](std::int64_t p) {
    const S* in = x + p * g.in_plane();
    S* out = y + p * g.out_plane();
    for (std::int64_t oh = 0; oh < g.out_height; ++oh) {
      const std::int64_t h0 = G::start(oh, g.height, g.out_height), h1 = G::end(oh, g.height, g.out_height);
      for (std::int64_t ow = 0; ow < g.out_width; ++ow) {
        const std::int64_t w0 = G::start(ow, g.width, g.out_width), w1 = G::end(ow, g.width, g.out_width);
        S sum = 0;
        for (std::int64_t h = h0; h < h1; ++h)
          for (std::int64_t w = w0; w < w1; ++w) sum += in[h * g.width + w];
        out[oh * g.out_width + ow] = sum / static_cast<S>(h1 - h0) / static_cast<S>(w1 - w0);
      }
    }
  });
}

// dx (planes, H, W) = each dy[oh, ow] / (rows cols) added over its window (overwrites dx; windows
// overlap when H' does not divide H).
template <class S>
void adaptive_avg_pool2d_backward(Cpu, const AdaptivePool2dGeometry& g, std::int64_t planes, const S* dy, S* dx) {
  using G = AdaptivePool2dGeometry;
  const std::int64_t work = planes * std::max(g.in_plane(), g.out_plane());
  detail::parallel_for(planes, work > detail::kPoolParallelGrain, [&](std::int64_t p) {
    S* out = dx + p * g.in_plane();
    const S* d = dy + p * g.out_plane();
    std::fill(out, out + g.in_plane(), S(0));
    for (std::int64_t oh = 0; oh < g.out_height; ++oh) {
      const std::int64_t h0 = G::start(oh, g.height, g.out_height), h1 = G::end(oh, g.height, g.out_height);
      for (std::int64_t ow = 0; ow < g.out_width; ++ow) {
        const std::int64_t w0 = G::start(ow, g.width, g.out_width), w1 = G::end(ow, g.width, g.out_width);
        const S share = d[oh * g.out_width + ow] / static_cast<S>(h1 - h0) / static_cast<S>(w1 - w0);
        for (std::int64_t h = h0; h < h1; ++h)
          for (std::int64_t w = w0; w < w1; ++w) out[h * g.width + w] += share;
      }
    }
  });
}

// y (planes) = mean of each plane of x (planes, plane).
template <class S>
void global_avg_pool_forward(Cpu, std::int64_t planes, std::int64_t plane, const S* x, S* y) {
  const S scale = S(1) / static_cast<S>(plane);
  detail::parallel_for(planes, planes * plane > detail::kPoolParallelGrain, [&](std::int64_t p) {
    const S* in = x + p * plane;
    S sum = 0;
    for (std::int64_t i = 0; i < plane; ++i) sum += in[i];
    y[p] = sum * scale;
  });
}

// dx (planes, plane) = dy[p] / plane on plane p.
template <class S>
void global_avg_pool_backward(Cpu, std::int64_t planes, std::int64_t plane, const S* dy, S* dx) {
  const S scale = S(1) / static_cast<S>(plane);
  detail::parallel_for(planes, planes * plane > detail::kPoolParallelGrain,
                       [&](std::int64_t p) { std::fill(dx + p * plane, dx + (p + 1) * plane, dy[p] * scale); });
}

// Channels last: y (n, c) = mean over the plane of x (n, plane, c); dx (n, plane, c) = dy / plane.
// The sums run over the plane in order, as global_avg_pool_forward's, so y is the same.
template <class S>
void global_avg_pool_channels_last_forward(Cpu, std::int64_t n, std::int64_t c, std::int64_t plane, const S* x, S* y) {
  const S scale = S(1) / static_cast<S>(plane);
  detail::parallel_for(n, n * c * plane > detail::kPoolParallelGrain, [&](std::int64_t i) {
    S* out = y + i * c;
    std::fill(out, out + c, S(0));
    for (std::int64_t k = 0; k < plane; ++k) {
      const S* row = x + (i * plane + k) * c;
#pragma omp simd
      for (std::int64_t ch = 0; ch < c; ++ch) out[ch] += row[ch];
    }
    for (std::int64_t ch = 0; ch < c; ++ch) out[ch] *= scale;
  });
}
template <class S>
void global_avg_pool_channels_last_backward(Cpu, std::int64_t n, std::int64_t c, std::int64_t plane, const S* dy,
                                            S* dx) {
  const S scale = S(1) / static_cast<S>(plane);
  detail::parallel_for(n, n * c * plane > detail::kPoolParallelGrain, [&](std::int64_t i) {
    for (std::int64_t k = 0; k < plane; ++k) {
      S* row = dx + (i * plane + k) * c;
#pragma omp simd
      for (std::int64_t ch = 0; ch < c; ++ch) row[ch] = dy[i * c + ch] * scale;
    }
  });
}

// Compiled once in compiled-kernels mode (kernels/cpu/compiled.hpp).
#define TESSERA_CPU_POOL_INSTANCES(PREFIX, S)                                                                       \
  PREFIX template void max_pool2d_forward<S>(Cpu, const Pool2dGeometry&, std::int64_t, const S*, S*, std::int32_t*); \
  PREFIX template void max_pool2d_backward<S>(Cpu, const Pool2dGeometry&, std::int64_t, const S*,                    \
                                              const std::int32_t*, S*);                                              \
  PREFIX template void avg_pool2d_forward<S>(Cpu, const Pool2dGeometry&, std::int64_t, const S*, S*);                \
  PREFIX template void avg_pool2d_backward<S>(Cpu, const Pool2dGeometry&, std::int64_t, const S*, S*);               \
  PREFIX template void adaptive_avg_pool2d_forward<S>(Cpu, const AdaptivePool2dGeometry&, std::int64_t, const S*, S*); \
  PREFIX template void adaptive_avg_pool2d_backward<S>(Cpu, const AdaptivePool2dGeometry&, std::int64_t, const S*,     \
                                                       S*);                                                         \
  PREFIX template void global_avg_pool_forward<S>(Cpu, std::int64_t, std::int64_t, const S*, S*);                    \
  PREFIX template void global_avg_pool_backward<S>(Cpu, std::int64_t, std::int64_t, const S*, S*);                   \
  PREFIX template void global_avg_pool_channels_last_forward<S>(Cpu, std::int64_t, std::int64_t, std::int64_t,       \
                                                                const S*, S*);                                       \
  PREFIX template void global_avg_pool_channels_last_backward<S>(Cpu, std::int64_t, std::int64_t, std::int64_t,      \
                                                                 const S*, S*);
TESSERA_CPU_KERNEL_INSTANCES(TESSERA_CPU_POOL_INSTANCES)

}  // namespace tessera

TESSERA_SIMD_CODE_END
