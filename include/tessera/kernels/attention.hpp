// Scaled dot-product attention kernels for every device: the CPU ones (kernels/cpu/attention.hpp) always, the
// CUDA ones (kernels/cuda/attention.cuh) in translation units compiled by nvcc, their declarations
// elsewhere in GPU programs (kernels/cuda/declarations.hpp).
#pragma once

#include "tessera/kernels/cpu/attention.hpp"
#if defined(__CUDACC__)
#include "tessera/kernels/cuda/attention.cuh"
#elif defined(TESSERA_COMPILED_CUDA_KERNELS)  // their declarations (kernels/cuda/declarations.hpp)
#include "tessera/kernels/cuda/declarations.hpp"
#endif
