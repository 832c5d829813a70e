// Linear: y = x W^T + b   x (*, in) -> y (*, out);  W (out, in), b (out).
// As torch.nn.Linear, the input may have any rank >= 1: the map applies to the last dimension, and
// the leading dimensions (*) are flattened into N rows (x (B, T, in) is N = B T rows; a vector
// x (in) gives y (out)). Below, N is that row count.
//
// Backward (dy (*, out), seen as (N, out)):
//   dW += dy^T x   (out, in)      db += sum_n dy   (out)      dx = dy W   (N, in)
// The input is not copied: the cache keeps a pointer to it, so the caller keeps x alive until
// backward (Sequential does: x is the previous layer's cached output).
#pragma once

#include <string>

#include "tessera/comm/local_env.hpp"
#include "tessera/core/concepts.hpp"
#include "tessera/core/init.hpp"
#include "tessera/core/memory_format.hpp"
#include "tessera/core/parameter.hpp"
#include "tessera/kernels/elementwise.hpp"
#include "tessera/kernels/gemm.hpp"

namespace tessera {

namespace detail {
// A linear layer's parameter gradients from dy (n, out) and its input x (n, in):
// dW += dy^T x (out, in), db += the column sums of dy (out); then each parameter's grad-ready hook.
template <class Compute, class S, class D>
void linear_parameter_grads(const S* dy, const S* x, std::int64_t n, std::int64_t out, std::int64_t in,
                            Parameter<S, D>& weight, Parameter<S, D>* bias) {
  gemm_in<Compute>(D{}, true, false, out, in, n, S(1), dy, out, x, in, S(1), weight.grad.data(), in);
  weight.grad_ready();
  if (bias == nullptr) return;
  add_column_sums(D{}, dy, n, out, bias->grad.data());
  bias->grad_ready();
}
}  // namespace detail

template <class E>
class Linear {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  // Backward reads x and dy, never y (its shape is kept apart): the layer after may free y.
  static constexpr bool kBackwardReadsOutput = false;
  struct Cache {
    const Tensor* x = nullptr;
    const Tensor* dy = nullptr;  // between backward_input and backward_weight
    Tensor y, dx;
    Shape y_shape;  // y's shape, still known once y is released
  };

  Linear(std::int64_t in_features, std::int64_t out_features, Rng& rng, bool bias = true)
      : in_(in_features), out_(out_features), has_bias_(bias), weight_(checked_weight_shape(in_features, out_features)) {
    default_weight_init_(weight_.value, rng);
    if (has_bias_) {
      bias_ = Parameter<S, D>({out_features}, ParamKind::Bias);
      default_bias_init_(bias_.value, in_features, rng);
    }
  }

  const Tensor& forward(const Tensor& x, Cache& c) {
    if (flattens_input_)
      TESSERA_CHECK(x.rank() >= 2 && x.numel() == x.dim(0) * in_, ShapeError, "Linear(", in_, ", ", out_,
                    ") on a flattened input: expected (N, ...) with ", in_, " elements per sample, got ", x.shape());
    else
      TESSERA_CHECK(x.rank() >= 1 && x.shape().dim(-1) == in_, ShapeError, "Linear(", in_, ", ", out_,
                    "): expected input (*, ", in_, ") (the last dimension is in_features), got ", x.shape());
    TESSERA_CHECK(format_ == MemoryFormat::Contiguous || x.rank() != 4, ArgumentError, "Linear(", in_, ", ", out_,
                  "): a 4-D input ", x.shape(), " in channels_last has its last dimension (W) apart in memory; ",
                  "flatten or pool it first");
    const auto n = x.numel() / in_;
    c.x = &x;
    Shape y_shape = flattens_input_ ? Shape{n, out_} : x.shape();
    y_shape[y_shape.rank() - 1] = out_;
    c.y_shape = y_shape;
    c.y.resize(y_shape);
    if (has_bias_) broadcast_rows(D{}, bias_.value.data(), n, out_, c.y.data());
    gemm_in<typename E::Compute>(D{}, false, true, n, out_, in_, S(1), x.data(), in_, weight_.value.data(), in_, has_bias_ ? S(1) : S(0),
         c.y.data(), out_);  // (N, in) x (in, out)
    return c.y;
  }

