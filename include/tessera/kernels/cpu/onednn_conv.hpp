// bfloat16 convolutions through oneDNN (kernels/cpu/onednn.hpp says why, and how the build and the
// process-wide setting choose it), for Conv2d in a bfloat16 Env (CpuLocalBf16, core/env.hpp). On a
// CPU with AMX, oneDNN's convolution kernels (brgconv) drive the tiles with the input blocked as
// nChw16c, the weights as pairs along the input channel and the im2col folded into the kernel.
//
// Semantics are autocast's and gemm_bf16's: x, W and dy are rounded to bfloat16 (nearest even),
// products are exact, sums are float; y, dx and dW are float. Tensors stay Tessera's float NCHW
// and OIHW: each call reorders x (and W) into oneDNN's blocked bfloat16 layouts and the result back,
// in buffers of the calling thread's scratch memory (core/scratch.hpp), so a layer keeps no
// activation copies between calls (a ResNet-50 b8 would hold about 1 GiB of them) and the
// primitives (the generated kernels, a few hundred KiB) are all it keeps. oneDNN itself allocates
// a little inside every primitive call (its argument table and execution context), so unlike
// Tessera's own kernels a step on it is not free of heap allocations (bench/README.md, "bfloat16").
// Which convolutions run here: onednn_conv_chosen().
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "tessera/core/linkage.hpp"
#include "tessera/kernels/conv2d_geometry.hpp"
#include "tessera/kernels/cpu/onednn.hpp"

namespace tessera {

// Whether a bfloat16 convolution of this geometry runs on oneDNN now: set_cpu_bf16_library,
// the build, and bfloat16 being on (cpu_bf16_active: AVX512-BF16 present and not turned off;
// without it the bfloat16 Env computes in float, and so does its convolution). `winograd`: Tessera's
// own Auto would run this layer as Winograd F(4x4, 3x3) (conv2d_blocking).
TESSERA_LINKAGE bool onednn_conv_chosen(const Conv2dGeometry& g, bool winograd);
// For benchmark reports: "oneDNN 2.6.3 (avx512_core_bf16)", or why not.
TESSERA_LINKAGE std::string cpu_bf16_conv_kernel();

// One convolution geometry at one batch size, its oneDNN primitives built on first use.
// forward: y = conv(x, W) + bias; bias is read when built `with_bias`, and must then be given.
// backward: dW += dL/dW (when dw is not null), dx = dL/dx (when dx is not null).
// Shapes as Conv2d's: x (batch, C, H, W), W (K, C / groups, kh, kw), y and dy (batch, K, H', W').
// Not for concurrent use: a layer copied to another thread gets its own (OneDnnConvSlot).
class OneDnnConv {
 public:
  OneDnnConv(const Conv2dGeometry& g, std::int64_t batch, bool training, bool with_bias);
  ~OneDnnConv();
  OneDnnConv(const OneDnnConv&) = delete;
  OneDnnConv& operator=(const OneDnnConv&) = delete;

  bool fits(const Conv2dGeometry& g, std::int64_t batch, bool training, bool with_bias) const;
  void forward(const float* x, const float* w, const float* bias, float* y);
  void backward(const float* x, const float* w, const float* dy, float* dw, float* dx);
  // oneDNN's name for the forward kernel it picked ("brg:avx512_core_amx", "jit_bf16:avx512_core_bf16").
  std::string implementation() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A layer's OneDnnConv, rebuilt when the input size, batch or mode changes. Copying a layer copies
// none of it (the copy builds its own on first use): primitives hold per-instance state.
class OneDnnConvSlot {
 public:
  OneDnnConvSlot() = default;
  OneDnnConvSlot(const OneDnnConvSlot&) {}
  OneDnnConvSlot& operator=(const OneDnnConvSlot&) {
    conv_.reset();
    return *this;
  }
  OneDnnConvSlot(OneDnnConvSlot&&) noexcept = default;
  OneDnnConvSlot& operator=(OneDnnConvSlot&&) noexcept = default;

