// Elementwise CUDA kernels: the Cuda overloads of kernels/cpu/elementwise.hpp (same names, same
// arguments, same maths), plus fill and the bias broadcast/reduction of Linear. All run on the
// device's stream; none synchronizes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "tessera/core/half.hpp"
#include "tessera/core/random.hpp"
#include "tessera/kernels/cuda/launch.cuh"
#include "tessera/kernels/dropout_key.hpp"

namespace tessera {

namespace cuda_detail {

template <class S, class Op>
__global__ void map_forward_kernel(Op op, const S* x, std::int64_t n, S* y) {
  TESSERA_CUDA_FOR(i, n) y[i] = op.value(x[i]);
}
template <class S, class Op>
__global__ void map_backward_kernel(Op op, const S* dy, const S* x, const S* y, std::int64_t n, S* dx) {
  TESSERA_CUDA_FOR(i, n) dx[i] = dy[i] * op.derivative(x[i], y[i]);
}
template <class S>
__global__ void fill_kernel(S* p, std::int64_t n, S value) {
  TESSERA_CUDA_FOR(i, n) p[i] = value;
}
template <class S>
__global__ void relu_forward_kernel(const S* x, std::int64_t n, S* y) {
  TESSERA_CUDA_FOR(i, n) y[i] = x[i] < S(0) ? S(0) : x[i];  // NaN passes through, as in torch.relu
}
template <class S>
__global__ void relu_backward_kernel(const S* dy, const S* y, std::int64_t n, S* dx) {
  TESSERA_CUDA_FOR(i, n) dx[i] = y[i] <= S(0) ? S(0) : dy[i];
}
// y = x Phi(x) = x (1 + erf(x / sqrt 2)) / 2;  dy/dx = Phi(x) + x phi(x).
template <class S>
__global__ void gelu_forward_kernel(const S* x, std::int64_t n, S* y) {
  TESSERA_CUDA_FOR(i, n) y[i] = S(0.5) * x[i] * (S(1) + erf(x[i] * S(0.70710678118654752440)));
}
template <class S>
__global__ void gelu_backward_kernel(const S* dy, const S* x, std::int64_t n, S* dx) {
  TESSERA_CUDA_FOR(i, n) {
    const S v = x[i];
    const S cdf = S(0.5) * (S(1) + erf(v * S(0.70710678118654752440)));
    const S pdf = S(0.39894228040143267794) * exp(S(-0.5) * v * v);
    dx[i] = dy[i] * (cdf + v * pdf);
  }
}
template <class S>
__global__ void multiply_kernel(const S* a, const S* b, std::int64_t n, S* out) {
  TESSERA_CUDA_FOR(i, n) out[i] = a[i] * b[i];
}
template <class S>
__global__ void add_kernel(const S* a, const S* b, std::int64_t n, S* out) {
  TESSERA_CUDA_FOR(i, n) out[i] = a[i] + b[i];
}
template <class S>
__global__ void add_relu_backward_kernel(const S* a, const S* b, const S* y, std::int64_t n, S* out) {
  TESSERA_CUDA_FOR(i, n) out[i] = y[i] <= S(0) ? S(0) : a[i] + b[i];
}
template <class S>
__global__ void add_relu_forward_kernel(const S* a, const S* b, std::int64_t n, S* y) {
  TESSERA_CUDA_FOR(i, n) {
    const S s = a[i] + b[i];
    y[i] = s < S(0) ? S(0) : s;
  }
}

// SplitMix64 of (seed, i): a counter-based stream, so every element draws independently of the
// launch shape and a seed fixes the mask. keep_i is u_i < 1 - p on the 53-bit grid, as on the CPU
// (whose masks come from one sequential stream instead: the two devices' masks differ, their
// distribution does not).
__device__ inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
template <class S>
__global__ void dropout_mask_kernel(std::int64_t n, std::uint64_t seed, std::uint64_t threshold, S scale, S* mask) {
  TESSERA_CUDA_FOR(i, n) {
    const std::uint64_t u = splitmix64(seed ^ splitmix64(static_cast<std::uint64_t>(i)));
    mask[i] = (u >> 11) < threshold ? scale : S(0);
  }
}

// y = x * mask of a (B, T, C) activation, the mask a function of each element's global position
// (kernels/dropout_key.hpp): the very values the CPU's dropout_rows gives.
template <class S>
__global__ void dropout_rows_kernel(DropoutKey key, std::int64_t t, std::int64_t width, std::int64_t n, const S* x,
                                    S* y) {
  TESSERA_CUDA_FOR(i, n) {
    const std::int64_t bt = i / width;
    y[i] = x[i] * static_cast<S>(key.mask(key.row(bt / t, 0, bt % t), i % width));
  }
}

// y (n, out): every row a copy of b (out).
template <class S>
__global__ void broadcast_rows_kernel(const S* b, std::int64_t rows, std::int64_t cols, S* y) {
  TESSERA_CUDA_FOR(i, rows * cols) y[i] = b[i % cols];
}
// db (cols) += sum over rows of dy (rows, cols): one thread per column, reading down the column
// (coalesced across the warp, since neighbouring threads read neighbouring columns).
template <class S>
__global__ void add_column_sums_kernel(const S* dy, std::int64_t rows, std::int64_t cols, S* db) {
  TESSERA_CUDA_FOR(j, cols) {
    S sum = 0;
    for (std::int64_t i = 0; i < rows; ++i) sum += dy[i * cols + j];
    db[j] += sum;
  }
}

template <class S>
__global__ void unscale_and_flag_kernel(S* g, std::int64_t n, S inv_scale, std::int32_t* found_nonfinite) {
  bool bad = false;
  TESSERA_CUDA_FOR(i, n) {
    bad = bad || !isfinite(g[i]);
    g[i] *= inv_scale;
  }
  if (bad) *found_nonfinite = 1;  // benign race: every writer stores the same value
}

template <class S>
__global__ void scale_elements_kernel(const S* x, std::int64_t n, S scale, S* out) {
  TESSERA_CUDA_FOR(i, n) out[i] = scale * x[i];
}

// The 16-bit wire, on the bits: Half and BHalf hold one std::uint16_t (core/half.hpp), converted
// with CUDA's round-to-nearest-even intrinsics, as the host's conversions round.
__device__ inline std::uint16_t float_to_wire_bits(float v, BHalf*) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
__device__ inline std::uint16_t float_to_wire_bits(float v, Half*) { return __half_as_ushort(__float2half_rn(v)); }
__device__ inline float wire_bits_to_float(std::uint16_t b, BHalf*) { return __bfloat162float(__ushort_as_bfloat16(b)); }
__device__ inline float wire_bits_to_float(std::uint16_t b, Half*) { return __half2float(__ushort_as_half(b)); }
template <class S, class W>
__global__ void cast_to_wire_kernel(const S* x, std::int64_t n, std::uint16_t* out) {
  TESSERA_CUDA_FOR(i, n) out[i] = float_to_wire_bits(static_cast<float>(x[i]), static_cast<W*>(nullptr));
}
template <class S, class W>
__global__ void cast_from_wire_kernel(const std::uint16_t* x, std::int64_t n, S* out) {
  TESSERA_CUDA_FOR(i, n) out[i] = static_cast<S>(wire_bits_to_float(x[i], static_cast<W*>(nullptr)));
}
template <class S, class W>
__global__ void add_from_wire_kernel(const std::uint16_t* x, std::int64_t n, S* out) {
  TESSERA_CUDA_FOR(i, n) out[i] += static_cast<S>(wire_bits_to_float(x[i], static_cast<W*>(nullptr)));
}

template <class S>
__global__ void accumulate_2d_kernel(S* dst, std::int64_t dst_pitch, const S* src, std::int64_t src_pitch,
                                     std::int64_t width, std::int64_t rows) {
  TESSERA_CUDA_FOR(e, width * rows) {
    const std::int64_t i = e / width, k = e % width;
    dst[i * dst_pitch + k] += src[i * src_pitch + k];
  }
}
template <class S>
__global__ void add_broadcast_rows_kernel(const S* b, std::int64_t rows, std::int64_t cols, S* y) {
  TESSERA_CUDA_FOR(i, rows * cols) y[i] += b[i % cols];
}

// y (cols, rows) = x (rows, cols) transposed, image blockIdx.z of `images`: tiles of 32 x 32
// staged in shared memory (one column of padding against bank conflicts), so that both the global
// reads and the writes are whole 128-byte rows of a warp.
inline constexpr int kTransposeTile = 32, kTransposeRows = 8;
template <class S>
__global__ void transpose_images_kernel(const S* x, std::int64_t rows, std::int64_t cols, S* y, bool accumulate) {
  __shared__ S tile[kTransposeTile][kTransposeTile + 1];
  const std::int64_t image = static_cast<std::int64_t>(blockIdx.z) * rows * cols;
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * kTransposeTile;
  const std::int64_t c0 = static_cast<std::int64_t>(blockIdx.x) * kTransposeTile;
  for (int k = threadIdx.y; k < kTransposeTile; k += kTransposeRows) {
    const std::int64_t r = r0 + k, c = c0 + threadIdx.x;
    if (r < rows && c < cols) tile[k][threadIdx.x] = x[image + r * cols + c];
  }
  __syncthreads();
  for (int k = threadIdx.y; k < kTransposeTile; k += kTransposeRows) {
    const std::int64_t c = c0 + k, r = r0 + threadIdx.x;
    if (r < rows && c < cols) {
      S& out = y[image + c * rows + r];
      out = accumulate ? out + tile[threadIdx.x][k] : tile[threadIdx.x][k];
    }
  }
}
// accumulate: y += the transpose (a gradient added back in another layout), else y = it.
template <class S>
void transpose_images(std::int64_t n, std::int64_t rows, std::int64_t cols, const S* x, S* y, bool accumulate = false) {
  if (n == 0 || rows == 0 || cols == 0) return;
  TESSERA_CHECK(n <= 65535 && (rows + kTransposeTile - 1) / kTransposeTile <= 65535, ArgumentError,
                "memory-format conversion of ", n, " images of ", rows, " x ", cols,
                ": more than 65535 images or row tiles for one launch");
  const dim3 blocks(static_cast<unsigned>((cols + kTransposeTile - 1) / kTransposeTile),
                    static_cast<unsigned>((rows + kTransposeTile - 1) / kTransposeTile), static_cast<unsigned>(n));
  transpose_images_kernel<S><<<blocks, dim3(kTransposeTile, kTransposeRows), 0, Cuda::stream()>>>(x, rows, cols, y,
                                                                                                  accumulate);
  TESSERA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace cuda_detail

// The user's functor is copied to the device by value (its members are its state); value and
// derivative must be TESSERA_HOST_DEVICE.
template <class S, class Op>
void map_forward(Cuda, const Op& op, const S* x, std::int64_t n, S* y) {
  TESSERA_CUDA_LAUNCH(cuda_detail::map_forward_kernel<S>, n, op, x, n, y);
}
template <class S, class Op>
void map_backward(Cuda, const Op& op, const S* dy, const S* x, const S* y, std::int64_t n, S* dx) {
  TESSERA_CUDA_LAUNCH(cuda_detail::map_backward_kernel<S>, n, op, dy, x, y, n, dx);
}

template <class S>
void fill_elements(Cuda, S* p, std::int64_t n, S value) {
  TESSERA_CUDA_LAUNCH(cuda_detail::fill_kernel<S>, n, p, n, value);
}
template <class S>
void relu_forward(Cuda, const S* x, std::int64_t n, S* y) {
  TESSERA_CUDA_LAUNCH(cuda_detail::relu_forward_kernel<S>, n, x, n, y);
}
template <class S>
void relu_backward(Cuda, const S* dy, const S* y, std::int64_t n, S* dx) {
  TESSERA_CUDA_LAUNCH(cuda_detail::relu_backward_kernel<S>, n, dy, y, n, dx);
}
template <class S>
void gelu_forward(Cuda, const S* x, std::int64_t n, S* y) {
  TESSERA_CUDA_LAUNCH(cuda_detail::gelu_forward_kernel<S>, n, x, n, y);
}
template <class S>
void gelu_backward(Cuda, const S* dy, const S* x, std::int64_t n, S* dx) {
  TESSERA_CUDA_LAUNCH(cuda_detail::gelu_backward_kernel<S>, n, dy, x, n, dx);
}
template <class S>
void multiply(Cuda, const S* a, const S* b, std::int64_t n, S* out) {
  TESSERA_CUDA_LAUNCH(cuda_detail::multiply_kernel<S>, n, a, b, n, out);
}
template <class S>
void add(Cuda, const S* a, const S* b, std::int64_t n, S* out) {
  TESSERA_CUDA_LAUNCH(cuda_detail::add_kernel<S>, n, a, b, n, out);
}
template <class S>
void add_relu_backward(Cuda, const S* a, const S* b, const S* y, std::int64_t n, S* out) {
  TESSERA_CUDA_LAUNCH(cuda_detail::add_relu_backward_kernel<S>, n, a, b, y, n, out);
}
template <class S>
void add_relu_forward(Cuda, const S* a, const S* b, std::int64_t n, S* y) {
  TESSERA_CUDA_LAUNCH(cuda_detail::add_relu_forward_kernel<S>, n, a, b, n, y);
}
// One draw from the layer's rng per call seeds the whole mask, so checkpoints that save the rng
// resume the same mask sequence.
template <class S>
void dropout_mask(Cuda, std::int64_t n, double p, Rng& rng, S* mask) {
  const auto threshold = static_cast<std::uint64_t>((1.0 - p) * 0x1.0p53);
  TESSERA_CUDA_LAUNCH(cuda_detail::dropout_mask_kernel<S>, n, n, rng.next_u64(), threshold, static_cast<S>(1.0 / (1.0 - p)),
                      mask);
}
template <class S>
void dropout_rows(Cuda, const DropoutKey& key, std::int64_t batch, std::int64_t t, std::int64_t width, const S* x,
                  S* y) {
  const std::int64_t n = batch * t * width;
  TESSERA_CUDA_LAUNCH(cuda_detail::dropout_rows_kernel<S>, n, key, t, width, n, x, y);
}
template <class S>
void broadcast_rows(Cuda, const S* b, std::int64_t rows, std::int64_t cols, S* y) {
  TESSERA_CUDA_LAUNCH(cuda_detail::broadcast_rows_kernel<S>, rows * cols, b, rows, cols, y);
}
template <class S>
void add_column_sums(Cuda, const S* dy, std::int64_t rows, std::int64_t cols, S* db) {
  TESSERA_CUDA_LAUNCH(cuda_detail::add_column_sums_kernel<S>, cols, dy, rows, cols, db);
}

template <class S>
void unscale_and_flag(Cuda, S* g, std::int64_t n, S inv_scale, std::int32_t* found_nonfinite) {
  TESSERA_CUDA_LAUNCH(cuda_detail::unscale_and_flag_kernel<S>, n, g, n, inv_scale, found_nonfinite);
}

template <class S>
void scale_elements(Cuda, const S* x, std::int64_t n, S scale, S* out) {
  TESSERA_CUDA_LAUNCH(cuda_detail::scale_elements_kernel<S>, n, x, n, scale, out);
}

template <class S, class W>
void cast_to_wire(Cuda, const S* x, std::int64_t n, W* out) {
  static_assert(sizeof(W) == sizeof(std::uint16_t), "a 16-bit wire type (Half, BHalf)");
  auto* const cast_to_wire_kernel = &cuda_detail::cast_to_wire_kernel<S, W>;
  TESSERA_CUDA_LAUNCH(cast_to_wire_kernel, n, x, n, reinterpret_cast<std::uint16_t*>(out));
}
template <class S, class W>
void cast_from_wire(Cuda, const W* x, std::int64_t n, S* out) {
  auto* const cast_from_wire_kernel = &cuda_detail::cast_from_wire_kernel<S, W>;
  TESSERA_CUDA_LAUNCH(cast_from_wire_kernel, n, reinterpret_cast<const std::uint16_t*>(x), n, out);
}
template <class S, class W>
void add_from_wire(Cuda, const W* x, std::int64_t n, S* out) {
  auto* const add_from_wire_kernel = &cuda_detail::add_from_wire_kernel<S, W>;
  TESSERA_CUDA_LAUNCH(add_from_wire_kernel, n, reinterpret_cast<const std::uint16_t*>(x), n, out);
}

template <class S>
void copy_2d(Cuda, S* dst, std::int64_t dst_pitch, const S* src, std::int64_t src_pitch, std::int64_t width,
             std::int64_t rows) {
  if (width == 0 || rows == 0) return;
  TESSERA_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch * sizeof(S), src, src_pitch * sizeof(S), width * sizeof(S),
                                       rows, cudaMemcpyDeviceToDevice, Cuda::stream()));
}
template <class S>
void accumulate_2d(Cuda, S* dst, std::int64_t dst_pitch, const S* src, std::int64_t src_pitch, std::int64_t width,
                   std::int64_t rows) {
  TESSERA_CUDA_LAUNCH(cuda_detail::accumulate_2d_kernel<S>, width * rows, dst, dst_pitch, src, src_pitch, width, rows);
}
template <class S>
void add_broadcast_rows(Cuda, const S* b, std::int64_t rows, std::int64_t cols, S* y) {
  TESSERA_CUDA_LAUNCH(cuda_detail::add_broadcast_rows_kernel<S>, rows * cols, b, rows, cols, y);
}

// Memory-format conversions (kernels/cpu/elementwise.hpp): each image a (c, hw) matrix transposed.
template <class S>
void nchw_to_nhwc(Cuda, std::int64_t n, std::int64_t c, std::int64_t hw, const S* x, S* y) {
  cuda_detail::transpose_images(n, c, hw, x, y);
}
template <class S>
void nhwc_to_nchw(Cuda, std::int64_t n, std::int64_t c, std::int64_t hw, const S* x, S* y) {
  cuda_detail::transpose_images(n, hw, c, x, y);
}

}  // namespace tessera
