// Activation layers, any input shape, y like x:
//
//   ReLU:  y = max(x, 0)                                  dx = dy * (y > 0)
//   GELU:  y = 0.5 x (1 + erf(x / sqrt 2))   (exact)      dx = dy (Phi(x) + x phi(x))
//
// Neither works in place: y is a new tensor in the cache, so the input (often a BatchNorm output
// that the BatchNorm backward still needs) stays intact. No parameters.
#pragma once

#include <string>

#include "tessera/core/concepts.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/kernels/elementwise.hpp"

namespace tessera {

// A parameter-free pointwise layer; Op supplies the kernels:
//   Op::forward(D, x, n, y)   Op::backward(D, dy, x, y, n, dx)   Op::name
template <class E, class Op>
class Pointwise {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  struct Cache {
    const Tensor* x = nullptr;
    Tensor y, dx;
  };

  const Tensor& forward(const Tensor& x, Cache& c) {
    c.x = &x;
    c.y.resize(x.shape());
    Op::forward(D{}, x.data(), x.numel(), c.y.data());
    return c.y;
  }

  const Tensor& backward(const Tensor& dy, Cache& c) {
    TESSERA_CHECK(c.x != nullptr, Error, Op::name, "::backward called before forward on this cache");
    TESSERA_CHECK(dy.shape() == c.y.shape(), ShapeError, Op::name, "::backward: dy ", dy.shape(),
                  " does not match output ", c.y.shape());
    if (needs_input_grad_) {
      c.dx.resize(dy.shape());
      Op::backward(D{}, dy.data(), c.x->data(), c.y.data(), dy.numel(), c.dx.data());
    }
    return c.dx;
  }

  template <class V>
  void visit(V&, const std::string&) {}
  void set_mode(Mode) {}
  void set_needs_input_grad(bool needed) { needs_input_grad_ = needed; }

 private:
  bool needs_input_grad_ = true;
};

struct ReluOp {
  static constexpr const char* name = "ReLU";
  template <class Dev, class S>
  static void forward(Dev d, const S* x, std::int64_t n, S* y) {
    relu_forward(d, x, n, y);
  }
  template <class Dev, class S>
  static void backward(Dev d, const S* dy, const S* /*x*/, const S* y, std::int64_t n, S* dx) {
    relu_backward(d, dy, y, n, dx);  // y > 0 exactly where x > 0
  }
};

struct GeluOp {
  static constexpr const char* name = "GELU";
  template <class Dev, class S>
  static void forward(Dev d, const S* x, std::int64_t n, S* y) {
    gelu_forward(d, x, n, y);
  }
  template <class Dev, class S>
  static void backward(Dev d, const S* dy, const S* x, const S* /*y*/, std::int64_t n, S* dx) {
    gelu_backward(d, dy, x, n, dx);
  }
};

template <class E>
using ReLU = Pointwise<E, ReluOp>;
template <class E>
using GELU = Pointwise<E, GeluOp>;

}  // namespace tessera
