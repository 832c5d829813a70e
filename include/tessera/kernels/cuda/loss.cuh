// Loss kernels on the GPU: the Cuda overloads of kernels/cpu/loss.hpp (same maths, see there).
// Cross-entropy runs one block per row (block reductions for max, sum exp and sum z); the
// per-row losses are summed on the host in double, as the loss value is returned to the host
// anyway (the call therefore synchronizes the stream, as loss.item() does in PyTorch).
#pragma once

#include <cstdint>
#include <vector>

#include "tessera/kernels/cuda/elementwise.cuh"
#include "tessera/kernels/cuda/launch.cuh"
#include "tessera/kernels/cuda/reduce.cuh"

namespace tessera {

namespace cuda_detail {

template <class S>
__global__ void softmax_cross_entropy_forward_kernel(const S* logits, const std::int64_t* labels,
                                                     std::int64_t classes, double smoothing, S* probs,
                                                     double* row_loss) {
  __shared__ double scratch[32];
  const std::int64_t i = blockIdx.x;
  const S* z = logits + i * classes;
  S* p = probs + i * classes;
  double local_max = -INFINITY;
  for (std::int64_t j = threadIdx.x; j < classes; j += blockDim.x) local_max = fmax(local_max, double(z[j]));
  const double zmax = block_reduce<true>(local_max, scratch);
  double sum_exp = 0, sum_z = 0;
  for (std::int64_t j = threadIdx.x; j < classes; j += blockDim.x) {
    const S e = exp(z[j] - S(zmax));
    p[j] = e;
    sum_exp += e;
    sum_z += z[j];
  }
  sum_exp = block_reduce<false>(sum_exp, scratch);
  sum_z = block_reduce<false>(sum_z, scratch);
  const S inv = S(1.0 / sum_exp);
  for (std::int64_t j = threadIdx.x; j < classes; j += blockDim.x) p[j] *= inv;
  if (threadIdx.x == 0) {
    const double lse = zmax + log(sum_exp);
    const double nll = lse - double(z[labels[i]]);
    const double uniform = lse - sum_z / double(classes);
    row_loss[i] = (1.0 - smoothing) * nll + smoothing * uniform;
  }
}

template <class S>
__global__ void softmax_cross_entropy_backward_kernel(const S* probs, const std::int64_t* labels, std::int64_t n,
                                                      std::int64_t classes, S off, S on, S scale, S* dlogits) {
  TESSERA_CUDA_FOR(k, n * classes) {
    const std::int64_t i = k / classes, j = k % classes;
    dlogits[k] = (probs[k] - off - (j == labels[i] ? on : S(0))) * scale;
  }
}

template <class S>
__global__ void squared_error_forward_kernel(const S* y, const S* t, std::int64_t n, S* diff, double* block_sums) {
  __shared__ double scratch[32];
  double local = 0;
  TESSERA_CUDA_FOR(i, n) {
    diff[i] = y[i] - t[i];
    local += double(diff[i]) * double(diff[i]);
  }
  local = block_reduce<false>(local, scratch);
  if (threadIdx.x == 0) block_sums[blockIdx.x] = local;
}

// Copies `count` doubles to the host (waiting for them) and sums them there.
inline double sum_on_host(const double* device_values, std::int64_t count) {
  std::vector<double> host(static_cast<std::size_t>(count));
  Cuda::copy_to_host(host.data(), device_values, host.size() * sizeof(double));
  Cuda::synchronize();
  double total = 0;
  for (double v : host) total += v;
  return total;
}

// Device scratch from the caching allocator, returned when the scope ends.
struct DeviceScratch {
  void* p;
  std::size_t bytes;
  explicit DeviceScratch(std::size_t b) : p(Cuda::allocate(b)), bytes(b) {}
  ~DeviceScratch() { Cuda::deallocate(p, bytes); }
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

}  // namespace cuda_detail

template <class S>
double softmax_cross_entropy_forward(Cuda, const S* logits, const std::int64_t* labels, std::int64_t n,
                                     std::int64_t classes, double smoothing, S* probs) {
  if (n == 0) return 0;
  cuda_detail::DeviceScratch row_loss(static_cast<std::size_t>(n) * sizeof(double));
  cuda_detail::softmax_cross_entropy_forward_kernel<S><<<static_cast<unsigned>(n), cuda_detail::kThreads, 0,
                                                         Cuda::stream()>>>(logits, labels, classes, smoothing, probs,
                                                                           row_loss.as<double>());
  TESSERA_CUDA_CHECK(cudaGetLastError());
  return cuda_detail::sum_on_host(row_loss.as<double>(), n);
}

template <class S>
void softmax_cross_entropy_backward(Cuda, const S* probs, const std::int64_t* labels, std::int64_t n,
                                    std::int64_t classes, double smoothing, double scale, S* dlogits) {
  TESSERA_CUDA_LAUNCH(cuda_detail::softmax_cross_entropy_backward_kernel<S>, n * classes, probs, labels, n, classes,
                      static_cast<S>(smoothing / static_cast<double>(classes)), static_cast<S>(1.0 - smoothing),
                      static_cast<S>(scale), dlogits);
}

template <class S>
double squared_error_forward(Cuda, const S* y, const S* t, std::int64_t n, S* diff) {
  if (n == 0) return 0;
  const unsigned blocks = cuda_detail::blocks_for(n);
  cuda_detail::DeviceScratch sums(blocks * sizeof(double));
  cuda_detail::squared_error_forward_kernel<S><<<blocks, cuda_detail::kThreads, 0, Cuda::stream()>>>(
      y, t, n, diff, sums.as<double>());
  TESSERA_CUDA_CHECK(cudaGetLastError());
  return cuda_detail::sum_on_host(sums.as<double>(), blocks);
}

}  // namespace tessera
