// gemm for every device. The CPU kernel is Eigen's and Eigen stays out of CUDA translation units
// (its templates would be compiled by nvcc's front end: slow, and noisy with warnings), so a TU
// compiled by nvcc gets the cuBLAS kernel only, and one compiled by the host compiler the Eigen
// kernel only: a program that runs a model on both devices builds each half in its own TU (see
// tests/cuda/layer_equivalence.hpp).
//
// gemm_in<Compute> is the product a layer of Env E runs: gemm_in<typename E::Compute>. Compute is
// the Scalar (the plain gemm) or BFloat16 (gemm_bf16: operands rounded to bfloat16, float sums;
// on the CPU, kernels/cpu/gemm_bf16.hpp; on the GPU, cuBLAS's CUBLAS_COMPUTE_32F_FAST_16BF; see
// core/env.hpp).
#pragma once

#include <cstdint>
#include <type_traits>

#include "tessera/core/env.hpp"

#if defined(__CUDACC__)
#include "tessera/kernels/cuda/gemm.cuh"
#else
#include "tessera/kernels/cpu/gemm.hpp"
#include "tessera/kernels/cpu/gemm_bf16.hpp"
#if defined(TESSERA_COMPILED_CUDA_KERNELS)  // the Cuda overloads too (kernels/cuda/declarations.hpp)
#include "tessera/kernels/cuda/declarations.hpp"
#endif
#endif

namespace tessera {

template <class Compute, class D, class S>
void gemm_in(D device, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, S alpha,
             const S* a, std::int64_t lda, const S* b, std::int64_t ldb, S beta, S* c, std::int64_t ldc) {
  if constexpr (std::is_same_v<Compute, BFloat16>) {
    static_assert(std::is_same_v<S, float>, "bfloat16 compute (Env<..., float, BFloat16>) keeps float weights");
    gemm_bf16(device, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
    gemm(device, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

}  // namespace tessera
