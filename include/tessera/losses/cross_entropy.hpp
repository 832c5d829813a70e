// CrossEntropyLoss: softmax cross-entropy of logits (N, C) against integer labels (N), as
// torch.nn.CrossEntropyLoss(ignore_index=-100, reduction, label_smoothing), computed as torch
// does: log-softmax, then the negative log-likelihood against the smoothed target. Logits of higher
// rank have their classes LAST: (B, T, V) with labels (B, T) is N = B T rows of V classes, i.e.
// nanoGPT's F.cross_entropy(logits.view(-1, V), targets.view(-1)); torch's own (N, C, d1, ...)
// layout, classes second, is not read.
//
//   logp_i = z_i - max z_i - log sum_j exp(z_ij - max z_i)    (log_probs, (N, C); kept in the cache)
//   t_i = (1 - eps) onehot(label_i) + eps / C                 (target distribution; eps = label_smoothing)
//   l_i = -sum_j t_ij logp_ij                 loss = sum_i l_i / #counted (Mean)  or  sum_i l_i (Sum)
//   dL/dz_i = (exp(logp_i) - t_i) / #counted  (Mean)  or  exp(logp_i) - t_i  (Sum)   (dlogits, (N, C))
//
// Rows whose label equals ignore_index add nothing and are not counted (a Mean over no counted
// rows is NaN, as in PyTorch). The cache's log_probs are what LogSoftmax<E>(1) would return, for
// metrics, distillation or sampling without a second pass. No class weights (torch's `weight`).
// Not a layer: no parameters, the chain starts here. forward copies the labels into the cache,
// so the caller's label buffer may be reused before backward. Also count_correct (top-1 hits).
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "tessera/comm/local_env.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/kernels/softmax.hpp"
#include "tessera/losses/nll.hpp"
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
    Tensor log_probs;                         // (*, C) log-softmax of the logits (their shape)
    Tensor dlogits;                           // (*, C) dL/dlogits, filled by backward
    tessera::Tensor<std::int64_t, D> labels;  // (N) the labels, on the device (capacity kept across steps)
    std::int64_t counted = 0;                 // rows not ignored
  };

  explicit CrossEntropyLoss(Reduction reduction = Reduction::Mean, double label_smoothing = 0.0,
                            std::int64_t ignore_index = -100)
      : reduction_(reduction), smoothing_(label_smoothing), ignore_index_(ignore_index) {
    TESSERA_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, ArgumentError,
                  "CrossEntropyLoss: label_smoothing=", label_smoothing, " must lie in [0, 1]");
  }

  S forward(const Tensor& logits, std::span<const std::int64_t> labels, Cache& c) {
    c.counted = detail::checked_class_labels([this] { return name(); }, logits, labels, ignore_index_, c.labels,
                                             /*any_rank=*/true);
    const std::int64_t classes = logits.dim(-1), n = logits.numel() / classes;
    c.log_probs.resize(logits.shape());
    softmax_forward(D{}, logits.data(), n, classes, 1, /*log=*/true, c.log_probs.data());
    const double total = nll_forward(D{}, c.log_probs.data(), c.labels.data(), n, classes, smoothing_, ignore_index_);
    return static_cast<S>(reduction_ == Reduction::Mean ? total * detail::reduction_scale(reduction_, c.counted)
                                                        : total);
  }

  const Tensor& backward(Cache& c) {
    TESSERA_CHECK(c.log_probs.rank() >= 2, Error, name(), "::backward called before forward on this cache");
    const std::int64_t classes = c.log_probs.dim(-1), n = c.log_probs.numel() / classes;
    c.dlogits.resize(c.log_probs.shape());
    nll_backward(D{}, c.log_probs.data(), c.labels.data(), n, classes, smoothing_, ignore_index_,
                 detail::reduction_scale(reduction_, c.counted), /*through_softmax=*/true, c.dlogits.data());
    return c.dlogits;
  }

  Reduction reduction() const { return reduction_; }
  double label_smoothing() const { return smoothing_; }
  std::int64_t ignore_index() const { return ignore_index_; }

 private:
  std::string name() const {
    return detail::cat("CrossEntropyLoss(reduction=", to_string(reduction_), ", label_smoothing=", smoothing_,
                       ", ignore_index=", ignore_index_, ")");
  }

  Reduction reduction_;
  double smoothing_;
  std::int64_t ignore_index_;
};

// Number of rows whose argmax (first maximum on ties) equals the label: top-1 hits. Logits
// (N, C), or (*, C) with classes last (a language model's (B, T, V): N = B T rows).
template <class S, class D>
std::int64_t count_correct(const Tensor<S, D>& logits, std::span<const std::int64_t> labels) {
  const std::int64_t classes = logits.rank() >= 2 ? logits.dim(logits.rank() - 1) : 0;
  TESSERA_CHECK(logits.rank() >= 2 && classes > 0 && static_cast<std::int64_t>(labels.size()) == logits.numel() / classes,
                ShapeError, "count_correct: expected logits (N, C) or (*, C) and one label per row, got logits ",
                logits.shape(), " and ", labels.size(), " labels");
  if constexpr (!D::host_accessible) {
    return count_correct(to_host(logits), labels);  // a (N, C) copy: small next to the step
  }
  const std::int64_t n = logits.numel() / classes;
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

// The class of any other Env is this one renamed (comm/local_env.hpp).
TESSERA_SAME_CODE_AS_LOCAL(CrossEntropyLoss);
TESSERA_LOCAL_EXTERN(CrossEntropyLoss)

}  // namespace tessera
