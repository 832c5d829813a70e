// What every optimizer shares: the Optimizer concept, the parameter list with its weight-decay
// mask, the element loop the update kernels run on, and the linear scaling rule.
//
// Optimizer contract (torch.optim semantics): step() applies one update to every parameter from its
// current grad and advances steps() by one; zero_grad() sets every grad to 0 (backward accumulates);
// lr()/set_lr() read and change the learning rate used by the next step() (schedules call set_lr
// once per iteration). A StatefulOptimizer also has visit_state(v), which hands its state to a
// checkpoint visitor: v.buffer(name, Tensor&) per state tensor, v.integer(name, std::int64_t&) for
// the step counter.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tessera/core/env.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/parameter.hpp"
#include "tessera/core/tensor.hpp"

namespace tessera {

template <class O>
concept Optimizer = requires(O& o, const O& co, double lr) {
  o.step();
  o.zero_grad();
  { co.lr() } -> std::convertible_to<double>;
  o.set_lr(lr);
};

// A visitor with the checkpoint interface and nothing else: checks visit_state's signature.
struct StateVisitorArchetype {
  template <class T>
  void buffer(const std::string&, T&) {}
  void integer(const std::string&, std::int64_t&) {}
};

template <class O>
concept StatefulOptimizer = Optimizer<O> && requires(O& o, StateVisitorArchetype& v, const O& co) {
  o.visit_state(v);
  { co.steps() } -> std::convertible_to<std::int64_t>;
};

namespace detail {

// Forwards an optimizer's integers ("optim.step") to a checkpoint visitor; its tensors stay out.
template <class V>
struct StateIntegersOf {
  V& v;
  template <class T>
  void buffer(const std::string&, T&) {}
  void integer(const std::string& name, std::int64_t& x) { v.integer(name, x); }
};

// An optimizer's state tensors, in visit order.
template <class S, class D>
struct StateTensorCollector {
  std::vector<std::pair<std::string, Tensor<S, D>*>> tensors;
  template <class T>
  void buffer(const std::string& name, T& t) {
    static_assert(std::is_same_v<T, Tensor<S, D>>, "optimizer state of another scalar or device than the shard's");
    tensors.emplace_back(name, &t);
  }
  void integer(const std::string&, std::int64_t&) {}
};

// The optimizer state of a sharded strategy's shard (Zero1, FullyShardedDataParallel) by kind:
// state named "optim.<kind>.<parameter name>" (Sgd's, Adam's; no dot in <kind>), each kind in
// first-seen order with its tensor per piece of the shard, piece_of[parameter name] (null where
// the piece has none, or is empty). `who` names the strategy in the error for any other name.
template <class S, class D, StatefulOptimizer O>
std::vector<std::pair<std::string, std::vector<Tensor<S, D>*>>> state_by_kind(O& optimizer,
                                                                             const std::map<std::string, std::size_t>& piece_of,
                                                                             std::size_t pieces, const char* who) {
  StateTensorCollector<S, D> c;
  optimizer.visit_state(c);
  std::vector<std::pair<std::string, std::vector<Tensor<S, D>*>>> out;
  for (auto& [name, t] : c.tensors) {
    const std::size_t dot = name.find('.', 6);
    const bool named = name.rfind("optim.", 0) == 0 && dot != std::string::npos;
    // An empty piece (a rank that owns no elements of some unit) holds nothing, but its kind still
    // counts: every rank must list the same kinds, which collectives then run over.
    const bool empty = t->numel() == 0;
    TESSERA_CHECK(named && (empty || piece_of.count(name.substr(dot + 1))), ArgumentError, who, ": optimizer state '",
                  name, "' is not named optim.<kind>.<parameter of this rank's shard>; it cannot be checkpointed");
    const std::string kind = name.substr(6, dot - 6);
    auto it = std::find_if(out.begin(), out.end(), [&](const auto& e) { return e.first == kind; });
    if (it == out.end()) {
      out.emplace_back(kind, std::vector<Tensor<S, D>*>(pieces, nullptr));
      it = out.end() - 1;
    }
    if (!empty) it->second[piece_of.at(name.substr(dot + 1))] = t;
  }
  return out;
}

}  // namespace detail

// Goyal et al. (2017): when the minibatch grows k-fold, multiply the learning rate by k.
// linear_scaling_rule(0.1, 8192) == 3.2 (ResNet-50's 0.1 per 256 images).
inline double linear_scaling_rule(double base_lr, std::int64_t global_batch, std::int64_t reference_batch = 256) {
  TESSERA_CHECK(base_lr >= 0, ArgumentError, "linear_scaling_rule: base_lr=", base_lr, " must be >= 0");
  TESSERA_CHECK(global_batch > 0 && reference_batch > 0, ArgumentError, "linear_scaling_rule: global_batch=",
                global_batch, " and reference_batch=", reference_batch, " must be positive");
  return base_lr * static_cast<double>(global_batch) / static_cast<double>(reference_batch);
}

// Biases and normalization scales/shifts are commonly excluded from weight decay (Goyal et al.;
// "no bias decay"): decaying them only shrinks the network's freedom to shift and rescale.
inline bool gets_weight_decay(ParamKind kind, bool decay_norm_and_bias) {
  return decay_norm_and_bias || kind == ParamKind::Weight;
}

// One optimized parameter: its state_dict name (state names derive from it), the parameter, and
// whether weight decay applies to it. The list plays the role of torch's two param groups
// ("decay" and "no_decay") without duplicating the other hyper-parameters.
template <class S, class D>
struct OptimParam {
  std::string name;
  Parameter<S, D>* param;
  bool decay;
};

// The parameters of `named` in visiting order with their decay mask. Requires a non-empty list
// (torch.optim raises on an empty one) of distinct parameters (torch only warns about a duplicate
// within one group, and then updates it twice per step; here it is an error) whose grad has the
// value's shape.
template <class E, class S = typename E::Scalar, class D = typename E::Device>
std::vector<OptimParam<S, D>> optim_params(const NamedTensors<E>& named, bool decay_norm_and_bias,
                                           const char* optimizer) {
  TESSERA_CHECK(!named.parameters.empty(), ArgumentError, optimizer,
                ": no parameters to optimize (collect them first, e.g. named_tensors(model))");
  std::vector<OptimParam<S, D>> out;
  out.reserve(named.parameters.size());
  for (const auto& [name, p] : named.parameters) {
    TESSERA_CHECK(p != nullptr, ArgumentError, optimizer, ": parameter '", name, "' is null");
    for (const auto& q : out)
      TESSERA_CHECK(q.param != p, ArgumentError, optimizer, ": parameter '", name, "' is the same object as '",
                    q.name, "'; each parameter may appear only once");
    TESSERA_CHECK(p->grad.shape() == p->value.shape(), ShapeError, optimizer, ": parameter '", name, "' has value ",
                  p->value.shape(), " but grad ", p->grad.shape());
    out.push_back({name, p, gets_weight_decay(p->kind, decay_norm_and_bias)});
  }
  return out;
}

namespace detail {

// Runs the strategies' update guards (DataParallel finishes its all-reduce) before an update.
template <class S, class D>
void before_update(const std::vector<OptimParam<S, D>>& params) {
  run_update_guards(params, [](const OptimParam<S, D>& p) { return p.param; });
}

// Makes t a zero tensor of the given shape unless it already is allocated with that shape (state
// created lazily by step() or by visit_state() must not clobber loaded values). The data check
// matters for empty parameters: a default Tensor already has the shape (0) but no buffer.
template <class S, class D>
void ensure_state_tensor(Tensor<S, D>& t, const Shape& shape) {
  if (t.shape() == shape && t.data() != nullptr) return;
  t.resize(shape);
  t.zero();
}

template <class S, class D>
void zero_grads(std::vector<OptimParam<S, D>>& params) {
  for (auto& p : params) p.param->grad.zero();
}

inline void check_lr(double lr, const char* optimizer) {
  TESSERA_CHECK(lr >= 0, ArgumentError, optimizer, ": lr=", lr, " must be set to a value >= 0");
}

}  // namespace detail

}  // namespace tessera
