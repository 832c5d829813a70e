// Elementwise kernels on flat arrays of n values (activations, dropout).
//
//   relu_forward      y = max(x, 0); NaN stays NaN (torch.relu)
//   relu_backward     dx = dy * (y > 0), and dy where y is NaN (torch's threshold_backward)   (from the output)
//   gelu_forward      y = x Phi(x) = 0.5 x (1 + erf(x / sqrt 2))      (exact form, PyTorch's default)
//   gelu_backward     dx = dy (Phi(x) + x phi(x)),  phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
//   gelu_tanh_forward y = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)     (approximate='tanh')
//   gelu_tanh_backward dx = dy (0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 0.044715 x^2)),  t = tanh(u)
//   dropout_mask      mask_i = keep_i / (1 - p), keep_i ~ Bernoulli(1 - p), drawn in order from rng
//   multiply          out = a * b
//   add_relu_backward out = (a + b) where y > 0 (or NaN), else 0: add, then relu_backward on y
//
// Loops are contiguous (the compiler vectorizes them) and OpenMP-parallel above a size threshold.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <numbers>

#include "tessera/core/random.hpp"
#include "tessera/device/cpu.hpp"
#include "tessera/kernels/cpu/compiled.hpp"
#include "tessera/kernels/cpu/fast_exp.hpp"

