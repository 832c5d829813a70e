// Softmax kernels on the CPU, along one dimension of a tensor seen as (outer, dim, inner):
// element (o, j, i) sits at (o dim + j) inner + i, so the softmax runs over j for every (o, i).
//
//   softmax:      y_j = exp(x_j - m) / sum_k exp(x_k - m)          m = max_k x_k (no overflow)
//   log-softmax:  y_j = x_j - m - log sum_k exp(x_k - m)
//   backward:     softmax      dx_j = y_j (dy_j - sum_k dy_k y_k)
//                 log-softmax  dx_j = dy_j - exp(y_j) sum_k dy_k
// Sums run in double. A NaN anywhere in a row makes the whole row NaN, and a row of -inf gives
// NaN (exp(-inf - -inf)), as in PyTorch.
//
// Negative log-likelihood on log-probabilities logp (n, C) with integer labels, shared by NLLLoss
// and CrossEntropyLoss (which is log-softmax followed by it). Target t_i = (1 - eps) onehot(y_i)
// + eps / C (eps = label smoothing, 0 for NLLLoss); rows whose label is ignore_index count nothing:
//   loss_i = -(1 - eps) logp[i, y_i] - eps / C sum_j logp[i, j]
//   dlogp  = -t_i scale                           (NLLLoss)
//   dz     = (exp(logp_i) - t_i) scale            (CrossEntropyLoss: through the log-softmax, since
//                                                  sum_j t_ij = 1)
// with dx = 0 on ignored rows.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "tessera/device/cpu.hpp"
#include "tessera/kernels/cpu/compiled.hpp"
#include "tessera/kernels/cpu/fast_exp.hpp"

