// gemm: C = alpha * op(A) * op(B) + beta * C on row-major matrices, the one matrix product every
// CPU layer goes through (Linear directly; Conv2d after im2col).
//
// Shapes: op(A) is (m, k), op(B) is (k, n), C is (m, n); lda/ldb/ldc are row strides.
// The product runs on Eigen's blocked GEMM, parallel over the OpenMP team. With TESSERA_USE_BLAS
// defined (meson option `blas`), Eigen hands products to the system BLAS (EIGEN_USE_BLAS), which
// must then be defined before any Eigen header: the umbrella header takes care of that.
#pragma once

#include <Eigen/Core>
#include <cstdint>

#include "tessera/device/cpu.hpp"

namespace tessera {

template <class S>
void gemm(Cpu, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, S alpha, const S* a,
          std::int64_t lda, const S* b, std::int64_t ldb, S beta, S* c, std::int64_t ldc) {
  using RowMat = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using ConstMap = Eigen::Map<const RowMat, Eigen::Unaligned, Eigen::OuterStride<>>;
  using Map = Eigen::Map<RowMat, Eigen::Unaligned, Eigen::OuterStride<>>;
  Map cm(c, m, n, Eigen::OuterStride<>(ldc));
  if (beta == S(0))
    cm.setZero();
  else if (beta != S(1))
    cm *= beta;
  if (m == 0 || n == 0 || k == 0) return;
  // A stored as (m, k) or, when transposed, as (k, m); likewise B.
  ConstMap am(a, trans_a ? k : m, trans_a ? m : k, Eigen::OuterStride<>(lda));
  ConstMap bm(b, trans_b ? n : k, trans_b ? k : n, Eigen::OuterStride<>(ldb));
  if (!trans_a && !trans_b)
    cm.noalias() += alpha * am * bm;
  else if (trans_a && !trans_b)
    cm.noalias() += alpha * am.transpose() * bm;
  else if (!trans_a && trans_b)
    cm.noalias() += alpha * am * bm.transpose();
  else
    cm.noalias() += alpha * am.transpose() * bm.transpose();
}

}  // namespace tessera