namespace tessera {

namespace detail {
// Below this many elements the OpenMP fork costs more than it saves.
inline constexpr std::int64_t kElementwiseParallelThreshold = 1 << 15;
}

// y = f(x) and dx = dy * f'(x, y) with a user's per-element functor (Pointwise layers with
// stateful ops, e.g. LeakyReLU's slope): op.value(x) and op.derivative(x, y).
template <class S, class Op>
void map_forward(Cpu, const Op& op, const S* x, std::int64_t n, S* y) {
  detail::parallel_for_simd(n, n >= detail::kElementwiseParallelThreshold,
                            [&](std::int64_t i) { y[i] = op.value(x[i]); });
}
template <class S, class Op>
void map_backward(Cpu, const Op& op, const S* dy, const S* x, const S* y, std::int64_t n, S* dx) {
  detail::parallel_for_simd(n, n >= detail::kElementwiseParallelThreshold,
                            [&](std::int64_t i) { dx[i] = dy[i] * op.derivative(x[i], y[i]); });
}

template <class S>
void relu_forward(Cpu, const S* x, std::int64_t n, S* y) {
  detail::parallel_for_simd(n, n >= detail::kElementwiseParallelThreshold, [&](std::int64_t i) {
    y[i] = x[i] < S(0) ? S(0) : x[i];  // NaN passes through, as in torch.relu
  });
}

template <class S>
void relu_backward(Cpu, const S* dy, const S* y, std::int64_t n, S* dx) {
  detail::parallel_for_simd(n, n >= detail::kElementwiseParallelThreshold, [&](std::int64_t i) {
    // dy[i] read whatever y[i] is: then this is a select, which SSE2 vectorizes; written as
    // `y[i] <= 0 ? 0 : dy[i]`, the load is conditional, and only a target with masked loads
    // (AVX-512) vectorized it: a portable build ran it as a branch per element.
    const S g = dy[i];
    dx[i] = y[i] <= S(0) ? S(0) : g;
  });
}

template <class S>
void gelu_forward(Cpu, const S* x, std::int64_t n, S* y) {
  const S inv_sqrt2 = static_cast<S>(std::numbers::sqrt2 / 2);
  detail::parallel_for(n, n >= detail::kElementwiseParallelThreshold / 8,
                       [&](std::int64_t i) { y[i] = S(0.5) * x[i] * (S(1) + std::erf(x[i] * inv_sqrt2)); });
}

template <class S>
void gelu_backward(Cpu, const S* dy, const S* x, std::int64_t n, S* dx) {
  const S inv_sqrt2 = static_cast<S>(std::numbers::sqrt2 / 2);
  const S inv_sqrt_2pi = static_cast<S>(std::numbers::inv_sqrtpi * std::numbers::sqrt2 / 2);
  detail::parallel_for(n, n >= detail::kElementwiseParallelThreshold / 8, [&](std::int64_t i) {
    const S v = x[i];
    const S cdf = S(0.5) * (S(1) + std::erf(v * inv_sqrt2));
    const S pdf = inv_sqrt_2pi * std::exp(S(-0.5) * v * v);
    dx[i] = dy[i] * (cdf + v * pdf);
  });
}

namespace detail {
// 1 + tanh(u) without cancellation where tanh(u) is near -1: with e = exp(-2|u|),
// 1 + tanh(u) = 2 / (1 + e) for u >= 0 and 2e / (1 + e) for u < 0 (|u| capped at 43, where e is
// float's smallest normal and 1 + tanh(u) rounds to 0 or 2 anyway).
inline float one_plus_tanh(float u) {
  const float e = exp_nonpositive(-2.0f * std::min(std::abs(u), 43.0f));
  const float q = 2.0f / (1.0f + e);
  return u >= 0.0f ? q : q * e;
}
template <class S>
S one_plus_tanh(S u) {
  return S(1) + std::tanh(u);  // float64: the library's, as torch's double kernels
}
inline constexpr double kGeluTanhScale = 0.7978845608028654;  // sqrt(2 / pi)
inline constexpr double kGeluTanhCubic = 0.044715;
}  // namespace detail

template <class S>
void gelu_tanh_forward(Cpu, const S* x, std::int64_t n, S* y) {
  const S k = S(detail::kGeluTanhScale), c = S(detail::kGeluTanhCubic);
  detail::parallel_for_simd(n, n >= detail::kElementwiseParallelThreshold, [&](std::int64_t i) {
    const S v = x[i];
    y[i] = S(0.5) * v * detail::one_plus_tanh(k * (v + c * v * v * v));
  });
}

template <class S>
void gelu_tanh_backward(Cpu, const S* dy, const S* x, std::int64_t n, S* dx) {
  const S k = S(detail::kGeluTanhScale), c = S(detail::kGeluTanhCubic);
  detail::parallel_for_simd(n, n >= detail::kElementwiseParallelThreshold, [&](std::int64_t i) {
    const S v = x[i];
    const S a = detail::one_plus_tanh(k * (v + c * v * v * v));  // 1 + t; 1 - t^2 = a (2 - a)
    dx[i] = dy[i] * (S(0.5) * a + S(0.5) * v * a * (S(2) - a) * k * (S(1) + S(3) * c * v * v));
  });
}

// Sequential in the rng (so a seed fixes the mask whatever the thread count). keep_i is
// u_i < 1 - p for u_i uniform in [0, 1) on the 53-bit grid, compared as integers.
template <class S>
void dropout_mask(Cpu, std::int64_t n, double p, Rng& rng, S* mask) {
  const auto threshold = static_cast<std::uint64_t>((1.0 - p) * 0x1.0p53);
  const S scale = static_cast<S>(1.0 / (1.0 - p));
  for (std::int64_t i = 0; i < n; ++i) mask[i] = (rng.next_u64() >> 11) < threshold ? scale : S(0);
}

template <class S>
void multiply(Cpu, const S* a, const S* b, std::int64_t n, S* out) {
  detail::parallel_for_simd(n, n >= detail::kElementwiseParallelThreshold,
                            [&](std::int64_t i) { out[i] = a[i] * b[i]; });
}

template <class S>
void add(Cpu, const S* a, const S* b, std::int64_t n, S* out) {
  detail::parallel_for_simd(n, n >= detail::kElementwiseParallelThreshold,
                            [&](std::int64_t i) { out[i] = a[i] + b[i]; });
}

// The residual join y = max(a + b, 0), fused so the sum is never stored: one pass over memory
// instead of two. Its backward is relu_backward on y.
template <class S>
void add_relu_forward(Cpu, const S* a, const S* b, std::int64_t n, S* y) {
  detail::parallel_for_simd(n, n >= detail::kElementwiseParallelThreshold, [&](std::int64_t i) {
    const S s = a[i] + b[i];
    y[i] = s < S(0) ? S(0) : s;
  });
}

// The residual join's backward taken on through the ReLU before it: out = a + b where y > 0 (and
// where y is NaN), 0 where y <= 0; the bits of add then relu_backward on y, in one pass over memory
// instead of two (layers/residual.hpp: a ResNet block's dL/dx masked by its input, the output of
// the block before, so that block skips its own relu_backward).
template <class S>
void add_relu_backward(Cpu, const S* a, const S* b, const S* y, std::int64_t n, S* out) {
  detail::parallel_for_simd(n, n >= detail::kElementwiseParallelThreshold, [&](std::int64_t i) {
    const S g = a[i] + b[i];  // read whatever y is: a select, as in relu_backward
    out[i] = y[i] <= S(0) ? S(0) : g;
  });
}

// Linear's bias: y (rows, cols) gets b (cols) in every row; db (cols) += the column sums of dy.
template <class S>
void broadcast_rows(Cpu, const S* b, std::int64_t rows, std::int64_t cols, S* y) {
  for (std::int64_t i = 0; i < rows; ++i) std::copy(b, b + cols, y + i * cols);
}
template <class S>
void add_column_sums(Cpu, const S* dy, std::int64_t rows, std::int64_t cols, S* db) {
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) db[j] += dy[i * cols + j];
}

