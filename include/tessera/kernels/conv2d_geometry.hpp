// A convolution's geometry (shapes, strides, padding) and the CPU kernel's blocking of it: plain
// arithmetic, no Eigen, so both the CPU kernel (kernels/cpu/conv2d.hpp) and the GPU one
// (kernels/cuda/conv2d.cuh) and the Conv2d layer in either kind of translation unit share it.
#pragma once

#include <algorithm>
#include <cstdint>

#include "tessera/device/cpu.hpp"

namespace tessera {

// Output extent of a convolution or pooling window along one axis; 0 when the window does not fit.
inline std::int64_t conv_output_extent(std::int64_t in, std::int64_t kernel, std::int64_t stride, std::int64_t pad,
                                       std::int64_t dilation = 1) {
  const std::int64_t span = in + 2 * pad - dilation * (kernel - 1) - 1;
  return span < 0 ? 0 : span / stride + 1;
}

// Everything about one convolution except the batch size and the data.
struct Conv2dGeometry {
  std::int64_t channels = 0, height = 0, width = 0;  // input C, H, W
  std::int64_t out_channels = 0, groups = 1;         // K, G
  std::int64_t kernel_h = 1, kernel_w = 1, stride_h = 1, stride_w = 1;
  std::int64_t pad_h = 0, pad_w = 0, dilation_h = 1, dilation_w = 1;
  std::int64_t out_height = 0, out_width = 0;  // H', W'

  std::int64_t in_plane() const { return height * width; }
  std::int64_t out_plane() const { return out_height * out_width; }
  std::int64_t taps() const { return kernel_h * kernel_w; }
  std::int64_t col_rows() const { return channels * taps(); }                  // C kh kw
  std::int64_t group_col_rows() const { return channels / groups * taps(); }  // C/G kh kw
  std::int64_t group_out_channels() const { return out_channels / groups; }   // K/G
  std::int64_t weight_elements() const { return out_channels * group_col_rows(); }
  // 1x1, stride 1, no padding: one sample's input is its own column matrix.
  bool pointwise() const {
    return kernel_h == 1 && kernel_w == 1 && stride_h == 1 && stride_w == 1 && pad_h == 0 && pad_w == 0;
  }
};

// How the output positions are cut into per-thread blocks (see the header comment).
struct Conv2dBlocking {
  std::int64_t samples = 1;  // whole samples per block; when 1, a block may be a band of rows
  std::int64_t rows = 1;     // output rows per band (out_height when blocks are whole samples)
  std::int64_t threads = 1;  // threads the workspace was sized for
  bool parallel_backward = false;  // sample groups split over threads, each with a private dw

  std::int64_t bands(const Conv2dGeometry& g) const { return (g.out_height + rows - 1) / rows; }
  std::int64_t groups(std::int64_t batch) const { return (batch + samples - 1) / samples; }
  std::int64_t max_columns(const Conv2dGeometry& g) const { return samples * rows * g.out_width; }
  bool direct(const Conv2dGeometry& g) const { return g.pointwise() && samples == 1; }

  // Per-thread buffers: col (C kh kw, columns) unless direct, and the (K, columns) staging
  // buffer of multi-sample blocks; then (threads - 1) private dw accumulators for backward.
  std::int64_t col_elements(const Conv2dGeometry& g) const {
    return direct(g) ? 0 : g.col_rows() * max_columns(g);
  }
  std::int64_t stage_elements(const Conv2dGeometry& g) const {
    return samples == 1 ? 0 : g.out_channels * max_columns(g);
  }
  std::int64_t thread_elements(const Conv2dGeometry& g) const { return col_elements(g) + stage_elements(g); }
  std::int64_t workspace_elements(const Conv2dGeometry& g, bool backward) const {
    return threads * thread_elements(g) + (backward && parallel_backward ? (threads - 1) * g.weight_elements() : 0);
  }
};

namespace detail {

// A block's column buffer stays in the per-core L2 cache (2 MiB on the machines we tune for, with
// room left for gemm's packed panels); below kMinBlockColumns the product gets too narrow.
constexpr std::int64_t kBlockBytes = 512 * 1024;
constexpr std::int64_t kMinBlockColumns = 256;
// Cap on the private dw accumulators of one layer (threads - 1 copies of its weight): beyond it
// (many threads, large late-stage weights) backward runs its gemms parallel inside instead.
constexpr std::int64_t kMaxPrivateGradientBytes = std::int64_t{32} << 20;
// Below this many elements of work a loop runs on one thread: waking the team would cost more.
constexpr std::int64_t kParallelGrain = 32768;

// Range [lo, hi) of output columns ow whose tap ow * stride + offset lies inside [0, extent).
inline void valid_output_range(std::int64_t offset, std::int64_t stride, std::int64_t extent, std::int64_t out,
                               std::int64_t& lo, std::int64_t& hi) {
  lo = offset >= 0 ? 0 : (-offset + stride - 1) / stride;
  hi = extent - 1 - offset < 0 ? 0 : (extent - 1 - offset) / stride + 1;
  lo = std::min(lo, out);
  hi = std::clamp(hi, lo, out);
}

}  // namespace detail

// Blocking for a batch: blocks of about kBlockBytes of columns (or `block_columns` columns when
// positive: tests and tuning), as bands of rows on large images, else as groups of whole samples
// whose number is rounded to a multiple of the threads so that backward (one group per thread at
// a time) stays balanced. Backward splits the groups over the threads when there are enough of
// them and the private dw copies fit in kMaxPrivateGradientBytes.
inline Conv2dBlocking conv2d_blocking(const Conv2dGeometry& g, std::int64_t batch, std::int64_t scalar_bytes,
                                      std::int64_t block_columns = 0) {
  Conv2dBlocking b;
  b.threads = Cpu::num_threads();
  const std::int64_t target =
      block_columns > 0
          ? block_columns
          : std::max(detail::kMinBlockColumns, detail::kBlockBytes / std::max<std::int64_t>(g.col_rows() * scalar_bytes, 1));
  const std::int64_t plane = std::max<std::int64_t>(g.out_plane(), 1);
  b.rows = std::max<std::int64_t>(g.out_height, 1);
  if (plane > target) {
    b.rows = std::clamp<std::int64_t>(target / std::max<std::int64_t>(g.out_width, 1), 1, b.rows);
  } else {
    // The largest group size up to target / plane whose number of groups divides evenly among the
    // threads (64 samples in groups of 5 make 13 groups: one thread would do 7, the other 6).
    const std::int64_t most = std::clamp<std::int64_t>(target / plane, 1, std::max<std::int64_t>(batch, 1));
    b.samples = most;
    for (std::int64_t s = most; s >= 1; --s)
      if (((batch + s - 1) / s) % b.threads == 0) {
        b.samples = s;
        break;
      }
    if (b.samples == most && ((batch + most - 1) / most) % b.threads != 0) {
      std::int64_t groups = (batch + most - 1) / most;
      groups = (groups + b.threads - 1) / b.threads * b.threads;
      b.samples = std::max<std::int64_t>(1, (batch + groups - 1) / groups);
    }
  }
  b.parallel_backward = b.threads > 1 && b.groups(batch) >= b.threads &&
                        (b.threads - 1) * g.weight_elements() * scalar_bytes <= detail::kMaxPrivateGradientBytes;
  return b;
}

}  // namespace tessera
