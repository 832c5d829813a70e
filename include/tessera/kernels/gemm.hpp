// gemm for every device. The CPU kernel is Eigen's and Eigen stays out of CUDA translation units
// (its templates would be compiled by nvcc's front end: slow, and noisy with warnings), so a TU
// compiled by nvcc gets the cuBLAS kernel only, and one compiled by the host compiler the Eigen
// kernel only: a program that runs a model on both devices builds each half in its own TU (see
// tests/cuda/layer_equivalence.hpp).
#pragma once

#if defined(__CUDACC__)
#include "tessera/kernels/cuda/gemm.cuh"
#else
#include "tessera/kernels/cpu/gemm.hpp"
#endif
