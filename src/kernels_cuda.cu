// The library tessera_cuda_kernels: the float and double instances of every Cuda kernel launcher,
// and Tensor fill for integer elements (kernels/cuda/declarations.hpp lists them), compiled once by
// nvcc, so that the build's GPU programs are ordinary .cpp units compiled by the host compiler
// against the declarations.
#include <cstdint>

#include "tessera/kernels/cuda/adam.cuh"
#include "tessera/kernels/cuda/attention.cuh"
#include "tessera/kernels/cuda/batch_norm.cuh"
#include "tessera/kernels/cuda/conv2d.cuh"
#include "tessera/kernels/cuda/elementwise.cuh"
#include "tessera/kernels/cuda/embedding.cuh"
#include "tessera/kernels/cuda/gemm.cuh"
#include "tessera/kernels/cuda/lamb.cuh"
#include "tessera/kernels/cuda/lars.cuh"
#include "tessera/kernels/cuda/loss.cuh"
#include "tessera/kernels/cuda/norm.cuh"
#include "tessera/kernels/cuda/pool.cuh"
#include "tessera/kernels/cuda/sgd.cuh"
#include "tessera/kernels/cuda/softmax.cuh"
#include "tessera/layers/activation.hpp"  // the per-element Ops of the map kernels' instances

namespace tessera {
TESSERA_CUDA_KERNEL_INSTANCES(float)
TESSERA_CUDA_KERNEL_INSTANCES(double)
TESSERA_CUDA_BF16_INSTANCES
TESSERA_CUDA_FILL_INSTANCES(std::int32_t)
TESSERA_CUDA_FILL_INSTANCES(std::int64_t)
TESSERA_CUDA_FILL_INSTANCES(std::uint8_t)
TESSERA_CUDA_FILL_INSTANCES(Half)
TESSERA_CUDA_FILL_INSTANCES(BHalf)
TESSERA_CUDA_WIRE_INSTANCES(float, Half)
TESSERA_CUDA_WIRE_INSTANCES(float, BHalf)
TESSERA_CUDA_WIRE_INSTANCES(double, Half)
TESSERA_CUDA_WIRE_INSTANCES(double, BHalf)
}  // namespace tessera
