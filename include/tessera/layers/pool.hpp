// Pooling layers with torch.nn semantics (maths in kernels/cpu/pool.hpp):
//   MaxPool2d(kernel, stride, padding)   x (N, C, H, W) -> y (N, C, H', W'), padding acts as -inf;
//                                        the argmax of each window is kept in the Cache for backward.
//   AvgPool2d(kernel, stride, padding)   same shapes, divisor kernel^2 (count_include_pad=True).
//   GlobalAvgPool                        x (N, C, H, W) -> y (N, C): AdaptiveAvgPool2d(1) + flatten,
//                                        what ResNet applies before its fc layer.
// H' = (H + 2 padding - kernel) / stride + 1; stride 0 means stride = kernel (PyTorch's default);
// padding must be at most kernel / 2, as PyTorch requires. No parameters.
#pragma once

#include <cstdint>
#include <string>

#include "tessera/core/concepts.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/kernels/pool.hpp"

namespace tessera {

namespace detail {

// Shared by MaxPool2d and AvgPool2d: configuration checks, the name errors use, output shapes.
class Pool2dConfig {
 public:
  Pool2dConfig(const char* kind, std::int64_t kernel, std::int64_t stride, std::int64_t padding)
      : kernel_(kernel), stride_(stride == 0 ? kernel : stride), pad_(padding) {
    name_ = cat(kind, "(kernel=", kernel_, ", stride=", stride_, ", padding=", pad_, ")");
    TESSERA_CHECK(kernel_ > 0 && stride_ > 0, ArgumentError, name_, ": kernel and stride must be positive");
    TESSERA_CHECK(pad_ >= 0 && 2 * pad_ <= kernel_, ArgumentError, name_,
                  ": padding must be between 0 and kernel / 2");
  }

  template <class S, class D>
  Pool2dGeometry geometry(const Tensor<S, D>& x) const {
    TESSERA_CHECK(x.rank() == 4, ShapeError, name_, ": expected input (N, C, H, W), got ", x.shape());
    TESSERA_CHECK(x.dim(2) + 2 * pad_ >= kernel_ && x.dim(3) + 2 * pad_ >= kernel_, ShapeError, name_, ": input ",
                  x.shape(), " is smaller than the window; expected (N, C, H, W) with H >= ", kernel_ - 2 * pad_,
                  " and W >= ", kernel_ - 2 * pad_);
    Pool2dGeometry g;
    g.height = x.dim(2);
    g.width = x.dim(3);
    g.kernel = kernel_;
    g.stride = stride_;
    g.pad = pad_;
    g.out_height = (g.height + 2 * pad_ - kernel_) / stride_ + 1;
    g.out_width = (g.width + 2 * pad_ - kernel_) / stride_ + 1;
    return g;
  }

  const std::string& name() const { return name_; }

 private:
  std::int64_t kernel_, stride_, pad_;
  std::string name_;
};

}  // namespace detail

template <class E>
class MaxPool2d {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  struct Cache {
    const Tensor* x = nullptr;
    Tensor y, dx;
    tessera::Tensor<std::int32_t, D> argmax;  // (N, C, H', W'): flat index h W + w of each window's maximum
  };

  explicit MaxPool2d(std::int64_t kernel, std::int64_t stride = 0, std::int64_t padding = 0)
      : config_("MaxPool2d", kernel, stride, padding) {}

  // y (N, C, H', W') = max over each window of x (N, C, H, W)
  const Tensor& forward(const Tensor& x, Cache& c) {
    const Pool2dGeometry g = config_.geometry(x);
    c.x = &x;
    c.y.resize({x.dim(0), x.dim(1), g.out_height, g.out_width});
    c.argmax.resize(c.y.shape());
    TESSERA_CHECK(g.in_plane() <= INT32_MAX, ShapeError, config_.name(), ": input plane ", x.shape(),
                  " has more than 2^31 elements");
    max_pool2d_forward(D{}, g, x.dim(0) * x.dim(1), x.data(), c.y.data(), c.argmax.data());
    return c.y;
  }

