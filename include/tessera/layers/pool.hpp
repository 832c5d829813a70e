// Pooling layers with torch.nn semantics (maths in kernels/cpu/pool.hpp):
//   MaxPool2d(kernel, stride, padding, ceil_mode)
//       x (N, C, H, W) -> y (N, C, H', W'), padding acts as -inf; the argmax of each window is
//       kept in the Cache for backward.
//   AvgPool2d(kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
//       same shapes; each window's sum divided by PyTorch's divisor (kernel^2 by default).
//   AdaptiveAvgPool2d(output_size) or (out_h, out_w)
//       x (N, C, H, W) -> y (N, C, out_h, out_w), window i along H = [floor(i H / out_h),
//       ceil((i + 1) H / out_h)): any output size, smaller or larger than the input.
//   GlobalAvgPool
//       x (N, C, H, W) -> y (N, C): AdaptiveAvgPool2d(1) + flatten, what ResNet applies before
//       its fc layer.
// Window layers: H' = floor((H + 2 padding - kernel) / stride) + 1, or with ceil_mode
// ceil(...) + 1 less one when that last window would start past H + padding (PyTorch's rule: every
// window starts inside the image or its left padding). stride 0 means stride = kernel (PyTorch's
// default); padding must be at most kernel / 2, as PyTorch requires. No parameters.
// Arguments come positionally in PyTorch's order (dilation and return_indices do not exist here),
// or as an options struct with designated initializers, like keyword arguments:
//   MaxPool2d<E> pool(3, 2, 1, /*ceil_mode=*/true);
//   AvgPool2d<E> avg({.kernel = 3, .stride = 2, .padding = 1, .count_include_pad = false});
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#include "tessera/comm/local_env.hpp"
#include "tessera/core/concepts.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/linkage.hpp"
#include "tessera/core/memory_format.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/kernels/elementwise.hpp"
#include "tessera/kernels/pool.hpp"

namespace tessera {

// torch.nn.MaxPool2d's arguments (square window; no dilation or return_indices).
struct MaxPool2dOptions {
  std::int64_t kernel = 0;
  std::int64_t stride = 0;  // 0: stride = kernel (torch's stride=None)
  std::int64_t padding = 0;
  bool ceil_mode = false;
};

// torch.nn.AvgPool2d's arguments (square window).
struct AvgPool2dOptions {
  std::int64_t kernel = 0;
  std::int64_t stride = 0;  // 0: stride = kernel (torch's stride=None)
  std::int64_t padding = 0;
  bool ceil_mode = false;
  bool count_include_pad = true;
  std::optional<std::int64_t> divisor_override;  // nonzero when set, as torch requires
};

namespace detail {

// Shared by MaxPool2d and AvgPool2d: configuration checks, the name errors use, output shapes.
class Pool2dConfig {
 public:
  Pool2dConfig(const char* kind, std::int64_t kernel, std::int64_t stride, std::int64_t padding, bool ceil_mode,
               bool count_include_pad = true, std::optional<std::int64_t> divisor_override = std::nullopt);

  template <class S, class D>
  Pool2dGeometry geometry(const Tensor<S, D>& x, MemoryFormat f = MemoryFormat::Contiguous) const {
    return geometry(x.shape(), f);
  }
  Pool2dGeometry geometry(const Shape& x, MemoryFormat f = MemoryFormat::Contiguous) const;

  const std::string& name() const { return name_; }

 private:
  // PyTorch's pooling_output_shape (the numerator is >= 0 once the input passed the check above).
  std::int64_t out_extent(std::int64_t in) const {
    std::int64_t out = (in + 2 * pad_ - kernel_ + (ceil_mode_ ? stride_ - 1 : 0)) / stride_ + 1;
    if (ceil_mode_ && (out - 1) * stride_ >= in + pad_) --out;  // the last window would start in right padding
    return out;
  }

