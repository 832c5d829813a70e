// Softmax and LogSoftmax layers along one dimension, as torch.nn.Softmax(dim) and
// torch.nn.LogSoftmax(dim); any input shape, y like x (maths in kernels/cpu/softmax.hpp):
//
//   Softmax:     y = exp(x - max) / sum exp(x - max)      dx = y (dy - sum(dy y))
//   LogSoftmax:  y = x - max - log sum exp(x - max)       dx = dy - exp(y) sum(dy)
// with the sums along `dim`. dim may be negative (counted from the back, -1 is the last) and is
// required, as torch's implicit choice of dim is deprecated. For classification, CrossEntropyLoss
// takes the logits directly (and fuses LogSoftmax + NLLLoss); LogSoftmax<E>(1) + NLLLoss is the same.
// No parameters.
#pragma once

#include <cstdint>
#include <string>

#include "tessera/comm/local_env.hpp"
#include "tessera/core/concepts.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/kernels/softmax.hpp"

namespace tessera {

namespace detail {
// Softmax and LogSoftmax differ in one flag: the kernels take it.
template <class E, bool Log>
class SoftmaxLayer : public ParameterFree {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  struct Cache {
    Tensor y, dx;
    bool forward_done = false;  // backward needs y
  };

  explicit SoftmaxLayer(int dim) : dim_(dim) {}

  const Tensor& forward(const Tensor& x, Cache& c) {
    const Extents e = extents(x.shape());
    c.y.resize(x.shape());
    softmax_forward(D{}, x.data(), e.outer, e.dim, e.inner, Log, c.y.data());
    c.forward_done = true;
    return c.y;
  }

  const Tensor& backward(const Tensor& dy, Cache& c) {
    TESSERA_CHECK(c.forward_done, Error, name(), "::backward called before forward on this cache");
    TESSERA_CHECK(dy.shape() == c.y.shape(), ShapeError, name(), "::backward: dy ", dy.shape(),
                  " does not match the output ", c.y.shape());
    if (!needs_input_grad_) return c.dx;
    const Extents e = extents(c.y.shape());
    c.dx.resize(dy.shape());
    softmax_backward(D{}, c.y.data(), dy.data(), e.outer, e.dim, e.inner, Log, c.dx.data());
    return c.dx;
  }

  void set_mode(Mode) {}
  void set_needs_input_grad(bool needed) { needs_input_grad_ = needed; }
  int dim() const { return dim_; }
  std::string name() const { return cat(Log ? "LogSoftmax" : "Softmax", "(dim=", dim_, ")"); }

 private:
  struct Extents {
    std::int64_t outer = 1, dim = 1, inner = 1;  // x seen as (outer, dim, inner)
  };
  Extents extents(const Shape& shape) const {
    TESSERA_CHECK(shape.rank() > 0 && dim_ >= -shape.rank() && dim_ < shape.rank(), ShapeError, name(), ": dim ",
                  dim_, " is out of range for an input ", shape, " (expected -", shape.rank(), " <= dim < ",
                  shape.rank(), ")");
    const int d = dim_ < 0 ? dim_ + shape.rank() : dim_;
    Extents e;
    for (int i = 0; i < shape.rank(); ++i) {
      if (i < d) e.outer *= shape[i];
      else if (i == d) e.dim = shape[i];
      else e.inner *= shape[i];
    }
    return e;
  }

  int dim_;
  bool needs_input_grad_ = true;
};
// The class of any other Env is this one renamed (comm/local_env.hpp).
TESSERA_SAME_CODE_AS_LOCAL_WITH(SoftmaxLayer, bool, Log);
}  // namespace detail

template <class E>
using Softmax = detail::SoftmaxLayer<E, false>;
template <class E>
using LogSoftmax = detail::SoftmaxLayer<E, true>;

}  // namespace tessera
