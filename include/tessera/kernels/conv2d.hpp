// Convolution kernels for every device. The CPU kernel multiplies through Eigen, which stays out
// of CUDA translation units: nvcc's TUs get the cuDNN kernel, the host compiler's the CPU one
// (see kernels/gemm.hpp).
#pragma once

#if defined(__CUDACC__)
#include "tessera/kernels/cuda/conv2d.cuh"
#else
#include "tessera/kernels/cpu/conv2d.hpp"
#if defined(TESSERA_COMPILED_CUDA_KERNELS)  // the Cuda overloads too (kernels/cuda/declarations.hpp)
#include "tessera/kernels/cuda/declarations.hpp"
#endif
#endif
