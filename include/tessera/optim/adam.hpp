// Adam<E> and AdamW<E>: torch.optim.Adam (L2 weight decay added to the gradient) and
// torch.optim.AdamW (decoupled weight decay, Loshchilov & Hutter), exactly PyTorch 1.13's update.
// Per parameter p with gradient g, at step t = 1, 2, ...:
//
//   Adam:   g = g + weight_decay * p              AdamW:  p = p * (1 - lr * weight_decay)
//   m = beta1 * m + (1 - beta1) * g               (exp_avg,    starts at 0)
//   v = beta2 * v + (1 - beta2) * g * g           (exp_avg_sq, starts at 0)
//   v_max = max(v_max, v)                         (amsgrad only; the denominator then uses v_max)
//   denom = sqrt(v) / sqrt(1 - beta2^t) + eps
//   p = p - (lr / (1 - beta1^t)) * m / denom
//
// Weight decay is skipped for ParamKind::Bias/Norm when decay_norm_and_bias is false. Arithmetic is
// in the parameter's scalar type S; the bias corrections are computed in double and rounded, as
// torch does. Requires lr >= 0, eps >= 0, 0 <= beta1, beta2 < 1, weight_decay >= 0 (ArgumentError).
// After the first step, step() allocates nothing; tensors of 2^15 elements or more are updated by
// all OpenMP threads.
//
// Checkpoint state (visit_state): "optim.exp_avg.<param name>", "optim.exp_avg_sq.<param name>",
// with amsgrad "optim.max_exp_avg_sq.<param name>", and "optim.step" (t of the last step). The
// moments start at zero, so visit_state simply creates missing ones as zeros of the parameter's
// shape: a checkpoint taken before the first step round-trips to exactly the initial state.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "tessera/core/parameter.hpp"
#include "tessera/kernels/optim.hpp"
#include "tessera/optim/optimizer.hpp"

namespace tessera {

struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;  // L2: added to the gradient
  bool amsgrad = false;
  bool decay_norm_and_bias = true;  // false: ParamKind::Bias and ParamKind::Norm get no weight decay
};

// The same fields; torch.optim.AdamW's default weight decay is 0.01, not 0.
struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;  // decoupled: p *= 1 - lr * weight_decay
  bool amsgrad = false;
  bool decay_norm_and_bias = true;
};

enum class AdamDecay { L2, Decoupled };

// Adam and AdamW share everything but where weight decay enters; use the aliases below.
template <class E, AdamDecay Decay>
class BasicAdam {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  using Options = std::conditional_t<Decay == AdamDecay::L2, AdamOptions, AdamWOptions>;

  // Keeps pointers to the parameters in `named` (the model must outlive the optimizer).
  // Parameters of a model of another Env are refused at compile time.
  template <class Other>
  BasicAdam(const NamedTensors<Other>& named, Options o) : BasicAdam(parameters_of_env<E>(named), o) {}
  BasicAdam(const NamedTensors<E>& named, Options o)
      : o_(o), params_(optim_params(named, o.decay_norm_and_bias, name())) {
    detail::check_lr(o.lr, name());
    TESSERA_CHECK(o.eps >= 0, ArgumentError, name(), ": eps=", o.eps, " must be >= 0");
    TESSERA_CHECK(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1, ArgumentError, name(), ": beta1=",
                  o.beta1, " and beta2=", o.beta2, " must lie in [0, 1)");
    TESSERA_CHECK(o.weight_decay >= 0, ArgumentError, name(), ": weight_decay=", o.weight_decay, " must be >= 0");
  }

  void step() {
    detail::before_update(params_);
    ensure_state();
    for (std::size_t i = 0; i < params_.size(); ++i) {
      Parameter<S, D>& p = *params_[i].param;
      TESSERA_CHECK(p.grad.shape() == p.value.shape(), ShapeError, name(), "::step: parameter '", params_[i].name,
                    "' has value ", p.value.shape(), " but grad ", p.grad.shape());
      const double wd = params_[i].decay ? o_.weight_decay : 0.0;
      const AdamStep c{o_.lr, o_.beta1, o_.beta2, o_.eps, Decay == AdamDecay::L2 ? wd : 0.0,
                       Decay == AdamDecay::Decoupled ? wd : 0.0, steps_ + 1};
      adam_update(D{}, p.value.numel(), p.value.data(), p.grad.data(), exp_avg_[i].data(), exp_avg_sq_[i].data(),
                  o_.amsgrad ? max_exp_avg_sq_[i].data() : nullptr, c);
    }
    ++steps_;
  }

  void zero_grad() { detail::zero_grads(params_); }

  double lr() const { return o_.lr; }
  void set_lr(double lr) {
    detail::check_lr(lr, name());
    o_.lr = lr;
  }
  std::int64_t steps() const { return steps_; }
  const Options& options() const { return o_; }

  template <class V>
  void visit_state(V& v) {
    ensure_state();
    for (std::size_t i = 0; i < params_.size(); ++i) {
      v.buffer("optim.exp_avg." + params_[i].name, exp_avg_[i]);
      v.buffer("optim.exp_avg_sq." + params_[i].name, exp_avg_sq_[i]);
      if (o_.amsgrad) v.buffer("optim.max_exp_avg_sq." + params_[i].name, max_exp_avg_sq_[i]);
    }
    v.integer("optim.step", steps_);
  }

 private:
  static constexpr const char* name() { return Decay == AdamDecay::L2 ? "Adam" : "AdamW"; }

  void ensure_state() {
    exp_avg_.resize(params_.size());
    exp_avg_sq_.resize(params_.size());
    if (o_.amsgrad) max_exp_avg_sq_.resize(params_.size());
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const Shape& shape = params_[i].param->value.shape();
      detail::ensure_state_tensor(exp_avg_[i], shape);
      detail::ensure_state_tensor(exp_avg_sq_[i], shape);
      if (o_.amsgrad) detail::ensure_state_tensor(max_exp_avg_sq_[i], shape);
    }
  }

  Options o_;
  std::vector<OptimParam<S, D>> params_;
  std::vector<Tensor> exp_avg_, exp_avg_sq_, max_exp_avg_sq_;  // one per parameter
  std::int64_t steps_ = 0;
};

template <class E>
using Adam = BasicAdam<E, AdamDecay::L2>;
template <class E>
using AdamW = BasicAdam<E, AdamDecay::Decoupled>;

}  // namespace tessera

