// Batch normalization on the GPU: the Cuda overloads of kernels/cpu/batch_norm.hpp, same steps,
// same maths (see there), so SyncBatchNorm's all-reduces between them work on device memory with
// NCCL. Per-channel sums are one block per channel reducing in double; per-element steps are one
// thread per element with the channel of element e at (e / hw) % c.
#pragma once

#include <cstdint>

#include "tessera/kernels/cpu/batch_norm.hpp"
#include "tessera/kernels/cuda/launch.cuh"
#include "tessera/kernels/cuda/reduce.cuh"

namespace tessera {

namespace cuda_detail {

template <class S>
__global__ void bn_local_stats_kernel(const S* x, BatchNormShape s, double* sum, double* sumsq) {
  __shared__ double scratch[32];
  const std::int64_t ch = blockIdx.x;
  double acc = 0, acc2 = 0;
  for (std::int64_t k = threadIdx.x; k < s.count(); k += blockDim.x) {
    const double v = x[((k / s.hw) * s.c + ch) * s.hw + k % s.hw];
    acc += v;
    acc2 += v * v;
  }
  acc = block_reduce<false>(acc, scratch);
  acc2 = block_reduce<false>(acc2, scratch);
  if (threadIdx.x == 0) {
    sum[ch] = acc;
    sumsq[ch] = acc2;
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

template <class S>
__global__ void bn_normalize_kernel(const S* x, BatchNormShape s, const S* mean, const S* invstd, const S* gamma,
                                    const S* beta, S* y, bool relu) {
  TESSERA_CUDA_FOR(e, s.numel()) {
    const std::int64_t ch = (e / s.hw) % s.c;
    const S v = batch_norm_value(x[e], mean[ch], gamma[ch] * invstd[ch], beta[ch]);
    y[e] = relu && v < S(0) ? S(0) : v;
  }
}

template <class S>
__global__ void bn_backward_local_sums_kernel(const S* dy, const S* x, BatchNormShape s, const S* mean,
                                              const S* invstd, double* sum_dy, double* sum_dy_xhat, bool relu,
                                              const S* gamma, const S* beta) {
  __shared__ double scratch[32];
  const std::int64_t ch = blockIdx.x;
  const double mu = mean[ch];
  const S scale = relu ? gamma[ch] * invstd[ch] : S(0), shift = relu ? beta[ch] : S(0);
  double acc = 0, acc_xmu = 0;
  for (std::int64_t k = threadIdx.x; k < s.count(); k += blockDim.x) {
    const std::int64_t e = ((k / s.hw) * s.c + ch) * s.hw + k % s.hw;
    const double g = relu ? relu_pass(batch_norm_value(x[e], mean[ch], scale, shift), dy[e]) : dy[e];
    acc += g;
    acc_xmu += g * (double(x[e]) - mu);
  }
  acc = block_reduce<false>(acc, scratch);
  acc_xmu = block_reduce<false>(acc_xmu, scratch);
  if (threadIdx.x == 0) {
    sum_dy[ch] = acc;
    sum_dy_xhat[ch] = acc_xmu * double(invstd[ch]);
  }
}

template <class S>
__global__ void bn_backward_input_kernel(const S* dy, const S* x, BatchNormShape s, const S* mean, const S* invstd,
                                         const S* gamma, const double* sum_dy, const double* sum_dy_xhat,
                                         std::int64_t count, S* dx, bool relu, const S* beta) {
  const double m = double(count);
  TESSERA_CUDA_FOR(e, s.numel()) {
    const std::int64_t ch = (e / s.hw) % s.c;
    const double is = invstd[ch], k = double(gamma[ch]) * is;
    const S a = S(k), b = S(-k * is * sum_dy_xhat[ch] / m), c = S(-k * sum_dy[ch] / m);
    const S g = relu ? relu_pass(batch_norm_value(x[e], mean[ch], gamma[ch] * invstd[ch], beta[ch]), dy[e]) : dy[e];
    dx[e] = a * g + b * (x[e] - mean[ch]) + c;
  }
}

template <class S>
__global__ void bn_backward_input_affine_kernel(const S* dy, BatchNormShape s, const S* invstd, const S* gamma, S* dx,
                                                bool relu, const S* x, const S* mean, const S* beta) {
  TESSERA_CUDA_FOR(e, s.numel()) {
    const std::int64_t ch = (e / s.hw) % s.c;
    const S a = gamma[ch] * invstd[ch];
    dx[e] = a * (relu ? relu_pass(batch_norm_value(x[e], mean[ch], a, beta[ch]), dy[e]) : dy[e]);
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

// One block per channel (the grid's x limit, 2^31 - 1, is far above any channel count).
inline unsigned channel_blocks(std::int64_t channels) { return static_cast<unsigned>(channels); }

}  // namespace cuda_detail

template <class S>
void batch_norm_local_stats(Cuda, const S* x, BatchNormShape s, double* sum, double* sumsq) {
  if (s.c == 0) return;
  cuda_detail::bn_local_stats_kernel<S><<<cuda_detail::channel_blocks(s.c), cuda_detail::kThreads, 0, Cuda::stream()>>>(
      x, s, sum, sumsq);
  TESSERA_CUDA_CHECK(cudaGetLastError());
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
                          const S* beta, S* y, bool relu = false) {
  TESSERA_CUDA_LAUNCH(cuda_detail::bn_normalize_kernel<S>, s.numel(), x, s, mean, invstd, gamma, beta, y, relu);
}
template <class S>
void batch_norm_backward_local_sums(Cuda, const S* dy, const S* x, BatchNormShape s, const S* mean,
                                    const S* invstd, double* sum_dy, double* sum_dy_xhat, bool relu = false,
                                    const S* gamma = nullptr, const S* beta = nullptr) {
  if (s.c == 0) return;
  cuda_detail::bn_backward_local_sums_kernel<S>
      <<<cuda_detail::channel_blocks(s.c), cuda_detail::kThreads, 0, Cuda::stream()>>>(dy, x, s, mean, invstd, sum_dy,
                                                                                       sum_dy_xhat, relu, gamma, beta);
  TESSERA_CUDA_CHECK(cudaGetLastError());
}
template <class S>
void batch_norm_backward_input(Cuda, const S* dy, const S* x, BatchNormShape s, const S* mean, const S* invstd,
                               const S* gamma, const double* sum_dy, const double* sum_dy_xhat, std::int64_t count,
                               S* dx, bool relu = false, const S* beta = nullptr) {
  TESSERA_CUDA_LAUNCH(cuda_detail::bn_backward_input_kernel<S>, s.numel(), dy, x, s, mean, invstd, gamma, sum_dy,
                      sum_dy_xhat, count, dx, relu, beta);
}
template <class S>
void batch_norm_backward_input_affine(Cuda, const S* dy, BatchNormShape s, const S* invstd, const S* gamma, S* dx,
                                      bool relu = false, const S* x = nullptr, const S* mean = nullptr,
                                      const S* beta = nullptr) {
  TESSERA_CUDA_LAUNCH(cuda_detail::bn_backward_input_affine_kernel<S>, s.numel(), dy, s, invstd, gamma, dx, relu, x,
                      mean, beta);
}
template <class S>
void batch_norm_accumulate_affine_grads(Cuda, std::int64_t channels, const double* sum_dy, const double* sum_dy_xhat,
                                        S* dgamma, S* dbeta) {
  TESSERA_CUDA_LAUNCH(cuda_detail::bn_affine_grads_kernel<S>, channels, channels, sum_dy, sum_dy_xhat, dgamma, dbeta);
}

}  // namespace tessera
