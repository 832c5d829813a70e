// Block-wide reductions for the CUDA kernels: every thread of a block passes its partial value
// and every thread gets the block's total (a warp shuffle tree, then one value per warp through
// shared memory). Blocks are at most 1024 threads, i.e. at most 32 warps.
#pragma once

namespace tessera::cuda_detail {

template <class T>
__device__ T warp_sum(T v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  return v;
}
template <class T>
__device__ T warp_max(T v) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const T other = __shfl_down_sync(0xffffffffu, v, offset);
    v = other > v ? other : v;
  }
  return v;
}

// Op is warp_sum or warp_max's combine; `scratch` holds 32 T in shared memory.
template <bool Max, class T>
__device__ T block_reduce(T v, T* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = (blockDim.x + 31) / 32;
  v = Max ? warp_max(v) : warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < warps ? scratch[lane] : (Max ? scratch[0] : T(0));
    v = Max ? warp_max(v) : warp_sum(v);
    if (lane == 0) scratch[0] = v;
  }
  __syncthreads();
  return scratch[0];
}

}  // namespace tessera::cuda_detail
