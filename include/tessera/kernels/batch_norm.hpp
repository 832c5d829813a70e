// Batch-norm kernels for every device: CPU always, CUDA in translation units compiled by nvcc.
#pragma once

#include "tessera/kernels/cpu/batch_norm.hpp"
#if defined(__CUDACC__)
#include "tessera/kernels/cuda/batch_norm.cuh"
#elif defined(TESSERA_COMPILED_CUDA_KERNELS)  // their declarations (kernels/cuda/declarations.hpp)
#include "tessera/kernels/cuda/declarations.hpp"
#endif