namespace tessera {

namespace detail {
constexpr std::int64_t kSoftmaxParallelGrain = 1 << 15;  // elements below which one thread does it
}

// y (outer, dim, inner) = softmax or log-softmax of x along dim.
template <class S>
void softmax_forward(Cpu, const S* x, std::int64_t outer, std::int64_t dim, std::int64_t inner, bool log, S* y) {
  [[maybe_unused]] const std::int64_t work = outer * dim * inner;
  detail::parallel_for(outer * inner, work >= detail::kSoftmaxParallelGrain, [&](std::int64_t r) {
    const std::int64_t o = r / inner, i = r % inner;
    const S* xr = x + o * dim * inner + i;
    S* yr = y + o * dim * inner + i;
    S m = -std::numeric_limits<S>::infinity();
#pragma omp simd reduction(max : m)
    for (std::int64_t j = 0; j < dim; ++j) m = std::max(m, xr[j * inner]);
    // e^(x - m) in S (vectorized for float where the classes are contiguous), summed in double.
    double sum = 0;
    if (inner == 1) {
#pragma omp simd reduction(+ : sum)
      for (std::int64_t j = 0; j < dim; ++j) sum += static_cast<double>(detail::exp_le0(xr[j] - m));
    } else {
      for (std::int64_t j = 0; j < dim; ++j) sum += static_cast<double>(detail::exp_le0(xr[j * inner] - m));
    }
    if (log) {
      const double shift = std::log(sum);
      for (std::int64_t j = 0; j < dim; ++j) yr[j * inner] = static_cast<S>(static_cast<double>(xr[j * inner] - m) - shift);
    } else {
      const double inv = 1.0 / sum;
      for (std::int64_t j = 0; j < dim; ++j)
        yr[j * inner] = static_cast<S>(static_cast<double>(detail::exp_le0(xr[j * inner] - m)) * inv);
    }
  });
}

// dx (outer, dim, inner) from the forward output y and dy (formulas at the top).
template <class S>
void softmax_backward(Cpu, const S* y, const S* dy, std::int64_t outer, std::int64_t dim, std::int64_t inner,
                      bool log, S* dx) {
  [[maybe_unused]] const std::int64_t work = outer * dim * inner;
  detail::parallel_for(outer * inner, work >= detail::kSoftmaxParallelGrain, [&](std::int64_t r) {
    const std::int64_t o = r / inner, i = r % inner;
    const std::int64_t base = o * dim * inner + i;
    double dot = 0;
    for (std::int64_t j = 0; j < dim; ++j) {
      const std::int64_t k = base + j * inner;
      dot += log ? static_cast<double>(dy[k]) : static_cast<double>(dy[k]) * static_cast<double>(y[k]);
    }
    for (std::int64_t j = 0; j < dim; ++j) {
      const std::int64_t k = base + j * inner;
      dx[k] = log ? static_cast<S>(dy[k] - detail::exp_le0(y[k]) * static_cast<S>(dot))
                  : static_cast<S>(y[k] * (dy[k] - static_cast<S>(dot)));
    }
  });
}

// Returns sum_i loss_i over the rows whose label is not ignore_index.
template <class S>
double nll_forward(Cpu, const S* logp, const std::int64_t* labels, std::int64_t n, std::int64_t classes,
                   double smoothing, std::int64_t ignore_index) {
  return detail::parallel_sum<double>(n, n * classes >= detail::kSoftmaxParallelGrain,
                                      [&](std::int64_t begin, std::int64_t end) {
    double total = 0;
    for (std::int64_t i = begin; i < end; ++i) {
      if (labels[i] == ignore_index) continue;
      const S* row = logp + i * classes;
      double loss = -(1.0 - smoothing) * static_cast<double>(row[labels[i]]);
      if (smoothing != 0) {
        double sum = 0;
        for (std::int64_t j = 0; j < classes; ++j) sum += static_cast<double>(row[j]);
        loss -= smoothing / static_cast<double>(classes) * sum;
      }
      total += loss;
    }
    return total;
  });
}

// dx (n, C): -t scale (through_softmax = false) or (exp(logp) - t) scale (true); 0 on ignored rows.
template <class S>
void nll_backward(Cpu, const S* logp, const std::int64_t* labels, std::int64_t n, std::int64_t classes,
                  double smoothing, std::int64_t ignore_index, double scale, bool through_softmax, S* dx) {
  const S s = static_cast<S>(scale);
  const S off = static_cast<S>(smoothing / static_cast<double>(classes));
  const S on = static_cast<S>(1.0 - smoothing);
  detail::parallel_for(n, n * classes >= detail::kSoftmaxParallelGrain, [&](std::int64_t i) {
    S* g = dx + i * classes;
    if (labels[i] == ignore_index) {
      std::fill(g, g + classes, S(0));
      return;
    }
    const S* row = logp + i * classes;
    if (through_softmax) {
      for (std::int64_t j = 0; j < classes; ++j) g[j] = (detail::exp_le0(row[j]) - off) * s;  // logp <= 0
    } else {
      for (std::int64_t j = 0; j < classes; ++j) g[j] = -off * s;
    }
    g[labels[i]] -= on * s;
  });
}

// Compiled once in compiled-kernels mode (kernels/cpu/compiled.hpp).
#define TESSERA_CPU_SOFTMAX_INSTANCES(PREFIX, S)                                                                 \
  PREFIX template void softmax_forward<S>(Cpu, const S*, std::int64_t, std::int64_t, std::int64_t, bool, S*); \
  PREFIX template void softmax_backward<S>(Cpu, const S*, const S*, std::int64_t, std::int64_t, std::int64_t,  \
                                           bool, S*);                                                          \
  PREFIX template double nll_forward<S>(Cpu, const S*, const std::int64_t*, std::int64_t, std::int64_t, double, \
                                        std::int64_t);                                                         \
  PREFIX template void nll_backward<S>(Cpu, const S*, const std::int64_t*, std::int64_t, std::int64_t, double,  \
                                       std::int64_t, double, bool, S*);
TESSERA_CPU_KERNEL_INSTANCES(TESSERA_CPU_SOFTMAX_INSTANCES)

}  // namespace tessera
