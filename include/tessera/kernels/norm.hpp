// LayerNorm and RMSNorm kernels for every device: the CPU ones (kernels/cpu/norm.hpp) always, the
// CUDA ones (kernels/cuda/norm.cuh) in translation units compiled by nvcc, their declarations
// elsewhere in GPU programs (kernels/cuda/declarations.hpp).
#pragma once

#include "tessera/kernels/cpu/norm.hpp"
#if defined(__CUDACC__)
#include "tessera/kernels/cuda/norm.cuh"
#elif defined(TESSERA_COMPILED_CUDA_KERNELS)  // their declarations (kernels/cuda/declarations.hpp)
#include "tessera/kernels/cuda/declarations.hpp"
#endif
