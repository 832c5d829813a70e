// bfloat16 convolutions through oneDNN (Debian's libdnnl-dev 2.6, the library PyTorch's CPU
// convolutions and autocast use), for Conv2d in a bfloat16 Env (CpuLocalBf16, core/env.hpp).
//
// Why a second library: on a CPU with AMX (Sapphire Rapids and later) a core multiplies 1,024
// bfloat16 pairs per cycle in its tile unit against 64 float FMAs with AVX-512, and oneDNN's
// convolution kernels (brgconv) drive the tiles with the input blocked as nChw16c, the weights as
// pairs along the input channel and the im2col folded into the kernel. Tessera's own bfloat16
// path (im2col, then gemm_bf16's VDPBF16PS kernel, kernels/cpu/gemm_bf16.hpp) cannot reach the
// tiles. oneDNN chooses its kernel at run time from the CPU it finds: AMX tiles where they exist,
// AVX512-BF16 dot products where they do not (Zen 4 and 5, Cooper Lake), so one binary serves
// both, and the measured choice per CPU kind is in bench/README.md, "bfloat16".
//
// Semantics are autocast's and gemm_bf16's: x, W and dy are rounded to bfloat16 (nearest even),
// products are exact, sums are float; y, dx and dW are float. Tensors stay Tessera's float NCHW
// and OIHW: each call reorders x (and W) into oneDNN's blocked bfloat16 layouts and the result back,
// in buffers of the calling thread's scratch memory (core/scratch.hpp), so a layer keeps no
// activation copies between calls (a ResNet-50 b8 would hold about 1 GiB of them) and the
// primitives (the generated kernels, a few hundred KiB) are all it keeps.
//
// Build: the meson option `onednn` (auto) defines TESSERA_ONEDNN and links libdnnl. Without it
// onednn_built() is false and Conv2d keeps its own kernels. Which convolutions run here:
// onednn_conv_chosen(); set_cpu_bf16_conv_library() overrides it for the whole process
// (TESSERA_BF16_CONV=tessera|onednn does the same from the environment, read once).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "tessera/core/linkage.hpp"
#include "tessera/kernels/conv2d_geometry.hpp"

namespace tessera {

// Which kernels compute a bfloat16 Env's convolutions.
enum class Bf16ConvLibrary {
  Auto,     // oneDNN where it is built in and the CPU has AVX512-BF16 (or AMX); else Tessera's
  Tessera,  // im2col + gemm_bf16, Winograd in float (kernels/cpu/conv2d.hpp)
  OneDnn,   // oneDNN wherever it is built in (an error otherwise: onednn_built())
};

// True when this build links oneDNN (TESSERA_ONEDNN).
TESSERA_LINKAGE bool onednn_built();
// The instruction set oneDNN's kernels use on this CPU ("avx512_core_amx", "avx512_core_bf16", ...),
// or "" without oneDNN.
TESSERA_LINKAGE std::string onednn_cpu_isa();
// True when that instruction set has AMX tiles.
TESSERA_LINKAGE bool onednn_uses_amx();
// Process-wide; the default is Auto unless TESSERA_BF16_CONV says otherwise.
TESSERA_LINKAGE void set_cpu_bf16_conv_library(Bf16ConvLibrary library);
TESSERA_LINKAGE Bf16ConvLibrary cpu_bf16_conv_library();
// Whether a bfloat16 convolution of this geometry and batch runs on oneDNN now: the setting above,
// the build, and bfloat16 being on (cpu_bf16_active: AVX512-BF16 present and not turned off;
// without it the bfloat16 Env computes in float, and so does its convolution). `winograd`: Tessera's
// own Auto would run this layer as Winograd F(4x4, 3x3) (conv2d_blocking).
TESSERA_LINKAGE bool onednn_conv_chosen(const Conv2dGeometry& g, std::int64_t batch, bool winograd);
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
  void reset() { conv_.reset(); }

 private:
  std::unique_ptr<OneDnnConv> conv_;
};

}  // namespace tessera

#if TESSERA_HEADER_DEFINITIONS
#include <atomic>
#include <cstdlib>
#include <initializer_list>
#include <unordered_map>

#include "tessera/core/error.hpp"
#include "tessera/core/scratch.hpp"
#include "tessera/kernels/cpu/gemm_bf16.hpp"

