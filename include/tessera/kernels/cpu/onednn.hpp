// oneDNN (Debian's libdnnl-dev 2.6, the library PyTorch's CPU convolutions, matmuls and autocast
// use) in a bfloat16 Env: which of a bfloat16 Env's kernels run on it, and the pieces its
// convolutions (onednn_conv.hpp) and products (onednn_gemm.hpp) share.
//
// Why a second library: on a CPU with AMX (Sapphire Rapids and later) a core multiplies 1,024
// bfloat16 pairs per cycle in its tile unit against 64 float FMAs with AVX-512. oneDNN drives the
// tiles (its brgemm kernels); Tessera's own bfloat16 kernels (gemm_bf16's VDPBF16PS,
// kernels/cpu/gemm_bf16.hpp) cannot. oneDNN chooses its kernel at run time from the CPU it finds:
// AMX tiles where they exist, AVX512-BF16 dot products where they do not (Zen 4 and 5, Cooper
// Lake), so one binary serves both. Where each runs is measured per CPU kind in bench/README.md,
// "bfloat16".
//
// Build: the meson option `onednn` (auto) defines TESSERA_ONEDNN and links libdnnl. Without it
// onednn_built() is false and every bfloat16 kernel is Tessera's. set_cpu_bf16_library() chooses
// for the whole process (TESSERA_BF16_LIBRARY=auto|tessera|onednn does the same from the
// environment, read once).
#pragma once

#include <cstdint>
#include <string>

#include "tessera/core/linkage.hpp"

namespace tessera {

// Which kernels compute a bfloat16 Env's convolutions and matrix products.
enum class Bf16Library {
  Auto,     // per layer and product: onednn_conv_chosen, onednn_gemm_chosen (oneDNN only where built in)
  Tessera,  // Tessera's own: gemm_bf16's kernel, im2col, Winograd in float (kernels/cpu/conv2d.hpp)
  OneDnn,   // oneDNN wherever it is built in (an error otherwise: onednn_built())
};

// True when this build links oneDNN (TESSERA_ONEDNN).
TESSERA_LINKAGE bool onednn_built();
// The instruction set oneDNN's kernels use on this CPU ("avx512_core_amx", "avx512_core_bf16", ...),
// or "" without oneDNN.
TESSERA_LINKAGE std::string onednn_cpu_isa();
// True when that instruction set has AMX tiles.
TESSERA_LINKAGE bool onednn_uses_amx();
// "oneDNN 2.6.3 (avx512_core_bf16)", or "" without oneDNN.
TESSERA_LINKAGE std::string onednn_version();
// Process-wide; the default is Auto unless TESSERA_BF16_LIBRARY says otherwise.
TESSERA_LINKAGE void set_cpu_bf16_library(Bf16Library library);
TESSERA_LINKAGE Bf16Library cpu_bf16_library();

}  // namespace tessera

#if TESSERA_HEADER_DEFINITIONS
#include <atomic>
#include <cstdlib>

#include "tessera/core/error.hpp"

#if defined(TESSERA_ONEDNN)
#include <oneapi/dnnl/dnnl.hpp>
#endif

