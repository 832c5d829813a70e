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
#include "tessera/kernels/loss.hpp"
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
    tessera::Tensor<std::int64_t, D> labels;  // (N) the labels, on the device (capacity kept across steps)
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
    c.labels.resize({n});
    D::copy_to_device(c.labels.data(), labels.data(), labels.size_bytes());
    c.probs.resize(logits.shape());
    const double total = softmax_cross_entropy_forward(D{}, logits.data(), c.labels.data(), n, classes, smoothing_,
                                                       c.probs.data());
    return static_cast<S>(reduction_ == Reduction::Mean ? total / static_cast<double>(n) : total);
  }

  const Tensor& backward(Cache& c) {
    TESSERA_CHECK(c.probs.rank() == 2, Error, name(), "::backward called before forward on this cache");
    const std::int64_t n = c.probs.dim(0), classes = c.probs.dim(1);
    const double scale = reduction_ == Reduction::Mean ? 1.0 / static_cast<double>(n) : 1.0;
    c.dlogits.resize(c.probs.shape());
    softmax_cross_entropy_backward(D{}, c.probs.data(), c.labels.data(), n, classes, smoothing_, scale,
                                   c.dlogits.data());
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
  if constexpr (!D::host_accessible) {
    return count_correct(to_host(logits), labels);  // a (N, C) copy: small next to the step
  }
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
