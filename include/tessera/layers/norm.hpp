// LayerNorm and RMSNorm over the last dimensions, as torch.nn.LayerNorm and torch.nn.RMSNorm:
// x (*, normalized_shape) -> y of x's shape, every leading index one row of n = numel(normalized_shape)
// values, normalized on its own (maths in kernels/cpu/norm.hpp).
//
//   LayerNorm(normalized_shape, eps = 1e-5, elementwise_affine = true, bias = true)
//     y = (x - mean) / sqrt(var + eps) * weight + bias     var biased (divides by n), as torch
//   RMSNorm(normalized_shape, eps = machine epsilon of the scalar, elementwise_affine = true)
//     y = x / sqrt(mean(x^2) + eps) * weight               (torch's eps=None: finfo(dtype).eps)
// weight starts at 1 and bias at 0, both of normalized_shape (torch's names: "weight", "bias").
// bias = false is nanoGPT's LayerNorm(bias=False) (torch >= 2.1 has the same argument).
// Unlike BatchNorm there are no running statistics: train and eval compute the same thing.
//
// Shapes: x (*, n1, ..., nk) with (n1, ..., nk) = normalized_shape; the cache keeps a pointer to x
// and the (rows) mean and 1/std, so backward reads x, never y.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include "tessera/comm/local_env.hpp"
#include "tessera/core/concepts.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/parameter.hpp"
#include "tessera/kernels/norm.hpp"

namespace tessera {

namespace detail {
// The row count of x for a layer normalizing over `normalized` (x's trailing dimensions must
// equal it).
template <class Tensor>
std::int64_t normalized_rows(const char* layer, const Shape& normalized, const Tensor& x) {
  bool ok = x.rank() >= normalized.rank();
  for (int i = 1; ok && i <= normalized.rank(); ++i) ok = x.shape().dim(-i) == normalized.dim(-i);
  TESSERA_CHECK(ok, ShapeError, layer, "(normalized_shape=", normalized, "): expected input (*, ",
                normalized.str().substr(1, normalized.str().size() - 2), "), got ", x.shape(),
                " (the trailing dimensions must equal normalized_shape)");
  return x.numel() / normalized.numel();
}

inline Shape checked_normalized_shape(const char* layer, const Shape& shape) {
  bool ok = shape.rank() > 0;
  for (std::int64_t d : shape) ok = ok && d > 0;
  TESSERA_CHECK(ok, ArgumentError, layer, ": normalized_shape ", shape, " must have rank >= 1 and positive extents");
  return shape;
}

// LayerNorm (Centered) and RMSNorm: one class, as their maths differ only by the centring and the
// bias (kernels/cpu/norm.hpp). eps unset: 1e-5 for LayerNorm, the scalar type's machine epsilon for
// RMSNorm (torch's eps=None); bias defaults to Centered, and RMSNorm has none.
template <class E, bool Centered>
class NormLayer {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  static constexpr bool kBackwardReadsOutput = false;
  struct Cache {
    const Tensor* x = nullptr;
    const Tensor* dy = nullptr;  // between backward_input and backward_weight
    Shape x_shape;      // x's shape at forward, checked again by backward
    Tensor y, dx;
    Tensor mean, rstd;  // (rows): the statistics forward normalized with (no mean for RMSNorm)
  };

  explicit NormLayer(Shape normalized_shape, std::optional<double> eps = std::nullopt, bool elementwise_affine = true,
                     bool bias = Centered)
      : shape_(checked_normalized_shape(kind(), normalized_shape)),
        eps_(eps.value_or(Centered ? 1e-5 : static_cast<double>(std::numeric_limits<S>::epsilon()))),
        affine_(elementwise_affine), has_bias_(elementwise_affine && bias) {
    TESSERA_CHECK(eps_ >= 0, ArgumentError, kind(), ": eps=", eps_, " must be >= 0");
    TESSERA_CHECK(Centered || !bias, ArgumentError, "RMSNorm has no bias (torch.nn.RMSNorm neither)");
    if (affine_) {
      weight_ = Parameter<S, D>(shape_, ParamKind::Norm);
      weight_.value.fill(S(1));
    }
    if (has_bias_) bias_ = Parameter<S, D>(shape_, ParamKind::Norm);  // zeros
  }
  explicit NormLayer(std::int64_t normalized_size, std::optional<double> eps = std::nullopt,
                     bool elementwise_affine = true, bool bias = Centered)
      : NormLayer(Shape{normalized_size}, eps, elementwise_affine, bias) {}

