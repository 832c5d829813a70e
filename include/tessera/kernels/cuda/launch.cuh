// Launch helpers shared by the CUDA kernels: one thread per element over a grid-stride loop, so
// one launch shape serves every size (a grid capped at what keeps all SMs busy, each thread
// looping when n is larger), and a launch check that names the kernel.
#pragma once

#include <algorithm>
#include <cstdint>

#include "tessera/device/cuda.cuh"
#include "tessera/kernels/cuda/declarations.hpp"

namespace tessera::cuda_detail {

inline constexpr int kThreads = 256;

// Enough blocks to cover n once, at most 65535 x 32 (grid-stride loops pick up the rest).
inline unsigned blocks_for(std::int64_t n) {
  const std::int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::clamp<std::int64_t>(blocks, 1, 65535 * 32));
}

// for (i : this thread's elements of [0, n)) inside a kernel.
#define TESSERA_CUDA_FOR(i, n)                                                                       \
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<std::int64_t>(blockDim.x) * gridDim.x)

// Launches kernel<<<blocks_for(n), kThreads, 0, Cuda::stream()>>>(args...) when n > 0 and
// reports a launch failure (bad configuration, no device) with the kernel's name and call site.
#define TESSERA_CUDA_LAUNCH(kernel, n, ...)                                                   \
  do {                                                                                        \
    if ((n) > 0) {                                                                            \
      kernel<<<::tessera::cuda_detail::blocks_for(n), ::tessera::cuda_detail::kThreads, 0,   \
               ::tessera::Cuda::stream()>>>(__VA_ARGS__);                                     \
      ::tessera::detail::cuda_check(cudaGetLastError(), #kernel, __FILE__, __LINE__);        \
    }                                                                                         \
  } while (0)

}  // namespace tessera::cuda_detail