// Mixed-precision loss scaling: g *= inv_scale, and *found_nonfinite = 1 if any element of g is
// inf or NaN (never reset here: the caller zeroes the flag once per step).
template <class S>
void unscale_and_flag(Cpu, S* g, std::int64_t n, S inv_scale, std::int32_t* found_nonfinite) {
  // Counted as a sum (parallel_sum): the number of non-finite elements.
  const std::int64_t bad = detail::parallel_sum<std::int64_t>(n, n >= detail::kElementwiseParallelThreshold,
                                                              [&](std::int64_t begin, std::int64_t end) {
    std::int64_t count = 0;
#pragma omp simd reduction(+ : count)
    for (std::int64_t i = begin; i < end; ++i) {
      count += !std::isfinite(g[i]);
      g[i] *= inv_scale;
    }
    return count;
  });
  if (bad) *found_nonfinite = 1;
}

// out = scale * x.
template <class S>
void scale_elements(Cpu, const S* x, std::int64_t n, S scale, S* out) {
  detail::parallel_for_simd(n, n >= detail::kElementwiseParallelThreshold,
                            [&](std::int64_t i) { out[i] = scale * x[i]; });
}

// A 16-bit wire (W: Half or BHalf; a sharded strategy's gathers and reductions): values rounded
// to W through float, read back through float, and added back through float.
template <class S, class W>
void cast_to_wire(Cpu, const S* x, std::int64_t n, W* out) {
  detail::parallel_for(n, n >= detail::kElementwiseParallelThreshold,
                       [&](std::int64_t i) { out[i] = W(static_cast<float>(x[i])); });
}
template <class S, class W>
void cast_from_wire(Cpu, const W* x, std::int64_t n, S* out) {
  detail::parallel_for(n, n >= detail::kElementwiseParallelThreshold,
                       [&](std::int64_t i) { out[i] = static_cast<S>(static_cast<float>(x[i])); });
}
template <class S, class W>
void add_from_wire(Cpu, const W* x, std::int64_t n, S* out) {
  detail::parallel_for(n, n >= detail::kElementwiseParallelThreshold,
                       [&](std::int64_t i) { out[i] += static_cast<S>(static_cast<float>(x[i])); });
}

// Strided blocks (pitches in elements): dst rows of `width` elements at dst_pitch apart get the
// src rows at src_pitch apart (copy_2d), or have them added (accumulate_2d). For gathering and
// scattering column slices (tensor parallelism).
template <class S>
void copy_2d(Cpu, S* dst, std::int64_t dst_pitch, const S* src, std::int64_t src_pitch, std::int64_t width,
             std::int64_t rows) {
  for (std::int64_t i = 0; i < rows; ++i) std::copy_n(src + i * src_pitch, width, dst + i * dst_pitch);
}
template <class S>
void accumulate_2d(Cpu, S* dst, std::int64_t dst_pitch, const S* src, std::int64_t src_pitch, std::int64_t width,
                   std::int64_t rows) {
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t k = 0; k < width; ++k) dst[i * dst_pitch + k] += src[i * src_pitch + k];
}
// y (rows, cols) += b (cols) in every row.
template <class S>
void add_broadcast_rows(Cpu, const S* b, std::int64_t rows, std::int64_t cols, S* y) {
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) y[i * cols + j] += b[j];
}