  const Tensor& forward(const Tensor& x, Cache& c) {
    const std::int64_t rows = normalized_rows(kind(), shape_, x);
    c.x = &x;
    c.x_shape = x.shape();
    c.y.resize(x.shape());
    c.rstd.resize({rows});
    if constexpr (Centered) {
      c.mean.resize({rows});
      layer_norm_forward(D{}, x.data(), rows, shape_.numel(), weight_ptr(), bias_ptr(), eps_, c.y.data(), c.mean.data(),
                         c.rstd.data());
    } else {
      rms_norm_forward(D{}, x.data(), rows, shape_.numel(), weight_ptr(), eps_, c.y.data(), c.rstd.data());
    }
    return c.y;
  }

  const Tensor& backward(const Tensor& dy, Cache& c) {
    check_backward(dy, c, "backward");
    return grads(dy, c, /*weight=*/true, /*input=*/needs_input_grad_);
  }
  // The backward in two halves, for zero-bubble pipeline schedules (parallel/pipeline_schedule.hpp):
  // backward_input forms dx (row sums) and keeps dy's address; backward_weight adds dweight and
  // dbias (column sums). backward runs the same two kernels (kernels/cpu/norm.hpp), so the bits
  // are backward's. x and dy must stay alive and unchanged until backward_weight.
  const Tensor& backward_input(const Tensor& dy, Cache& c) {
    check_backward(dy, c, "backward_input");
    c.dy = &dy;
    return grads(dy, c, /*weight=*/false, /*input=*/needs_input_grad_);
  }
  void backward_weight(Cache& c) {
    TESSERA_CHECK(c.dy != nullptr, Error, name(), "::backward_weight called without backward_input on this cache");
    check_backward(*c.dy, c, "backward_weight");
    grads(*c.dy, c, /*weight=*/true, /*input=*/false);
    c.dy = nullptr;
  }

  template <class V>
  void visit(V& v, const std::string& prefix) {
    if (affine_) v.parameter(prefix + "weight", weight_);
    if (has_bias_) v.parameter(prefix + "bias", bias_);
  }
  void set_mode(Mode) {}
  void set_needs_input_grad(bool needed) { needs_input_grad_ = needed; }

  const Shape& normalized_shape() const { return shape_; }
  double eps() const { return eps_; }
  Parameter<S, D>& weight() { return weight_; }
  Parameter<S, D>& bias() { return bias_; }  // empty without one (always for RMSNorm)
  std::string name() const { return cat(kind(), "(", shape_, ", eps=", eps_, ")"); }

 private:
  void check_backward(const Tensor& dy, const Cache& c, const char* what) const {
    TESSERA_CHECK(c.x != nullptr, Error, name(), "::", what, " called before forward on this cache");
    TESSERA_CHECK(dy.shape() == c.x_shape, ShapeError, name(), "::", what, ": dy ", dy.shape(),
                  " does not match the input ", c.x_shape);
    TESSERA_CHECK(c.x->shape() == c.x_shape, ShapeError, name(), "::", what, ": the input changed shape to ",
                  c.x->shape(), " since forward (keep it alive and unchanged)");
  }
  // c.dx = dL/dx when `input`; the parameter gradients accumulate when `weight`.
  const Tensor& grads(const Tensor& dy, Cache& c, bool weight, bool input) {
    const std::int64_t rows = c.rstd.numel();
    if (input) c.dx.resize(dy.shape());
    S* dx = input ? c.dx.data() : nullptr;
    S* dweight = weight && affine_ ? weight_.grad.data() : nullptr;
    S* dbias = weight && has_bias_ ? bias_.grad.data() : nullptr;
    if constexpr (Centered)
      layer_norm_backward(D{}, c.x->data(), dy.data(), c.mean.data(), c.rstd.data(), weight_ptr(), rows, shape_.numel(),
                          dx, dweight, dbias);
    else
      rms_norm_backward(D{}, c.x->data(), dy.data(), c.rstd.data(), weight_ptr(), rows, shape_.numel(), dx, dweight);
    if (weight && affine_) weight_.grad_ready();
    if (weight && has_bias_) bias_.grad_ready();
    return c.dx;
  }

  static const char* kind() { return Centered ? "LayerNorm" : "RMSNorm"; }
  const S* weight_ptr() const { return affine_ ? weight_.value.data() : nullptr; }
  const S* bias_ptr() const { return has_bias_ ? bias_.value.data() : nullptr; }

  Shape shape_;
  double eps_;
  bool affine_, has_bias_;
  bool needs_input_grad_ = true;
  Parameter<S, D> weight_, bias_;
};

// The class of any other Env is this one renamed (comm/local_env.hpp).
TESSERA_SAME_CODE_AS_LOCAL_WITH(NormLayer, bool, Centered);
}  // namespace detail

template <class E>
using LayerNorm = detail::NormLayer<E, true>;
template <class E>
using RMSNorm = detail::NormLayer<E, false>;

TESSERA_LOCAL_EXTERN(detail::NormLayer, true)
TESSERA_LOCAL_EXTERN(detail::NormLayer, false)

}  // namespace tessera
