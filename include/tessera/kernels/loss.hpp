// Loss kernels for every device: CPU always, CUDA in translation units compiled by nvcc.
#pragma once

#include "tessera/kernels/cpu/loss.hpp"
#if defined(__CUDACC__)
#include "tessera/kernels/cuda/loss.cuh"
#elif defined(TESSERA_COMPILED_CUDA_KERNELS)  // their declarations (kernels/cuda/declarations.hpp)
#include "tessera/kernels/cuda/declarations.hpp"
#endif
