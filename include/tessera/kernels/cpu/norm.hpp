// Row normalizations on the CPU: LayerNorm and RMSNorm over the last n values of each of `rows`
// rows (x seen as (rows, n), n = the product of normalized_shape), as torch.nn.LayerNorm and
// torch.nn.RMSNorm.
//
//   LayerNorm:  mu = mean_j x_j   var = mean_j (x_j - mu)^2 (biased)   r = 1 / sqrt(var + eps)
//               xhat_j = (x_j - mu) r        y_j = xhat_j w_j + b_j
//               dxhat_j = dy_j w_j
//               dx_j = r (dxhat_j - mean_k dxhat_k - xhat_j mean_k dxhat_k xhat_k)
//   RMSNorm:    r = 1 / sqrt(mean_j x_j^2 + eps)   xhat_j = x_j r   y_j = xhat_j w_j
//               dx_j = r (dxhat_j - xhat_j mean_k dxhat_k xhat_k)
//   both:       dw_j += sum_rows dy_j xhat_j     db_j += sum_rows dy_j     (accumulated)
// w and b may be null (no affine, no bias): then they count as 1 and 0. The row statistics (mu
// and r, saved for backward) and the row sums of backward run in double; rows are independent
// and split over the OpenMP team, the parameter gradients by column blocks (no two threads add
// to one w_j).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "tessera/device/cpu.hpp"
#include "tessera/kernels/cpu/compiled.hpp"

