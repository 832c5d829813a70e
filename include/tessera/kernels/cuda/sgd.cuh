// The fused SGD update on the GPU: the Cuda overload of sgd_update in optim/sgd.hpp (same maths,
// same order of operations, scalars rounded from double once), one pass over p, g and the momentum
// buffer. fma() where torch's add(..., alpha) rounds once (see kernels/cpu/optim.hpp).
#pragma once

#include <cstdint>

#include "tessera/kernels/cuda/launch.cuh"
#include "tessera/kernels/cpu/optim.hpp"

namespace tessera {

namespace cuda_detail {
// mode 0: no momentum; 1: first step (buffer = d); 2: buffer = m buffer + (1 - dampening) d.
template <class S>
__global__ void sgd_update_kernel(std::int64_t n, S* p, const S* g, S* buf, int mode, S neg_lr, S wd, S m, S keep,
                                  bool nesterov) {
  TESSERA_CUDA_FOR(i, n) {
    const S d = fma(wd, p[i], g[i]);
    if (mode == 0) {
      p[i] = fma(neg_lr, d, p[i]);
    } else {
      const S b = mode == 1 ? d : fma(keep, d, buf[i] * m);
      buf[i] = b;
      p[i] = fma(neg_lr, nesterov ? fma(m, b, d) : b, p[i]);
    }
  }
}
}  // namespace cuda_detail

template <class S>
void sgd_update(Cuda, std::int64_t n, S* p, const S* g, S* buf, const SgdStep& c) {
  const int mode = c.momentum == 0 ? 0 : c.first_step ? 1 : 2;
  TESSERA_CUDA_LAUNCH(cuda_detail::sgd_update_kernel<S>, n, n, p, g, buf, mode, S(-c.lr), S(c.weight_decay),
                      S(c.momentum), S(1 - c.dampening), c.nesterov);
}

}  // namespace tessera