namespace tessera {

namespace detail {
// TESSERA_BF16_LIBRARY, read once: "tessera", "onednn" or "auto"/unset.
inline Bf16Library bf16_library_from_environment() {
  // Its name until it covered the products too: refused rather than silently ignored.
  if (std::getenv("TESSERA_BF16_CONV") != nullptr)
    throw ArgumentError("TESSERA_BF16_CONV is now TESSERA_BF16_LIBRARY (auto, tessera or onednn; it covers the "
                        "products too)");
  const char* v = std::getenv("TESSERA_BF16_LIBRARY");
  if (v == nullptr || *v == '\0' || std::string(v) == "auto") return Bf16Library::Auto;
  if (std::string(v) == "tessera") return Bf16Library::Tessera;
  if (std::string(v) == "onednn") return Bf16Library::OneDnn;
  throw ArgumentError(std::string("TESSERA_BF16_LIBRARY='") + v +
                      "' is not a bfloat16 kernel library: use auto, tessera or onednn");
}
inline std::atomic<Bf16Library>& bf16_library_setting() {
  static std::atomic<Bf16Library> setting{bf16_library_from_environment()};
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

TESSERA_LINKAGE bool onednn_uses_amx() {
  static const bool amx = onednn_cpu_isa().find("amx") != std::string::npos;  // asked per layer call
  return amx;
}

TESSERA_LINKAGE std::string onednn_version() {
#if defined(TESSERA_ONEDNN)
  const dnnl_version_t* v = dnnl_version();
  return "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch) + " (" +
         onednn_cpu_isa() + ")";
#else
  return "";
#endif
}

TESSERA_LINKAGE void set_cpu_bf16_library(Bf16Library library) {
  TESSERA_CHECK(library != Bf16Library::OneDnn || onednn_built(), ArgumentError,
                "set_cpu_bf16_library(OneDnn): this build has no oneDNN (meson option onednn; Debian: libdnnl-dev)");
  detail::bf16_library_setting() = library;
}

TESSERA_LINKAGE Bf16Library cpu_bf16_library() { return detail::bf16_library_setting().load(); }

#if defined(TESSERA_ONEDNN)

namespace detail {

using dnnl_memory = dnnl::memory;

// Carves a buffer into 64-byte aligned pieces, one per operand in oneDNN's layout. The buffer holds
// words(bytes) floats, `bytes` being what the takes of one call add up to (rounded() each).
class OneDnnArena {
 public:
  static std::size_t rounded(std::size_t bytes) { return (bytes + 63) / 64 * 64; }
  static std::int64_t words(std::size_t bytes) { return static_cast<std::int64_t>((bytes + 64 + 3) / 4); }
  explicit OneDnnArena(float* buffer) {
    const auto base = reinterpret_cast<std::uintptr_t>(buffer);
    next_ = reinterpret_cast<char*>((base + 63) / 64 * 64);
  }
  void* take(const dnnl_memory::desc& d) {
    void* p = next_;
    next_ += rounded(d.get_size());
    return p;
  }

 private:
  char* next_;
};

// One operand of a primitive: `user` describes Tessera's tensor, `kernel` the layout the primitive
// chose. Where they differ, `convert` reorders between them (user -> kernel for inputs; kernel ->
// user for outputs, adding into the user's tensor when accumulating). The memories are built once,
// without buffers: each call only sets their data handles (no allocation, no primitive lookup).
struct OneDnnOperand {
  dnnl_memory user, kernel;
  dnnl::reorder convert;
  bool direct = true;  // the primitive reads or writes the user's tensor itself

  void init(const dnnl::engine& e, const dnnl_memory::desc& user_desc, const dnnl_memory::desc& kernel_desc,
            bool output, bool accumulate = false) {
    user = dnnl_memory(user_desc, e, DNNL_MEMORY_NONE);
    direct = !accumulate && user_desc == kernel_desc;
    if (direct) {
      kernel = user;
      return;
    }
    kernel = dnnl_memory(kernel_desc, e, DNNL_MEMORY_NONE);
    dnnl::primitive_attr attr;
    if (accumulate) {  // dst += src: the reorder's sum post-op (beta = 1)
      dnnl::post_ops ops;
      ops.append_sum(1.0f);
      attr.set_post_ops(ops);
    }
    convert = output ? dnnl::reorder(dnnl::reorder::primitive_desc(e, kernel_desc, e, user_desc, attr))
                     : dnnl::reorder(dnnl::reorder::primitive_desc(e, user_desc, e, kernel_desc, attr));
  }
  std::size_t kernel_bytes() const { return direct ? 0 : OneDnnArena::rounded(kernel.get_desc().get_size()); }
  // An input: the primitive's copy of `data` (converted into the arena unless direct).
  void read(const void* data, OneDnnArena& arena, dnnl::stream& s) {
    user.set_data_handle(const_cast<void*>(data));
    if (direct) return;
    kernel.set_data_handle(arena.take(kernel.get_desc()));
    convert.execute(s, user, kernel);
  }
  // An output: where the primitive writes, then finish() moves it into `data`.
  void write_to(void* data, OneDnnArena& arena) {
    user.set_data_handle(data);
    if (!direct) kernel.set_data_handle(arena.take(kernel.get_desc()));
  }
  void finish(dnnl::stream& s) {
    if (!direct) convert.execute(s, kernel, user);
  }
};

}  // namespace detail

#endif  // TESSERA_ONEDNN

}  // namespace tessera

#endif  // TESSERA_HEADER_DEFINITIONS
