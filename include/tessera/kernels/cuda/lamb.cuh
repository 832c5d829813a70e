// LAMB on the GPU: the Cuda overloads of lamb_moments and lamb_apply in optim/lamb.hpp (the norms
// for the trust ratio are lars.cuh's l2_norm). Same order of operations as the CPU kernels.
#pragma once

#include <cstdint>

#include "tessera/kernels/cuda/lars.cuh"
#include "tessera/kernels/cpu/optim.hpp"

namespace tessera {

namespace cuda_detail {
template <class S>
__global__ void lamb_moments_kernel(std::int64_t n, const S* w, const S* g, S* m, S* v, S* r, LambCoefficients<S> c) {
  TESSERA_CUDA_FOR(k, n) {
    m[k] = fma(c.one_minus_b1, g[k], m[k] * c.b1);
    v[k] = fma(c.one_minus_b2 * g[k], g[k], v[k] * c.b2);
    r[k] = fma(c.wd, w[k], (m[k] / c.c1) / (sqrt(v[k] / c.c2) + c.eps));
  }
}
template <class S>
__global__ void lamb_apply_kernel(std::int64_t n, S* w, const S* r, S neg_step) {
  TESSERA_CUDA_FOR(k, n) w[k] = fma(neg_step, r[k], w[k]);
}
}  // namespace cuda_detail

template <class S>
void lamb_moments(Cuda, std::int64_t n, const S* w, const S* g, S* m, S* v, S* r, LambCoefficients<S> c) {
  TESSERA_CUDA_LAUNCH(cuda_detail::lamb_moments_kernel<S>, n, n, w, g, m, v, r, c);
}
template <class S>
void lamb_apply(Cuda, std::int64_t n, S* w, const S* r, S neg_step) {
  TESSERA_CUDA_LAUNCH(cuda_detail::lamb_apply_kernel<S>, n, n, w, r, neg_step);
}

}  // namespace tessera