#if defined(TESSERA_ONEDNN)
#include <oneapi/dnnl/dnnl.hpp>
#endif

namespace tessera {

namespace detail {
// TESSERA_BF16_CONV, read once: "tessera", "onednn" or "auto"/unset.
inline Bf16ConvLibrary bf16_conv_library_from_environment() {
  const char* v = std::getenv("TESSERA_BF16_CONV");
  if (v == nullptr || *v == '\0' || std::string(v) == "auto") return Bf16ConvLibrary::Auto;
  if (std::string(v) == "tessera") return Bf16ConvLibrary::Tessera;
  if (std::string(v) == "onednn") return Bf16ConvLibrary::OneDnn;
  throw ArgumentError(std::string("TESSERA_BF16_CONV='") + v +
                      "' is not a bfloat16 convolution library: use auto, tessera or onednn");
}
inline std::atomic<Bf16ConvLibrary>& bf16_conv_library_setting() {
  static std::atomic<Bf16ConvLibrary> setting{bf16_conv_library_from_environment()};
  return setting;
}
}  // namespace detail

TESSERA_LINKAGE bool onednn_built() {
#if defined(TESSERA_ONEDNN)
  return true;
#else
  return false;
#endif
}

TESSERA_LINKAGE std::string onednn_cpu_isa() {
#if defined(TESSERA_ONEDNN)
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::sse41: return "sse41";
    case dnnl::cpu_isa::avx: return "avx";
    case dnnl::cpu_isa::avx2: return "avx2";
    case dnnl::cpu_isa::avx2_vnni: return "avx2_vnni";
    case dnnl::cpu_isa::avx512_core: return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni: return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16: return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_amx: return "avx512_core_amx";
    default: return "other";
  }
#else
  return "";
#endif
}

TESSERA_LINKAGE bool onednn_uses_amx() { return onednn_cpu_isa().find("amx") != std::string::npos; }

TESSERA_LINKAGE void set_cpu_bf16_conv_library(Bf16ConvLibrary library) {
  TESSERA_CHECK(library != Bf16ConvLibrary::OneDnn || onednn_built(), ArgumentError,
                "set_cpu_bf16_conv_library(OneDnn): this build has no oneDNN (meson option onednn; Debian: "
                "libdnnl-dev)");
  detail::bf16_conv_library_setting() = library;
}

TESSERA_LINKAGE Bf16ConvLibrary cpu_bf16_conv_library() { return detail::bf16_conv_library_setting().load(); }

TESSERA_LINKAGE bool onednn_conv_chosen(const Conv2dGeometry& g, std::int64_t batch, bool winograd) {
  const Bf16ConvLibrary library = cpu_bf16_conv_library();
  if (library == Bf16ConvLibrary::Tessera || !onednn_built() || !cpu_bf16_active()) return false;
  if (library == Bf16ConvLibrary::OneDnn || onednn_uses_amx()) return true;
  // AVX512-BF16 without AMX (ResNet-50 layer by layer on Zen 5: bench/README.md, "bfloat16"):
  // - 1x1 layers are plain products: Tessera's gemm_bf16 reads NCHW as it lies, where oneDNN pays
  //   a reorder in and one out; Tessera's.
  // - Winograd's float products read the transformed filter U (36 C K floats: 37 MiB at 512
  //   channels) once per block, so they run at memory speed unless the batch has many tiles per
  //   output channel: with at least 2.5 per channel (ResNet-50 b8 and b32: 64 channels at 56x56,
  //   128 at 28x28, 3 to 24 tiles per channel) F(4x4, 3x3)'s 4x fewer multiply-adds beat
  //   bfloat16's 2x rate; with fewer (256 at 14x14: 0.5 at b8, 2 at b32; 512 at 7x7) oneDNN's
  //   direct kernel wins.
  // - Other spatial kernels (3x3 stride 2, the 7x7 stem): oneDNN folds the im2col into its kernel.
  if (g.kernel_h * g.kernel_w == 1) return false;
  if (winograd) {
    const std::int64_t tiles = (g.out_height + 3) / 4 * ((g.out_width + 3) / 4) * batch;
    return 2 * tiles < 5 * g.out_channels;
  }
  return true;
}

