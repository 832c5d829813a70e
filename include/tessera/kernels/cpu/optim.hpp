// Optimizer update kernels on the CPU: the element loops of SGD, Adam/AdamW, LARS and LAMB, each
// on n contiguous elements of one parameter, over OpenMP threads when n is large. The optimizers
// (optim/) compute the per-parameter coefficients (learning rate, bias corrections, trust ratios)
// and call these with the device tag first; the CUDA overloads are in kernels/cuda/{sgd,adam,lars,
// lamb}.cuh, picked by kernels/optim.hpp. Formulas as in PyTorch's torch.optim, in its operation
// order so that float32 rounds alike:
//
// - Scalars are computed as torch's Python code computes them: in double (1 - beta, 1 - dampening,
//   lr / (1 - beta1^t), sqrt(1 - beta2^t), lr * trust, ...) and rounded to S once, where torch
//   converts a Python scalar into the tensor's dtype. Never from already-rounded S values.
// - Every tensor op is one rounding in S, in torch's order: buf.mul_(m).add_(d, alpha=a) rounds
//   buf*m, then adds a*d; addcmul_(g, g, value=c) is self + (c*g)*g; addcdiv_ is self + (c*m)/d.
// - torch's CPU kernels (AVX2/AVX-512/NEON builds, i.e. every current x86-64 and ARM wheel) and its
//   CUDA kernels evaluate `x + alpha * y` (add/sub with alpha, addcmul) as one fused multiply-add.
//   detail::mul_add does the same where the target has FMA, so that a float32 trajectory stays
//   within a few ulps of torch's over hundreds of steps instead of drifting by its own rounding.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "tessera/device/cpu.hpp"
#include "tessera/kernels/cpu/compiled.hpp"

