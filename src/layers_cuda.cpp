// Part of tessera_cuda_kernels: the layers, losses and models of the one-process GPU Envs
// (CudaLocal, CudaLocal64), compiled once, by the host compiler, for every GPU program of the build
// (src/layers_cpu.cpp is the CPU twin; comm/local_env.hpp explains). Their device code is the
// launchers' (src/kernels_cuda.cu), seen here through their declarations.
#ifndef TESSERA_COMPILED_CUDA_KERNELS
#define TESSERA_COMPILED_CUDA_KERNELS 1
#endif
#include "tessera/comm/local_cuda.cuh"
#include "local_layers.hpp"

namespace tessera {
TESSERA_LOCAL_LAYER_LIST(TESSERA_LOCAL_CUDA_INSTANCES)
}  // namespace tessera
