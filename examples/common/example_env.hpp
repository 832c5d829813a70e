// The examples' layer bundle: float32 on the CPU, or on the GPU in their CUDA builds
// (main_cuda.cu / main_nccl.cu define TESSERA_EXAMPLE_CUDA or TESSERA_EXAMPLE_NCCL and include
// main.cpp, compiled by nvcc). The strategy's communicator is each example's own choice.
#pragma once

#if defined(TESSERA_EXAMPLE_CUDA) || defined(TESSERA_EXAMPLE_NCCL)
#include "tessera/device/cuda.cuh"
#else
#include "tessera/comm/local.hpp"
#endif

namespace examples {
#if defined(TESSERA_EXAMPLE_CUDA) || defined(TESSERA_EXAMPLE_NCCL)
using Env = tessera::CudaLocal;
#else
using Env = tessera::CpuLocal;
#endif
using Device = typename Env::Device;
}  // namespace examples
