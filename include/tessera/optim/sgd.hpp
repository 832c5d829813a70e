// Sgd<E>: stochastic gradient descent with momentum, dampening, Nesterov momentum and L2 weight
// decay, exactly torch.optim.SGD's update (PyTorch 1.13), per parameter p with gradient g:
//
//   d   = g + weight_decay * p                       (weight_decay skipped for masked parameters)
//   buf = d                                          first step: a copy, no dampening
//   buf = momentum * buf + (1 - dampening) * d       later steps
//   d   = nesterov ? d + momentum * buf : buf        (only when momentum != 0)
//   p   = p - lr * d
//
// All arithmetic is in the parameter's scalar type S (hyper-parameters are rounded to S first, as
// torch does with Python scalars). Requires lr >= 0, momentum >= 0, weight_decay >= 0, and for
// nesterov momentum > 0 and dampening == 0 (ArgumentError otherwise). After the first step,
// step() allocates nothing; tensors of 2^15 elements or more are updated by all OpenMP threads.
//
// Checkpoint state (visit_state): "optim.momentum_buffer.<param name>" per parameter when
// momentum != 0, and "optim.step". The buffer holds history iff step > 0; visit_state creates
// missing buffers as zeros of the parameter's shape so that a loader always finds a target and a
// checkpoint taken before the first step restores to "no history yet".
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "tessera/core/parameter.hpp"
#include "tessera/kernels/optim.hpp"
#include "tessera/optim/optimizer.hpp"

namespace tessera {

struct SgdOptions {
  double lr = std::numeric_limits<double>::quiet_NaN();  // required, as in torch.optim.SGD
  double momentum = 0;
  double dampening = 0;
  double weight_decay = 0;
  bool nesterov = false;
  bool decay_norm_and_bias = true;  // false: ParamKind::Bias and ParamKind::Norm get no weight decay
};

template <class E>
class Sgd {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;

  // Keeps pointers to the parameters in `named` (the model must outlive the optimizer).
  // Parameters of a model of another Env are refused at compile time.
  template <class Other>
  Sgd(const NamedTensors<Other>& named, SgdOptions o) : Sgd(parameters_of_env<E>(named), o) {}
  Sgd(const NamedTensors<E>& named, SgdOptions o)
      : o_(o), params_(optim_params(named, o.decay_norm_and_bias, "Sgd")) {
    detail::check_lr(o.lr, "Sgd");
    TESSERA_CHECK(o.momentum >= 0, ArgumentError, "Sgd: momentum=", o.momentum, " must be >= 0");
    TESSERA_CHECK(o.weight_decay >= 0, ArgumentError, "Sgd: weight_decay=", o.weight_decay, " must be >= 0");
    TESSERA_CHECK(!o.nesterov || (o.momentum > 0 && o.dampening == 0), ArgumentError,
                  "Sgd: nesterov=true requires momentum > 0 and dampening == 0 (got momentum=", o.momentum,
                  ", dampening=", o.dampening, ")");
  }

  void step() {
    detail::before_update(params_);
    if (o_.momentum != 0) ensure_state();
    for (std::size_t i = 0; i < params_.size(); ++i) {
      Parameter<S, D>& p = *params_[i].param;
      TESSERA_CHECK(p.grad.shape() == p.value.shape(), ShapeError, "Sgd::step: parameter '", params_[i].name,
                    "' has value ", p.value.shape(), " but grad ", p.grad.shape());
      const SgdStep c{o_.lr, o_.momentum, o_.dampening, params_[i].decay ? o_.weight_decay : 0.0, o_.nesterov,
                      steps_ == 0};
      sgd_update(D{}, p.value.numel(), p.value.data(), p.grad.data(),
                 o_.momentum != 0 ? momentum_[i].data() : nullptr, c);
    }
    ++steps_;
  }

  void zero_grad() { detail::zero_grads(params_); }

  double lr() const { return o_.lr; }
  void set_lr(double lr) {
    detail::check_lr(lr, "Sgd::set_lr");
    o_.lr = lr;
  }
  std::int64_t steps() const { return steps_; }
  const SgdOptions& options() const { return o_; }

  template <class V>
  void visit_state(V& v) {
    if (o_.momentum != 0) {
      ensure_state();
      for (std::size_t i = 0; i < params_.size(); ++i)
        v.buffer("optim.momentum_buffer." + params_[i].name, momentum_[i]);
    }
    v.integer("optim.step", steps_);
  }

 private:
  void ensure_state() {
    momentum_.resize(params_.size());
    for (std::size_t i = 0; i < params_.size(); ++i)
      detail::ensure_state_tensor(momentum_[i], params_[i].param->value.shape());
  }

  SgdOptions o_;
  std::vector<OptimParam<S, D>> params_;
  std::vector<Tensor> momentum_;  // one per parameter when momentum != 0
  std::int64_t steps_ = 0;
};

}  // namespace tessera

