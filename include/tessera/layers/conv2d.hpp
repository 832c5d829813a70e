// Conv2d: 2-D convolution with stride, padding, dilation and groups, like torch.nn.Conv2d.
//
//   x (N, C_in, H, W) -> y (N, C_out, H', W'),   H' = (H + 2 pad_h - dilation_h (kernel_h - 1) - 1) / stride_h + 1
//   weight (C_out, C_in / groups, kernel_h, kernel_w), optional bias (C_out)
// Backward (dy (N, C_out, H', W')): weight.grad += dL/dW, bias.grad += sum of dy over N, H', W',
// returns dx (N, C_in, H, W) unless set_needs_input_grad(false). Maths in kernels/cpu/conv2d.hpp.
//
// Default initialization is PyTorch's (U(+-1/sqrt(fan_in)) for weight and bias); models that want
// He initialization call kaiming_normal_(conv.weight().value, rng) themselves.
// Forward only (Mode::Inference), forward_epilogue also applies the eval BatchNorm, residual add
// and ReLU after the layer (ConvEpilogue) to each block of its output while that is in cache.
// The im2col column buffers hold nothing between forward and backward, so they come from the
// calling thread's scratch memory (core/scratch.hpp), shared with every other layer.
// Memory format (set_memory_format, core/memory_format.hpp): in channels_last x, y and their
// gradients are NHWC. On the GPU cuDNN convolves them as they are (kernels/cuda/conv2d.cuh); on
// the CPU the layer transposes them around its planar kernels (a reference, two passes more per
// tensor, the planar copies kept in the cache for backward).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "tessera/comm/local_env.hpp"
#include "tessera/core/concepts.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/init.hpp"
#include "tessera/core/memory_format.hpp"
#include "tessera/core/parameter.hpp"
#include "tessera/core/scratch.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/kernels/conv2d.hpp"
#include "tessera/kernels/cpu/onednn_conv.hpp"
#include "tessera/kernels/elementwise.hpp"

namespace tessera {

struct Conv2dOptions {
  std::int64_t in_channels = 0, out_channels = 0, kernel_h = 0, kernel_w = 0;
  std::int64_t stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0, dilation_h = 1, dilation_w = 1, groups = 1;
  bool bias = true;
};

template <class E>
class Conv2d {
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
    // channels_last on the CPU: x, and y or dy then dx, in NCHW for the planar kernels.
    Tensor x_planar, planar, dx_planar;
  };

  Conv2d(Conv2dOptions o, Rng& rng) : o_(o), name_(describe(o)) {
    TESSERA_CHECK(o.in_channels > 0 && o.out_channels > 0 && o.kernel_h > 0 && o.kernel_w > 0 && o.groups > 0,
                  ArgumentError, name_, ": channels, kernel size and groups must be positive");
    TESSERA_CHECK(o.stride_h > 0 && o.stride_w > 0 && o.dilation_h > 0 && o.dilation_w > 0, ArgumentError, name_,
                  ": stride and dilation must be positive");
    TESSERA_CHECK(o.pad_h >= 0 && o.pad_w >= 0, ArgumentError, name_, ": padding must be non-negative");
    TESSERA_CHECK(o.in_channels % o.groups == 0 && o.out_channels % o.groups == 0, ArgumentError, name_,
                  ": in_channels=", o.in_channels, " and out_channels=", o.out_channels,
                  " must both be divisible by groups=", o.groups);
    weight_ = Parameter<S, D>({o.out_channels, o.in_channels / o.groups, o.kernel_h, o.kernel_w}, ParamKind::Weight);
    default_weight_init_(weight_.value, rng);
    if (o.bias) {
      bias_ = Parameter<S, D>({o.out_channels}, ParamKind::Bias);
      default_bias_init_(bias_.value, fan(weight_.value, FanMode::FanIn), rng);
    }
  }

