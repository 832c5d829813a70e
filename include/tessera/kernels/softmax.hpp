// Softmax and NLL kernels for every device: CPU always, CUDA in translation units compiled by nvcc.
#pragma once

#include "tessera/kernels/cpu/softmax.hpp"
#if defined(__CUDACC__)
#include "tessera/kernels/cuda/softmax.cuh"
#elif defined(TESSERA_COMPILED_CUDA_KERNELS)  // their declarations (kernels/cuda/declarations.hpp)
#include "tessera/kernels/cuda/declarations.hpp"
#endif
