// MLP: flatten -> [Linear -> ReLU] x hidden -> Linear.   x (N, ...) -> logits (N, classes)
// Hidden widths are a runtime list, so one type covers every depth. Parameter names follow a
// torch.nn.Sequential(Flatten, Linear, ReLU, ...): "1.weight" for the first Linear, "3.weight", ...
#pragma once

#include <string>
#include <vector>

#include "tessera/layers/activation.hpp"
#include "tessera/layers/flatten.hpp"
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
    typename Flatten<E>::Cache flatten;
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
  }

  const Tensor& forward(const Tensor& x, Cache& c) {
    if (c.linear.size() != linear_.size()) {  // first forward on this cache only
      c.linear.resize(linear_.size());
      c.relu.resize(relu_.size());
    }
    const Tensor* h = &flatten_.forward(x, c.flatten);
    for (std::size_t i = 0; i < linear_.size(); ++i) {
      h = &linear_[i].forward(*h, c.linear[i]);
      if (i < relu_.size()) h = &relu_[i].forward(*h, c.relu[i]);
    }
    return *h;
  }

  const Tensor& backward(const Tensor& dy, Cache& c) {
    const Tensor* g = &dy;
    for (std::size_t i = linear_.size(); i-- > 0;) {
      if (i < relu_.size()) g = &relu_[i].backward(*g, c.relu[i]);
      g = &linear_[i].backward(*g, c.linear[i]);
    }
    return *g;  // the first Linear skips dL/dx: nothing consumes it
  }

  void set_mode(Mode) {}
  template <class V>
  void visit(V& v, const std::string& prefix) {
    for (std::size_t i = 0; i < linear_.size(); ++i) linear_[i].visit(v, prefix + std::to_string(2 * i + 1) + ".");
  }
  std::string name() const { return "MLP"; }

 private:
  Flatten<E> flatten_;
  std::vector<Linear<E>> linear_;
  std::vector<ReLU<E>> relu_;
};

}  // namespace tessera