  // Square kernel: torch.nn.Conv2d's leading arguments (in, out, kernel, stride, padding), then the
  // rng, then bias before dilation and groups (torch: dilation, groups, bias).
  Conv2d(std::int64_t in_channels, std::int64_t out_channels, std::int64_t kernel, Rng& rng, std::int64_t stride = 1,
         std::int64_t padding = 0, bool bias = true, std::int64_t dilation = 1, std::int64_t groups = 1)
      : Conv2d(Conv2dOptions{in_channels, out_channels, kernel, kernel, stride, stride, padding, padding, dilation,
                             dilation, groups, bias},
               rng) {}

  // y (N, C_out, H', W') = conv(x (N, C_in, H, W), weight) + bias
  const Tensor& forward(const Tensor& x, Cache& c) {
    const Conv2dGeometry g = geometry(x);
    c.x = &x;
    c.y_shape = Shape{x.dim(0), o_.out_channels, g.out_height, g.out_width};
    c.y.resize(c.y_shape);
    const S* bias = o_.bias ? bias_.value.data() : nullptr;
    const S* xd = planar_reference() ? to_planar(x, c.x_planar) : x.data();
    S* yd = planar_reference() ? planar_buffer(c.planar, c.y_shape) : c.y.data();
    const Conv2dBlocking b = blocking(g, x.dim(0));
    if (on_onednn(g, b)) {
      onednn_forward(g, x.dim(0), xd, bias, yd);
    } else {
      S* workspace = scratch<S, D>(D::host_accessible ? b.workspace_elements(g, false) : 0);
      if constexpr (std::is_same_v<D, Cpu>)
        conv2d_forward(D{}, g, b, x.dim(0), xd, weight_.value.data(), bias, yd, workspace,
                       prepared_winograd_filter(g, b));
      else
        conv2d_forward(D{}, g, b, x.dim(0), xd, weight_.value.data(), bias, yd, workspace);
    }
    if (planar_reference()) from_planar(c.planar, c.y);
    return c.y;
  }

  // Forward only (Mode::Inference): y = relu(bn(conv(x)) + addend) in one pass, with e from the
  // eval BatchNorm after this layer (BatchNorm2d::inference_epilogue), e.addend and e.relu set by
  // the caller (addend: a tensor shaped like y). y is the caller's (the fused group's last
  // layer's output); this layer's cache then refuses backward.
  const Tensor& forward_epilogue(const Tensor& x, Cache& c, Tensor& y, ConvEpilogue<S> e,
                                 const Tensor* addend = nullptr) {
    const Conv2dGeometry g = geometry(x);
    c.x = nullptr;  // backward would need this layer's output gradient through the fused layers
    c.y_shape = Shape{x.dim(0), o_.out_channels, g.out_height, g.out_width};
    if (addend != nullptr)
      TESSERA_CHECK(addend->shape() == c.y_shape, ShapeError, name_, ": the residual addend ", addend->shape(),
                    " does not match the output ", c.y_shape, " (a block that changes shape needs a projection)");
    e.bias = o_.bias ? bias_.value.data() : nullptr;
    e.addend = addend != nullptr ? addend->data() : nullptr;
    y.resize(c.y_shape);
    const S* xd = planar_reference() ? to_planar(x, c.x_planar) : x.data();
    S* yd = planar_reference() ? planar_buffer(c.planar, c.y_shape) : y.data();
    if (planar_reference() && addend != nullptr) e.addend = to_planar(*addend, c.dx);  // c.dx: free in inference
    const Conv2dBlocking b = blocking(g, x.dim(0));
    if (on_onednn(g, b)) {
      // oneDNN's output (with the bias), then the epilogue in one pass over it.
      onednn_forward(g, x.dim(0), xd, e.bias, yd);
      e.bias = nullptr;
      if constexpr (std::is_same_v<D, Cpu>)
        detail::conv_epilogue_planes(e, yd, 0, x.dim(0), o_.out_channels, g.out_plane(), 0, g.out_plane(), true);
    } else {
      S* workspace = scratch<S, D>(D::host_accessible ? b.workspace_elements(g, false) : 0);
      if constexpr (std::is_same_v<D, Cpu>)
        conv2d_forward_epilogue(D{}, g, b, x.dim(0), xd, weight_.value.data(), e, yd, workspace,
                                prepared_winograd_filter(g, b));
      else
        conv2d_forward_epilogue(D{}, g, b, x.dim(0), xd, weight_.value.data(), e, yd, workspace);
    }
    if (planar_reference()) from_planar(c.planar, y);
    return y;
  }

