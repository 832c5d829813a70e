// Lamb<E>: layer-wise adaptive moments (You et al. 2019, "Large Batch Optimization for Deep
// Learning: Training BERT in 76 minutes"). Per parameter w with gradient g at step t = 1, 2, ...:
//
//   m = beta1 m + (1 - beta1) g             v = beta2 v + (1 - beta2) g^2
//   m_hat = m / (1 - beta1^t)               v_hat = v / (1 - beta2^t)
//   r = m_hat / (sqrt(v_hat) + eps) + weight_decay * w
//   trust = ||w|| / ||r||                   if ||w|| > 0 and ||r|| > 0, else 1
//   w = w - lr * trust * r
//
// Biases and BatchNorm scales/shifts get neither weight decay nor the trust ratio by default
// (trust = 1: Adam for them); adapt_norm_and_bias = true includes them. Norms are summed in
// double. Scalars follow torch's Adam: 1 - beta, the bias corrections and -lr * trust are computed
// in double and rounded to S once; m and v are divided by the rounded corrections (see
// kernels/cpu/optim.hpp for the order of operations). Checkpoint state: "optim.exp_avg.<name>", "optim.exp_avg_sq.<name>", "optim.step".
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "tessera/core/parameter.hpp"
#include "tessera/kernels/optim.hpp"
#include "tessera/optim/lars.hpp"
#include "tessera/optim/optimizer.hpp"

namespace tessera {

struct LambOptions {
  double lr = std::numeric_limits<double>::quiet_NaN();  // required
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-6;
  double weight_decay = 0;
  bool adapt_norm_and_bias = false;
};

template <class E>
class Lamb {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;

  // Parameters of a model of another Env are refused at compile time.
  template <class Other>
  Lamb(const NamedTensors<Other>& named, LambOptions o) : Lamb(parameters_of_env<E>(named), o) {}
  Lamb(const NamedTensors<E>& named, LambOptions o)
      : o_(o), params_(optim_params(named, o.adapt_norm_and_bias, "Lamb")) {
    detail::check_lr(o.lr, "Lamb");
    TESSERA_CHECK(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1 && o.eps >= 0 && o.weight_decay >= 0,
                  ArgumentError, "Lamb: need 0 <= beta1, beta2 < 1, eps >= 0, weight_decay >= 0 (got ", o.beta1,
                  ", ", o.beta2, ", ", o.eps, ", ", o.weight_decay, ")");
  }

  void step() {
    detail::before_update(params_);
    ensure_state();
    ++steps_;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      Parameter<S, D>& p = *params_[i].param;
      TESSERA_CHECK(p.grad.shape() == p.value.shape(), ShapeError, "Lamb::step: parameter '", params_[i].name,
                    "' has value ", p.value.shape(), " but grad ", p.grad.shape());
      const bool adapt = params_[i].decay;
      const std::int64_t n = p.value.numel();
      S* w = p.value.data();
      S* r = update_[i].data();
      // First pass: moments and the raw update r; second: the trust-scaled step.
      lamb_moments(D{}, n, w, p.grad.data(), exp_avg_[i].data(), exp_avg_sq_[i].data(), r,
                   lamb_coefficients<S>(o_.beta1, o_.beta2, o_.eps, adapt ? o_.weight_decay : 0.0, steps_));
      double trust = 1.0;
      if (adapt) {
        const double w_norm = l2_norm(D{}, w, n), r_norm = l2_norm(D{}, r, n);
        if (w_norm > 0 && r_norm > 0) trust = w_norm / r_norm;
      }
      lamb_apply(D{}, n, w, r, S(-o_.lr * trust));
      last_trust_[i] = trust;
    }
  }

  void zero_grad() { detail::zero_grads(params_); }
  double lr() const { return o_.lr; }
  void set_lr(double lr) {
    detail::check_lr(lr, "Lamb::set_lr");
    o_.lr = lr;
  }
  std::int64_t steps() const { return steps_; }
  const std::vector<double>& trust_ratios() const { return last_trust_; }

  template <class V>
  void visit_state(V& v) {
    ensure_state();
    for (std::size_t i = 0; i < params_.size(); ++i) {
      v.buffer("optim.exp_avg." + params_[i].name, exp_avg_[i]);
      v.buffer("optim.exp_avg_sq." + params_[i].name, exp_avg_sq_[i]);
    }
    v.integer("optim.step", steps_);
  }

 private:
  void ensure_state() {
    exp_avg_.resize(params_.size());
    exp_avg_sq_.resize(params_.size());
    update_.resize(params_.size());
    last_trust_.resize(params_.size(), 1.0);
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const Shape& shape = params_[i].param->value.shape();
      detail::ensure_state_tensor(exp_avg_[i], shape);
      detail::ensure_state_tensor(exp_avg_sq_[i], shape);
      detail::ensure_state_tensor(update_[i], shape);
    }
  }

  LambOptions o_;
  std::vector<OptimParam<S, D>> params_;
  std::vector<Tensor> exp_avg_, exp_avg_sq_, update_;
  std::vector<double> last_trust_;
  std::int64_t steps_ = 0;
};

}  // namespace tessera

