// Lars<E>: layer-wise adaptive rate scaling (You, Gitman, Ginsburg 2017), the optimizer of
// large-batch ResNet-50 training. Per parameter w with gradient g, in this order:
//
//   trust = eta * ||w|| / (||g|| + weight_decay * ||w|| + eps)   if ||w|| > 0 and ||g|| > 0, else 1
//   d     = g + weight_decay * w
//   v     = momentum * v + lr * trust * d                          (v = 0 before the first step)
//   w     = w - v
//
// Biases and BatchNorm scales/shifts (ParamKind::Bias/Norm) get neither weight decay nor the
// trust ratio by default (trust = 1: plain momentum SGD for them), as in the paper's reference
// implementations; adapt_norm_and_bias = true adapts and decays them too. Norms are summed in
// double; the trust ratio and lr * trust are computed in double and rounded to S once, and the
// element update is torch's d = g.add(w, alpha=wd); v.mul_(momentum).add_(d, alpha=lr*trust);
// w.sub_(v) (see kernels/cpu/optim.hpp). Checkpoint state: "optim.momentum_buffer.<name>" and "optim.step".
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "tessera/core/parameter.hpp"
#include "tessera/kernels/optim.hpp"
#include "tessera/optim/optimizer.hpp"

namespace tessera {

struct LarsOptions {
  double lr = std::numeric_limits<double>::quiet_NaN();  // required
  double momentum = 0.9;
  double weight_decay = 0;
  double eta = 0.001;  // trust coefficient
  double eps = 1e-9;
  bool adapt_norm_and_bias = false;
};

template <class E>
class Lars {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;

  // Parameters of a model of another Env are refused at compile time.
  template <class Other>
  Lars(const NamedTensors<Other>& named, LarsOptions o) : Lars(parameters_of_env<E>(named), o) {}
  Lars(const NamedTensors<E>& named, LarsOptions o)
      : o_(o), params_(optim_params(named, o.adapt_norm_and_bias, "Lars")) {
    detail::check_lr(o.lr, "Lars");
    TESSERA_CHECK(o.momentum >= 0 && o.weight_decay >= 0 && o.eta > 0 && o.eps >= 0, ArgumentError,
                  "Lars: need momentum >= 0, weight_decay >= 0, eta > 0, eps >= 0 (got ", o.momentum, ", ",
                  o.weight_decay, ", ", o.eta, ", ", o.eps, ")");
  }

  void step() {
    detail::before_update(params_);
    ensure_state();
    for (std::size_t i = 0; i < params_.size(); ++i) {
      Parameter<S, D>& p = *params_[i].param;
      const bool adapt = params_[i].decay;  // the same mask: weights (or everything, if switched on)
      const std::int64_t n = p.value.numel();
      const double wd = adapt ? o_.weight_decay : 0.0;
      double trust = 1.0;
      if (adapt) {
        const double w_norm = l2_norm(D{}, p.value.data(), n), g_norm = l2_norm(D{}, p.grad.data(), n);
        if (w_norm > 0 && g_norm > 0) trust = o_.eta * w_norm / (g_norm + wd * w_norm + o_.eps);
      }
      lars_update(D{}, n, p.value.data(), p.grad.data(), momentum_[i].data(), S(o_.lr * trust), S(o_.momentum), S(wd));
      last_trust_[i] = trust;
    }
    ++steps_;
  }

  void zero_grad() { detail::zero_grads(params_); }
  double lr() const { return o_.lr; }
  void set_lr(double lr) {
    detail::check_lr(lr, "Lars::set_lr");
    o_.lr = lr;
  }
  std::int64_t steps() const { return steps_; }
  // The trust ratio each parameter got in the last step (1 for excluded ones), for logging.
  const std::vector<double>& trust_ratios() const { return last_trust_; }

  template <class V>
  void visit_state(V& v) {
    ensure_state();
    for (std::size_t i = 0; i < params_.size(); ++i) v.buffer("optim.momentum_buffer." + params_[i].name, momentum_[i]);
    v.integer("optim.step", steps_);
  }

 private:
  void ensure_state() {
    momentum_.resize(params_.size());
    last_trust_.resize(params_.size(), 1.0);
    for (std::size_t i = 0; i < params_.size(); ++i)
      detail::ensure_state_tensor(momentum_[i], params_[i].param->value.shape());
  }

  LarsOptions o_;
  std::vector<OptimParam<S, D>> params_;
  std::vector<Tensor> momentum_;
  std::vector<double> last_trust_;
  std::int64_t steps_ = 0;
};

}  // namespace tessera

