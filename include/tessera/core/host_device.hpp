// TESSERA_HOST_DEVICE marks a function that runs on the host and, in translation units compiled
// by nvcc, on the GPU too (the per-element functors of Pointwise layers).
#pragma once

#if defined(__CUDACC__)
#define TESSERA_HOST_DEVICE __host__ __device__
#else
#define TESSERA_HOST_DEVICE
#endif