// Memory-format conversions (core/memory_format.hpp) of n images of c channels by hw pixels:
// nchw_to_nhwc writes y[(i hw + s) c + ch] = x[(i c + ch) hw + s], nhwc_to_nchw the inverse. Each
// image is a (c, hw) matrix transposed in tiles of 32 x 32, so both the reads and the writes stay
// within a few cache lines per tile.
namespace detail {
inline constexpr std::int64_t kTransposeTile = 32;
// y (cols, rows) = x (rows, cols) transposed, for one image.
template <class S>
void transpose_tiles(const S* x, std::int64_t rows, std::int64_t cols, S* y) {
  for (std::int64_t r0 = 0; r0 < rows; r0 += kTransposeTile)
    for (std::int64_t c0 = 0; c0 < cols; c0 += kTransposeTile) {
      const std::int64_t r1 = std::min(rows, r0 + kTransposeTile), c1 = std::min(cols, c0 + kTransposeTile);
      for (std::int64_t r = r0; r < r1; ++r)
        for (std::int64_t k = c0; k < c1; ++k) y[k * rows + r] = x[r * cols + k];
    }
}
}  // namespace detail
template <class S>
void nchw_to_nhwc(Cpu, std::int64_t n, std::int64_t c, std::int64_t hw, const S* x, S* y) {
  detail::parallel_for(n, n * c * hw > (1 << 16),
                       [&](std::int64_t i) { detail::transpose_tiles(x + i * c * hw, c, hw, y + i * c * hw); });
}
template <class S>
void nhwc_to_nchw(Cpu, std::int64_t n, std::int64_t c, std::int64_t hw, const S* x, S* y) {
  detail::parallel_for(n, n * c * hw > (1 << 16),
                       [&](std::int64_t i) { detail::transpose_tiles(x + i * c * hw, hw, c, y + i * c * hw); });
}

// Compiled once in compiled-kernels mode (kernels/cpu/compiled.hpp); map_forward/map_backward
// take the caller's functor and stay templates.
#define TESSERA_CPU_ELEMENTWISE_INSTANCES(PREFIX, S)                                                             \
  PREFIX template void relu_forward<S>(Cpu, const S*, std::int64_t, S*);                                       \
  PREFIX template void relu_backward<S>(Cpu, const S*, const S*, std::int64_t, S*);                            \
  PREFIX template void gelu_forward<S>(Cpu, const S*, std::int64_t, S*);                                       \
  PREFIX template void gelu_backward<S>(Cpu, const S*, const S*, std::int64_t, S*);                            \
  PREFIX template void gelu_tanh_forward<S>(Cpu, const S*, std::int64_t, S*);                                  \
  PREFIX template void gelu_tanh_backward<S>(Cpu, const S*, const S*, std::int64_t, S*);                       \
  PREFIX template void dropout_mask<S>(Cpu, std::int64_t, double, Rng&, S*);                                   \
  PREFIX template void multiply<S>(Cpu, const S*, const S*, std::int64_t, S*);                                 \
  PREFIX template void add<S>(Cpu, const S*, const S*, std::int64_t, S*);                                      \
  PREFIX template void add_relu_forward<S>(Cpu, const S*, const S*, std::int64_t, S*);                         \
  PREFIX template void add_relu_backward<S>(Cpu, const S*, const S*, const S*, std::int64_t, S*);              \
  PREFIX template void broadcast_rows<S>(Cpu, const S*, std::int64_t, std::int64_t, S*);                       \
  PREFIX template void add_column_sums<S>(Cpu, const S*, std::int64_t, std::int64_t, S*);                      \
  PREFIX template void unscale_and_flag<S>(Cpu, S*, std::int64_t, S, std::int32_t*);                           \
  PREFIX template void scale_elements<S>(Cpu, const S*, std::int64_t, S, S*);                                  \
  PREFIX template void copy_2d<S>(Cpu, S*, std::int64_t, const S*, std::int64_t, std::int64_t, std::int64_t);  \
  PREFIX template void accumulate_2d<S>(Cpu, S*, std::int64_t, const S*, std::int64_t, std::int64_t,          \
                                        std::int64_t);                                                         \
  PREFIX template void add_broadcast_rows<S>(Cpu, const S*, std::int64_t, std::int64_t, S*);                   \
  PREFIX template void nchw_to_nhwc<S>(Cpu, std::int64_t, std::int64_t, std::int64_t, const S*, S*);          \
  PREFIX template void nhwc_to_nchw<S>(Cpu, std::int64_t, std::int64_t, std::int64_t, const S*, S*);
TESSERA_CPU_KERNEL_INSTANCES(TESSERA_CPU_ELEMENTWISE_INSTANCES)

}  // namespace tessera
