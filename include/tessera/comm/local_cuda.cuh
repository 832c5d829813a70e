// The single-GPU bundles: the Cuda device with the one-process communicator (CudaNccl, for many
// GPUs, lives with NcclComm). Kept out of device/cuda.cuh so that the device layer never
// includes a communicator.
#pragma once

#include "tessera/comm/local.hpp"
#include "tessera/core/env.hpp"
#include "tessera/device/cuda.cuh"

namespace tessera {

using CudaLocal = Env<Cuda, LocalComm, float>;
using CudaLocal64 = Env<Cuda, LocalComm, double>;
// float weights, bfloat16 products (core/env.hpp): cuBLAS's and cuDNN's bf16 tensor-core paths.
using CudaLocalBf16 = Env<Cuda, LocalComm, float, BFloat16>;

}  // namespace tessera
