// NLLLoss: negative log-likelihood of log-probabilities (N, C) against integer labels (N), as
// torch.nn.NLLLoss(ignore_index=-100, reduction):
//
//   l_i = -logp[i, label_i]          loss = sum_i l_i / #counted (Mean)  or  sum_i l_i (Sum)
//   dL/dlogp[i, j] = -[j == label_i] / #counted (Mean)  or  -[j == label_i] (Sum)     (N, C)
//
// Rows whose label equals ignore_index add nothing and are not counted; a Mean over no counted
// rows is NaN, as in PyTorch. Feed it a LogSoftmax<E>(1) output: the two together are
// CrossEntropyLoss (which fuses them). No class weights (torch's `weight`).
// Not a layer: no parameters, the chain starts here. forward copies the labels into the cache,
// so the caller's label buffer may be reused before backward.
#pragma once

#include <concepts>
#include <cstdint>
#include <limits>
#include <span>
#include <string>

#include "tessera/comm/local_env.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/kernels/softmax.hpp"
#include "tessera/losses/reduction.hpp"

namespace tessera {

namespace detail {
// Checks N labels for (N, C) scores (each in [0, C) or equal to ignore_index), copies them to the
// device, and returns how many rows count (are not ignored). who() names the loss in an error; it
// is called only then, so a training step builds no string (and allocates nothing) here. With
// any_rank, scores may be (*, C) of any rank >= 2 (the classes last, N = numel / C): a language
// model's (B, T, V) logits with (B, T) labels, named in an error by their (b, t) position.
template <class S, class D, std::invocable Who>
std::int64_t checked_class_labels(const Who& who, const Tensor<S, D>& scores,
                                  std::span<const std::int64_t> labels, std::int64_t ignore_index,
                                  Tensor<std::int64_t, D>& device_labels, bool any_rank = false) {
  TESSERA_CHECK((any_rank ? scores.rank() >= 2 : scores.rank() == 2) && scores.numel() > 0, ShapeError, who(),
                any_rank ? ": expected input (*, C) with at least one row and C > 0, got "
                         : ": expected input (N, C) with N, C > 0, got ",
                scores.shape());
  const std::int64_t classes = scores.dim(-1), n = scores.numel() / classes;
  TESSERA_CHECK(static_cast<std::int64_t>(labels.size()) == n, ShapeError, who(), ": input ", scores.shape(), " needs ",
                n, " labels, got ", labels.size());
  const Shape rows(scores.shape().begin(), scores.shape().end() - 1);
  std::int64_t counted = 0;
  for (std::size_t i = 0; i < labels.size(); ++i) {
    if (labels[i] == ignore_index) continue;
    TESSERA_CHECK(labels[i] >= 0 && labels[i] < classes, ArgumentError, who(), ": labels",
                  multi_index(static_cast<std::int64_t>(i), rows), " = ", labels[i], " is out of range [0, ",
                  classes, ") and is not ignore_index");
    ++counted;
  }
  device_labels.resize({n});
  D::copy_to_device(device_labels.data(), labels.data(), labels.size_bytes());
  return counted;
}

// 1 / #counted for Mean (NaN when nothing counts, like torch's 0 / 0), 1 for Sum.
inline double reduction_scale(Reduction r, std::int64_t counted) {
  if (r == Reduction::Sum) return 1.0;
  return counted == 0 ? std::numeric_limits<double>::quiet_NaN() : 1.0 / static_cast<double>(counted);
}
}  // namespace detail

template <class E>
class NLLLoss {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  struct Cache {
    const Tensor* log_probs = nullptr;        // the input, kept by pointer (alive until backward)
    Tensor dlog_probs;                        // (N, C) dL/dlogp, filled by backward
    tessera::Tensor<std::int64_t, D> labels;  // (N) the labels, on the device
    std::int64_t counted = 0;                 // rows not ignored
  };

  explicit NLLLoss(Reduction reduction = Reduction::Mean, std::int64_t ignore_index = -100)
      : reduction_(reduction), ignore_index_(ignore_index) {}

  S forward(const Tensor& log_probs, std::span<const std::int64_t> labels, Cache& c) {
    c.counted = detail::checked_class_labels([this] { return name(); }, log_probs, labels, ignore_index_, c.labels);
    c.log_probs = &log_probs;
    const double total =
        nll_forward(D{}, log_probs.data(), c.labels.data(), log_probs.dim(0), log_probs.dim(1), 0.0, ignore_index_);
    return static_cast<S>(reduction_ == Reduction::Mean ? total * detail::reduction_scale(reduction_, c.counted)
                                                        : total);
  }

  const Tensor& backward(Cache& c) {
    TESSERA_CHECK(c.log_probs != nullptr, Error, name(), "::backward called before forward on this cache");
    const std::int64_t n = c.log_probs->dim(0), classes = c.log_probs->dim(1);
    c.dlog_probs.resize({n, classes});
    nll_backward(D{}, c.log_probs->data(), c.labels.data(), n, classes, 0.0, ignore_index_,
                 detail::reduction_scale(reduction_, c.counted), /*through_softmax=*/false, c.dlog_probs.data());
    return c.dlog_probs;
  }

  Reduction reduction() const { return reduction_; }
  std::int64_t ignore_index() const { return ignore_index_; }

 private:
  std::string name() const {
    return detail::cat("NLLLoss(reduction=", to_string(reduction_), ", ignore_index=", ignore_index_, ")");
  }

  Reduction reduction_;
  std::int64_t ignore_index_;
};

// The class of any other Env is this one renamed (comm/local_env.hpp).
TESSERA_SAME_CODE_AS_LOCAL(NLLLoss);
TESSERA_LOCAL_EXTERN(NLLLoss)

}  // namespace tessera
