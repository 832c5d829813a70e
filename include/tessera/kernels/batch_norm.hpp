// Batch-norm kernels for every device: CPU always, CUDA in translation units compiled by nvcc.
#pragma once

#include "tessera/kernels/cpu/batch_norm.hpp"
#if defined(__CUDACC__)
#include "tessera/kernels/cuda/batch_norm.cuh"
#endif