TESSERA_LINKAGE std::string cpu_bf16_conv_kernel() {
  if (!onednn_built()) return "Tessera im2col + gemm_bf16 (built without oneDNN)";
  if (!cpu_bf16_active()) return "Tessera float (bfloat16 off or no AVX512-BF16)";
  if (cpu_bf16_conv_library() == Bf16ConvLibrary::Tessera) return "Tessera im2col + gemm_bf16 (oneDNN turned off)";
#if defined(TESSERA_ONEDNN)
  const dnnl_version_t* v = dnnl_version();
  const std::string onednn = "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." +
                             std::to_string(v->patch) + " (" + onednn_cpu_isa() + ")";
  if (cpu_bf16_conv_library() == Bf16ConvLibrary::OneDnn || onednn_uses_amx()) return onednn;
  return onednn + " for kernels wider than 1x1, Tessera's gemm_bf16 for 1x1";
#else
  return "";
#endif
}

#if defined(TESSERA_ONEDNN)

// The primitives of one geometry and batch, and the layouts they chose ("any": the kernel's own).
// User memories describe Tessera's tensors (float NCHW, [G]OIHW); their data handles are set per
// call. The kernels' operands live in scratch (their descriptors only are kept).
struct OneDnnConv::Impl {
  using memory = dnnl::memory;
  using dt = memory::data_type;
  using tag = memory::format_tag;

