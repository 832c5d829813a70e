// Batch normalization on the GPU: the Cuda overloads of kernels/cpu/batch_norm.hpp, same steps,
// same maths (see there), so SyncBatchNorm's all-reduces between them work on device memory with
// NCCL.
//
// Every pass over the activation (local sums, normalize, backward) runs on a grid of (C, splits)
// blocks: block (ch, j) takes channel ch of the images [j N / splits, (j + 1) N / splits), so the
// per-channel constants are read once per block, no thread divides to find its channel
// (detail::ChannelWalk), and a layer with few channels (64 at ResNet-50's first stage) still fills
// the GPU: its N images are split until there are about kTargetBlocks blocks. Where HW is a
// multiple of 16 / sizeof(S) and every pointer is 16-byte aligned, a thread loads and stores 16
// bytes at a time. Per-channel sums accumulate in double; with more than one split each block
// writes its partial sums and one more kernel adds them per channel in split order, so the result
// does not depend on timing (no atomics). Channels last (NHWC) has its own passes, below the
// planar ones (a channel's values are C apart there).
#pragma once

#include <algorithm>
#include <cstdint>

#include "tessera/kernels/channel_walk.hpp"
#include "tessera/kernels/cpu/batch_norm.hpp"
#include "tessera/kernels/cuda/launch.cuh"
#include "tessera/kernels/cuda/reduce.cuh"