  std::int64_t kernel_, stride_, pad_;
  bool ceil_mode_, count_include_pad_;
  std::int64_t divisor_override_;  // 0: none
  std::string name_;
};

// Out of line (core/linkage.hpp): compiled once in tessera_kernels, not in every program with a pool.
#if TESSERA_HEADER_DEFINITIONS
TESSERA_LINKAGE Pool2dConfig::Pool2dConfig(const char* kind, std::int64_t kernel, std::int64_t stride,
                                           std::int64_t padding, bool ceil_mode, bool count_include_pad,
                                           std::optional<std::int64_t> divisor_override)
    : kernel_(kernel),
      stride_(stride == 0 ? kernel : stride),
      pad_(padding),
      ceil_mode_(ceil_mode),
      count_include_pad_(count_include_pad),
      divisor_override_(divisor_override.value_or(0)) {
  name_ = cat(kind, "(kernel=", kernel_, ", stride=", stride_, ", padding=", pad_);
  if (ceil_mode_) name_ += ", ceil_mode=true";
  if (!count_include_pad_) name_ += ", count_include_pad=false";
  if (divisor_override) name_ += cat(", divisor_override=", *divisor_override);
  name_ += ")";
  TESSERA_CHECK(kernel_ > 0 && stride_ > 0, ArgumentError, name_, ": kernel and stride must be positive");
  TESSERA_CHECK(pad_ >= 0 && 2 * pad_ <= kernel_, ArgumentError, name_, ": padding must be between 0 and kernel / 2");
  TESSERA_CHECK(!divisor_override || *divisor_override != 0, ArgumentError, name_,
                ": divisor_override must not be zero");
}

TESSERA_LINKAGE Pool2dGeometry Pool2dConfig::geometry(const Shape& x, MemoryFormat f) const {
  TESSERA_CHECK(x.rank() == 4, ShapeError, name_, ": expected input (N, C, H, W), got ", x);
  // Smallest H giving one window: H + 2 padding >= kernel, or in ceil mode a window may start
  // inside the image and run past its padded end (ceil((H + 2p - k) / s) >= 0).
  const std::int64_t least = std::max<std::int64_t>(1, kernel_ - 2 * pad_ - (ceil_mode_ ? stride_ - 1 : 0));
  TESSERA_CHECK(x.dim(2) >= least && x.dim(3) >= least, ShapeError, name_, ": input ", x,
                " is smaller than the window; expected (N, C, H, W) with H >= ", least, " and W >= ", least);
  Pool2dGeometry g;
  g.height = x.dim(2);
  g.width = x.dim(3);
  g.kernel = kernel_;
  g.stride = stride_;
  g.pad = pad_;
  g.out_height = out_extent(g.height);
  g.out_width = out_extent(g.width);
  g.count_include_pad = count_include_pad_;
  g.divisor_override = divisor_override_;
  g.channels = x.dim(1);
  g.channels_last = f == MemoryFormat::ChannelsLast;
  return g;
}
#endif  // TESSERA_HEADER_DEFINITIONS

}  // namespace detail

template <class E>
class MaxPool2d {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  // Backward routes dy through argmax: it reads neither x nor y (their shapes are kept apart),
  // so both may be released (core/concepts.hpp).
  static constexpr bool kBackwardReadsInput = false;
  static constexpr bool kBackwardReadsOutput = false;
  struct Cache {
    const Tensor* x = nullptr;
    Tensor y, dx;
    tessera::Tensor<std::int32_t, D> argmax;  // (N, C, H', W'): flat index h W + w of each window's maximum
    Shape x_shape, y_shape;
    bool forward_only = false;  // the forward ran in Mode::Inference and kept no argmax
  };

  explicit MaxPool2d(MaxPool2dOptions o) : config_("MaxPool2d", o.kernel, o.stride, o.padding, o.ceil_mode) {}
  explicit MaxPool2d(std::int64_t kernel, std::int64_t stride = 0, std::int64_t padding = 0, bool ceil_mode = false)
      : MaxPool2d(MaxPool2dOptions{kernel, stride, padding, ceil_mode}) {}

  // y (N, C, H', W') = max over each window of x (N, C, H, W). In Mode::Inference the argmax that
  // backward routes through is not kept (the same values, without an int32 per output to write:
  // ResNet-50's stem pooling writes 6.4 MB of it at batch 8), and backward is refused.
  const Tensor& forward(const Tensor& x, Cache& c) {
    const Pool2dGeometry g = config_.geometry(x, format_);
    c.x = &x;
    c.y.resize({x.dim(0), x.dim(1), g.out_height, g.out_width});
    c.forward_only = mode_ == Mode::Inference;
    if (c.forward_only) c.argmax = tessera::Tensor<std::int32_t, D>();
    else c.argmax.resize(c.y.shape());
    TESSERA_CHECK(g.in_plane() <= INT32_MAX, ShapeError, config_.name(), ": input plane ", x.shape(),
                  " has more than 2^31 elements");
    max_pool2d_forward(D{}, g, x.dim(0) * x.dim(1), x.data(), c.y.data(),
                       c.forward_only ? nullptr : c.argmax.data());
    c.x_shape = x.shape();
    c.y_shape = c.y.shape();
    return c.y;
  }

