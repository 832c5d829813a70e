// Elementwise kernels for every device: the CPU ones (kernels/cpu/elementwise.hpp) always, the
// CUDA ones (kernels/cuda/elementwise.cuh) in translation units compiled by nvcc. Layers call
// them as relu_forward(D{}, ...), and overload resolution on the device tag picks the kernel.
#pragma once

#include "tessera/kernels/cpu/elementwise.hpp"
#if defined(__CUDACC__)
#include "tessera/kernels/cuda/elementwise.cuh"
#elif defined(TESSERA_COMPILED_CUDA_KERNELS)  // their declarations (kernels/cuda/declarations.hpp)
#include "tessera/kernels/cuda/declarations.hpp"
#endif
