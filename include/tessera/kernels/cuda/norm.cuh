// LayerNorm and RMSNorm on the GPU: the Cuda overloads of kernels/cpu/norm.hpp (same maths, see
// there). One block per row, its sums reduced over the block in double; the parameter gradients
// one thread per column, summing down the rows (adjacent threads read adjacent columns).
#pragma once

#include <cmath>
#include <cstdint>

#include "tessera/kernels/cuda/launch.cuh"
#include "tessera/kernels/cuda/reduce.cuh"
#include "tessera/kernels/cuda/softmax.cuh"

namespace tessera {

namespace cuda_detail {

template <class S>
__global__ void norm_forward_kernel(const S* x, std::int64_t n, const S* weight, const S* bias, double eps, S* y,
                                    S* mean, S* rstd) {
  __shared__ double scratch[32];
  const std::int64_t r = blockIdx.x;
  const S* xr = x + r * n;
  S* yr = y + r * n;
  double mu = 0;
  if (mean != nullptr) {
    double sum = 0;
    for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) sum += double(xr[j]);
    mu = block_reduce<false>(sum, scratch) / double(n);
  }
  double ss = 0;
  for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const double c = double(xr[j]) - mu;
    ss += c * c;
  }
  const double rs = 1.0 / sqrt(block_reduce<false>(ss, scratch) / double(n) + eps);
  if (threadIdx.x == 0) {
    if (mean != nullptr) mean[r] = S(mu);
    rstd[r] = S(rs);
  }
  const S m = S(mu), s = S(rs);
  for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const S xhat = (xr[j] - m) * s;
    yr[j] = (weight != nullptr ? xhat * weight[j] : xhat) + (bias != nullptr ? bias[j] : S(0));
  }
}

template <class S>
__global__ void norm_input_grad_kernel(const S* x, const S* dy, const S* mean, const S* rstd, const S* weight,
                                       std::int64_t n, S* dx) {
  __shared__ double scratch[32];
  const std::int64_t r = blockIdx.x;
  const S* xr = x + r * n;
  const S* gr = dy + r * n;
  const S mu = mean != nullptr ? mean[r] : S(0), rs = rstd[r];
  double sum_g = 0, sum_gx = 0;
  for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const double g = double(weight != nullptr ? gr[j] * weight[j] : gr[j]);
    sum_g += g;
    sum_gx += g * double((xr[j] - mu) * rs);
  }
  sum_g = block_reduce<false>(sum_g, scratch);
  sum_gx = block_reduce<false>(sum_gx, scratch);
  const S mean_g = mean != nullptr ? S(sum_g / double(n)) : S(0), mean_gx = S(sum_gx / double(n));
  for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const S g = weight != nullptr ? gr[j] * weight[j] : gr[j];
    dx[r * n + j] = rs * (g - mean_g - (xr[j] - mu) * rs * mean_gx);
  }
}

template <class S>
__global__ void norm_parameter_grads_kernel(const S* x, const S* dy, const S* mean, const S* rstd, std::int64_t rows,
                                            std::int64_t n, S* dweight, S* dbias) {
  TESSERA_CUDA_FOR(j, n) {
    double dw = 0, db = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      const double g = double(dy[r * n + j]);
      dw += g * double((x[r * n + j] - (mean != nullptr ? mean[r] : S(0))) * rstd[r]);
      db += g;
    }
    if (dweight != nullptr) dweight[j] += S(dw);
    if (dbias != nullptr) dbias[j] += S(db);
  }
}

template <class S>
void norm_forward(const S* x, std::int64_t rows, std::int64_t n, const S* weight, const S* bias, double eps, S* y,
                  S* mean, S* rstd) {
  if (rows == 0) return;
  norm_forward_kernel<S><<<static_cast<unsigned>(rows), softmax_block(n), 0, Cuda::stream()>>>(x, n, weight, bias, eps,
                                                                                                y, mean, rstd);
  TESSERA_CUDA_CHECK(cudaGetLastError());
}

template <class S>
void norm_backward(const S* x, const S* dy, const S* mean, const S* rstd, const S* weight, std::int64_t rows,
                   std::int64_t n, S* dx, S* dweight, S* dbias) {
  if (rows == 0) return;
  if (dx != nullptr) {
    norm_input_grad_kernel<S><<<static_cast<unsigned>(rows), softmax_block(n), 0, Cuda::stream()>>>(x, dy, mean, rstd,
                                                                                                   weight, n, dx);
    TESSERA_CUDA_CHECK(cudaGetLastError());
  }
  if (dweight != nullptr || dbias != nullptr)
    TESSERA_CUDA_LAUNCH(norm_parameter_grads_kernel<S>, n, x, dy, mean, rstd, rows, n, dweight, dbias);
}

}  // namespace cuda_detail

template <class S>
void layer_norm_forward(Cuda, const S* x, std::int64_t rows, std::int64_t n, const S* weight, const S* bias, double eps,
                        S* y, S* mean, S* rstd) {
  cuda_detail::norm_forward(x, rows, n, weight, bias, eps, y, mean, rstd);
}

template <class S>
void layer_norm_backward(Cuda, const S* x, const S* dy, const S* mean, const S* rstd, const S* weight,
                         std::int64_t rows, std::int64_t n, S* dx, S* dweight, S* dbias) {
  cuda_detail::norm_backward(x, dy, mean, rstd, weight, rows, n, dx, dweight, dbias);
}

template <class S>
void rms_norm_forward(Cuda, const S* x, std::int64_t rows, std::int64_t n, const S* weight, double eps, S* y, S* rstd) {
  cuda_detail::norm_forward(x, rows, n, weight, static_cast<const S*>(nullptr), eps, y, static_cast<S*>(nullptr), rstd);
}

template <class S>
void rms_norm_backward(Cuda, const S* x, const S* dy, const S* rstd, const S* weight, std::int64_t rows, std::int64_t n,
                       S* dx, S* dweight) {
  cuda_detail::norm_backward(x, dy, static_cast<const S*>(nullptr), rstd, weight, rows, n, dx, dweight,
                             static_cast<S*>(nullptr));
}

}  // namespace tessera
