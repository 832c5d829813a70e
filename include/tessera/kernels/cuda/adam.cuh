// The fused Adam/AdamW update on the GPU: the Cuda overload of adam_update in optim/adam.hpp
// (same maths and order of operations, as torch's; scalars rounded from double once; fma() where
// torch's add(..., alpha) and addcmul round once), one pass over p, g, m, v (and v_max).
#pragma once

#include <cmath>
#include <cstdint>

#include "tessera/kernels/cuda/launch.cuh"
#include "tessera/kernels/cpu/optim.hpp"

namespace tessera {

namespace cuda_detail {
template <class S>
__global__ void adam_update_kernel(std::int64_t n, S* p, const S* g, S* m, S* v, S* v_max, S step, S bc2_sqrt, S eps,
                                   S wd, S shrink, S b1, S b2, S one_minus_b1, S one_minus_b2) {
  TESSERA_CUDA_FOR(i, n) {
    const S gi = fma(wd, p[i], g[i]);
    p[i] = p[i] * shrink;
    m[i] = fma(one_minus_b1, gi, m[i] * b1);
    v[i] = fma(one_minus_b2 * gi, gi, v[i] * b2);
    S second = v[i];
    if (v_max != nullptr) {
      v_max[i] = v_max[i] > v[i] ? v_max[i] : v[i];
      second = v_max[i];
    }
    // addcdiv: (step * m) / denom, then + p, each rounded (nothing here nvcc could contract).
    p[i] = p[i] + step * m[i] / (sqrt(second) / bc2_sqrt + eps);
  }
}
}  // namespace cuda_detail

template <class S>
void adam_update(Cuda, std::int64_t n, S* p, const S* g, S* m, S* v, S* v_max, const AdamStep& c) {
  const double bias_correction1 = 1 - std::pow(c.beta1, static_cast<double>(c.t));
  const double bias_correction2 = 1 - std::pow(c.beta2, static_cast<double>(c.t));
  TESSERA_CUDA_LAUNCH(cuda_detail::adam_update_kernel<S>, n, n, p, g, m, v, v_max, S(-(c.lr / bias_correction1)),
                      S(std::sqrt(bias_correction2)), S(c.eps), S(c.l2_decay), S(1 - c.lr * c.decoupled_decay),
                      S(c.beta1), S(c.beta2), S(1 - c.beta1), S(1 - c.beta2));
}

}  // namespace tessera
