// Pooling kernels for every device: CPU always, CUDA in translation units compiled by nvcc.
#pragma once

#include "tessera/kernels/cpu/pool.hpp"
#if defined(__CUDACC__)
#include "tessera/kernels/cuda/pool.cuh"
#endif
