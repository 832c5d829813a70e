// Loss kernels on the CPU: softmax cross-entropy (with label smoothing) and squared error.
//
// Cross-entropy per row i of logits z (classes C), target t = (1 - eps) onehot(y_i) + eps / C:
//   p = softmax(z),  loss_i = -sum_j t_j log p_j = (1 - eps)(lse - z_y) + eps (lse - mean_j z_j)
//   dloss_i/dz = p - t
// with lse = max z + log sum exp(z - max z), so exp never overflows.
#pragma once

#include <cmath>
#include <cstdint>

#include "tessera/device/cpu.hpp"

namespace tessera {

// probs (n, C) = softmax of logits; returns sum_i loss_i.
template <class S>
double softmax_cross_entropy_forward(Cpu, const S* logits, const std::int64_t* labels, std::int64_t n,
                                     std::int64_t classes, double smoothing, S* probs) {
  double total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total) if (n * classes >= (1 << 15))
  for (std::int64_t i = 0; i < n; ++i) {
    const S* z = logits + i * classes;
    S* p = probs + i * classes;
    S zmax = z[0];
    for (std::int64_t j = 1; j < classes; ++j) zmax = z[j] > zmax ? z[j] : zmax;
    double sum_exp = 0, sum_z = 0;
    for (std::int64_t j = 0; j < classes; ++j) {
      p[j] = std::exp(z[j] - zmax);
      sum_exp += p[j];
      sum_z += z[j];
    }
    const double lse = static_cast<double>(zmax) + std::log(sum_exp);
    const S inv = static_cast<S>(1.0 / sum_exp);
    for (std::int64_t j = 0; j < classes; ++j) p[j] *= inv;
    const double nll = lse - static_cast<double>(z[labels[i]]);
    const double uniform = lse - sum_z / static_cast<double>(classes);
    total += (1.0 - smoothing) * nll + smoothing * uniform;
  }
  return total;
}

// dlogits (n, C) = (probs - target) * scale.
template <class S>
void softmax_cross_entropy_backward(Cpu, const S* probs, const std::int64_t* labels, std::int64_t n,
                                    std::int64_t classes, double smoothing, double scale, S* dlogits) {
  const S s = static_cast<S>(scale);
  const S off = static_cast<S>(smoothing / static_cast<double>(classes));
  const S on = static_cast<S>(1.0 - smoothing);
#pragma omp parallel for schedule(static) if (n * classes >= (1 << 15))
  for (std::int64_t i = 0; i < n; ++i) {
    const S* p = probs + i * classes;
    S* g = dlogits + i * classes;
    for (std::int64_t j = 0; j < classes; ++j) g[j] = (p[j] - off) * s;
    g[labels[i]] -= on * s;
  }
}

// diff = y - t; returns sum_i diff_i^2 (accumulated in double).
template <class S>
double squared_error_forward(Cpu, const S* y, const S* t, std::int64_t n, S* diff) {
  double total = 0;
#pragma omp parallel for simd schedule(static) reduction(+ : total) if (n >= (1 << 15))
  for (std::int64_t i = 0; i < n; ++i) {
    diff[i] = y[i] - t[i];
    total += static_cast<double>(diff[i]) * static_cast<double>(diff[i]);
  }
  return total;
}

}  // namespace tessera