namespace tessera {

namespace detail {
inline constexpr std::int64_t kNormParallelGrain = 1 << 14;  // elements below which one thread does it
inline constexpr std::int64_t kNormColumnBlock = 64;         // columns per parameter-gradient task

// dw_j += sum_r dy[r, j] xhat[r, j] and db_j += sum_r dy[r, j], xhat from x and the saved
// statistics (mean null: RMSNorm). Parallel over column blocks.
template <class S>
void norm_parameter_grads(const S* x, const S* dy, const S* mean, const S* rstd, std::int64_t rows, std::int64_t n,
                          S* dweight, S* dbias) {
  if (dweight == nullptr && dbias == nullptr) return;
  const std::int64_t blocks = (n + kNormColumnBlock - 1) / kNormColumnBlock;
  detail::parallel_for(blocks, rows * n >= kNormParallelGrain && blocks > 1, [&](std::int64_t blk) {
    const std::int64_t j0 = blk * kNormColumnBlock, j1 = std::min(n, j0 + kNormColumnBlock);
    S dw[kNormColumnBlock] = {}, db[kNormColumnBlock] = {};
    for (std::int64_t r = 0; r < rows; ++r) {
      const S* xr = x + r * n;
      const S* gr = dy + r * n;
      const S mu = mean != nullptr ? mean[r] : S(0), rs = rstd[r];
      for (std::int64_t j = j0; j < j1; ++j) {
        dw[j - j0] += gr[j] * ((xr[j] - mu) * rs);
        db[j - j0] += gr[j];
      }
    }
    for (std::int64_t j = j0; j < j1; ++j) {
      if (dweight != nullptr) dweight[j] += dw[j - j0];
      if (dbias != nullptr) dbias[j] += db[j - j0];
    }
  });
}

// The forward of both (mean null: RMSNorm, no centring).
template <class S>
void norm_forward(const S* x, std::int64_t rows, std::int64_t n, const S* weight, const S* bias, double eps, S* y,
                  S* mean, S* rstd) {
  detail::parallel_for(rows, rows * n >= kNormParallelGrain, [&](std::int64_t r) {
    const S* xr = x + r * n;
    S* yr = y + r * n;
    // The row sums in double, vectorized: `omp simd reduction` lets the compiler reorder them (it
    // keeps a float or double sum in source order otherwise, one element at a time).
    double mu = 0;
    if (mean != nullptr) {
#pragma omp simd reduction(+ : mu)
      for (std::int64_t j = 0; j < n; ++j) mu += static_cast<double>(xr[j]);
      mu /= static_cast<double>(n);
    }
    double ss = 0;  // sum (x - mu)^2, two-pass: no cancellation when |mu| >> the spread
#pragma omp simd reduction(+ : ss)
    for (std::int64_t j = 0; j < n; ++j) {
      const double c = static_cast<double>(xr[j]) - mu;
      ss += c * c;
    }
    const double rs = 1.0 / std::sqrt(ss / static_cast<double>(n) + eps);
    if (mean != nullptr) mean[r] = static_cast<S>(mu);
    rstd[r] = static_cast<S>(rs);
    const S m = static_cast<S>(mu), s = static_cast<S>(rs);
    for (std::int64_t j = 0; j < n; ++j) {
      const S xhat = (xr[j] - m) * s;
      yr[j] = (weight != nullptr ? xhat * weight[j] : xhat) + (bias != nullptr ? bias[j] : S(0));
    }
  });
}

template <class S>
void norm_input_grad(const S* x, const S* dy, const S* mean, const S* rstd, const S* weight, std::int64_t rows,
                     std::int64_t n, S* dx) {
  detail::parallel_for(rows, rows * n >= kNormParallelGrain, [&](std::int64_t r) {
    const S* xr = x + r * n;
    const S* gr = dy + r * n;
    S* dr = dx + r * n;
    const S mu = mean != nullptr ? mean[r] : S(0), rs = rstd[r];
    double sum_g = 0, sum_gx = 0;  // sums of dxhat and dxhat xhat over the row
#pragma omp simd reduction(+ : sum_g, sum_gx)
    for (std::int64_t j = 0; j < n; ++j) {
      const double g = static_cast<double>(weight != nullptr ? gr[j] * weight[j] : gr[j]);
      sum_g += g;
      sum_gx += g * static_cast<double>((xr[j] - mu) * rs);
    }
    const S mean_g = mean != nullptr ? static_cast<S>(sum_g / static_cast<double>(n)) : S(0);
    const S mean_gx = static_cast<S>(sum_gx / static_cast<double>(n));
    for (std::int64_t j = 0; j < n; ++j) {
      const S g = weight != nullptr ? gr[j] * weight[j] : gr[j];
      dr[j] = rs * (g - mean_g - (xr[j] - mu) * rs * mean_gx);
    }
  });
}
}  // namespace detail

// y (rows, n) = LayerNorm of x; mean and rstd (rows) saved for backward.
template <class S>
void layer_norm_forward(Cpu, const S* x, std::int64_t rows, std::int64_t n, const S* weight, const S* bias, double eps,
                        S* y, S* mean, S* rstd) {
  detail::norm_forward(x, rows, n, weight, bias, eps, y, mean, rstd);
}

// dx (null: not needed), and dweight, dbias accumulated (null: none).
template <class S>
void layer_norm_backward(Cpu, const S* x, const S* dy, const S* mean, const S* rstd, const S* weight,
                         std::int64_t rows, std::int64_t n, S* dx, S* dweight, S* dbias) {
  if (dx != nullptr) detail::norm_input_grad(x, dy, mean, rstd, weight, rows, n, dx);
  detail::norm_parameter_grads(x, dy, mean, rstd, rows, n, dweight, dbias);
}

// y (rows, n) = RMSNorm of x; rstd (rows) saved for backward.
template <class S>
void rms_norm_forward(Cpu, const S* x, std::int64_t rows, std::int64_t n, const S* weight, double eps, S* y, S* rstd) {
  detail::norm_forward(x, rows, n, weight, static_cast<const S*>(nullptr), eps, y, static_cast<S*>(nullptr), rstd);
}

template <class S>
void rms_norm_backward(Cpu, const S* x, const S* dy, const S* rstd, const S* weight, std::int64_t rows, std::int64_t n,
                       S* dx, S* dweight) {
  if (dx != nullptr) detail::norm_input_grad(x, dy, static_cast<const S*>(nullptr), rstd, weight, rows, n, dx);
  detail::norm_parameter_grads(x, dy, static_cast<const S*>(nullptr), rstd, rows, n, dweight, static_cast<S*>(nullptr));
}

// Compiled once in compiled-kernels mode (kernels/cpu/compiled.hpp).
#define TESSERA_CPU_NORM_INSTANCES(PREFIX, S)                                                                    \
  PREFIX template void layer_norm_forward<S>(Cpu, const S*, std::int64_t, std::int64_t, const S*, const S*, double, \
                                             S*, S*, S*);                                                       \
  PREFIX template void layer_norm_backward<S>(Cpu, const S*, const S*, const S*, const S*, const S*, std::int64_t, \
                                              std::int64_t, S*, S*, S*);                                         \
  PREFIX template void rms_norm_forward<S>(Cpu, const S*, std::int64_t, std::int64_t, const S*, double, S*, S*);  \
  PREFIX template void rms_norm_backward<S>(Cpu, const S*, const S*, const S*, const S*, std::int64_t, std::int64_t, \
                                            S*, S*);
TESSERA_CPU_KERNEL_INSTANCES(TESSERA_CPU_NORM_INSTANCES)

}  // namespace tessera
