// Optimizer update kernels for every device: the CPU ones (kernels/cpu/optim.hpp) always, the CUDA
// ones in translation units compiled by nvcc. The optimizers call sgd_update(D{}, ...) etc., and
// overload resolution on the device tag picks the kernel.
#pragma once

#include "tessera/kernels/cpu/optim.hpp"
#if defined(__CUDACC__)
#include "tessera/kernels/cuda/adam.cuh"
#include "tessera/kernels/cuda/lamb.cuh"
#include "tessera/kernels/cuda/lars.cuh"
#include "tessera/kernels/cuda/sgd.cuh"
#elif defined(TESSERA_COMPILED_CUDA_KERNELS)  // their declarations (kernels/cuda/declarations.hpp)
#include "tessera/kernels/cuda/declarations.hpp"
#endif