  // dy (N, C, H', W') -> dx (N, C, H, W), nonzero only at each window's argmax
  const Tensor& backward(const Tensor& dy, Cache& c) {
    TESSERA_CHECK(c.x != nullptr, Error, config_.name(), "::backward called before forward on this cache");
    TESSERA_CHECK(!c.forward_only, Error, config_.name(), ": backward after a forward in Mode::Inference, which kept ",
                  "no argmax (set Mode::Train or Mode::Eval before the forward to differentiate)");
    TESSERA_CHECK(dy.shape() == c.y_shape, ShapeError, config_.name(), "::backward: dy ", dy.shape(),
                  " does not match the output ", c.y_shape);
    if (!needs_input_grad_) return c.dx;
    const Pool2dGeometry g = config_.geometry(c.x_shape, format_);
    c.dx.resize(c.x_shape);
    max_pool2d_backward(D{}, g, c.x_shape.dim(0) * c.x_shape.dim(1), dy.data(), c.argmax.data(), c.dx.data());
    return c.dx;
  }

  template <class V>
  void visit(V&, const std::string&) {}
  void set_mode(Mode m) { mode_ = m; }
  void set_needs_input_grad(bool needed) { needs_input_grad_ = needed; }
  void set_memory_format(MemoryFormat f) { format_ = f; }
  const std::string& name() const { return config_.name(); }

 private:
  detail::Pool2dConfig config_;
  Mode mode_ = Mode::Train;
  bool needs_input_grad_ = true;
  MemoryFormat format_ = MemoryFormat::Contiguous;
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

  explicit AvgPool2d(AvgPool2dOptions o)
      : config_("AvgPool2d", o.kernel, o.stride, o.padding, o.ceil_mode, o.count_include_pad, o.divisor_override) {}
  explicit AvgPool2d(std::int64_t kernel, std::int64_t stride = 0, std::int64_t padding = 0, bool ceil_mode = false,
                     bool count_include_pad = true, std::optional<std::int64_t> divisor_override = std::nullopt)
      : AvgPool2d(AvgPool2dOptions{kernel, stride, padding, ceil_mode, count_include_pad, divisor_override}) {}

  // y (N, C, H', W') = sum over each window of x (N, C, H, W) / divisor (kernel^2 by default)
  const Tensor& forward(const Tensor& x, Cache& c) {
    const Pool2dGeometry g = config_.geometry(x, format_);
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
    const Pool2dGeometry g = config_.geometry(*c.x, format_);
    c.dx.resize(c.x->shape());
    avg_pool2d_backward(D{}, g, c.x->dim(0) * c.x->dim(1), dy.data(), c.dx.data());
    return c.dx;
  }

  template <class V>
  void visit(V&, const std::string&) {}
  void set_mode(Mode) {}
  void set_needs_input_grad(bool needed) { needs_input_grad_ = needed; }
  void set_memory_format(MemoryFormat f) { format_ = f; }
  const std::string& name() const { return config_.name(); }

 private:
  detail::Pool2dConfig config_;
  bool needs_input_grad_ = true;
  MemoryFormat format_ = MemoryFormat::Contiguous;
};

template <class E>
class AdaptiveAvgPool2d {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  struct Cache {
    const Tensor* x = nullptr;
    Tensor y, dx;
    Tensor planar_in, planar_out;  // channels_last with an output larger than 1 x 1: NCHW copies
  };

  explicit AdaptiveAvgPool2d(std::int64_t output_size) : AdaptiveAvgPool2d(output_size, output_size) {}
  AdaptiveAvgPool2d(std::int64_t out_height, std::int64_t out_width) : out_height_(out_height), out_width_(out_width) {
    name_ = out_height == out_width ? detail::cat("AdaptiveAvgPool2d(output_size=", out_height, ")")
                                    : detail::cat("AdaptiveAvgPool2d(output_size=(", out_height, ", ", out_width, "))");
    TESSERA_CHECK(out_height > 0 && out_width > 0, ArgumentError, name_, ": output size must be positive");
  }

  // y (N, C, H', W'): y[i, j] = mean of x over rows [floor(i H / H'), ceil((i + 1) H / H')) and the
  // like columns of x (N, C, H, W).
  const Tensor& forward(const Tensor& x, Cache& c) {
    const AdaptivePool2dGeometry g = geometry(x);
    c.x = &x;
    c.y.resize({x.dim(0), x.dim(1), out_height_, out_width_});
    const bool nhwc = format_ == MemoryFormat::ChannelsLast;
    if (g.out_plane() == 1) {
      if (nhwc) global_avg_pool_channels_last_forward(D{}, x.dim(0), x.dim(1), g.in_plane(), x.data(), c.y.data());
      else global_avg_pool_forward(D{}, x.dim(0) * x.dim(1), g.in_plane(), x.data(), c.y.data());
    } else if (nhwc) {  // the planar kernel between transposes
      c.planar_in.resize(x.shape());
      c.planar_out.resize(c.y.shape());
      nhwc_to_nchw(D{}, x.dim(0), x.dim(1), g.in_plane(), x.data(), c.planar_in.data());
      adaptive_avg_pool2d_forward(D{}, g, x.dim(0) * x.dim(1), c.planar_in.data(), c.planar_out.data());
      nchw_to_nhwc(D{}, x.dim(0), x.dim(1), g.out_plane(), c.planar_out.data(), c.y.data());
    } else {
      adaptive_avg_pool2d_forward(D{}, g, x.dim(0) * x.dim(1), x.data(), c.y.data());
    }
    return c.y;
  }