  // dy (N, C_out, H', W') -> dx (N, C_in, H, W); weight.grad and bias.grad accumulate.
  const Tensor& backward(const Tensor& dy, Cache& c) {
    const Conv2dGeometry g = checked_backward_geometry(dy, c, "backward");
    const S* dyd = planar_reference() ? to_planar(dy, c.planar) : dy.data();
    bias_grad(g, dyd, c.x->dim(0));
    return grads(g, c, dyd, /*weight=*/true, /*input=*/needs_input_grad_);
  }
  // The backward in two halves, for zero-bubble pipeline schedules (parallel/pipeline_schedule.hpp):
  // backward_input returns dx = the transposed convolution of dy with W and keeps dy's address;
  // backward_weight then adds dL/dW (x correlated with dy) and dL/db. The kernels run the same
  // blocks in the same order as backward's (kernels/cpu/conv2d.hpp), so the bits are backward's.
  // x and dy must stay alive and unchanged until backward_weight.
  const Tensor& backward_input(const Tensor& dy, Cache& c) {
    const Conv2dGeometry g = checked_backward_geometry(dy, c, "backward_input");
    c.dy = &dy;
    const S* dyd = planar_reference() ? to_planar(dy, c.planar) : dy.data();
    return grads(g, c, dyd, /*weight=*/false, /*input=*/needs_input_grad_);
  }
  void backward_weight(Cache& c) {
    TESSERA_CHECK(c.dy != nullptr, Error, name_, "::backward_weight called without backward_input on this cache");
    const Conv2dGeometry g = checked_backward_geometry(*c.dy, c, "backward_weight");
    const S* dyd = planar_reference() ? c.planar.data() : c.dy->data();  // backward_input's NCHW copy of dy
    bias_grad(g, dyd, c.x->dim(0));
    grads(g, c, dyd, /*weight=*/true, /*input=*/false);
    c.dy = nullptr;
  }

  template <class V>
  void visit(V& v, const std::string& prefix) {
    v.parameter(prefix + "weight", weight_);
    if (o_.bias) v.parameter(prefix + "bias", bias_);
  }
  // Leaving Mode::Inference frees the transformed filter kept for it (prepared_winograd_filter).
  void set_mode(Mode m) {
    mode_ = m;
    if (m != Mode::Inference) winograd_filter_ = Tensor();
  }
  std::int64_t out_channels() const { return o_.out_channels; }
  // The stem of a network need not compute dL/dx: saves the w^T dy product and col2im.
  void set_needs_input_grad(bool needed) { needs_input_grad_ = needed; }
  // The layout of x, y and their gradients (core/memory_format.hpp); the weight keeps PyTorch's.
  void set_memory_format(MemoryFormat f) { format_ = f; }
  MemoryFormat memory_format() const { return format_; }
  // Output positions per block (one im2col buffer, one gemm; see kernels/cpu/conv2d.hpp): 0
  // (default) sizes blocks to the L2 cache; n > 0 asks for about n columns. For tests and tuning.
  void set_block_columns(std::int64_t n) { block_columns_ = n; }
  // Auto (default): Winograd F(4x4, 3x3) for 3x3 stride-1 layers where it saves enough work, else
  // im2col (kernels/conv2d_geometry.hpp). Im2col or Winograd force one; Winograd only where it
  // applies (3x3, stride 1, dilation 1, groups 1, padding <= 2). CPU only: cuDNN picks its own.
  void set_algorithm(ConvAlgorithm a) {
    if (a == ConvAlgorithm::Winograd) {
      Conv2dGeometry g;
      g.kernel_h = o_.kernel_h, g.kernel_w = o_.kernel_w, g.stride_h = o_.stride_h, g.stride_w = o_.stride_w;
      g.dilation_h = o_.dilation_h, g.dilation_w = o_.dilation_w, g.groups = o_.groups, g.pad_h = o_.pad_h;
      g.pad_w = o_.pad_w;
      TESSERA_CHECK(winograd_applies(g), ArgumentError, name_,
                    ": Winograd F(4x4, 3x3) needs a 3x3 kernel, stride 1, dilation 1, groups 1 and padding <= 2");
    }
    algorithm_ = a;
  }
  ConvAlgorithm algorithm() const { return algorithm_; }

