// Loss kernels on the GPU: the Cuda overloads of kernels/cpu/loss.hpp (same maths, see there).
// Partial sums are added on the host in double, as the loss value is returned to the host anyway
// (the call therefore synchronizes the stream, as loss.item() does in PyTorch). Also the helpers
// the other losses share (kernels/cuda/softmax.cuh).
#pragma once

#include <cstdint>
#include <vector>

#include "tessera/kernels/cuda/elementwise.cuh"
#include "tessera/kernels/cuda/launch.cuh"
#include "tessera/kernels/cuda/reduce.cuh"

namespace tessera {

namespace cuda_detail {

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
