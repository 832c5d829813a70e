// LAMB on the GPU: the Cuda overloads of lamb_moments and lamb_apply in optim/lamb.hpp (the norms
// for the trust ratio are lars.cuh's l2_norm).
#pragma once

#include <cstdint>

#include "tessera/kernels/cuda/lars.cuh"
#include "tessera/kernels/cpu/optim.hpp"

namespace tessera {

namespace cuda_detail {
template <class S>
__global__ void lamb_moments_kernel(std::int64_t n, const S* w, const S* g, S* m, S* v, S* r, LambCoefficients<S> c) {
  TESSERA_CUDA_FOR(k, n) {
    m[k] = c.b1 * m[k] + (S(1) - c.b1) * g[k];
    v[k] = c.b2 * v[k] + (S(1) - c.b2) * g[k] * g[k];
    r[k] = (m[k] * c.inv_c1) / (sqrt(v[k] * c.inv_c2) + c.eps) + c.wd * w[k];
  }
}
template <class S>
__global__ void lamb_apply_kernel(std::int64_t n, S* w, const S* r, S step) {
  TESSERA_CUDA_FOR(k, n) w[k] -= step * r[k];
}
}  // namespace cuda_detail

template <class S>
void lamb_moments(Cuda, std::int64_t n, const S* w, const S* g, S* m, S* v, S* r, LambCoefficients<S> c) {
  TESSERA_CUDA_LAUNCH(cuda_detail::lamb_moments_kernel<S>, n, n, w, g, m, v, r, c);
}
template <class S>
void lamb_apply(Cuda, std::int64_t n, S* w, const S* r, S step) {
  TESSERA_CUDA_LAUNCH(cuda_detail::lamb_apply_kernel<S>, n, n, w, r, step);
}

}  // namespace tessera