  Parameter<S, D>& weight() { return weight_; }
  Parameter<S, D>& bias() { return bias_; }
  const Conv2dOptions& options() const { return o_; }
  const std::string& name() const { return name_; }

 private:
  // "Conv2d(3, 64, kernel=7, stride=2, padding=3, bias=false)": the configuration error messages name.
  static std::string describe(const Conv2dOptions& o) {
    auto pair = [](std::int64_t h, std::int64_t w) {
      return h == w ? std::to_string(h) : std::to_string(h) + "x" + std::to_string(w);
    };
    std::string s = "Conv2d(" + std::to_string(o.in_channels) + ", " + std::to_string(o.out_channels) +
                    ", kernel=" + pair(o.kernel_h, o.kernel_w) + ", stride=" + pair(o.stride_h, o.stride_w) +
                    ", padding=" + pair(o.pad_h, o.pad_w);
    if (o.dilation_h != 1 || o.dilation_w != 1) s += ", dilation=" + pair(o.dilation_h, o.dilation_w);
    if (o.groups != 1) s += ", groups=" + std::to_string(o.groups);
    if (!o.bias) s += ", bias=false";
    return s + ")";
  }

  // The geometry of the cached input, after checking dy and x against forward's shapes.
  Conv2dGeometry checked_backward_geometry(const Tensor& dy, const Cache& c, const char* what) const {
    TESSERA_CHECK(c.x != nullptr, Error, name_, "::", what, " called before forward on this cache");
    const Tensor& x = *c.x;
    TESSERA_CHECK(dy.shape() == c.y_shape, ShapeError, name_, "::", what, ": dy ", dy.shape(),
                  " does not match the output ", c.y_shape);
    const Conv2dGeometry g = geometry(x);
    TESSERA_CHECK((Shape{x.dim(0), o_.out_channels, g.out_height, g.out_width}) == c.y_shape, ShapeError, name_,
                  "::", what, ": the input changed shape to ", x.shape(), " since forward (keep it alive and unchanged)");
    return g;
  }
  // bias.grad += the sum of dy over N, H', W'.
  void bias_grad(const Conv2dGeometry& g, const S* dyd, std::int64_t n) {
    if (!o_.bias) return;
    if (g.channels_last)  // NHWC dy: (N H' W', C_out) rows
      add_column_sums(D{}, dyd, n * g.out_plane(), o_.out_channels, bias_.grad.data());
    else
      conv2d_bias_backward(D{}, n, o_.out_channels, g.out_plane(), dyd, bias_.grad.data());
    bias_.grad_ready();
  }
  // weight.grad += dL/dW when `weight`, c.dx = dL/dx when `input`.
  const Tensor& grads(const Conv2dGeometry& g, Cache& c, const S* dyd, bool weight, bool input) {
    const Tensor& x = *c.x;
    const std::int64_t n = x.dim(0);
    if (input) c.dx.resize(x.shape());
    S* dxd = !input ? nullptr : planar_reference() ? planar_buffer(c.dx_planar, x.shape()) : c.dx.data();
    const S* xd = planar_reference() ? c.x_planar.data() : x.data();
    const Conv2dBlocking b = blocking(g, n);
    if (on_onednn(g, b)) {
      if constexpr (std::is_same_v<S, float>)
        onednn_.get(g, n, /*training=*/true, o_.bias)
            .backward(xd, weight_.value.data(), dyd, weight ? weight_.grad.data() : nullptr, dxd);
    } else {
      conv2d_backward(D{}, g, b, n, xd, weight_.value.data(), dyd, weight ? weight_.grad.data() : nullptr, dxd,
                      scratch<S, D>(D::host_accessible ? b.workspace_elements(g, true) : 0));  // cuDNN has its own
    }
    if (weight) weight_.grad_ready();
    if (planar_reference() && input) from_planar(c.dx_planar, c.dx);
    return c.dx;
  }
  Conv2dGeometry geometry(const Tensor& x) const {
    TESSERA_CHECK(x.rank() == 4 && x.dim(1) == o_.in_channels, ShapeError, name_, ": expected input (N, ",
                  o_.in_channels, ", H, W), got ", x.shape());
    Conv2dGeometry g;
    g.channels = o_.in_channels;
    g.height = x.dim(2);
    g.width = x.dim(3);
    g.out_channels = o_.out_channels;
    g.groups = o_.groups;
    g.kernel_h = o_.kernel_h;
    g.kernel_w = o_.kernel_w;
    g.stride_h = o_.stride_h;
    g.stride_w = o_.stride_w;
    g.pad_h = o_.pad_h;
    g.pad_w = o_.pad_w;
    g.dilation_h = o_.dilation_h;
    g.dilation_w = o_.dilation_w;
    // The GPU convolves NHWC as it is; the CPU's kernels are planar (planar_reference).
    g.channels_last = !D::host_accessible && format_ == MemoryFormat::ChannelsLast;
    g.out_height = conv_output_extent(g.height, o_.kernel_h, o_.stride_h, o_.pad_h, o_.dilation_h);
    g.out_width = conv_output_extent(g.width, o_.kernel_w, o_.stride_w, o_.pad_w, o_.dilation_w);
    if (g.out_height <= 0 || g.out_width <= 0) {
      const std::int64_t min_h = o_.dilation_h * (o_.kernel_h - 1) + 1 - 2 * o_.pad_h;
      const std::int64_t min_w = o_.dilation_w * (o_.kernel_w - 1) + 1 - 2 * o_.pad_w;
      throw ShapeError(detail::cat(name_, ": input ", x.shape(), " is smaller than the kernel; expected (N, ",
                                   o_.in_channels, ", H, W) with H >= ", min_h, " and W >= ", min_w));
    }
    return g;
  }