  // dy (N, C, H', W') -> dx (N, C, H, W), nonzero only at each window's argmax
  const Tensor& backward(const Tensor& dy, Cache& c) {
    TESSERA_CHECK(c.x != nullptr, Error, config_.name(), "::backward called before forward on this cache");
    TESSERA_CHECK(dy.shape() == c.y.shape(), ShapeError, config_.name(), "::backward: dy ", dy.shape(),
                  " does not match the output ", c.y.shape());
    if (!needs_input_grad_) return c.dx;
    const Pool2dGeometry g = config_.geometry(*c.x);
    c.dx.resize(c.x->shape());
    max_pool2d_backward(D{}, g, c.x->dim(0) * c.x->dim(1), dy.data(), c.argmax.data(), c.dx.data());
    return c.dx;
  }

  template <class V>
  void visit(V&, const std::string&) {}
  void set_mode(Mode) {}
  void set_needs_input_grad(bool needed) { needs_input_grad_ = needed; }
  const std::string& name() const { return config_.name(); }

 private:
  detail::Pool2dConfig config_;
  bool needs_input_grad_ = true;
};

template <class E>
class AvgPool2d {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  struct Cache {
    const Tensor* x = nullptr;
    Tensor y, dx;
  };

  explicit AvgPool2d(std::int64_t kernel, std::int64_t stride = 0, std::int64_t padding = 0)
      : config_("AvgPool2d", kernel, stride, padding) {}

  // y (N, C, H', W') = sum over each window of x (N, C, H, W) / kernel^2
  const Tensor& forward(const Tensor& x, Cache& c) {
    const Pool2dGeometry g = config_.geometry(x);
    c.x = &x;
    c.y.resize({x.dim(0), x.dim(1), g.out_height, g.out_width});
    avg_pool2d_forward(D{}, g, x.dim(0) * x.dim(1), x.data(), c.y.data());
    return c.y;
  }

  // dy (N, C, H', W') -> dx (N, C, H, W)
  const Tensor& backward(const Tensor& dy, Cache& c) {
    TESSERA_CHECK(c.x != nullptr, Error, config_.name(), "::backward called before forward on this cache");
    TESSERA_CHECK(dy.shape() == c.y.shape(), ShapeError, config_.name(), "::backward: dy ", dy.shape(),
                  " does not match the output ", c.y.shape());
    if (!needs_input_grad_) return c.dx;
    const Pool2dGeometry g = config_.geometry(*c.x);
    c.dx.resize(c.x->shape());
    avg_pool2d_backward(D{}, g, c.x->dim(0) * c.x->dim(1), dy.data(), c.dx.data());
    return c.dx;
  }

  template <class V>
  void visit(V&, const std::string&) {}
  void set_mode(Mode) {}
  void set_needs_input_grad(bool needed) { needs_input_grad_ = needed; }
  const std::string& name() const { return config_.name(); }

 private:
  detail::Pool2dConfig config_;
  bool needs_input_grad_ = true;
};

template <class E>
class GlobalAvgPool {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  struct Cache {
    const Tensor* x = nullptr;
    Tensor y, dx;
  };

  // y (N, C) = mean over H, W of x (N, C, H, W)
  const Tensor& forward(const Tensor& x, Cache& c) {
    TESSERA_CHECK(x.rank() == 4 && x.dim(2) > 0 && x.dim(3) > 0, ShapeError,
                  "GlobalAvgPool: expected input (N, C, H, W) with H, W > 0, got ", x.shape());
    c.x = &x;
    c.y.resize({x.dim(0), x.dim(1)});
    global_avg_pool_forward(D{}, x.dim(0) * x.dim(1), x.dim(2) * x.dim(3), x.data(), c.y.data());
    return c.y;
  }

  // dy (N, C) -> dx (N, C, H, W) = dy / (H W) on every pixel
  const Tensor& backward(const Tensor& dy, Cache& c) {
    TESSERA_CHECK(c.x != nullptr, Error, "GlobalAvgPool::backward called before forward on this cache");
    TESSERA_CHECK(dy.shape() == c.y.shape(), ShapeError, "GlobalAvgPool::backward: dy ", dy.shape(),
                  " does not match the output ", c.y.shape());
    if (!needs_input_grad_) return c.dx;
    const Tensor& x = *c.x;
    c.dx.resize(x.shape());
    global_avg_pool_backward(D{}, x.dim(0) * x.dim(1), x.dim(2) * x.dim(3), dy.data(), c.dx.data());
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