  OneDnnConv& get(const Conv2dGeometry& g, std::int64_t batch, bool training, bool with_bias) {
    if (!conv_ || !conv_->fits(g, batch, training, with_bias)) {
      conv_.reset();  // the old primitives go first
      conv_ = std::make_unique<OneDnnConv>(g, batch, training, with_bias);
    }
    return *conv_;
  }
 private:
  std::unique_ptr<OneDnnConv> conv_;
};

}  // namespace tessera

#if TESSERA_HEADER_DEFINITIONS
#include <algorithm>
#include <unordered_map>

#include "tessera/core/error.hpp"
#include "tessera/core/scratch.hpp"
#include "tessera/kernels/cpu/gemm_bf16.hpp"

namespace tessera {

TESSERA_LINKAGE bool onednn_conv_chosen(const Conv2dGeometry& g, bool winograd) {
  const Bf16Library library = cpu_bf16_library();
  if (library == Bf16Library::Tessera || !onednn_built() || !cpu_bf16_active()) return false;
  if (library == Bf16Library::OneDnn) return true;
  // Both oneDNN's bfloat16 instructions (VDPBF16PS, AMX's TDPBF16PS) multiply pairs along the input
  // channels: with one channel (a grey-scale stem) half of every pair is padding, and oneDNN's dW
  // falls back to a plain GEMM. Tessera's im2col product runs along C kh kw instead.
  if (g.channels / g.groups < 2) return false;
  if (onednn_uses_amx()) return true;
  // AVX512-BF16 without AMX, as measured layer by layer (ResNet-50, ResNet-20 and LeNet-5 on Zen 5:
  // bench/README.md, "bfloat16"):
  // - 1x1 layers are plain products: Tessera's gemm_bf16 reads NCHW as it lies, where oneDNN pays
  //   a reorder in and one out. (The strided ones, which Tessera gathers first, came out either
  //   way by layer and batch.)
  // - Winograd's layers stay Tessera's where F(4x4, 3x3)'s 4x fewer multiply-adds (float) beat
  //   bfloat16's 2x rate: where its 4x4 output tiles cover the image exactly (ResNet-50's 56x56 and
  //   28x28) and the channels are many enough for the 36 products to outweigh the tile transforms,
  //   whose cost per tile grows with C + K where the products' grows with C K (64 and 128 channels
  //   were faster on Tessera's, ResNet-20's 16 on oneDNN's; nothing between was measured). On 14x14
  //   and 7x7 outputs the last tile of each row and column overhangs (16 computed for 14, 8 for 7:
  //   a quarter of the tile work is padding), and oneDNN's direct kernel wins.
  // - Other spatial kernels (3x3 stride 2, 5x5, the 7x7 stem): oneDNN folds the im2col into its kernel.
  if (g.kernel_h * g.kernel_w == 1) return false;
  if (winograd)
    return g.out_height % 4 != 0 || g.out_width % 4 != 0 || std::min(g.channels, g.out_channels) < 64;
  return true;
}

TESSERA_LINKAGE std::string cpu_bf16_conv_kernel() {
  if (!onednn_built()) return "Tessera im2col + gemm_bf16 (built without oneDNN)";
  if (!cpu_bf16_active())
    return "Tessera float (bfloat16 compute off: turned off, slower than float here, or no AVX512-BF16)";
  if (cpu_bf16_library() == Bf16Library::Tessera) return "Tessera im2col + gemm_bf16 (oneDNN turned off)";
  if (cpu_bf16_library() == Bf16Library::OneDnn || onednn_uses_amx()) return onednn_version();
  return onednn_version() + " for kernels wider than 1x1, Tessera's for the rest (onednn_conv_chosen)";
}

#if defined(TESSERA_ONEDNN)

// The primitives of one geometry and batch, the layouts they chose ("any": the kernel's own), and
// their operands (detail::OneDnnOperand). The operands in oneDNN's layouts live in scratch.
struct OneDnnConv::Impl {
  using memory = dnnl::memory;
  using dt = memory::data_type;
  using tag = memory::format_tag;
  using Operand = detail::OneDnnOperand;

