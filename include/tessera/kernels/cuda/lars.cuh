// LARS on the GPU: the Cuda overloads of l2_norm and lars_update in optim/lars.hpp. The norms
// come back to the host (the trust ratio is computed there, as on the CPU): one small copy and a
// stream synchronization per adapted parameter.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "tessera/kernels/cuda/launch.cuh"
#include "tessera/kernels/cuda/reduce.cuh"
#include "tessera/kernels/cpu/optim.hpp"

namespace tessera {

namespace cuda_detail {
template <class S>
__global__ void sum_of_squares_kernel(const S* x, std::int64_t n, double* block_sums) {
  __shared__ double scratch[32];
  double local = 0;
  TESSERA_CUDA_FOR(i, n) local += double(x[i]) * double(x[i]);
  local = block_reduce<false>(local, scratch);
  if (threadIdx.x == 0) block_sums[blockIdx.x] = local;
}
template <class S>
__global__ void lars_update_kernel(std::int64_t n, S* w, const S* g, S* v, S scaled_lr, S m, S decay) {
  TESSERA_CUDA_FOR(k, n) {
    v[k] = fma(scaled_lr, fma(decay, w[k], g[k]), v[k] * m);  // as the CPU kernel (torch's order)
    w[k] -= v[k];
  }
}
}  // namespace cuda_detail

template <class S>
double l2_norm(Cuda, const S* x, std::int64_t n) {
  if (n == 0) return 0;
  const unsigned blocks = std::min<unsigned>(cuda_detail::blocks_for(n), 1024);
  void* sums = Cuda::allocate(blocks * sizeof(double));
  cuda_detail::sum_of_squares_kernel<S><<<blocks, cuda_detail::kThreads, 0, Cuda::stream()>>>(
      x, n, static_cast<double*>(sums));
  TESSERA_CUDA_CHECK(cudaGetLastError());
  std::vector<double> host(blocks);
  Cuda::copy_to_host(host.data(), sums, blocks * sizeof(double));
  Cuda::synchronize();
  Cuda::deallocate(sums, blocks * sizeof(double));
  double total = 0;
  for (double v : host) total += v;
  return std::sqrt(total);
}

template <class S>
void lars_update(Cuda, std::int64_t n, S* w, const S* g, S* v, S scaled_lr, S m, S decay) {
  TESSERA_CUDA_LAUNCH(cuda_detail::lars_update_kernel<S>, n, n, w, g, v, scaled_lr, m, decay);
}

}  // namespace tessera
