// Optimizer update kernels on the CPU: the element loops of SGD, Adam/AdamW, LARS and LAMB, each
// on n contiguous elements of one parameter, over OpenMP threads when n is large. The optimizers
// (optim/) compute the per-parameter coefficients (learning rate, bias corrections, trust ratios)
// and call these with the device tag first; the CUDA overloads are in kernels/cuda/{sgd,adam,lars,
// lamb}.cuh, picked by kernels/optim.hpp. Formulas as in PyTorch's torch.optim, in its operation
// order so that float32 rounds alike.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "tessera/device/cpu.hpp"

namespace tessera {
namespace detail {

// Below this many elements the OpenMP fork/join costs more than the update itself (biases, BN).
inline constexpr std::int64_t kOptimParallelElements = std::int64_t(1) << 15;

// Runs f(i) for i in [0, n), over OpenMP threads when n is large. f is inlined, so the loop
// body vectorizes like a hand-written loop.
template <class F>
void for_each_element(std::int64_t n, F f) {
#pragma omp parallel for schedule(static) if (n >= kOptimParallelElements)
  for (std::int64_t i = 0; i < n; ++i) f(i);
}

}  // namespace detail

// The coefficients of one update of one parameter (weight decay already masked).
struct SgdStep {
  double lr, momentum, dampening, weight_decay;
  bool nesterov;
  bool first_step;  // the momentum buffer has no history yet: it becomes a copy of d
};

// The update above on n contiguous elements; buf is unused (may be null) when momentum == 0.
template <class S>
void sgd_update(Cpu, std::int64_t n, S* p, const S* g, S* buf, const SgdStep& c) {
  const S lr = S(-c.lr), wd = S(c.weight_decay), m = S(c.momentum), keep = S(1 - c.dampening);
  const bool nesterov = c.nesterov;
  if (c.momentum == 0) {
    detail::for_each_element(n, [=](std::int64_t i) { p[i] = p[i] + lr * (g[i] + wd * p[i]); });
  } else if (c.first_step) {
    detail::for_each_element(n, [=](std::int64_t i) {
      const S d = g[i] + wd * p[i];
      buf[i] = d;
      p[i] = p[i] + lr * (nesterov ? d + m * d : d);
    });
  } else {
    detail::for_each_element(n, [=](std::int64_t i) {
      const S d = g[i] + wd * p[i];
      const S b = buf[i] * m + keep * d;
      buf[i] = b;
      p[i] = p[i] + lr * (nesterov ? d + m * b : b);
    });
  }
}

// The coefficients of one update of one parameter at step t (weight decay already masked).
struct AdamStep {
  double lr, beta1, beta2, eps;
  double l2_decay;        // Adam: added to the gradient as l2_decay * p
  double decoupled_decay; // AdamW: p *= 1 - lr * decoupled_decay
  std::int64_t t;         // 1 on the first step
};

// The update above on n contiguous elements; v_max is used (and updated) only when non-null.
template <class S>
void adam_update(Cpu, std::int64_t n, S* p, const S* g, S* m, S* v, S* v_max, const AdamStep& c) {
  const double bias_correction1 = 1 - std::pow(c.beta1, static_cast<double>(c.t));
  const double bias_correction2 = 1 - std::pow(c.beta2, static_cast<double>(c.t));
  const S step = S(-(c.lr / bias_correction1));
  const S bc2_sqrt = S(std::sqrt(bias_correction2));
  const S eps = S(c.eps), wd = S(c.l2_decay), shrink = S(1 - c.lr * c.decoupled_decay);
  const S b1 = S(c.beta1), b2 = S(c.beta2), one_minus_b1 = S(1 - c.beta1), one_minus_b2 = S(1 - c.beta2);
  // Operations in torch's order (mul_ then add_, (value * m) / denom) so float32 rounds alike.
  auto moments = [=](std::int64_t i) {
    const S gi = g[i] + wd * p[i];
    p[i] = p[i] * shrink;
    m[i] = m[i] * b1 + one_minus_b1 * gi;
    v[i] = v[i] * b2 + one_minus_b2 * gi * gi;
  };
  if (v_max == nullptr) {
    detail::for_each_element(n, [=](std::int64_t i) {
      moments(i);
      p[i] = p[i] + step * m[i] / (std::sqrt(v[i]) / bc2_sqrt + eps);
    });
  } else {
    detail::for_each_element(n, [=](std::int64_t i) {
      moments(i);
      v_max[i] = std::max(v_max[i], v[i]);
      p[i] = p[i] + step * m[i] / (std::sqrt(v_max[i]) / bc2_sqrt + eps);
    });
  }
}

// ||x||_2 in double, over OpenMP threads for large tensors (the GPU's is in kernels/cuda/lars.cuh).
template <class S>
double l2_norm(Cpu, const S* x, std::int64_t n) {
  double sum = 0;
#pragma omp parallel for reduction(+ : sum) schedule(static) if (n >= detail::kOptimParallelElements)
  for (std::int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return std::sqrt(sum);
}

// One LARS step on n elements: v = m v + lr_scaled (g + wd w);  w -= v.
template <class S>
void lars_update(Cpu, std::int64_t n, S* w, const S* g, S* v, S scaled_lr, S m, S decay) {
  detail::for_each_element(n, [=](std::int64_t k) {
    v[k] = m * v[k] + scaled_lr * (g[k] + decay * w[k]);
    w[k] -= v[k];
  });
}

// One LAMB step's two passes on n elements (see the header): the moments and the raw update
// r = m^ / (sqrt(v^) + eps) + wd w, then w -= step r once the trust ratio is known.
template <class S>
struct LambCoefficients {
  S b1, b2, inv_c1, inv_c2, eps, wd;
};
template <class S>
void lamb_moments(Cpu, std::int64_t n, const S* w, const S* g, S* m, S* v, S* r, LambCoefficients<S> c) {
  detail::for_each_element(n, [=](std::int64_t k) {
    m[k] = c.b1 * m[k] + (S(1) - c.b1) * g[k];
    v[k] = c.b2 * v[k] + (S(1) - c.b2) * g[k] * g[k];
    r[k] = (m[k] * c.inv_c1) / (std::sqrt(v[k] * c.inv_c2) + c.eps) + c.wd * w[k];
  });
}
template <class S>
void lamb_apply(Cpu, std::int64_t n, S* w, const S* r, S step) {
  detail::for_each_element(n, [=](std::int64_t k) { w[k] -= step * r[k]; });
}

}  // namespace tessera
