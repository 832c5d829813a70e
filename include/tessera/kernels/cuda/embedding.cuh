// Embedding on the GPU: the Cuda overloads of kernels/cpu/embedding.hpp. Backward adds each
// token's row with atomicAdd (a repeated id adds from several threads), so the order of a repeated
// id's additions, and with it the last bits of a float sum, may differ between runs.
#pragma once

#include <cstdint>

#include "tessera/kernels/cuda/launch.cuh"

namespace tessera {

namespace cuda_detail {

template <class S>
__global__ void embedding_forward_kernel(const S* weight, std::int64_t dim, const std::int64_t* ids, std::int64_t count,
                                         S* y) {
  TESSERA_CUDA_FOR(k, count * dim) y[k] = weight[ids[k / dim] * dim + k % dim];
}

template <class S>
__global__ void embedding_backward_kernel(const S* dy, const std::int64_t* ids, std::int64_t count, std::int64_t dim,
                                          std::int64_t skip_id, S* dweight) {
  TESSERA_CUDA_FOR(k, count * dim) {
    const std::int64_t id = ids[k / dim];
    if (id != skip_id) atomicAdd(dweight + id * dim + k % dim, dy[k]);
  }
}

}  // namespace cuda_detail

template <class S>
void embedding_forward(Cuda, const S* weight, std::int64_t dim, const std::int64_t* ids, std::int64_t count, S* y) {
  TESSERA_CUDA_LAUNCH(cuda_detail::embedding_forward_kernel<S>, count * dim, weight, dim, ids, count, y);
}

template <class S>
void embedding_backward(Cuda, const S* dy, const std::int64_t* ids, std::int64_t count, std::int64_t dim,
                        std::int64_t skip_id, S* dweight) {
  TESSERA_CUDA_LAUNCH(cuda_detail::embedding_backward_kernel<S>, count * dim, dy, ids, count, dim, skip_id, dweight);
}

}  // namespace tessera
