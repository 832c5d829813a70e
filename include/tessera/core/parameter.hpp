// Parameter: a trainable tensor, its gradient, and the hook backward calls once the gradient for
// this step is complete (DataParallel uses the hook to start a bucket's all-reduce while the rest
// of backward still runs; by default nothing happens).
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tessera/core/concepts.hpp"
#include "tessera/core/env.hpp"
#include "tessera/core/random.hpp"
#include "tessera/core/tensor.hpp"

namespace tessera {

enum class ParamKind { Weight, Bias, Norm };  // Norm = BatchNorm scale/shift

// A strategy that must act on gradients before the optimizer applies them (DataParallel's
// all-reduce) installs one of these in each parameter it manages; every optimizer calls
// before_update() once per distinct guard at the start of step(). So the synchronization cannot be
// skipped: forgetting dp.finish() finishes it there, and stepping on gradients that can never be
// averaged (inside no_sync) throws an error that names the strategy.
struct UpdateGuard {
  virtual void before_update() = 0;

 protected:
  ~UpdateGuard() = default;
};

template <class S, class D>
struct Parameter {
  Tensor<S, D> value;
  Tensor<S, D> grad;
  ParamKind kind = ParamKind::Weight;
  std::function<void(Parameter&)> on_grad_ready;
  UpdateGuard* update_guard = nullptr;

  Parameter() = default;
  explicit Parameter(const Shape& shape, ParamKind k = ParamKind::Weight)
      : value(shape, S(0)), grad(shape, S(0)), kind(k) {}

  void grad_ready() {
    if (on_grad_ready) on_grad_ready(*this);
  }
};

// A parameter that two units of a model read (GPT's token embedding, which is also its output
// layer, lm_head): a pipeline whose stages hold the two units apart keeps a copy on each stage
// and sums the two gradients before the optimizer steps, so the copies stay equal (Megatron's
// embedding group). Units are the model's pipeline units (parallel/pipeline.hpp).
template <class S, class D>
struct TiedParameter {
  std::string name;
  std::size_t first_unit = 0, second_unit = 0;
  Parameter<S, D>* parameter = nullptr;
};

// Holds back the grad_ready hooks of some parameters whose gradient is not final when their layer's
// backward ends (a pipeline's tied wte until the other stage's part is added; a tensor-parallel
// model's replicated parameters until their sum over the ranks), so that a strategy acting on
// grad_ready (DataParallel's bucket all-reduce) sees the final gradient: from hold() the hooks
// only count their calls; release() restores them and makes each held call, or with
// every_parameter_once one call per parameter (the holder computed every one of these gradients,
// some outside a layer's backward). A Scope around the step restores the hooks whatever happens
// in it (calls held then are dropped: the step failed). Built once with its parameters (add) and
// reused every step: after the first, hold and release allocate nothing.
template <class S, class D>
class GradReadyHold {
 public:
  GradReadyHold() = default;
  GradReadyHold(const GradReadyHold&) = delete;
  GradReadyHold& operator=(const GradReadyHold&) = delete;
  ~GradReadyHold() { abandon(); }
  // Restores the hooks on leaving the scope (after release(), nothing is left to restore).
  struct Scope {
    GradReadyHold& hold;
    ~Scope() { hold.abandon(); }
  };
  void add(Parameter<S, D>& p) { parameters_.push_back(&p); }
  bool empty() const { return parameters_.empty(); }
  void hold() {
    if (held_) return;
    held_ = true;
    saved_.clear();
    calls_.assign(parameters_.size(), 0);
    for (std::size_t k = 0; k < parameters_.size(); ++k) {
      saved_.push_back(std::move(parameters_[k]->on_grad_ready));
      parameters_[k]->on_grad_ready = [this, k](Parameter<S, D>&) { ++calls_[k]; };
    }
  }
  void release(bool every_parameter_once = false) {
    if (!held_) return;
    abandon();
    for (std::size_t k = 0; k < parameters_.size(); ++k)
      for (int call = 0; call < (every_parameter_once ? 1 : calls_[k]); ++call) parameters_[k]->grad_ready();
  }
  // The hooks back, the held calls dropped.
  void abandon() {
    if (!held_) return;
    held_ = false;
    for (std::size_t k = 0; k < parameters_.size(); ++k) parameters_[k]->on_grad_ready = std::move(saved_[k]);
  }

 private:
  std::vector<Parameter<S, D>*> parameters_;
  std::vector<std::function<void(Parameter<S, D>&)>> saved_;
  std::vector<int> calls_;
  bool held_ = false;
};

// Names as PyTorch's state_dict spells them ("layer1.0.conv1.weight"), gathered once after
// construction by visiting the model. The visit protocol every layer follows:
//   v.parameter(name, Parameter&)   trainable tensors
//   v.buffer(name, Tensor&)         state that is not trained (BatchNorm running statistics)
//   v.rng(name, Rng&)               random generators a layer owns (Dropout), so a checkpoint
//                                   can resume their streams exactly
// The list carries the model's Env, so an optimizer or strategy of another Env is refused at
// compile time. Requires: the model is not moved afterwards (the pointers point into it).
template <class E>
struct NamedTensors {
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  std::vector<std::pair<std::string, Parameter<S, D>*>> parameters;
  std::vector<std::pair<std::string, Tensor<S, D>*>> buffers;
  std::vector<std::pair<std::string, Rng*>> rngs;

  void parameter(std::string name, Parameter<S, D>& p) { parameters.emplace_back(std::move(name), &p); }
  void buffer(std::string name, Tensor<S, D>& t) { buffers.emplace_back(std::move(name), &t); }
  void rng(std::string name, Rng& r) { rngs.emplace_back(std::move(name), &r); }
};

// Collects a layer's or model's parameters and buffers under a prefix; scalar and device come
// from the model's Env: `auto params = named_tensors(model);`.
template <class M>
NamedTensors<typename M::Env> named_tensors(M& model, const std::string& prefix = "") {
  static_assert(check_visitable<M>());
  NamedTensors<typename M::Env> out;
  model.visit(out, prefix);
  return out;
}

// The parameter list a part of Env E (optimizer, strategy) was given, refused at compile time
// when it comes from a model of another Env (Sgd<CpuThreads> on a CpuLocal model's parameters).
template <class E, class Other>
const NamedTensors<E>& parameters_of_env(const NamedTensors<Other>& named) {
  if constexpr (std::is_same_v<E, Other>) {
    return named;
  } else {
    static_assert(check_same_env<E, Other>());
    static const NamedTensors<E> none;
    return none;
  }
}

template <class E>
std::size_t count_parameters(const NamedTensors<E>& named) {
  std::size_t n = 0;
  for (auto& [name, p] : named.parameters) n += static_cast<std::size_t>(p->value.numel());
  return n;
}

// The distinct update guards of a parameter list, in order (consecutive parameters usually share
// one, so the check per step is a short scan).
template <class Params, class Get>
void run_update_guards(const Params& params, Get get) {
  UpdateGuard* last = nullptr;
  for (const auto& entry : params) {
    UpdateGuard* g = get(entry)->update_guard;
    if (g != nullptr && g != last) {
      g->before_update();
      last = g;
    }
  }
}

}  // namespace tessera