namespace tessera {

namespace cuda_detail {

// Blocks a pass aims for: several per SM of any current GPU (132 on an H100 / H200), so that
// enough loads are in flight to reach the memory's bandwidth.
inline constexpr std::int64_t kTargetBlocks = 1024;
// A split keeps at least this many values per thread, below which another block costs more than
// it brings.
inline constexpr std::int64_t kMinValuesPerThread = 8;

// V values of S that a thread loads or stores as one 16-byte access (V = 1: one value).
template <class S, int V>
struct alignas(sizeof(S) * V) Pack {
  S v[V];
};

// The layout of a pass: (C, splits) blocks and the values per unit V (16 / sizeof(S) or 1).
struct ChannelGrid {
  std::int64_t channels = 0, splits = 1;
  bool vectorized = false;
  dim3 blocks() const { return dim3(static_cast<unsigned>(channels), static_cast<unsigned>(splits), 1); }
};

template <class S>
constexpr int kPackValues = 16 % sizeof(S) == 0 ? static_cast<int>(16 / sizeof(S)) : 1;

inline bool aligned16(const void* p) { return p == nullptr || reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

template <class S, class... Pointers>
ChannelGrid channel_grid(BatchNormShape s, Pointers... pointers) {
  ChannelGrid g;
  g.channels = s.c;  // the grid's x limit, 2^31 - 1, is far above any channel count
  g.splits = std::max<std::int64_t>(1, (kTargetBlocks + s.c - 1) / s.c);
  g.splits = std::min(g.splits, std::max<std::int64_t>(1, s.n));
  g.splits = std::min(g.splits, std::max<std::int64_t>(1, s.count() / (kThreads * kMinValuesPerThread)));
  g.splits = std::min<std::int64_t>(g.splits, 65535);  // the grid's y limit
  g.vectorized = kPackValues<S> > 1 && s.hw % kPackValues<S> == 0 && (aligned16(pointers) && ...);
  return g;
}

// The walk of this block's thread over its channel and images (V values per unit).
template <int V>
__device__ detail::ChannelWalk block_walk(BatchNormShape s) {
  const std::int64_t splits = gridDim.y, j = blockIdx.y;
  return detail::ChannelWalk(s.hw / V, s.c, blockIdx.x, j * s.n / splits, (j + 1) * s.n / splits, threadIdx.x,
                             blockDim.x);
}

// Writes a block's two sums: the channel's own when there is one split, else its partial sums
// (partial[j C + ch] and partial[(splits + j) C + ch]); bn_combine_kernel adds those.
__device__ inline void store_channel_sums(double a, double b, double* out_a, double* out_b, double* partial) {
  if (threadIdx.x != 0) return;
  const std::int64_t ch = blockIdx.x, c = gridDim.x, splits = gridDim.y, j = blockIdx.y;
  if (splits == 1) {
    out_a[ch] = a;
    out_b[ch] = b;
  } else {
    partial[j * c + ch] = a;
    partial[(splits + j) * c + ch] = b;
  }
}

template <class S, int V>
__global__ void bn_local_stats_kernel(const S* x, BatchNormShape s, double* sum, double* sumsq, double* partial) {
  __shared__ double scratch[32];
  double acc = 0, acc2 = 0;
  const auto* xs = reinterpret_cast<const Pack<S, V>*>(x);
  for (detail::ChannelWalk w = block_walk<V>(s); w.valid(); w.next()) {
    const Pack<S, V> p = xs[w.unit()];
#pragma unroll
    for (int q = 0; q < V; ++q) {
      const double v = p.v[q];
      acc += v;
      acc2 += v * v;
    }
  }
  acc = block_reduce<false>(acc, scratch);
  acc2 = block_reduce<false>(acc2, scratch);
  store_channel_sums(acc, acc2, sum, sumsq, partial);
}

// a[ch] = sum_j partial[j C + ch], b[ch] = sum_j partial[(splits + j) C + ch], added in split order.
// (A template only so that this header may define it in every translation unit that includes it.)
template <class T>
__global__ void bn_combine_kernel(std::int64_t channels, std::int64_t splits, const T* partial, T* a, T* b) {
  TESSERA_CUDA_FOR(ch, channels) {
    T sa = 0, sb = 0;
    for (std::int64_t j = 0; j < splits; ++j) {
      sa += partial[j * channels + ch];
      sb += partial[(splits + j) * channels + ch];
    }
    a[ch] = sa;
    b[ch] = sb;
  }
}

template <class S>
__global__ void bn_finalize_kernel(std::int64_t channels, const double* sum, const double* sumsq, std::int64_t count,
                                   double eps, S* mean, S* invstd) {
  TESSERA_CUDA_FOR(ch, channels) {
    const double m = double(count), mu = sum[ch] / m;
    const double var = fmax(sumsq[ch] / m - mu * mu, 0.0);
    mean[ch] = S(mu);
    invstd[ch] = S(1.0 / sqrt(var + eps));
  }
}

template <class S>
__global__ void bn_update_running_kernel(std::int64_t channels, const double* sum, const double* sumsq,
                                         std::int64_t count, double momentum, S* running_mean, S* running_var) {
  TESSERA_CUDA_FOR(ch, channels) {
    const double m = double(count), mu = sum[ch] / m;
    const double var = fmax(sumsq[ch] / m - mu * mu, 0.0) * (m / (m - 1.0));
    running_mean[ch] = S((1.0 - momentum) * double(running_mean[ch]) + momentum * mu);
    running_var[ch] = S((1.0 - momentum) * double(running_var[ch]) + momentum * var);
  }
}

template <class S>
__global__ void bn_invstd_kernel(std::int64_t channels, const S* var, double eps, S* invstd) {
  TESSERA_CUDA_FOR(ch, channels) invstd[ch] = S(1.0 / sqrt(double(var[ch]) + eps));
}

template <class S, int V>
__global__ void bn_normalize_kernel(const S* x, BatchNormShape s, const S* mean, const S* invstd, const S* gamma,
                                    const S* beta, S* y, bool relu) {
  const std::int64_t ch = blockIdx.x;
  const S m = mean[ch], scale = gamma[ch] * invstd[ch], shift = beta[ch];
  const auto* xs = reinterpret_cast<const Pack<S, V>*>(x);
  auto* ys = reinterpret_cast<Pack<S, V>*>(y);
  for (detail::ChannelWalk w = block_walk<V>(s); w.valid(); w.next()) {
    Pack<S, V> p = xs[w.unit()];
#pragma unroll
    for (int q = 0; q < V; ++q) {
      const S v = batch_norm_value(p.v[q], m, scale, shift);
      p.v[q] = relu && v < S(0) ? S(0) : v;
    }
    ys[w.unit()] = p;
  }
}

// y = max(bn(x) + addend, 0), the unfused steps' roundings (kernels/cpu/batch_norm.hpp).
template <class S, int V>
__global__ void bn_normalize_add_relu_kernel(const S* x, BatchNormShape s, const S* mean, const S* invstd,
                                             const S* gamma, const S* beta, const S* addend, S* y) {
  const std::int64_t ch = blockIdx.x;
  const S m = mean[ch], scale = gamma[ch] * invstd[ch], shift = beta[ch];
  const auto* xs = reinterpret_cast<const Pack<S, V>*>(x);
  const auto* as = reinterpret_cast<const Pack<S, V>*>(addend);
  auto* ys = reinterpret_cast<Pack<S, V>*>(y);
  for (detail::ChannelWalk w = block_walk<V>(s); w.valid(); w.next()) {
    Pack<S, V> p = xs[w.unit()];
    const Pack<S, V> a = as[w.unit()];
#pragma unroll
    for (int q = 0; q < V; ++q) {
      const S sum = batch_norm_value(p.v[q], m, scale, shift) + a.v[q];
      p.v[q] = sum < S(0) ? S(0) : sum;
    }
    ys[w.unit()] = p;
  }
}

// sum_dy = sum g and sum_dy_xhat = invstd sum g (x - mean), g = dy (through the fused ReLU's mask).
template <class S, int V>
__global__ void bn_backward_local_sums_kernel(const S* dy, const S* x, BatchNormShape s, const S* mean,
                                              const S* invstd, double* sum_dy, double* sum_dy_xhat, double* partial,
                                              bool relu, const S* gamma, const S* beta) {
  __shared__ double scratch[32];
  const std::int64_t ch = blockIdx.x;
  const S m = mean[ch];
  const S scale = relu ? gamma[ch] * invstd[ch] : S(0), shift = relu ? beta[ch] : S(0);
  const double mu = m;
  double acc = 0, acc_xmu = 0;
  const auto* xs = reinterpret_cast<const Pack<S, V>*>(x);
  const auto* dys = reinterpret_cast<const Pack<S, V>*>(dy);
  for (detail::ChannelWalk w = block_walk<V>(s); w.valid(); w.next()) {
    const Pack<S, V> px = xs[w.unit()], pd = dys[w.unit()];
#pragma unroll
    for (int q = 0; q < V; ++q) {
      const double g = relu ? relu_pass(batch_norm_value(px.v[q], m, scale, shift), pd.v[q]) : pd.v[q];
      acc += g;
      acc_xmu += g * (double(px.v[q]) - mu);
    }
  }
  acc = block_reduce<false>(acc, scratch);
  acc_xmu = block_reduce<false>(acc_xmu, scratch);
  store_channel_sums(acc, acc_xmu * double(invstd[ch]), sum_dy, sum_dy_xhat, partial);
}

template <class S, int V>
__global__ void bn_backward_input_kernel(const S* dy, const S* x, BatchNormShape s, const S* mean, const S* invstd,
                                         const S* gamma, const double* sum_dy, const double* sum_dy_xhat,
                                         std::int64_t count, S* dx, bool relu, const S* beta) {
  const std::int64_t ch = blockIdx.x;
  const double m = double(count), is = invstd[ch], k = double(gamma[ch]) * is;
  const S a = S(k), b = S(-k * is * sum_dy_xhat[ch] / m), c = S(-k * sum_dy[ch] / m);
  const S mu = mean[ch], scale = gamma[ch] * invstd[ch], shift = relu ? beta[ch] : S(0);
  const auto* xs = reinterpret_cast<const Pack<S, V>*>(x);
  const auto* dys = reinterpret_cast<const Pack<S, V>*>(dy);
  auto* dxs = reinterpret_cast<Pack<S, V>*>(dx);
  for (detail::ChannelWalk w = block_walk<V>(s); w.valid(); w.next()) {
    const Pack<S, V> px = xs[w.unit()], pd = dys[w.unit()];
    Pack<S, V> out;
#pragma unroll
    for (int q = 0; q < V; ++q) {
      const S g = relu ? relu_pass(batch_norm_value(px.v[q], mu, scale, shift), pd.v[q]) : pd.v[q];
      out.v[q] = a * g + b * (px.v[q] - mu) + c;
    }
    dxs[w.unit()] = out;
  }
}

template <class S, int V>
__global__ void bn_backward_input_affine_kernel(const S* dy, BatchNormShape s, const S* invstd, const S* gamma, S* dx,
                                                bool relu, const S* x, const S* mean, const S* beta) {
  const std::int64_t ch = blockIdx.x;
  const S a = gamma[ch] * invstd[ch];
  const S mu = relu ? mean[ch] : S(0), shift = relu ? beta[ch] : S(0);
  const auto* xs = reinterpret_cast<const Pack<S, V>*>(x);
  const auto* dys = reinterpret_cast<const Pack<S, V>*>(dy);
  auto* dxs = reinterpret_cast<Pack<S, V>*>(dx);
  for (detail::ChannelWalk w = block_walk<V>(s); w.valid(); w.next()) {
    const Pack<S, V> pd = dys[w.unit()];
    Pack<S, V> out;
    if (relu) {
      const Pack<S, V> px = xs[w.unit()];
#pragma unroll
      for (int q = 0; q < V; ++q) out.v[q] = a * relu_pass(batch_norm_value(px.v[q], mu, a, shift), pd.v[q]);
    } else {
#pragma unroll
      for (int q = 0; q < V; ++q) out.v[q] = a * pd.v[q];
    }
    dxs[w.unit()] = out;
  }
}

template <class S>
__global__ void bn_affine_grads_kernel(std::int64_t channels, const double* sum_dy, const double* sum_dy_xhat,
                                       S* dgamma, S* dbeta) {
  TESSERA_CUDA_FOR(ch, channels) {
    dgamma[ch] += S(sum_dy_xhat[ch]);
    dbeta[ch] += S(sum_dy[ch]);
  }
}

// Channels last (BatchNormShape::channels_last): x is R = N HW rows of C values. The sums run on a
// grid of (ceil(C / 32), splits) blocks of 32 x 8 threads: thread (tx, ty) of block (b, j) takes
// channel 32 b + tx over every 8th row of the block's run [j R / splits, (j + 1) R / splits), so a
// warp reads 32 neighbouring channels of one row (whole cache lines); the 8 row sums of a channel
// are added in row order in shared memory, then the splits' partial sums in split order
// (bn_combine_kernel), as in the planar passes. The elementwise passes take one element per thread
// (channel = index mod C), with the per-channel constants read through the cache.
inline constexpr int kRowChannels = 32, kRowThreads = 8;

inline ChannelGrid row_grid(BatchNormShape s) {
  ChannelGrid g;
  g.channels = s.c;
  const std::int64_t channel_blocks = (s.c + kRowChannels - 1) / kRowChannels;
  g.splits = std::max<std::int64_t>(1, (kTargetBlocks + channel_blocks - 1) / channel_blocks);
  g.splits = std::min(g.splits, std::max<std::int64_t>(1, s.count() / (kRowThreads * kMinValuesPerThread)));
  g.splits = std::min<std::int64_t>(g.splits, 65535);
  return g;
}
inline dim3 row_blocks(const ChannelGrid& g) {
  return dim3(static_cast<unsigned>((g.channels + kRowChannels - 1) / kRowChannels), static_cast<unsigned>(g.splits), 1);
}

// This thread's rows [r, end) step kRowThreads, and its channel (ch < 0: none).
struct RowWalk {
  std::int64_t ch, r, end;
};
__device__ inline RowWalk row_walk(BatchNormShape s) {
  const std::int64_t rows = s.n * s.hw, splits = gridDim.y, j = blockIdx.y;
  const std::int64_t ch = static_cast<std::int64_t>(blockIdx.x) * kRowChannels + threadIdx.x;
  return {ch < s.c ? ch : -1, j * rows / splits + threadIdx.y, (j + 1) * rows / splits};
}

// Adds the block's kRowThreads partial sums of each channel in row order and writes them as
// store_channel_sums does (b scaled by b_scale[ch] when given).
template <class S>
__device__ void store_row_sums(BatchNormShape s, double a, double b, const S* b_scale, double* out_a, double* out_b,
                               double* partial) {
  __shared__ double sa[kRowThreads][kRowChannels], sb[kRowThreads][kRowChannels];
  sa[threadIdx.y][threadIdx.x] = a;
  sb[threadIdx.y][threadIdx.x] = b;
  __syncthreads();
  const std::int64_t ch = static_cast<std::int64_t>(blockIdx.x) * kRowChannels + threadIdx.x;
  if (threadIdx.y != 0 || ch >= s.c) return;
  double ta = 0, tb = 0;
  for (int k = 0; k < kRowThreads; ++k) ta += sa[k][threadIdx.x], tb += sb[k][threadIdx.x];
  if (b_scale != nullptr) tb *= double(b_scale[ch]);
  const std::int64_t splits = gridDim.y, j = blockIdx.y;
  if (splits == 1) {
    out_a[ch] = ta;
    out_b[ch] = tb;
  } else {
    partial[j * s.c + ch] = ta;
    partial[(splits + j) * s.c + ch] = tb;
  }
}

template <class S>
__global__ void bn_rows_local_stats_kernel(const S* x, BatchNormShape s, double* sum, double* sumsq, double* partial) {
  const RowWalk w = row_walk(s);
  double a = 0, b = 0;
  if (w.ch >= 0)
    for (std::int64_t r = w.r; r < w.end; r += kRowThreads) {
      const double v = x[r * s.c + w.ch];
      a += v;
      b += v * v;
    }
  store_row_sums<S>(s, a, b, nullptr, sum, sumsq, partial);
}

template <class S>
__global__ void bn_rows_backward_local_sums_kernel(const S* dy, const S* x, BatchNormShape s, const S* mean,
                                                   const S* invstd, double* sum_dy, double* sum_dy_xhat,
                                                   double* partial, bool relu, const S* gamma, const S* beta) {
  const RowWalk w = row_walk(s);
  double acc = 0, acc_xmu = 0;
  if (w.ch >= 0) {
    const S m = mean[w.ch];
    const S scale = relu ? gamma[w.ch] * invstd[w.ch] : S(0), shift = relu ? beta[w.ch] : S(0);
    const double mu = m;
    for (std::int64_t r = w.r; r < w.end; r += kRowThreads) {
      const std::int64_t i = r * s.c + w.ch;
      const double g = relu ? relu_pass(batch_norm_value(x[i], m, scale, shift), dy[i]) : dy[i];
      acc += g;
      acc_xmu += g * (double(x[i]) - mu);
    }
  }
  store_row_sums<S>(s, acc, acc_xmu, invstd, sum_dy, sum_dy_xhat, partial);
}

// The elementwise passes over rows: thread (tx, ty) of block (bx, by) takes channels 32 bx + tx
// (+ 32 gridDim.x ...) of rows 8 by + ty (+ 8 gridDim.y ...), element i = r C + ch; a warp reads
// 32 neighbouring channels of one row, and no thread divides to find its channel.
#define TESSERA_ROWS_FOR(i, ch, s)                                                                                \
  for (std::int64_t r_ = static_cast<std::int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; r_ < (s).n * (s).hw; \
       r_ += static_cast<std::int64_t>(gridDim.y) * blockDim.y)                                                \
    for (std::int64_t ch = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x, i = r_ * (s).c + ch; \
         ch < (s).c; ch += static_cast<std::int64_t>(gridDim.x) * blockDim.x, i = r_ * (s).c + ch)
inline dim3 rows_elementwise_blocks(BatchNormShape s) {
  const std::int64_t channel_blocks = std::min<std::int64_t>((s.c + kRowChannels - 1) / kRowChannels, 1024);
  const std::int64_t row_blocks = std::clamp<std::int64_t>((kTargetBlocks * 8 + channel_blocks - 1) / channel_blocks, 1,
                                                           (s.n * s.hw + kRowThreads - 1) / kRowThreads);
  return dim3(static_cast<unsigned>(channel_blocks), static_cast<unsigned>(std::min<std::int64_t>(row_blocks, 65535)), 1);
}
// Launches kernel<S> over the rows when s has elements, and checks the launch.
#define TESSERA_BN_ROWS_LAUNCH(kernel, s, ...)                                                                   \
  do {                                                                                                         \
    if ((s).numel() > 0) {                                                                                     \
      kernel<<<::tessera::cuda_detail::rows_elementwise_blocks(s),                                             \
               dim3(::tessera::cuda_detail::kRowChannels, ::tessera::cuda_detail::kRowThreads), 0,              \
               ::tessera::Cuda::stream()>>>(__VA_ARGS__);                                                      \
      ::tessera::detail::cuda_check(cudaGetLastError(), #kernel, __FILE__, __LINE__);                          \
    }                                                                                                          \
  } while (0)

template <class S>
__global__ void bn_rows_normalize_kernel(const S* x, BatchNormShape s, const S* mean, const S* invstd, const S* gamma,
                                         const S* beta, S* y, bool relu) {
  TESSERA_ROWS_FOR(i, ch, s) {
    const S v = batch_norm_value(x[i], mean[ch], gamma[ch] * invstd[ch], beta[ch]);
    y[i] = relu && v < S(0) ? S(0) : v;
  }
}

template <class S>
__global__ void bn_rows_normalize_add_relu_kernel(const S* x, BatchNormShape s, const S* mean, const S* invstd,
                                                  const S* gamma, const S* beta, const S* addend, S* y) {
  TESSERA_ROWS_FOR(i, ch, s) {
    const S sum = batch_norm_value(x[i], mean[ch], gamma[ch] * invstd[ch], beta[ch]) + addend[i];
    y[i] = sum < S(0) ? S(0) : sum;
  }
}

// The planar kernel's a, b, c per channel, computed once: coefficients (3 C) = [a | b | c].
template <class S>
__global__ void bn_rows_coefficients_kernel(std::int64_t channels, const S* invstd, const S* gamma,
                                            const double* sum_dy, const double* sum_dy_xhat, std::int64_t count,
                                            S* coefficients) {
  TESSERA_CUDA_FOR(ch, channels) {
    const double m = double(count), is = invstd[ch], k = double(gamma[ch]) * is;
    coefficients[ch] = S(k);
    coefficients[channels + ch] = S(-k * is * sum_dy_xhat[ch] / m);
    coefficients[2 * channels + ch] = S(-k * sum_dy[ch] / m);
  }
}

template <class S>
__global__ void bn_rows_backward_input_kernel(const S* dy, const S* x, BatchNormShape s, const S* mean,
                                              const S* invstd, const S* gamma, const S* coefficients, S* dx, bool relu,
                                              const S* beta) {
  TESSERA_ROWS_FOR(i, ch, s) {
    const S mu = mean[ch];
    const S g = relu ? relu_pass(batch_norm_value(x[i], mu, gamma[ch] * invstd[ch], beta[ch]), dy[i]) : dy[i];
    dx[i] = coefficients[ch] * g + coefficients[s.c + ch] * (x[i] - mu) + coefficients[2 * s.c + ch];
  }
}

template <class S>
__global__ void bn_rows_backward_input_affine_kernel(const S* dy, BatchNormShape s, const S* invstd, const S* gamma,
                                                     S* dx, bool relu, const S* x, const S* mean, const S* beta) {
  TESSERA_ROWS_FOR(i, ch, s) {
    const S a = gamma[ch] * invstd[ch];
    dx[i] = relu ? a * relu_pass(batch_norm_value(x[i], mean[ch], a, beta[ch]), dy[i]) : a * dy[i];
  }
}

// Launches kernel<S, V> on g's grid, with V = kPackValues<S> where g is vectorized.
#define TESSERA_BN_LAUNCH(kernel, S, g, ...)                                                                    \
  do {                                                                                                         \
    if ((g).vectorized)                                                                                        \
      kernel<S, ::tessera::cuda_detail::kPackValues<S>>                                                        \
          <<<(g).blocks(), ::tessera::cuda_detail::kThreads, 0, ::tessera::Cuda::stream()>>>(__VA_ARGS__);    \
    else                                                                                                       \
      kernel<S, 1><<<(g).blocks(), ::tessera::cuda_detail::kThreads, 0, ::tessera::Cuda::stream()>>>(__VA_ARGS__); \
    ::tessera::detail::cuda_check(cudaGetLastError(), #kernel, __FILE__, __LINE__);                            \
  } while (0)

// Partial sums of a split pass: 2 x splits x C doubles from the device's cache (freed after the
// combine is queued: the stream orders any later user of the block after it).
class PartialSums {
 public:
  PartialSums(const ChannelGrid& g)
      : bytes_(g.splits > 1 ? static_cast<std::size_t>(2 * g.splits * g.channels) * sizeof(double) : 0),
        data_(bytes_ > 0 ? static_cast<double*>(Cuda::allocate(bytes_)) : nullptr) {}
  PartialSums(const PartialSums&) = delete;
  PartialSums& operator=(const PartialSums&) = delete;
  ~PartialSums() { Cuda::deallocate(data_, bytes_); }
  double* data() const { return data_; }
  // Adds the partials into a and b (nothing to do with one split: the blocks wrote a and b).
  void combine(const ChannelGrid& g, double* a, double* b) const {
    if (g.splits > 1) TESSERA_CUDA_LAUNCH(bn_combine_kernel<double>, g.channels, g.channels, g.splits, data_, a, b);
  }

 private:
  std::size_t bytes_;
  double* data_;
};

}  // namespace cuda_detail

template <class S>
void batch_norm_local_stats(Cuda, const S* x, BatchNormShape s, double* sum, double* sumsq) {
  if (s.c == 0) return;
  if (s.channels_last) {
    const cuda_detail::ChannelGrid g = cuda_detail::row_grid(s);
    const cuda_detail::PartialSums partial(g);
    cuda_detail::bn_rows_local_stats_kernel<S>
        <<<cuda_detail::row_blocks(g), dim3(cuda_detail::kRowChannels, cuda_detail::kRowThreads), 0, Cuda::stream()>>>(
            x, s, sum, sumsq, partial.data());
    TESSERA_CUDA_CHECK(cudaGetLastError());
    partial.combine(g, sum, sumsq);
    return;
  }
  const cuda_detail::ChannelGrid g = cuda_detail::channel_grid<S>(s, x);
  const cuda_detail::PartialSums partial(g);
  TESSERA_BN_LAUNCH(cuda_detail::bn_local_stats_kernel, S, g, x, s, sum, sumsq, partial.data());
  partial.combine(g, sum, sumsq);
}
template <class S>
void batch_norm_finalize_stats(Cuda, std::int64_t channels, const double* sum, const double* sumsq,
                               std::int64_t count, double eps, S* mean, S* invstd) {
  TESSERA_CUDA_LAUNCH(cuda_detail::bn_finalize_kernel<S>, channels, channels, sum, sumsq, count, eps, mean, invstd);
}
template <class S>
void batch_norm_update_running(Cuda, std::int64_t channels, const double* sum, const double* sumsq,
                               std::int64_t count, double momentum, S* running_mean, S* running_var) {
  TESSERA_CUDA_LAUNCH(cuda_detail::bn_update_running_kernel<S>, channels, channels, sum, sumsq, count, momentum,
                      running_mean, running_var);
}
template <class S>
void batch_norm_invstd(Cuda, std::int64_t channels, const S* var, double eps, S* invstd) {
  TESSERA_CUDA_LAUNCH(cuda_detail::bn_invstd_kernel<S>, channels, channels, var, eps, invstd);
}
template <class S>
void batch_norm_normalize(Cuda, const S* x, BatchNormShape s, const S* mean, const S* invstd, const S* gamma,
                          const S* beta, S* y, bool relu) {
  if (s.numel() == 0) return;
  if (s.channels_last) {
    TESSERA_BN_ROWS_LAUNCH(cuda_detail::bn_rows_normalize_kernel<S>, s, x, s, mean, invstd, gamma, beta, y, relu);
    return;
  }
  const cuda_detail::ChannelGrid g = cuda_detail::channel_grid<S>(s, x, y);
  TESSERA_BN_LAUNCH(cuda_detail::bn_normalize_kernel, S, g, x, s, mean, invstd, gamma, beta, y, relu);
}
template <class S>
void batch_norm_normalize_add_relu(Cuda, const S* x, BatchNormShape s, const S* mean, const S* invstd, const S* gamma,
                                   const S* beta, const S* addend, S* y) {
  if (s.numel() == 0) return;
  if (s.channels_last) {
    TESSERA_BN_ROWS_LAUNCH(cuda_detail::bn_rows_normalize_add_relu_kernel<S>, s, x, s, mean, invstd, gamma, beta,
                        addend, y);
    return;
  }
  const cuda_detail::ChannelGrid g = cuda_detail::channel_grid<S>(s, x, addend, y);
  TESSERA_BN_LAUNCH(cuda_detail::bn_normalize_add_relu_kernel, S, g, x, s, mean, invstd, gamma, beta, addend, y);
}
template <class S>
void batch_norm_backward_local_sums(Cuda, const S* dy, const S* x, BatchNormShape s, const S* mean,
                                    const S* invstd, double* sum_dy, double* sum_dy_xhat, bool relu,
                                    const S* gamma, const S* beta) {
  if (s.c == 0) return;
  if (s.channels_last) {
    const cuda_detail::ChannelGrid g = cuda_detail::row_grid(s);
    const cuda_detail::PartialSums partial(g);
    cuda_detail::bn_rows_backward_local_sums_kernel<S>
        <<<cuda_detail::row_blocks(g), dim3(cuda_detail::kRowChannels, cuda_detail::kRowThreads), 0, Cuda::stream()>>>(
            dy, x, s, mean, invstd, sum_dy, sum_dy_xhat, partial.data(), relu, gamma, beta);
    TESSERA_CUDA_CHECK(cudaGetLastError());
    partial.combine(g, sum_dy, sum_dy_xhat);
    return;
  }
  const cuda_detail::ChannelGrid g = cuda_detail::channel_grid<S>(s, dy, x);
  const cuda_detail::PartialSums partial(g);
  TESSERA_BN_LAUNCH(cuda_detail::bn_backward_local_sums_kernel, S, g, dy, x, s, mean, invstd, sum_dy, sum_dy_xhat,
                    partial.data(), relu, gamma, beta);
  partial.combine(g, sum_dy, sum_dy_xhat);
}
template <class S>
void batch_norm_backward_input(Cuda, const S* dy, const S* x, BatchNormShape s, const S* mean, const S* invstd,
                               const S* gamma, const double* sum_dy, const double* sum_dy_xhat, std::int64_t count,
                               S* dx, bool relu, const S* beta) {
  if (s.numel() == 0) return;
  if (s.channels_last) {
    // 3 C coefficients from the device's cache, freed once the kernels are queued (stream order).
    const std::size_t bytes = static_cast<std::size_t>(3 * s.c) * sizeof(S);
    S* coefficients = static_cast<S*>(Cuda::allocate(bytes));
    TESSERA_CUDA_LAUNCH(cuda_detail::bn_rows_coefficients_kernel<S>, s.c, s.c, invstd, gamma, sum_dy, sum_dy_xhat,
                        count, coefficients);
    TESSERA_BN_ROWS_LAUNCH(cuda_detail::bn_rows_backward_input_kernel<S>, s, dy, x, s, mean, invstd, gamma,
                        coefficients, dx, relu, beta);
    Cuda::deallocate(coefficients, bytes);
    return;
  }
  const cuda_detail::ChannelGrid g = cuda_detail::channel_grid<S>(s, dy, x, dx);
  TESSERA_BN_LAUNCH(cuda_detail::bn_backward_input_kernel, S, g, dy, x, s, mean, invstd, gamma, sum_dy, sum_dy_xhat,
                    count, dx, relu, beta);
}
template <class S>
void batch_norm_backward_input_affine(Cuda, const S* dy, BatchNormShape s, const S* invstd, const S* gamma, S* dx,
                                      bool relu, const S* x, const S* mean,
                                      const S* beta) {
  if (s.numel() == 0) return;
  if (s.channels_last) {
    TESSERA_BN_ROWS_LAUNCH(cuda_detail::bn_rows_backward_input_affine_kernel<S>, s, dy, s, invstd, gamma, dx, relu,
                        x, mean, beta);
    return;
  }
  const cuda_detail::ChannelGrid g = cuda_detail::channel_grid<S>(s, dy, dx, x);
  TESSERA_BN_LAUNCH(cuda_detail::bn_backward_input_affine_kernel, S, g, dy, s, invstd, gamma, dx, relu, x, mean, beta);
}
template <class S>
void batch_norm_accumulate_affine_grads(Cuda, std::int64_t channels, const double* sum_dy, const double* sum_dy_xhat,
                                        S* dgamma, S* dbeta) {
  TESSERA_CUDA_LAUNCH(cuda_detail::bn_affine_grads_kernel<S>, channels, channels, sum_dy, sum_dy_xhat, dgamma, dbeta);
}

#undef TESSERA_BN_LAUNCH
#undef TESSERA_BN_ROWS_LAUNCH
#undef TESSERA_ROWS_FOR

}  // namespace tessera
