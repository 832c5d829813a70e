// Pooling on the GPU: the Cuda overloads of kernels/cpu/pool.hpp, same semantics (see there), in
// either memory format: a thread's element is found in memory order and its neighbours through
// Pool2dGeometry::locate and offset, so in channels last (NHWC) a warp reads 32 neighbouring
// channels of one pixel.
// Forward: one thread per output element, the window visited in row-major order so the argmax
// (first maximum, NaN wins) is PyTorch's. Backward: one thread per *input* element gathering from
// the windows that cover it (max: those whose argmax is this element), so no atomics are needed and
// the sums run in a fixed order. Average pooling divides each window by its own divisor
// (Pool2dGeometry::avg_divisor), which covers ceil mode, count_include_pad and divisor_override.
#pragma once

#include <cstdint>

#include "tessera/kernels/cpu/pool.hpp"
#include "tessera/kernels/cuda/launch.cuh"
#include "tessera/kernels/cuda/reduce.cuh"

namespace tessera {

namespace cuda_detail {

// Output rows (or columns) [lo, hi) whose window, of size k at stride s after padding p, covers
// input row h.
__device__ inline void covering_windows(std::int64_t h, std::int64_t k, std::int64_t s, std::int64_t p,
                                        std::int64_t out, std::int64_t& lo, std::int64_t& hi) {
  const std::int64_t top = h + p - k + 1;  // smallest oh with oh s + k - 1 >= h + p
  lo = top <= 0 ? 0 : (top + s - 1) / s;
  hi = (h + p) / s + 1;
  if (hi > out) hi = out;
}

template <class S>
__global__ void max_pool_forward_kernel(Pool2dGeometry g, std::int64_t planes, const S* x, S* y,
                                        std::int32_t* argmax) {
  TESSERA_CUDA_FOR(o, planes * g.out_plane()) {
    std::int64_t p, oh, ow;
    g.locate(o, g.out_height, g.out_width, p, oh, ow);
    const std::int64_t h0 = max(oh * g.stride - g.pad, std::int64_t(0)), h1 = min(oh * g.stride - g.pad + g.kernel, g.height);
    const std::int64_t w0 = max(ow * g.stride - g.pad, std::int64_t(0)), w1 = min(ow * g.stride - g.pad + g.kernel, g.width);
    S best = -INFINITY;
    std::int32_t at = static_cast<std::int32_t>(h0 * g.width + w0);
    for (std::int64_t h = h0; h < h1; ++h)
      for (std::int64_t w = w0; w < w1; ++w) {
        const S v = x[g.in_offset(p, h, w)];
        if (v > best || v != v) {
          best = v;
          at = static_cast<std::int32_t>(h * g.width + w);
        }
      }
    y[o] = best;
    if (argmax != nullptr) argmax[o] = at;  // null: Mode::Inference keeps none
  }
}

template <class S>
__global__ void max_pool_backward_kernel(Pool2dGeometry g, std::int64_t planes, const S* dy, const std::int32_t* argmax,
                                         S* dx) {
  TESSERA_CUDA_FOR(e, planes * g.in_plane()) {
    std::int64_t p, h, w;
    g.locate(e, g.height, g.width, p, h, w);
    std::int64_t oh0, oh1, ow0, ow1;
    covering_windows(h, g.kernel, g.stride, g.pad, g.out_height, oh0, oh1);
    covering_windows(w, g.kernel, g.stride, g.pad, g.out_width, ow0, ow1);
    const auto self = static_cast<std::int32_t>(h * g.width + w);
    S sum = 0;
    for (std::int64_t oh = oh0; oh < oh1; ++oh)
      for (std::int64_t ow = ow0; ow < ow1; ++ow) {
        const std::int64_t o = g.out_offset(p, oh, ow);
        if (argmax[o] == self) sum += dy[o];
      }
    dx[e] = sum;
  }
}

template <class S>
__global__ void avg_pool_forward_kernel(Pool2dGeometry g, std::int64_t planes, const S* x, S* y) {
  TESSERA_CUDA_FOR(o, planes * g.out_plane()) {
    std::int64_t p, oh, ow;
    g.locate(o, g.out_height, g.out_width, p, oh, ow);
    const std::int64_t h0 = max(oh * g.stride - g.pad, std::int64_t(0)), h1 = min(oh * g.stride - g.pad + g.kernel, g.height);
    const std::int64_t w0 = max(ow * g.stride - g.pad, std::int64_t(0)), w1 = min(ow * g.stride - g.pad + g.kernel, g.width);
    S sum = 0;
    for (std::int64_t h = h0; h < h1; ++h)
      for (std::int64_t w = w0; w < w1; ++w) sum += x[g.in_offset(p, h, w)];
    // 1 / k^2 times the sum under the default options, as on the CPU.
    y[o] = g.uniform_avg_divisor() ? sum * (S(1) / S(g.avg_divisor(0, 0))) : sum / S(g.avg_divisor(oh, ow));
  }
}

template <class S>
__global__ void avg_pool_backward_kernel(Pool2dGeometry g, std::int64_t planes, const S* dy, S* dx) {
  const bool uniform = g.uniform_avg_divisor();
  const S scale = S(1) / S(g.avg_divisor(0, 0));
  TESSERA_CUDA_FOR(e, planes * g.in_plane()) {
    std::int64_t p, h, w;
    g.locate(e, g.height, g.width, p, h, w);
    std::int64_t oh0, oh1, ow0, ow1;
    covering_windows(h, g.kernel, g.stride, g.pad, g.out_height, oh0, oh1);
    covering_windows(w, g.kernel, g.stride, g.pad, g.out_width, ow0, ow1);
    S sum = 0;
    for (std::int64_t oh = oh0; oh < oh1; ++oh)
      for (std::int64_t ow = ow0; ow < ow1; ++ow) {
        const S d = dy[g.out_offset(p, oh, ow)];
        sum += uniform ? d * scale : d / S(g.avg_divisor(oh, ow));
      }
    dx[e] = sum;
  }
}

template <class S>
__global__ void adaptive_avg_pool_forward_kernel(AdaptivePool2dGeometry g, std::int64_t planes, const S* x, S* y) {
  using G = AdaptivePool2dGeometry;
  TESSERA_CUDA_FOR(o, planes * g.out_plane()) {
    const std::int64_t p = o / g.out_plane(), oh = (o % g.out_plane()) / g.out_width, ow = o % g.out_width;
    const S* in = x + p * g.in_plane();
    const std::int64_t h0 = G::start(oh, g.height, g.out_height), h1 = G::end(oh, g.height, g.out_height);
    const std::int64_t w0 = G::start(ow, g.width, g.out_width), w1 = G::end(ow, g.width, g.out_width);
    S sum = 0;
    for (std::int64_t h = h0; h < h1; ++h)
      for (std::int64_t w = w0; w < w1; ++w) sum += in[h * g.width + w];
    y[o] = sum / S(h1 - h0) / S(w1 - w0);
  }
}

// Output indices [lo, hi) along one axis whose adaptive window [start, end) covers input index i:
// start(o) <= i  <=>  o < ceil((i + 1) out / in);  end(o) > i  <=>  o >= floor(i out / in).
__device__ inline void adaptive_covering_windows(std::int64_t i, std::int64_t in, std::int64_t out,
                                                 std::int64_t& lo, std::int64_t& hi) {
  lo = i * out / in;
  hi = ((i + 1) * out + in - 1) / in;
  if (hi > out) hi = out;
}

template <class S>
__global__ void adaptive_avg_pool_backward_kernel(AdaptivePool2dGeometry g, std::int64_t planes, const S* dy, S* dx) {
  using G = AdaptivePool2dGeometry;
  TESSERA_CUDA_FOR(e, planes * g.in_plane()) {
    const std::int64_t p = e / g.in_plane(), h = (e % g.in_plane()) / g.width, w = e % g.width;
    std::int64_t oh0, oh1, ow0, ow1;
    adaptive_covering_windows(h, g.height, g.out_height, oh0, oh1);
    adaptive_covering_windows(w, g.width, g.out_width, ow0, ow1);
    S sum = 0;
    for (std::int64_t oh = oh0; oh < oh1; ++oh) {
      const S rows = S(G::end(oh, g.height, g.out_height) - G::start(oh, g.height, g.out_height));
      for (std::int64_t ow = ow0; ow < ow1; ++ow) {
        const S cols = S(G::end(ow, g.width, g.out_width) - G::start(ow, g.width, g.out_width));
        sum += dy[p * g.out_plane() + oh * g.out_width + ow] / rows / cols;
      }
    }
    dx[e] = sum;
  }
}

// One block per plane.
template <class S>
__global__ void global_avg_pool_forward_kernel(std::int64_t plane, const S* x, S* y) {
  __shared__ S scratch[32];
  const S* in = x + static_cast<std::int64_t>(blockIdx.x) * plane;
  S sum = 0;
  for (std::int64_t i = threadIdx.x; i < plane; i += blockDim.x) sum += in[i];
  sum = block_reduce<false>(sum, scratch);
  if (threadIdx.x == 0) y[blockIdx.x] = sum * (S(1) / S(plane));
}

template <class S>
__global__ void global_avg_pool_backward_kernel(std::int64_t planes, std::int64_t plane, const S* dy, S* dx) {
  const S scale = S(1) / S(plane);
  TESSERA_CUDA_FOR(e, planes * plane) dx[e] = dy[e / plane] * scale;
}

// Channels last: y (n, c) = mean over the plane of x (n, plane, c), one thread per (n, c), the
// plane summed in order (as the CPU does); neighbouring threads read neighbouring channels.
template <class S>
__global__ void global_avg_pool_channels_last_forward_kernel(std::int64_t n, std::int64_t c, std::int64_t plane,
                                                             const S* x, S* y) {
  TESSERA_CUDA_FOR(o, n * c) {
    const std::int64_t i = o / c, ch = o % c;
    S sum = 0;
    for (std::int64_t k = 0; k < plane; ++k) sum += x[(i * plane + k) * c + ch];
    y[o] = sum * (S(1) / S(plane));
  }
}
template <class S>
__global__ void global_avg_pool_channels_last_backward_kernel(std::int64_t n, std::int64_t c, std::int64_t plane,
                                                              const S* dy, S* dx) {
  const S scale = S(1) / S(plane);
  TESSERA_CUDA_FOR(e, n * plane * c) dx[e] = dy[(e / (plane * c)) * c + e % c] * scale;
}

}  // namespace cuda_detail

template <class S>
void global_avg_pool_channels_last_forward(Cuda, std::int64_t n, std::int64_t c, std::int64_t plane, const S* x,
                                           S* y) {
  TESSERA_CUDA_LAUNCH(cuda_detail::global_avg_pool_channels_last_forward_kernel<S>, n * c, n, c, plane, x, y);
}
template <class S>
void global_avg_pool_channels_last_backward(Cuda, std::int64_t n, std::int64_t c, std::int64_t plane, const S* dy,
                                            S* dx) {
  TESSERA_CUDA_LAUNCH(cuda_detail::global_avg_pool_channels_last_backward_kernel<S>, n * plane * c, n, c, plane, dy,
                      dx);
}

template <class S>
void max_pool2d_forward(Cuda, const Pool2dGeometry& g, std::int64_t planes, const S* x, S* y, std::int32_t* argmax) {
  TESSERA_CUDA_LAUNCH(cuda_detail::max_pool_forward_kernel<S>, planes * g.out_plane(), g, planes, x, y, argmax);
}
template <class S>
void max_pool2d_backward(Cuda, const Pool2dGeometry& g, std::int64_t planes, const S* dy, const std::int32_t* argmax,
                         S* dx) {
  TESSERA_CUDA_LAUNCH(cuda_detail::max_pool_backward_kernel<S>, planes * g.in_plane(), g, planes, dy, argmax, dx);
}
template <class S>
void avg_pool2d_forward(Cuda, const Pool2dGeometry& g, std::int64_t planes, const S* x, S* y) {
  TESSERA_CUDA_LAUNCH(cuda_detail::avg_pool_forward_kernel<S>, planes * g.out_plane(), g, planes, x, y);
}
template <class S>
void avg_pool2d_backward(Cuda, const Pool2dGeometry& g, std::int64_t planes, const S* dy, S* dx) {
  TESSERA_CUDA_LAUNCH(cuda_detail::avg_pool_backward_kernel<S>, planes * g.in_plane(), g, planes, dy, dx);
}
template <class S>
void adaptive_avg_pool2d_forward(Cuda, const AdaptivePool2dGeometry& g, std::int64_t planes, const S* x, S* y) {
  TESSERA_CUDA_LAUNCH(cuda_detail::adaptive_avg_pool_forward_kernel<S>, planes * g.out_plane(), g, planes, x, y);
}
template <class S>
void adaptive_avg_pool2d_backward(Cuda, const AdaptivePool2dGeometry& g, std::int64_t planes, const S* dy, S* dx) {
  TESSERA_CUDA_LAUNCH(cuda_detail::adaptive_avg_pool_backward_kernel<S>, planes * g.in_plane(), g, planes, dy, dx);
}
template <class S>
void global_avg_pool_forward(Cuda, std::int64_t planes, std::int64_t plane, const S* x, S* y) {
  if (planes == 0) return;
  cuda_detail::global_avg_pool_forward_kernel<S><<<static_cast<unsigned>(planes), cuda_detail::kThreads, 0,
                                                   Cuda::stream()>>>(plane, x, y);
  TESSERA_CUDA_CHECK(cudaGetLastError());
}
template <class S>
void global_avg_pool_backward(Cuda, std::int64_t planes, std::int64_t plane, const S* dy, S* dx) {
  TESSERA_CUDA_LAUNCH(cuda_detail::global_avg_pool_backward_kernel<S>, planes * plane, planes, plane, dy, dx);
}

}  // namespace tessera
