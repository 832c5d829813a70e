// MLP: flatten -> [Linear -> ReLU] x hidden -> Linear.   x (N, ...) -> logits (N, classes)
// Hidden widths are a runtime list, so one type covers every depth. Parameter names follow a
// torch.nn.Sequential(Flatten, Linear, ReLU, ...): "1.weight" for the first Linear, "3.weight", ...
// The flatten is the first Linear's (Linear::set_flattens_input): it reads x (N, ...) as
// (N, in_features) where it lies, which a Flatten layer could only do by copying x.
#pragma once

#include <string>
#include <vector>

#include "tessera/comm/local_env.hpp"
#include "tessera/core/concepts.hpp"
#include "tessera/layers/activation.hpp"
#include "tessera/layers/linear.hpp"

namespace tessera {

template <class E>
class Mlp {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  struct Cache {
    std::vector<typename Linear<E>::Cache> linear;
    std::vector<typename ReLU<E>::Cache> relu;
  };

  Mlp(std::int64_t in_features, const std::vector<std::int64_t>& hidden, std::int64_t num_classes,
      std::uint64_t seed = 0) {
    Rng rng(seed);
    std::int64_t in = in_features;
    for (auto width : hidden) {
      linear_.emplace_back(in, width, rng);
      in = width;
    }
    linear_.emplace_back(in, num_classes, rng);
    relu_.resize(hidden.size());
    linear_.front().set_needs_input_grad(false);
    linear_.front().set_flattens_input(true);
  }

  const Tensor& forward(const Tensor& x, Cache& c) { return forward_units(x, c, 0, unit_count()); }
  const Tensor& backward(const Tensor& dy, Cache& c) {
    return backward_units(dy, c, 0, unit_count());  // the first Linear skips dL/dx: nothing consumes it
  }

  // Pipeline units: unit i is Linear i with its ReLU (unit 0's Linear flattens x).
  std::size_t unit_count() const { return linear_.size(); }
  const Tensor& forward_units(const Tensor& x, Cache& c, std::size_t begin, std::size_t end) {
    if (c.linear.size() != linear_.size()) {  // first forward on this cache only
      c.linear.resize(linear_.size());
      c.relu.resize(relu_.size());
    }
    const Tensor* h = &x;
    for (std::size_t i = begin; i < end; ++i) {
      h = &linear_[i].forward(*h, c.linear[i]);
      if (i < relu_.size()) h = &relu_[i].forward(*h, c.relu[i]);
    }
    return *h;
  }
  const Tensor& backward_units(const Tensor& dy, Cache& c, std::size_t begin, std::size_t end) {
    return backward_units_impl(dy, c, begin, end, /*input_only=*/false);
  }
  // The backward of units [begin, end) in two halves (Linear::backward_input / backward_weight),
  // for zero-bubble pipeline schedules: the input gradient first, the weight gradients later from
  // the same cache. Together the same bits as backward_units.
  const Tensor& backward_units_input(const Tensor& dy, Cache& c, std::size_t begin, std::size_t end) {
    return backward_units_impl(dy, c, begin, end, /*input_only=*/true);
  }
  void backward_units_weight(Cache& c, std::size_t begin, std::size_t end) {
    for (std::size_t i = end; i-- > begin;) linear_[i].backward_weight(c.linear[i]);
  }
  template <class V>
  void visit_units(V& v, const std::string& prefix, std::size_t begin, std::size_t end) {
    for (std::size_t i = begin; i < end; ++i) linear_[i].visit(v, prefix + std::to_string(2 * i + 1) + ".");
  }
  std::string unit_name(std::size_t i) const { return "linear" + std::to_string(i); }

  void set_mode(Mode) {}
  template <class V>
  void visit(V& v, const std::string& prefix) {
    visit_units(v, prefix, 0, unit_count());
  }
  std::string name() const { return "MLP"; }

 private:
  const Tensor& backward_units_impl(const Tensor& dy, Cache& c, std::size_t begin, std::size_t end, bool input_only) {
    const Tensor* g = &dy;
    for (std::size_t i = end; i-- > begin;) {
      if (i < relu_.size()) g = &relu_[i].backward(*g, c.relu[i]);
      g = &backward_or_input(linear_[i], *g, c.linear[i], input_only);
    }
    return *g;
  }

  std::vector<Linear<E>> linear_;
  std::vector<ReLU<E>> relu_;
};

// The class of any other Env is this one renamed (comm/local_env.hpp).
TESSERA_SAME_CODE_AS_LOCAL(Mlp);
TESSERA_LOCAL_EXTERN(Mlp)

}  // namespace tessera