  Conv2dGeometry g;
  std::int64_t batch;
  bool training, with_bias;
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  memory::desc x_user, w_user, y_user;  // Tessera's layouts (dy as y, dx as x, dW as W)
  memory bias_user;
  dnnl::convolution_forward::primitive_desc fwd_pd;
  dnnl::convolution_forward fwd;
  Operand fwd_x, fwd_w, fwd_y;
  std::unordered_map<int, memory> fwd_args;
  bool have_backward = false;
  dnnl::convolution_backward_data::primitive_desc bwd_data_pd;
  dnnl::convolution_backward_data bwd_data;
  Operand data_dy, data_w, data_dx;
  std::unordered_map<int, memory> data_args;
  dnnl::convolution_backward_weights::primitive_desc bwd_weights_pd;
  dnnl::convolution_backward_weights bwd_weights;
  Operand weights_x, weights_dy, weights_dw;
  std::unordered_map<int, memory> weights_args;
  // dW's kernel reads dy in the layout dx's kernel converted it to: one conversion serves both.
  bool shared_dy = false;

  memory::dims strides() const { return {g.stride_h, g.stride_w}; }
  memory::dims dilates() const { return {g.dilation_h - 1, g.dilation_w - 1}; }
  // PyTorch's symmetric padding: oneDNN checks (H + pad_l + pad_r - span) / stride + 1 == H',
  // which holds with pad_r = pad_l for H' as Conv2d computes it (floor division).
  memory::dims padding() const { return {g.pad_h, g.pad_w}; }
  memory::dims x_dims() const { return {batch, g.channels, g.height, g.width}; }
  memory::dims y_dims() const { return {batch, g.out_channels, g.out_height, g.out_width}; }
  memory::dims w_dims() const {
    if (g.groups == 1) return {g.out_channels, g.channels, g.kernel_h, g.kernel_w};
    return {g.groups, g.out_channels / g.groups, g.channels / g.groups, g.kernel_h, g.kernel_w};
  }

  Impl(const Conv2dGeometry& geometry, std::int64_t n, bool train, bool bias)
      : g(geometry), batch(n), training(train), with_bias(bias) {
    x_user = memory::desc(x_dims(), dt::f32, tag::nchw);
    y_user = memory::desc(y_dims(), dt::f32, tag::nchw);
    w_user = memory::desc(w_dims(), dt::f32, g.groups == 1 ? tag::oihw : tag::goihw);
    const memory::desc b_user({g.out_channels}, dt::f32, tag::x);
    const memory::desc x_any(x_dims(), dt::bf16, tag::any), w_any(w_dims(), dt::bf16, tag::any);
    const memory::desc y_any(y_dims(), dt::f32, tag::any);
    const auto prop = train ? dnnl::prop_kind::forward_training : dnnl::prop_kind::forward_inference;
    const auto conv = dnnl::algorithm::convolution_direct;
    fwd_pd = dnnl::convolution_forward::primitive_desc(
        bias ? dnnl::convolution_forward::desc(prop, conv, x_any, w_any, b_user, y_any, strides(), dilates(), padding(),
                                               padding())
             : dnnl::convolution_forward::desc(prop, conv, x_any, w_any, y_any, strides(), dilates(), padding(),
                                               padding()),
        engine);
    fwd = dnnl::convolution_forward(fwd_pd);
    fwd_x.init(engine, x_user, fwd_pd.src_desc(), false);
    fwd_w.init(engine, w_user, fwd_pd.weights_desc(), false);
    fwd_y.init(engine, y_user, fwd_pd.dst_desc(), true);
    fwd_args = {{DNNL_ARG_SRC, fwd_x.kernel}, {DNNL_ARG_WEIGHTS, fwd_w.kernel}, {DNNL_ARG_DST, fwd_y.kernel}};
    if (bias) {
      bias_user = memory(b_user, engine, DNNL_MEMORY_NONE);
      fwd_args.emplace(DNNL_ARG_BIAS, bias_user);
    }
  }