  // channels_last on the CPU: the planar kernels between transposes (see the top).
  bool planar_reference() const { return D::host_accessible && format_ == MemoryFormat::ChannelsLast; }
  // t (N, C, H, W) in NHWC -> planar (NCHW); returns planar's data.
  static const S* to_planar(const Tensor& t, Tensor& planar) {
    planar.resize(t.shape());
    nhwc_to_nchw(D{}, t.dim(0), t.dim(1), t.dim(2) * t.dim(3), t.data(), planar.data());
    return planar.data();
  }
  static S* planar_buffer(Tensor& planar, const Shape& shape) {
    planar.resize(shape);
    return planar.data();
  }
  // planar (NCHW) -> t (NHWC), t shaped like planar.
  static void from_planar(const Tensor& planar, Tensor& t) {
    t.resize(planar.shape());
    nchw_to_nhwc(D{}, planar.dim(0), planar.dim(1), planar.dim(2) * planar.dim(3), planar.data(), t.data());
  }

  // A bfloat16 Env's convolution on the CPU runs on oneDNN where onednn_conv_chosen says so
  // (kernels/cpu/onednn_conv.hpp: AMX or AVX512-BF16 kernels), unless set_algorithm forced one of
  // Tessera's own algorithms. `b`: the layer's blocking, which says whether Auto chose Winograd.
  bool on_onednn(const Conv2dGeometry& g, const Conv2dBlocking& b) const {
    if constexpr (std::is_same_v<D, Cpu> && std::is_same_v<S, float> && E::bf16_compute)
      return algorithm_ == ConvAlgorithm::Auto && onednn_conv_chosen(g, b.winograd);
    else
      return false;
  }
  void onednn_forward(const Conv2dGeometry& g, std::int64_t n, const S* x, const S* bias, S* y) {
    if constexpr (std::is_same_v<S, float>)
      onednn_.get(g, n, /*training=*/mode_ != Mode::Inference, o_.bias).forward(x, weight_.value.data(), bias, y);
  }

