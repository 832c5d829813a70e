// Flatten (torch.nn.Flatten with its defaults): x (N, d1, ..., dk) -> y (N, d1 * ... * dk), row-major
// order unchanged; backward reshapes dy (N, prod) back to x's shape.
//
// Tensors own their buffers (no views), so the reshape is a copy; a rank-2 input is already flat
// and passes through without one. No parameters.
#pragma once

#include <string>

#include "tessera/comm/local_env.hpp"
#include "tessera/core/concepts.hpp"
#include "tessera/core/memory_format.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/kernels/elementwise.hpp"

namespace tessera {

template <class E>
class Flatten {
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
    TESSERA_CHECK(x.rank() >= 2, ShapeError, "Flatten: expected an input (N, ...) of rank >= 2, got ", x.shape());
    c.x = &x;
    if (x.rank() == 2) return x;
    const std::int64_t n = x.dim(0);
    c.y.resize({n, n > 0 ? x.numel() / n : 0});
    // channels_last (N, C, H, W) flattens in PyTorch's order, (c, h, w), as x.flatten(1) does.
    if (reorders(x)) nhwc_to_nchw(D{}, n, x.dim(1), x.dim(2) * x.dim(3), x.data(), c.y.data());
    else D::copy(c.y.data(), x.data(), x.bytes());
    return c.y;
  }

  const Tensor& backward(const Tensor& dy, Cache& c) {
    TESSERA_CHECK(c.x != nullptr, Error, "Flatten::backward called before forward on this cache");
    // The model's first layer: nobody reads dL/dx, and the layer after it may have skipped
    // computing it too (a tensor-parallel block's set_needs_input_grad(false) returns none).
    if (!needs_input_grad_) return c.dx;
    const Tensor& x = *c.x;
    const std::int64_t n = x.dim(0);
    const Shape flat{n, n > 0 ? x.numel() / n : 0};
    TESSERA_CHECK(dy.shape() == flat, ShapeError, "Flatten::backward: expected dy ", flat, " for input ",
                  x.shape(), ", got ", dy.shape());
    if (x.rank() == 2) return dy;
    if (needs_input_grad_) {
      c.dx.resize(x.shape());
      if (reorders(x)) nchw_to_nhwc(D{}, n, x.dim(1), x.dim(2) * x.dim(3), dy.data(), c.dx.data());
      else D::copy(c.dx.data(), dy.data(), dy.bytes());
    }
    return c.dx;
  }

  template <class V>
  void visit(V&, const std::string&) {}
  void set_mode(Mode) {}
  void set_needs_input_grad(bool needed) { needs_input_grad_ = needed; }
  void set_memory_format(MemoryFormat f) { format_ = f; }

 private:
  bool reorders(const Tensor& x) const {
    return format_ == MemoryFormat::ChannelsLast && x.rank() == 4 && x.dim(1) > 1 && x.dim(2) * x.dim(3) > 1;
  }

  bool needs_input_grad_ = true;
  MemoryFormat format_ = MemoryFormat::Contiguous;
};

// The class of any other Env is this one renamed (comm/local_env.hpp).
TESSERA_SAME_CODE_AS_LOCAL(Flatten);
TESSERA_LOCAL_EXTERN(Flatten)

}  // namespace tessera