  void build_backward() {
    const memory::desc dx_any(x_dims(), dt::f32, tag::any), w_any(w_dims(), dt::bf16, tag::any);
    const memory::desc dy_any(y_dims(), dt::bf16, tag::any), x_any(x_dims(), dt::bf16, tag::any);
    const memory::desc dw_any(w_dims(), dt::f32, tag::any);
    const dnnl::convolution_backward_data::desc dd(dnnl::algorithm::convolution_direct, dx_any, w_any, dy_any,
                                                   strides(), dilates(), padding(), padding());
    bwd_data_pd = dnnl::convolution_backward_data::primitive_desc(dd, engine, fwd_pd);
    bwd_data = dnnl::convolution_backward_data(bwd_data_pd);
    data_dy.init(engine, y_user, bwd_data_pd.diff_dst_desc(), false);
    data_w.init(engine, w_user, bwd_data_pd.weights_desc(), false);
    data_dx.init(engine, x_user, bwd_data_pd.diff_src_desc(), true);
    data_args = {{DNNL_ARG_DIFF_DST, data_dy.kernel}, {DNNL_ARG_WEIGHTS, data_w.kernel},
                 {DNNL_ARG_DIFF_SRC, data_dx.kernel}};
    const dnnl::convolution_backward_weights::desc wd(dnnl::algorithm::convolution_direct, x_any, dw_any, dy_any,
                                                      strides(), dilates(), padding(), padding());
    bwd_weights_pd = dnnl::convolution_backward_weights::primitive_desc(wd, engine, fwd_pd);
    bwd_weights = dnnl::convolution_backward_weights(bwd_weights_pd);
    weights_x.init(engine, x_user, bwd_weights_pd.src_desc(), false);
    shared_dy = !data_dy.direct && bwd_weights_pd.diff_dst_desc() == bwd_data_pd.diff_dst_desc();
    if (!shared_dy) weights_dy.init(engine, y_user, bwd_weights_pd.diff_dst_desc(), false);
    // dW is accumulated (Conv2d's contract: weight.grad +=): the kernel writes its own buffer and
    // the reorder back adds it.
    weights_dw.init(engine, w_user, bwd_weights_pd.diff_weights_desc(), true, /*accumulate=*/true);
    weights_args = {{DNNL_ARG_SRC, weights_x.kernel}, {DNNL_ARG_DIFF_DST, shared_dy ? data_dy.kernel : weights_dy.kernel},
                    {DNNL_ARG_DIFF_WEIGHTS, weights_dw.kernel}};
    have_backward = true;
  }

  void forward(const float* x, const float* w, const float* bias, float* y) {
    detail::OneDnnArena arena(
        scratch<float, Cpu>(detail::OneDnnArena::words(fwd_x.kernel_bytes() + fwd_w.kernel_bytes() + fwd_y.kernel_bytes())));
    fwd_x.read(x, arena, stream);
    fwd_w.read(w, arena, stream);
    fwd_y.write_to(y, arena);
    if (with_bias) bias_user.set_data_handle(const_cast<float*>(bias));
    fwd.execute(stream, fwd_args);
    fwd_y.finish(stream);
    stream.wait();
  }

