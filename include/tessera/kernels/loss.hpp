// Loss kernels for every device: CPU always, CUDA in translation units compiled by nvcc.
#pragma once

#include "tessera/kernels/cpu/loss.hpp"
#if defined(__CUDACC__)
#include "tessera/kernels/cuda/loss.cuh"
#endif
