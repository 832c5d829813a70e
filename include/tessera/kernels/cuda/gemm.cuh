// gemm on the GPU: the Cuda overload of kernels/cpu/gemm.hpp, C = alpha op(A) op(B) + beta C on
// row-major matrices, through cuBLAS on the device's stream, at Cuda::math_precision() (double
// always computes in double). gemm_bf16 is the product of an Env<Cuda, Comm, float, BFloat16>
// (gemm_in<BFloat16>): bfloat16 products with float sums whatever the process's math precision,
// as gemm_bf16(Cpu) on the CPU and PyTorch's autocast to bfloat16.
//
// cuBLAS is column-major. A row-major (m, n) matrix is the column-major (n, m) matrix C^T, and
// C^T = op(B)^T op(A)^T, so the row-major product is cuBLAS's column-major product with the
// operands swapped: gemm(opB, opA, n, m, k, B, ldb, A, lda, C, ldc). No data moves.
#pragma once

#include <cstdint>
#include <limits>
#include <type_traits>

#include "tessera/device/cuda.cuh"
#include "tessera/kernels/cuda/declarations.hpp"

namespace tessera {

template <class S>
void gemm(Cuda, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, S alpha, const S* a,
          std::int64_t lda, const S* b, std::int64_t ldb, S beta, S* c, std::int64_t ldc) {
  static_assert(std::is_same_v<S, float> || std::is_same_v<S, double>, "gemm(Cuda): float or double");
  if (m == 0 || n == 0) return;
  const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  // cuBLAS's classic API takes int sizes; a larger one would wrap silently.
  const auto i = [](std::int64_t v) {
    TESSERA_CHECK(v >= 0 && v <= std::numeric_limits<int>::max(), ArgumentError, "gemm(Cuda): size or stride ", v,
                  " does not fit cuBLAS's int arguments");
    return static_cast<int>(v);
  };
  if constexpr (std::is_same_v<S, float>) {
    const MathPrecision precision = Cuda::math_precision();
    if (precision == MathPrecision::Float32) {
      TESSERA_CUBLAS_CHECK(cublasSgemm(Cuda::cublas(), op_b, op_a, i(n), i(m), i(k), &alpha, b, i(ldb), a, i(lda),
                                       &beta, c, i(ldc)));
    } else {
      // fp32 in and out, products on tensor cores from TF32 / 16-bit roundings of the inputs, fp32 sums.
      const cublasComputeType_t compute = precision == MathPrecision::TensorFloat32 ? CUBLAS_COMPUTE_32F_FAST_TF32
                                          : precision == MathPrecision::Float16     ? CUBLAS_COMPUTE_32F_FAST_16F
                                                                                    : CUBLAS_COMPUTE_32F_FAST_16BF;
      TESSERA_CUBLAS_CHECK(cublasGemmEx(Cuda::cublas(), op_b, op_a, i(n), i(m), i(k), &alpha, b, CUDA_R_32F, i(ldb), a,
                                        CUDA_R_32F, i(lda), &beta, c, CUDA_R_32F, i(ldc), compute,
                                        CUBLAS_GEMM_DEFAULT));
    }
  } else {
    TESSERA_CUBLAS_CHECK(cublasDgemm(Cuda::cublas(), op_b, op_a, i(n), i(m), i(k), &alpha, b, i(ldb), a, i(lda), &beta,
                                     c, i(ldc)));
  }
}

// fp32 in and out; cuBLAS rounds A and B to bfloat16 (8 significant bits, fp32's range) and sums
// their products in fp32 on the tensor cores (CUBLAS_COMPUTE_32F_FAST_16BF), as the CPU's
// gemm_bf16. A template over S only so that it is declared and instantiated as the other
// launchers (kernels/cuda/declarations.hpp); float is its one instance.
template <class S>
void gemm_bf16(Cuda, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, S alpha, const S* a,
               std::int64_t lda, const S* b, std::int64_t ldb, S beta, S* c, std::int64_t ldc) {
  static_assert(std::is_same_v<S, float>, "gemm_bf16(Cuda): bfloat16 products of float matrices");
  if (m == 0 || n == 0) return;
  const auto i = [](std::int64_t v) {
    TESSERA_CHECK(v >= 0 && v <= std::numeric_limits<int>::max(), ArgumentError, "gemm_bf16(Cuda): size or stride ",
                  v, " does not fit cuBLAS's int arguments");
    return static_cast<int>(v);
  };
  TESSERA_CUBLAS_CHECK(cublasGemmEx(Cuda::cublas(), trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                    trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, i(n), i(m), i(k), &alpha, b, CUDA_R_32F,
                                    i(ldb), a, CUDA_R_32F, i(lda), &beta, c, CUDA_R_32F, i(ldc),
                                    CUBLAS_COMPUTE_32F_FAST_16BF, CUBLAS_GEMM_DEFAULT));
}

}  // namespace tessera