  void backward(const float* x, const float* w, const float* dy, float* dw, float* dx) {
    if (!have_backward) build_backward();
    detail::OneDnnArena arena(scratch<float, Cpu>(
        detail::OneDnnArena::words(data_dy.kernel_bytes() + data_w.kernel_bytes() + data_dx.kernel_bytes() +
                                   weights_x.kernel_bytes() + weights_dy.kernel_bytes() + weights_dw.kernel_bytes())));
    const bool dy_converted = dx != nullptr;
    if (dx != nullptr) {
      data_dy.read(dy, arena, stream);
      data_w.read(w, arena, stream);
      data_dx.write_to(dx, arena);
      bwd_data.execute(stream, data_args);
      data_dx.finish(stream);
    }
    if (dw != nullptr) {
      weights_x.read(x, arena, stream);
      if (shared_dy && !dy_converted) data_dy.read(dy, arena, stream);  // the layout the args name
      if (!shared_dy) weights_dy.read(dy, arena, stream);
      weights_dw.write_to(dw, arena);
      bwd_weights.execute(stream, weights_args);
      weights_dw.finish(stream);
    }
    stream.wait();
  }
};

TESSERA_LINKAGE OneDnnConv::OneDnnConv(const Conv2dGeometry& g, std::int64_t batch, bool training, bool with_bias) {
  TESSERA_CHECK(!g.channels_last, ArgumentError, "OneDnnConv: the CPU convolutions take NCHW tensors");
  try {
    impl_ = std::make_unique<Impl>(g, batch, training, with_bias);
  } catch (const dnnl::error& e) {
    throw Error(detail::cat("oneDNN has no bfloat16 convolution for C=", g.channels, " K=", g.out_channels, " ",
                            g.kernel_h, "x", g.kernel_w, " stride ", g.stride_h, " on input ", g.height, "x", g.width,
                            " batch ", batch, ": ", e.what(), " (TESSERA_BF16_LIBRARY=tessera uses Tessera's kernels)"));
  }
}

TESSERA_LINKAGE std::string OneDnnConv::implementation() const { return impl_->fwd_pd.impl_info_str(); }

namespace detail {
// A oneDNN failure at run time, with the convolution it was running.
[[noreturn]] inline void onednn_failed(const char* what, const Conv2dGeometry& g, std::int64_t batch,
                                       const dnnl::error& e) {
  throw Error(cat("OneDnnConv::", what, " (C=", g.channels, " K=", g.out_channels, " ", g.kernel_h, "x", g.kernel_w,
                  " stride ", g.stride_h, " on input ", g.height, "x", g.width, " batch ", batch, "): oneDNN: ", e.what()));
}
}  // namespace detail

TESSERA_LINKAGE void OneDnnConv::forward(const float* x, const float* w, const float* bias, float* y) {
  TESSERA_CHECK(bias != nullptr || !impl_->with_bias, ArgumentError, "OneDnnConv::forward: built with a bias, given none");
  try {
    impl_->forward(x, w, bias, y);
  } catch (const dnnl::error& e) {
    detail::onednn_failed("forward", impl_->g, impl_->batch, e);
  }
}

TESSERA_LINKAGE void OneDnnConv::backward(const float* x, const float* w, const float* dy, float* dw, float* dx) {
  TESSERA_CHECK(impl_->training, Error, "OneDnnConv::backward: built for inference (forward only)");
  try {
    impl_->backward(x, w, dy, dw, dx);
  } catch (const dnnl::error& e) {
    detail::onednn_failed("backward", impl_->g, impl_->batch, e);
  }
}

#else  // no oneDNN in this build: nothing can construct one (onednn_conv_chosen is false)

struct OneDnnConv::Impl {
  Conv2dGeometry g;
  std::int64_t batch = 0;
  bool training = false, with_bias = false;
};

namespace detail {
[[noreturn]] inline void no_onednn() {
  throw Error("OneDnnConv: this build has no oneDNN (meson option onednn; Debian: libdnnl-dev)");
}
}  // namespace detail

TESSERA_LINKAGE OneDnnConv::OneDnnConv(const Conv2dGeometry&, std::int64_t, bool, bool) { detail::no_onednn(); }
TESSERA_LINKAGE std::string OneDnnConv::implementation() const { detail::no_onednn(); }
TESSERA_LINKAGE void OneDnnConv::forward(const float*, const float*, const float*, float*) { detail::no_onednn(); }
TESSERA_LINKAGE void OneDnnConv::backward(const float*, const float*, const float*, float*, float*) {
  detail::no_onednn();
}

#endif  // TESSERA_ONEDNN

TESSERA_LINKAGE OneDnnConv::~OneDnnConv() = default;

TESSERA_LINKAGE bool OneDnnConv::fits(const Conv2dGeometry& g, std::int64_t batch, bool training, bool with_bias) const {
  const Conv2dGeometry& h = impl_->g;
  return batch == impl_->batch && training == impl_->training && with_bias == impl_->with_bias && g.channels == h.channels && g.height == h.height &&
         g.width == h.width && g.out_channels == h.out_channels && g.groups == h.groups && g.kernel_h == h.kernel_h &&
         g.kernel_w == h.kernel_w && g.stride_h == h.stride_h && g.stride_w == h.stride_w && g.pad_h == h.pad_h &&
         g.pad_w == h.pad_w && g.dilation_h == h.dilation_h && g.dilation_w == h.dilation_w;
}

}  // namespace tessera

#endif  // TESSERA_HEADER_DEFINITIONS
