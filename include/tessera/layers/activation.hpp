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
#include "tessera/kernels/cpu/elementwise.hpp"

namespace tessera {

template <class E>
class ReLU {
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
    relu_forward(D{}, x.data(), x.numel(), c.y.data());
    return c.y;
  }

  const Tensor& backward(const Tensor& dy, Cache& c) {
    TESSERA_CHECK(c.x != nullptr, Error, "ReLU::backward called before forward on this cache");
    TESSERA_CHECK(dy.shape() == c.y.shape(), ShapeError, "ReLU::backward: dy ", dy.shape(),
                  " does not match output ", c.y.shape());
    if (needs_input_grad_) {
      c.dx.resize(dy.shape());
      relu_backward(D{}, dy.data(), c.y.data(), dy.numel(), c.dx.data());
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

template <class E>
class GELU {
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
    gelu_forward(D{}, x.data(), x.numel(), c.y.data());
    return c.y;
  }

  const Tensor& backward(const Tensor& dy, Cache& c) {
    TESSERA_CHECK(c.x != nullptr, Error, "GELU::backward called before forward on this cache");
    TESSERA_CHECK(dy.shape() == c.x->shape(), ShapeError, "GELU::backward: dy ", dy.shape(),
                  " does not match output ", c.x->shape());
    if (needs_input_grad_) {
      c.dx.resize(dy.shape());
      gelu_backward(D{}, dy.data(), c.x->data(), dy.numel(), c.dx.data());
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

}  // namespace tessera
