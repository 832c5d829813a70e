// Parameter: a trainable tensor, its gradient, and the hook backward calls once the gradient for
// this step is complete (DataParallel uses the hook to start a bucket's all-reduce while the rest
// of backward still runs; by default nothing happens).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "tessera/core/random.hpp"
#include "tessera/core/tensor.hpp"

namespace tessera {

enum class ParamKind { Weight, Bias, Norm };  // Norm = BatchNorm scale/shift

template <class S, class D = Cpu>
struct Parameter {
  Tensor<S, D> value;
  Tensor<S, D> grad;
  ParamKind kind = ParamKind::Weight;
  std::function<void(Parameter&)> on_grad_ready;

  Parameter() = default;
  explicit Parameter(const Shape& shape, ParamKind k = ParamKind::Weight)
      : value(shape, S(0)), grad(shape, S(0)), kind(k) {}

  void grad_ready() {
    if (on_grad_ready) on_grad_ready(*this);
  }
};

// Names as PyTorch's state_dict spells them ("layer1.0.conv1.weight"), gathered once after
// construction by visiting the model. The visit protocol every layer follows:
//   v.parameter(name, Parameter&)   trainable tensors
//   v.buffer(name, Tensor&)         state that is not trained (BatchNorm running statistics)
//   v.rng(name, Rng&)               random generators a layer owns (Dropout), so a checkpoint
//                                   can resume their streams exactly
// Requires: the model is not moved afterwards (the pointers point into it).
template <class S, class D = Cpu>
struct NamedTensors {
  std::vector<std::pair<std::string, Parameter<S, D>*>> parameters;
  std::vector<std::pair<std::string, Tensor<S, D>*>> buffers;
  std::vector<std::pair<std::string, Rng*>> rngs;

  void parameter(std::string name, Parameter<S, D>& p) { parameters.emplace_back(std::move(name), &p); }
  void buffer(std::string name, Tensor<S, D>& t) { buffers.emplace_back(std::move(name), &t); }
  void rng(std::string name, Rng& r) { rngs.emplace_back(std::move(name), &r); }
};

// Collects a layer's or model's parameters and buffers under a prefix.
template <class S, class D, class L>
NamedTensors<S, D> named_tensors(L& layer, const std::string& prefix = "") {
  NamedTensors<S, D> out;
  layer.visit(out, prefix);
  return out;
}

template <class S, class D>
std::size_t count_parameters(const NamedTensors<S, D>& named) {
  std::size_t n = 0;
  for (auto& [name, p] : named.parameters) n += static_cast<std::size_t>(p->value.numel());
  return n;
}

}  // namespace tessera