  Conv2dBlocking blocking(const Conv2dGeometry& g, std::int64_t batch) const {
    // Mode::Inference runs no backward: Auto need not keep Winograd's private dU within bounds.
    return conv2d_blocking(g, batch, sizeof(S), block_columns_, algorithm_, E::bf16_compute, mode_ == Mode::Inference);
  }

  // In Mode::Inference on the CPU, where Winograd was chosen: the transformed filter U (36 C K
  // elements, four times the weights), computed on the first forward and handed to the next ones
  // instead of being computed again by each (its share of a ResNet-50 inference: bench/README.md,
  // "Inference and training memory"). The weights are not frozen by the mode (a checkpoint may be
  // loaded, a caller may hold weight()), so every forward compares their fingerprint with U's: one
  // multiply-add per weight against the transform's 36 outputs of about 30 flops each per 9
  // weights. Null otherwise.
  const S* prepared_winograd_filter(const Conv2dGeometry& g, const Conv2dBlocking& b) {
    if (mode_ != Mode::Inference || !b.winograd) return nullptr;
    const std::uint64_t fingerprint = weight_fingerprint();
    if (winograd_filter_.numel() == 0 || fingerprint != winograd_filter_of_) {
      winograd_filter_.resize({winograd_filter_elements(g)});
      winograd_prepare_filter(g, weight_.value.data(), winograd_filter_.data());
      winograd_filter_of_ = fingerprint;
    }
    return winograd_filter_.data();
  }
  // sum over i of (bits(w_i) + 1) (2 i + 1) mod 2^64: an odd factor is invertible mod 2^64, so a
  // change to any one weight changes it, and so does exchanging two. In vectors (simd): one
  // 64-bit multiply-add per weight; split over the team (the sum mod 2^64 is the same in any
  // order), whose other threads would otherwise wait for it (ResNet-50's 3x3 layers: 11 M weights).
  std::uint64_t weight_fingerprint() const {
    using Bits = std::conditional_t<sizeof(S) == 4, std::uint32_t, std::uint64_t>;
    static_assert(sizeof(S) == sizeof(Bits));
    const S* w = weight_.value.data();
    const std::int64_t n = weight_.value.numel();
    return detail::parallel_sum<std::uint64_t>(n, n > detail::kParallelGrain, [w](std::int64_t begin, std::int64_t end) {
      std::uint64_t sum = 0;
#pragma omp simd reduction(+ : sum)
      for (std::int64_t i = begin; i < end; ++i) {
        Bits bits;
        std::memcpy(&bits, w + i, sizeof(S));
        sum += (static_cast<std::uint64_t>(bits) + 1) * (2 * static_cast<std::uint64_t>(i) + 1);
      }
      return sum;
    });
  }

  Conv2dOptions o_;
  std::string name_;
  bool needs_input_grad_ = true;
  std::int64_t block_columns_ = 0;
  ConvAlgorithm algorithm_ = ConvAlgorithm::Auto;
  Parameter<S, D> weight_;
  Parameter<S, D> bias_;
  Mode mode_ = Mode::Train;
  MemoryFormat format_ = MemoryFormat::Contiguous;
  Tensor winograd_filter_;  // prepared_winograd_filter's U, and the weights' fingerprint it is of
  std::uint64_t winograd_filter_of_ = 0;
  OneDnnConvSlot onednn_;  // a bfloat16 Env's oneDNN primitives (on_onednn), for the last input size
};

// The class of any other Env is this one renamed (comm/local_env.hpp).
TESSERA_SAME_CODE_AS_LOCAL(Conv2d);
TESSERA_LOCAL_EXTERN(Conv2d)

}  // namespace tessera