  // dy (N, C, H', W') -> dx (N, C, H, W): each dy[i, j] / (window rows x cols) over its window.
  const Tensor& backward(const Tensor& dy, Cache& c) {
    TESSERA_CHECK(c.x != nullptr, Error, name_, "::backward called before forward on this cache");
    TESSERA_CHECK(dy.shape() == c.y.shape(), ShapeError, name_, "::backward: dy ", dy.shape(),
                  " does not match the output ", c.y.shape());
    if (!needs_input_grad_) return c.dx;
    const AdaptivePool2dGeometry g = geometry(*c.x);
    c.dx.resize(c.x->shape());
    const std::int64_t n = c.x->dim(0), channels = c.x->dim(1);
    const bool nhwc = format_ == MemoryFormat::ChannelsLast;
    if (g.out_plane() == 1) {
      if (nhwc) global_avg_pool_channels_last_backward(D{}, n, channels, g.in_plane(), dy.data(), c.dx.data());
      else global_avg_pool_backward(D{}, n * channels, g.in_plane(), dy.data(), c.dx.data());
    } else if (nhwc) {
      c.planar_out.resize(dy.shape());
      c.planar_in.resize(c.x->shape());
      nhwc_to_nchw(D{}, n, channels, g.out_plane(), dy.data(), c.planar_out.data());
      adaptive_avg_pool2d_backward(D{}, g, n * channels, c.planar_out.data(), c.planar_in.data());
      nchw_to_nhwc(D{}, n, channels, g.in_plane(), c.planar_in.data(), c.dx.data());
    } else {
      adaptive_avg_pool2d_backward(D{}, g, n * channels, dy.data(), c.dx.data());
    }
    return c.dx;
  }

  template <class V>
  void visit(V&, const std::string&) {}
  void set_mode(Mode) {}
  void set_needs_input_grad(bool needed) { needs_input_grad_ = needed; }
  void set_memory_format(MemoryFormat f) { format_ = f; }
  const std::string& name() const { return name_; }

 private:
  AdaptivePool2dGeometry geometry(const Tensor& x) const {
    TESSERA_CHECK(x.rank() == 4 && x.dim(2) > 0 && x.dim(3) > 0, ShapeError, name_,
                  ": expected input (N, C, H, W) with H, W > 0, got ", x.shape());
    return {x.dim(2), x.dim(3), out_height_, out_width_};
  }

  std::int64_t out_height_, out_width_;
  std::string name_;
  bool needs_input_grad_ = true;
  MemoryFormat format_ = MemoryFormat::Contiguous;
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
    if (format_ == MemoryFormat::ChannelsLast)
      global_avg_pool_channels_last_forward(D{}, x.dim(0), x.dim(1), x.dim(2) * x.dim(3), x.data(), c.y.data());
    else
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
    if (format_ == MemoryFormat::ChannelsLast)
      global_avg_pool_channels_last_backward(D{}, x.dim(0), x.dim(1), x.dim(2) * x.dim(3), dy.data(), c.dx.data());
    else
      global_avg_pool_backward(D{}, x.dim(0) * x.dim(1), x.dim(2) * x.dim(3), dy.data(), c.dx.data());
    return c.dx;
  }

  template <class V>
  void visit(V&, const std::string&) {}
  void set_mode(Mode) {}
  void set_needs_input_grad(bool needed) { needs_input_grad_ = needed; }
  // channels_last: x (N, C, H, W) in NHWC; y (N, C) is the same in both formats.
  void set_memory_format(MemoryFormat f) { format_ = f; }

 private:
  bool needs_input_grad_ = true;
  MemoryFormat format_ = MemoryFormat::Contiguous;
};

// The class of any other Env is this one renamed (comm/local_env.hpp).
TESSERA_SAME_CODE_AS_LOCAL(MaxPool2d);
TESSERA_SAME_CODE_AS_LOCAL(AvgPool2d);
TESSERA_SAME_CODE_AS_LOCAL(AdaptiveAvgPool2d);
TESSERA_SAME_CODE_AS_LOCAL(GlobalAvgPool);
TESSERA_LOCAL_EXTERN(MaxPool2d)
TESSERA_LOCAL_EXTERN(AvgPool2d)
TESSERA_LOCAL_EXTERN(AdaptiveAvgPool2d)
TESSERA_LOCAL_EXTERN(GlobalAvgPool)

}  // namespace tessera
