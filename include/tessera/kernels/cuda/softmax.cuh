// Softmax kernels on the GPU: the Cuda overloads of kernels/cpu/softmax.hpp (same maths and
// layout, see there). One block per (outer, inner) row, with block reductions over the softmax
// dimension in double; the block is as narrow as the row allows (32 to 256 threads), so short rows
// (channel softmax over a few classes) do not leave most threads idle. The NLL loss is summed on
// the host in double, as the loss value is returned to the host anyway (like loss.item()).
#pragma once

#include <cstdint>

#include "tessera/kernels/cuda/launch.cuh"
#include "tessera/kernels/cuda/loss.cuh"
#include "tessera/kernels/cuda/reduce.cuh"

namespace tessera {

namespace cuda_detail {

inline unsigned softmax_block(std::int64_t dim) {
  unsigned threads = 32;
  while (threads < kThreads && static_cast<std::int64_t>(threads) < dim) threads *= 2;
  return threads;
}

template <class S>
__global__ void softmax_forward_kernel(const S* x, std::int64_t dim, std::int64_t inner, bool log, S* y) {
  __shared__ double scratch[32];
  const std::int64_t r = blockIdx.x, o = r / inner, i = r % inner;
  const S* xr = x + o * dim * inner + i;
  S* yr = y + o * dim * inner + i;
  double local_max = -INFINITY;
  for (std::int64_t j = threadIdx.x; j < dim; j += blockDim.x) local_max = fmax(local_max, double(xr[j * inner]));
  const double m = block_reduce<true>(local_max, scratch);
  double sum = 0;
  for (std::int64_t j = threadIdx.x; j < dim; j += blockDim.x) sum += exp(double(xr[j * inner]) - m);
  sum = block_reduce<false>(sum, scratch);
  if (log) {
    const double shift = ::log(sum);
    for (std::int64_t j = threadIdx.x; j < dim; j += blockDim.x) yr[j * inner] = S(double(xr[j * inner]) - m - shift);
  } else {
    const double inv = 1.0 / sum;
    for (std::int64_t j = threadIdx.x; j < dim; j += blockDim.x) yr[j * inner] = S(exp(double(xr[j * inner]) - m) * inv);
  }
}

template <class S>
__global__ void softmax_backward_kernel(const S* y, const S* dy, std::int64_t dim, std::int64_t inner, bool log,
                                        S* dx) {
  __shared__ double scratch[32];
  const std::int64_t r = blockIdx.x, o = r / inner, i = r % inner;
  const std::int64_t base = o * dim * inner + i;
  double dot = 0;
  for (std::int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
    const std::int64_t k = base + j * inner;
    dot += log ? double(dy[k]) : double(dy[k]) * double(y[k]);
  }
  dot = block_reduce<false>(dot, scratch);
  for (std::int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
    const std::int64_t k = base + j * inner;
    dx[k] = log ? S(dy[k] - exp(y[k]) * S(dot)) : S(y[k] * (dy[k] - S(dot)));
  }
}

template <class S>
__global__ void nll_forward_kernel(const S* logp, const std::int64_t* labels, std::int64_t n, std::int64_t classes,
                                   double smoothing, std::int64_t ignore_index, double* row_loss) {
  TESSERA_CUDA_FOR(i, n) {
    double loss = 0;
    if (labels[i] != ignore_index) {
      const S* row = logp + i * classes;
      loss = -(1.0 - smoothing) * double(row[labels[i]]);
      if (smoothing != 0) {
        double sum = 0;
        for (std::int64_t j = 0; j < classes; ++j) sum += double(row[j]);
        loss -= smoothing / double(classes) * sum;
      }
    }
    row_loss[i] = loss;
  }
}

template <class S>
__global__ void nll_backward_kernel(const S* logp, const std::int64_t* labels, std::int64_t n, std::int64_t classes,
                                    S off, S on, std::int64_t ignore_index, S scale, bool through_softmax, S* dx) {
  TESSERA_CUDA_FOR(k, n * classes) {
    const std::int64_t i = k / classes, j = k % classes;
    if (labels[i] == ignore_index) {
      dx[k] = S(0);
    } else {
      dx[k] = ((through_softmax ? S(exp(logp[k])) : S(0)) - off - (j == labels[i] ? on : S(0))) * scale;
    }
  }
}

}  // namespace cuda_detail

template <class S>
void softmax_forward(Cuda, const S* x, std::int64_t outer, std::int64_t dim, std::int64_t inner, bool log, S* y) {
  if (outer * inner == 0 || dim == 0) return;
  cuda_detail::softmax_forward_kernel<S><<<static_cast<unsigned>(outer * inner), cuda_detail::softmax_block(dim), 0,
                                           Cuda::stream()>>>(x, dim, inner, log, y);
  TESSERA_CUDA_CHECK(cudaGetLastError());
}

template <class S>
void softmax_backward(Cuda, const S* y, const S* dy, std::int64_t outer, std::int64_t dim, std::int64_t inner,
                      bool log, S* dx) {
  if (outer * inner == 0 || dim == 0) return;
  cuda_detail::softmax_backward_kernel<S><<<static_cast<unsigned>(outer * inner), cuda_detail::softmax_block(dim), 0,
                                            Cuda::stream()>>>(y, dy, dim, inner, log, dx);
  TESSERA_CUDA_CHECK(cudaGetLastError());
}

template <class S>
double nll_forward(Cuda, const S* logp, const std::int64_t* labels, std::int64_t n, std::int64_t classes,
                   double smoothing, std::int64_t ignore_index) {
  if (n == 0) return 0;
  cuda_detail::DeviceScratch row_loss(static_cast<std::size_t>(n) * sizeof(double));
  TESSERA_CUDA_LAUNCH(cuda_detail::nll_forward_kernel<S>, n, logp, labels, n, classes, smoothing, ignore_index,
                      row_loss.as<double>());
  return cuda_detail::sum_on_host(row_loss.as<double>(), n);
}

template <class S>
void nll_backward(Cuda, const S* logp, const std::int64_t* labels, std::int64_t n, std::int64_t classes,
                  double smoothing, std::int64_t ignore_index, double scale, bool through_softmax, S* dx) {
  TESSERA_CUDA_LAUNCH(cuda_detail::nll_backward_kernel<S>, n * classes, logp, labels, n, classes,
                      static_cast<S>(smoothing / static_cast<double>(classes)), static_cast<S>(1.0 - smoothing),
                      ignore_index, static_cast<S>(scale), through_softmax, dx);
}

}  // namespace tessera
