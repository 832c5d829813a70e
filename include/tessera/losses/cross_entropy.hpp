// CrossEntropyLoss: softmax cross-entropy of logits (N, C) against integer labels (N), as
// torch.nn.CrossEntropyLoss(reduction, label_smoothing):
//
//   p_i = softmax(z_i)                                  (probs, (N, C); log-sum-exp with the max subtracted)
//   t_i = (1 - eps) onehot(label_i) + eps / C           (target distribution; eps = label_smoothing)
//   l_i = -sum_j t_ij log p_ij                          loss = mean_i l_i  or  sum_i l_i
//   dL/dz_i = (p_i - t_i) / N  (Mean)  or  p_i - t_i  (Sum)                    (dlogits, (N, C))
//
// Not a layer: no parameters, the chain starts here. forward copies the labels into the cache,
// so the caller's label buffer may be reused before backward. Also count_correct (top-1 hits).
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "tessera/core/tensor.hpp"
#include "tessera/losses/reduction.hpp"

namespace tessera {

template <class E>
class CrossEntropyLoss {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  struct Cache {
    Tensor probs;                      // (N, C) softmax of the logits
    Tensor dlogits;                    // (N, C) dL/dlogits, filled by backward
    std::vector<std::int64_t> labels;  // (N) copy of the labels (capacity kept across steps)
  };

  explicit CrossEntropyLoss(Reduction reduction = Reduction::Mean, double label_smoothing = 0.0)
      : reduction_(reduction), smoothing_(label_smoothing) {
    TESSERA_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, ArgumentError,
                  "CrossEntropyLoss: label_smoothing=", label_smoothing, " must lie in [0, 1]");
  }

  S forward(const Tensor& logits, std::span<const std::int64_t> labels, Cache& c) {
    TESSERA_CHECK(logits.rank() == 2 && logits.dim(0) > 0 && logits.dim(1) > 0, ShapeError, name(),
                  ": expected logits (N, C) with N, C > 0, got ", logits.shape());
    const std::int64_t n = logits.dim(0), classes = logits.dim(1);
    TESSERA_CHECK(static_cast<std::int64_t>(labels.size()) == n, ShapeError, name(), ": logits ", logits.shape(),
                  " need ", n, " labels, got ", labels.size());
    for (std::size_t i = 0; i < labels.size(); ++i)
      TESSERA_CHECK(labels[i] >= 0 && labels[i] < classes, ArgumentError, name(), ": labels[", i, "] = ", labels[i],
                    " is out of range [0, ", classes, ")");
    c.labels.assign(labels.begin(), labels.end());
    c.probs.resize(logits.shape());
    const double eps = smoothing_;
    double total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total) if (n * classes >= (1 << 15))
    for (std::int64_t i = 0; i < n; ++i) {
      const S* z = logits.data() + i * classes;
      S* p = c.probs.data() + i * classes;
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
      // -sum_j t_j log p_j with log p_j = z_j - lse.
      const double nll = lse - static_cast<double>(z[c.labels[static_cast<std::size_t>(i)]]);
      const double uniform = lse - sum_z / static_cast<double>(classes);
      total += (1.0 - eps) * nll + eps * uniform;
    }
    return static_cast<S>(reduction_ == Reduction::Mean ? total / static_cast<double>(n) : total);
  }

  const Tensor& backward(Cache& c) {
    TESSERA_CHECK(c.probs.rank() == 2, Error, name(), "::backward called before forward on this cache");
    const std::int64_t n = c.probs.dim(0), classes = c.probs.dim(1);
    const S scale = reduction_ == Reduction::Mean ? static_cast<S>(1.0 / static_cast<double>(n)) : S(1);
    const S off = static_cast<S>(smoothing_ / static_cast<double>(classes));
    const S on = static_cast<S>(1.0 - smoothing_);
    c.dlogits.resize(c.probs.shape());
#pragma omp parallel for schedule(static) if (n * classes >= (1 << 15))
    for (std::int64_t i = 0; i < n; ++i) {
      const S* p = c.probs.data() + i * classes;
      S* g = c.dlogits.data() + i * classes;
      for (std::int64_t j = 0; j < classes; ++j) g[j] = (p[j] - off) * scale;
      g[c.labels[static_cast<std::size_t>(i)]] -= on * scale;
    }
    return c.dlogits;
  }

  Reduction reduction() const { return reduction_; }
  double label_smoothing() const { return smoothing_; }

 private:
  std::string name() const {
    return detail::cat("CrossEntropyLoss(reduction=", to_string(reduction_), ", label_smoothing=", smoothing_, ")");
  }

  Reduction reduction_;
  double smoothing_;
};

// Number of rows whose argmax (first maximum on ties) equals the label: top-1 hits.
template <class S, class D>
std::int64_t count_correct(const Tensor<S, D>& logits, std::span<const std::int64_t> labels) {
  TESSERA_CHECK(logits.rank() == 2 && static_cast<std::int64_t>(labels.size()) == logits.dim(0), ShapeError,
                "count_correct: expected logits (N, C) and N labels, got logits ", logits.shape(), " and ",
                labels.size(), " labels");
  const std::int64_t n = logits.dim(0), classes = logits.dim(1);
  std::int64_t hits = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const S* z = logits.data() + i * classes;
    std::int64_t best = 0;
    for (std::int64_t j = 1; j < classes; ++j)
      if (z[j] > z[best]) best = j;
    hits += classes > 0 && best == labels[static_cast<std::size_t>(i)];
  }
  return hits;
}

}  // namespace tessera