  Conv2dGeometry g;
  std::int64_t batch;
  bool training, with_bias;
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  memory::desc x_user, w_user, b_user, y_user;  // Tessera's layouts (dy as y, dx as x, dW as W)
  dnnl::convolution_forward::primitive_desc fwd_pd;
  dnnl::convolution_forward fwd;
  bool have_backward = false;
  dnnl::convolution_backward_data::primitive_desc bwd_data_pd;
  dnnl::convolution_backward_data bwd_data;
  dnnl::convolution_backward_weights::primitive_desc bwd_weights_pd;
  dnnl::convolution_backward_weights bwd_weights;

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
    b_user = memory::desc({g.out_channels}, dt::f32, tag::x);
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
  }

  void build_backward() {
    const memory::desc dx_any(x_dims(), dt::f32, tag::any), w_any(w_dims(), dt::bf16, tag::any);
    const memory::desc dy_any(y_dims(), dt::bf16, tag::any), x_any(x_dims(), dt::bf16, tag::any);
    const memory::desc dw_any(w_dims(), dt::f32, tag::any);
    const dnnl::convolution_backward_data::desc dd(dnnl::algorithm::convolution_direct, dx_any, w_any, dy_any,
                                                   strides(), dilates(), padding(), padding());
    bwd_data_pd = dnnl::convolution_backward_data::primitive_desc(dd, engine, fwd_pd);
    bwd_data = dnnl::convolution_backward_data(bwd_data_pd);
    const dnnl::convolution_backward_weights::desc wd(dnnl::algorithm::convolution_direct, x_any, dw_any, dy_any,
                                                      strides(), dilates(), padding(), padding());
    bwd_weights_pd = dnnl::convolution_backward_weights::primitive_desc(wd, engine, fwd_pd);
    bwd_weights = dnnl::convolution_backward_weights(bwd_weights_pd);
    have_backward = true;
  }

  // Carves the calling thread's scratch into 64-byte aligned buffers, one per descriptor.
  struct Arena {
    char* next;
    explicit Arena(std::size_t bytes) {
      const auto base = reinterpret_cast<std::uintptr_t>(scratch<float, Cpu>(static_cast<std::int64_t>((bytes + 3) / 4)));
      next = reinterpret_cast<char*>((base + 63) / 64 * 64);
    }
    static std::size_t rounded(std::size_t bytes) { return (bytes + 63) / 64 * 64; }
    void* take(const memory::desc& d) {
      void* p = next;
      next += rounded(d.get_size());
      return p;
    }
  };
  static std::size_t bytes(std::initializer_list<memory::desc> ds) {
    std::size_t total = 64;  // scratch's own alignment may be less than 64
    for (const auto& d : ds) total += Arena::rounded(d.get_size());
    return total;
  }

  // The operand `user` as the kernel wants it (`want`): the user's memory itself when the layouts
  // agree, else a reorder into the arena. `accumulate`: dst += src (reorders into the user's).
  memory as(const memory::desc& want, const memory::desc& user_desc, const void* user, Arena& arena) {
    memory u(user_desc, engine, const_cast<void*>(user));
    if (want == user_desc) return u;
    memory m(want, engine, arena.take(want));
    dnnl::reorder(u, m).execute(stream, u, m);
    return m;
  }
  void to_user(const memory& src, const memory::desc& user_desc, void* user, bool accumulate) {
    memory u(user_desc, engine, user);
    if (!accumulate && src.get_desc() == user_desc) return;  // the kernel wrote the user's memory
    dnnl::primitive_attr attr;
    if (accumulate) {
      dnnl::post_ops ops;
      ops.append_sum(1.0f);
      attr.set_post_ops(ops);
    }
    const dnnl::reorder::primitive_desc pd(engine, src.get_desc(), engine, user_desc, attr);
    dnnl::reorder(pd).execute(stream, const_cast<memory&>(src), u);
  }
  memory output(const memory::desc& want, const memory::desc& user_desc, void* user, Arena& arena) {
    if (want == user_desc) return memory(user_desc, engine, user);
    return memory(want, engine, arena.take(want));
  }

  void forward(const float* x, const float* w, const float* bias, float* y) {
    Arena arena(bytes({fwd_pd.src_desc(), fwd_pd.weights_desc(), fwd_pd.dst_desc()}));
    memory xs = as(fwd_pd.src_desc(), x_user, x, arena);
    memory ws = as(fwd_pd.weights_desc(), w_user, w, arena);
    memory ys = output(fwd_pd.dst_desc(), y_user, y, arena);
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, xs}, {DNNL_ARG_WEIGHTS, ws}, {DNNL_ARG_DST, ys}};
    if (with_bias) args.emplace(DNNL_ARG_BIAS, memory(b_user, engine, const_cast<float*>(bias)));
    fwd.execute(stream, args);
    to_user(ys, y_user, y, false);
    stream.wait();
  }

  void backward(const float* x, const float* w, const float* dy, float* dw, float* dx) {
    if (!have_backward) build_backward();
    if (dx != nullptr) {
      Arena arena(bytes({bwd_data_pd.diff_dst_desc(), bwd_data_pd.weights_desc(), bwd_data_pd.diff_src_desc()}));
      memory dys = as(bwd_data_pd.diff_dst_desc(), y_user, dy, arena);
      memory ws = as(bwd_data_pd.weights_desc(), w_user, w, arena);
      memory dxs = output(bwd_data_pd.diff_src_desc(), x_user, dx, arena);
      bwd_data.execute(stream, {{DNNL_ARG_DIFF_DST, dys}, {DNNL_ARG_WEIGHTS, ws}, {DNNL_ARG_DIFF_SRC, dxs}});
      to_user(dxs, x_user, dx, false);
    }
    if (dw != nullptr) {
      // dW is accumulated (Conv2d's contract: weight.grad +=), so the kernel writes its own
      // buffer and the reorder back adds it.
      Arena arena(bytes({bwd_weights_pd.src_desc(), bwd_weights_pd.diff_dst_desc(), bwd_weights_pd.diff_weights_desc()}));
      memory xs = as(bwd_weights_pd.src_desc(), x_user, x, arena);
      memory dys = as(bwd_weights_pd.diff_dst_desc(), y_user, dy, arena);
      memory dws(bwd_weights_pd.diff_weights_desc(), engine, arena.take(bwd_weights_pd.diff_weights_desc()));
      bwd_weights.execute(stream, {{DNNL_ARG_SRC, xs}, {DNNL_ARG_DIFF_DST, dys}, {DNNL_ARG_DIFF_WEIGHTS, dws}});
      to_user(dws, w_user, dw, true);
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
                            " batch ", batch, ": ", e.what(), " (TESSERA_BF16_CONV=tessera uses Tessera's kernels)"));
  }
}

TESSERA_LINKAGE std::string OneDnnConv::implementation() const { return impl_->fwd_pd.impl_info_str(); }

TESSERA_LINKAGE void OneDnnConv::forward(const float* x, const float* w, const float* bias, float* y) {
  TESSERA_CHECK(bias != nullptr || !impl_->with_bias, ArgumentError, "OneDnnConv::forward: built with a bias, given none");
  impl_->forward(x, w, bias, y);
}

TESSERA_LINKAGE void OneDnnConv::backward(const float* x, const float* w, const float* dy, float* dw, float* dx) {
  TESSERA_CHECK(impl_->training, Error, "OneDnnConv::backward: built for inference (forward only)");
  impl_->backward(x, w, dy, dw, dx);
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
