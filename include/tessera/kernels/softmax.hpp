// Softmax and NLL kernels for every device: CPU always, CUDA in translation units compiled by nvcc.
#pragma once

#include "tessera/kernels/cpu/softmax.hpp"
#if defined(__CUDACC__)
#include "tessera/kernels/cuda/softmax.cuh"
#endif