  const Tensor& backward(const Tensor& dy, Cache& c) {
    const auto n = backward_rows(dy, c, "backward");
    detail::linear_parameter_grads<typename E::Compute>(dy.data(), c.x->data(), n, out_, in_, weight_, has_bias_ ? &bias_ : nullptr);
    return input_grad(dy, c, n);
  }
  // The backward in two halves, for pipeline schedules that run the weight gradients later (zero
  // bubble, parallel/pipeline_schedule.hpp): backward_input returns dL/dx = dy W and keeps dy's
  // address; backward_weight then adds dL/dW = dy^T x and dL/db. The same products as backward, so
  // the same bits. dy and x must stay alive and unchanged until backward_weight (a pipeline's slot
  // or the next layer's cache holds them).
  const Tensor& backward_input(const Tensor& dy, Cache& c) {
    const auto n = backward_rows(dy, c, "backward_input");
    c.dy = &dy;
    return input_grad(dy, c, n);
  }
  void backward_weight(Cache& c) {
    TESSERA_CHECK(c.dy != nullptr, Error, "Linear(", in_, ", ", out_,
                  ")::backward_weight called without backward_input on this cache");
    const auto n = backward_rows(*c.dy, c, "backward_weight");
    detail::linear_parameter_grads<typename E::Compute>(c.dy->data(), c.x->data(), n, out_, in_, weight_,
                                                        has_bias_ ? &bias_ : nullptr);
    c.dy = nullptr;
  }

  template <class V>
  void visit(V& v, const std::string& prefix) {
    v.parameter(prefix + "weight", weight_);
    if (has_bias_) v.parameter(prefix + "bias", bias_);
  }
  void set_mode(Mode) {}
  // (N, F) inputs are the same in every memory format; a 4-D one in channels_last is refused.
  void set_memory_format(MemoryFormat f) { format_ = f; }
  // The first layer of a network need not compute dL/dx (nobody consumes it).
  void set_needs_input_grad(bool needed) { needs_input_grad_ = needed; }
  // On: x (N, d1, ..., dk) is read as (N, d1 ... dk), what an nn.Flatten before this layer would
  // hand it, and dL/dx comes back in x's shape. For a model that holds both (Mlp): tensors have no
  // views, so a Flatten layer copies its input (bench/README.md, "Figures behind design choices in
  // the headers"). Off by default: as in nn.Linear, the last dimension is in_features.
  void set_flattens_input(bool on) { flattens_input_ = on; }

  Parameter<S, D>& weight() { return weight_; }
  static Shape checked_weight_shape(std::int64_t in, std::int64_t out) {
    TESSERA_CHECK(in > 0 && out > 0, ArgumentError, "Linear: in_features=", in, " and out_features=", out,
                  " must be positive");
    return {out, in};
  }
  Parameter<S, D>& bias() { return bias_; }

 private:
  // Rows of dy after checking it and the cached input against forward's shapes.
  std::int64_t backward_rows(const Tensor& dy, const Cache& c, const char* what) const {
    TESSERA_CHECK(c.x != nullptr, Error, "Linear::", what, " called before forward on this cache");
    const Tensor& x = *c.x;
    TESSERA_CHECK(dy.shape() == c.y_shape, ShapeError, "Linear(", in_, ", ", out_, ")::", what, ": dy ",
                  dy.shape(), " does not match output ", c.y_shape);
    const auto n = c.y_shape.numel() / out_;
    const bool same_rows = flattens_input_ ? x.rank() >= 2 && x.dim(0) == n
                                           : x.rank() == c.y_shape.rank() && x.shape().dim(-1) == in_;
    TESSERA_CHECK(same_rows && x.numel() == n * in_, ShapeError, "Linear(", in_, ", ", out_, ")::", what,
                  ": the input changed shape to ", x.shape(), " since forward (keep it alive and unchanged)");
    return n;
  }
  const Tensor& input_grad(const Tensor& dy, Cache& c, std::int64_t n) {
    if (needs_input_grad_) {
      c.dx.resize(c.x->shape());
      gemm_in<typename E::Compute>(D{}, false, false, n, in_, out_, S(1), dy.data(), out_, weight_.value.data(), in_, S(0),
                                   c.dx.data(), in_);
    }
    return c.dx;
  }

  std::int64_t in_, out_;
  bool has_bias_;
  bool needs_input_grad_ = true;
  bool flattens_input_ = false;
  Parameter<S, D> weight_;
  Parameter<S, D> bias_;
  MemoryFormat format_ = MemoryFormat::Contiguous;
};

// The class of any other Env is this one renamed (comm/local_env.hpp).
TESSERA_SAME_CODE_AS_LOCAL(Linear);
TESSERA_LOCAL_EXTERN(Linear)

}  // namespace tessera