namespace tessera {
namespace detail {

// Below this many elements the OpenMP fork/join costs more than the update itself (biases, BN).
inline constexpr std::int64_t kOptimParallelElements = std::int64_t(1) << 15;

// Runs f(i) for i in [0, n), over OpenMP threads when n is large. f is inlined, so the loop
// body vectorizes like a hand-written loop.
template <class F>
void for_each_element(std::int64_t n, F f) {
// simd: the updates read and write several arrays, which the compiler cannot prove apart; each
// element's arithmetic is the same in a vector lane (the tests compare with PyTorch bit for bit).
  detail::parallel_for_simd(n, n >= kOptimParallelElements, [&](std::int64_t i) { f(i); });
}

// 1 where this translation unit is compiled for a CPU with fused multiply-add (x86-64 with -mfma
// or -march=native on Haswell and later; AArch64), 0 otherwise. Tests use it to pick their bound.
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
#define TESSERA_OPTIM_FUSED_MULTIPLY_ADD 1
#else
#define TESSERA_OPTIM_FUSED_MULTIPLY_ADD 0
#endif

// c + a * b rounded the way torch's `c.add_(b, alpha=a)` rounds on this CPU: once (fused) where
// the hardware has FMA, as torch's vectorized kernels do, else after the product and after the sum.
// Without FMA hardware the compiler cannot fuse a * b + c either, so both branches are exact about
// their rounding.
template <class S>
inline S mul_add(S a, S b, S c) {
#if TESSERA_OPTIM_FUSED_MULTIPLY_ADD
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
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
  // torch: d = g.add(p, alpha=wd); buf.mul_(m).add_(d, alpha=1 - dampening) (1 - dampening in
  // double); nesterov: d = d.add(buf, alpha=m); p.add_(d, alpha=-lr).
  const S neg_lr = S(-c.lr), wd = S(c.weight_decay), m = S(c.momentum), keep = S(1 - c.dampening);
  const bool nesterov = c.nesterov;
  using detail::mul_add;
  if (c.momentum == 0) {
    detail::for_each_element(n, [=](std::int64_t i) { p[i] = mul_add(neg_lr, mul_add(wd, p[i], g[i]), p[i]); });
  } else if (c.first_step) {
    detail::for_each_element(n, [=](std::int64_t i) {
      const S d = mul_add(wd, p[i], g[i]);
      buf[i] = d;
      p[i] = mul_add(neg_lr, nesterov ? mul_add(m, d, d) : d, p[i]);
    });
  } else {
    detail::for_each_element(n, [=](std::int64_t i) {
      const S d = mul_add(wd, p[i], g[i]);
      const S b = mul_add(keep, d, buf[i] * m);
      buf[i] = b;
      p[i] = mul_add(neg_lr, nesterov ? mul_add(m, b, d) : b, p[i]);
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
  // torch's order: g.add(p, alpha=wd); p.mul_(1 - lr*wd); m.mul_(b1).add_(g, alpha=1 - b1);
  // v.mul_(b2).addcmul_(g, g, value=1 - b2); denom = (sqrt(v) / bc2_sqrt).add_(eps);
  // p.addcdiv_(m, denom, value=-step_size), which is p + (value * m) / denom.
  using detail::mul_add;
  auto moments = [=](std::int64_t i) {
    const S gi = mul_add(wd, p[i], g[i]);
    p[i] = p[i] * shrink;
    m[i] = mul_add(one_minus_b1, gi, m[i] * b1);
    v[i] = mul_add(one_minus_b2 * gi, gi, v[i] * b2);
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
  const double sum = detail::parallel_sum<double>(n, n >= detail::kOptimParallelElements,
                                                  [&](std::int64_t begin, std::int64_t end) {
    double part = 0;
    for (std::int64_t i = begin; i < end; ++i) part += static_cast<double>(x[i]) * static_cast<double>(x[i]);
    return part;
  });
  return std::sqrt(sum);
}

// One LARS step on n elements, as torch ops d = g.add(w, alpha=wd); v.mul_(m).add_(d,
// alpha=lr*trust); w.sub_(v). The caller rounds lr * trust (computed in double) to S once.
template <class S>
void lars_update(Cpu, std::int64_t n, S* w, const S* g, S* v, S scaled_lr, S m, S decay) {
  using detail::mul_add;
  detail::for_each_element(n, [=](std::int64_t k) {
    v[k] = mul_add(scaled_lr, mul_add(decay, w[k], g[k]), v[k] * m);
    w[k] -= v[k];
  });
}

// One LAMB step's two passes on n elements (see optim/lamb.hpp): the moments and the raw update
// r = m^ / (sqrt(v^) + eps) + wd w, then w += neg_step r once the trust ratio is known. Every
// coefficient is a double-precision value rounded to S once (1 - beta too, as torch's Adam does;
// the bias corrections c1 = 1 - beta1^t and c2 = 1 - beta2^t are divided by, not inverted).
template <class S>
struct LambCoefficients {
  S b1, b2, one_minus_b1, one_minus_b2, c1, c2, eps, wd;
};

// The coefficients of step t (1 on the first step) from the double-precision options.
template <class S>
LambCoefficients<S> lamb_coefficients(double beta1, double beta2, double eps, double weight_decay, std::int64_t t) {
  const double c1 = 1 - std::pow(beta1, static_cast<double>(t)), c2 = 1 - std::pow(beta2, static_cast<double>(t));
  return {S(beta1), S(beta2), S(1 - beta1), S(1 - beta2), S(c1), S(c2), S(eps), S(weight_decay)};
}

// torch ops: m.mul_(b1).add_(g, alpha=1 - b1); v.mul_(b2).addcmul_(g, g, value=1 - b2);
// r = (m / c1) / ((v / c2).sqrt() + eps); r.add_(w, alpha=wd).
template <class S>
void lamb_moments(Cpu, std::int64_t n, const S* w, const S* g, S* m, S* v, S* r, LambCoefficients<S> c) {
  using detail::mul_add;
  detail::for_each_element(n, [=](std::int64_t k) {
    m[k] = mul_add(c.one_minus_b1, g[k], m[k] * c.b1);
    v[k] = mul_add(c.one_minus_b2 * g[k], g[k], v[k] * c.b2);
    r[k] = mul_add(c.wd, w[k], (m[k] / c.c1) / (std::sqrt(v[k] / c.c2) + c.eps));
  });
}
// w.add_(r, alpha=-lr*trust): neg_step is -(lr * trust) rounded to S.
template <class S>
void lamb_apply(Cpu, std::int64_t n, S* w, const S* r, S neg_step) {
  detail::for_each_element(n, [=](std::int64_t k) { w[k] = detail::mul_add(neg_step, r[k], w[k]); });
}

// Compiled once in compiled-kernels mode (kernels/cpu/compiled.hpp): a program then needs no
// optimization level of its own for the update loops (tessera_kernels is built at -O3).
#define TESSERA_CPU_OPTIM_INSTANCES(PREFIX, S)                                                                     \
  PREFIX template void sgd_update<S>(Cpu, std::int64_t, S*, const S*, S*, const SgdStep&);                      \
  PREFIX template void adam_update<S>(Cpu, std::int64_t, S*, const S*, S*, S*, S*, const AdamStep&);            \
  PREFIX template double l2_norm<S>(Cpu, const S*, std::int64_t);                                               \
  PREFIX template void lars_update<S>(Cpu, std::int64_t, S*, const S*, S*, S, S, S);                            \
  PREFIX template void lamb_moments<S>(Cpu, std::int64_t, const S*, const S*, S*, S*, S*, LambCoefficients<S>); \
  PREFIX template void lamb_apply<S>(Cpu, std::int64_t, S*, const S*, S);
TESSERA_CPU_KERNEL_INSTANCES(TESSERA_CPU_OPTIM_INSTANCES)

}  // namespace tessera
