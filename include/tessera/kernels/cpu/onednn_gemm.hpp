// bfloat16 matrix products through oneDNN's matmul (kernels/cpu/onednn.hpp says why), for
// gemm_bf16 and so for every product a bfloat16 Env runs: Linear's three, attention's, and the
// im2col products of the convolutions that stay on Tessera's kernels. On a CPU with AMX the matmul
// (brgemm) multiplies in the tile unit; gemm_bf16's own kernel (VDPBF16PS) cannot.
//
// Semantics are gemm_bf16's: op(A) and op(B) are rounded to bfloat16 (nearest even), products are
// exact, sums are float, C = alpha op(A) op(B) + beta C stays float. Only the order of the float
// sums differs from Tessera's kernel. A and B are reordered into the matmul's bfloat16 layouts
// (B blocked in pairs along k) in a buffer of the calling thread; C is written in place through
// its row stride, beta by the matmul's sum post-op, alpha by its output scale.
//
// Each thread keeps the primitives of the shapes it has run (a product's shape, strides, alpha
// and beta), so a steady training step builds none; oneDNN allocates a little inside each call,
// as for the convolutions (onednn_conv.hpp).
#pragma once

#include <cstdint>
#include <string>

#include "tessera/core/linkage.hpp"
#include "tessera/kernels/cpu/onednn.hpp"

namespace tessera {

// Whether gemm_bf16 runs a product of this size on oneDNN, when it computes in bfloat16 at all
// (cpu_bf16_active(), which gemm_bf16 checks first): set_cpu_bf16_library, the build, the CPU and
// the size. Products with no elements never do.
TESSERA_LINKAGE bool onednn_gemm_chosen(std::int64_t m, std::int64_t n, std::int64_t k);
// C = alpha op(A) op(B) + beta C on oneDNN's bfloat16 matmul, gemm_bf16's arguments (row-major,
// op(A) (m, k), op(B) (k, n), C (m, n)). False when oneDNN has no kernel for this product (or the
// build no oneDNN): nothing was written, and the caller computes it.
TESSERA_LINKAGE bool onednn_gemm_bf16(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                                      float alpha, const float* a, std::int64_t lda, const float* b,
                                      std::int64_t ldb, float beta, float* c, std::int64_t ldc);
// For benchmark reports: which products run on oneDNN ("", without oneDNN or bfloat16).
TESSERA_LINKAGE std::string onednn_gemm_report();

}  // namespace tessera

#if TESSERA_HEADER_DEFINITIONS
#include <functional>
#include <memory>
#include <unordered_map>
#include <vector>

#include "tessera/core/error.hpp"

namespace tessera {

// Without AMX, Auto keeps gemm_bf16's own kernel: measured layer by layer on Zen 5 (forward and both
// gradients, bench/bf16_linear.cpp), it was faster on the MLP's, LeNet-5's and examples/15_gpt's
// Linear layers by a wide margin, and oneDNN's matmul won only on a GPT-2 small block's two widest
// layers, by a few percent (bench/README.md, "bfloat16", "oneDNN's matmul for the products", has
// the figures): not worth a size rule on one run. With AMX, oneDNN's tiles do 16x the multiply-adds per cycle of
// VDPBF16PS, but each call has a fixed cost (primitive execution, two reorders, the team's start)
// that is ten times a small product's whole time on gemm_bf16. Below 2^23 multiply-adds that cost
// would eat the gain; the threshold is an estimate from the fixed cost measured without AMX, not a
// measurement on AMX hardware.
inline constexpr std::int64_t kOneDnnGemmMinMacs = std::int64_t{1} << 23;

TESSERA_LINKAGE bool onednn_gemm_chosen(std::int64_t m, std::int64_t n, std::int64_t k) {
  if (m <= 0 || n <= 0 || k <= 0 || !onednn_built()) return false;
  const Bf16Library library = cpu_bf16_library();
  if (library == Bf16Library::Tessera) return false;
  if (library == Bf16Library::OneDnn) return true;
  return onednn_uses_amx() && m * n * k >= kOneDnnGemmMinMacs;
}

TESSERA_LINKAGE std::string onednn_gemm_report() {
  if (!onednn_built()) return "";
  switch (cpu_bf16_library()) {
    case Bf16Library::Tessera: return "";
    case Bf16Library::OneDnn: return onednn_version() + " matmul for every product";
    case Bf16Library::Auto: break;
  }
  if (!onednn_uses_amx()) return "";
  return onednn_version() + " matmul for products of at least 2^23 multiply-adds";
}

#if defined(TESSERA_ONEDNN)

namespace detail {

// What makes two products the same primitive.
struct OneDnnGemmKey {
  bool trans_a, trans_b;
  std::int64_t m, n, k, lda, ldb, ldc;
  float alpha, beta;
  bool operator==(const OneDnnGemmKey&) const = default;
};
struct OneDnnGemmKeyHash {
  std::size_t operator()(const OneDnnGemmKey& key) const {
    std::size_t h = key.trans_a * 2 + key.trans_b;
    for (std::int64_t v : {key.m, key.n, key.k, key.lda, key.ldb, key.ldc}) h = h * 1000003u ^ std::hash<std::int64_t>{}(v);
    return h * 31 ^ std::hash<float>{}(key.alpha) ^ std::hash<float>{}(key.beta) * 7;
  }
};

// One product's matmul and operands; `supported` false where oneDNN has no kernel (remembered, so
// that the refusal is not asked again).
struct OneDnnGemm {
  bool supported = false;
  dnnl::matmul matmul;
  OneDnnOperand a, b;
  dnnl::memory c;
  std::unordered_map<int, dnnl::memory> args;
};

// A thread's primitives, its stream, and its buffer for the converted operands (its own: gemm_bf16's
// callers often hold core/scratch.hpp's buffer, an im2col, as an operand). Bounded: a thread that
// has run more shapes than kMaxEntries starts over.
struct OneDnnGemmCache {
  static constexpr std::size_t kMaxEntries = 256;
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  std::unordered_map<OneDnnGemmKey, std::unique_ptr<OneDnnGemm>, OneDnnGemmKeyHash> entries;
  std::vector<float> buffer;  // grows only

  OneDnnGemm& get(const OneDnnGemmKey& key) {
    auto found = entries.find(key);
    if (found != entries.end()) return *found->second;
    if (entries.size() >= kMaxEntries) entries.clear();
    auto entry = std::make_unique<OneDnnGemm>();
    build(key, *entry);
    return *entries.emplace(key, std::move(entry)).first->second;
  }

  void build(const OneDnnGemmKey& key, OneDnnGemm& g) {
    using memory = dnnl::memory;
    using dt = memory::data_type;
    // Tessera's row-major operands as oneDNN sees them: op(A) (m, k) and op(B) (k, n) through
    // their strides (a transposed operand is its stored matrix read column-wise), C (m, n).
    const memory::desc a_user({key.m, key.k}, dt::f32, key.trans_a ? memory::dims{1, key.lda} : memory::dims{key.lda, 1});
    const memory::desc b_user({key.k, key.n}, dt::f32, key.trans_b ? memory::dims{1, key.ldb} : memory::dims{key.ldb, 1});
    const memory::desc c_user({key.m, key.n}, dt::f32, memory::dims{key.ldc, 1});
    const memory::desc a_any({key.m, key.k}, dt::bf16, memory::format_tag::any);
    const memory::desc b_any({key.k, key.n}, dt::bf16, memory::format_tag::any);
    dnnl::primitive_attr attr;
    if (key.alpha != 1.0f) attr.set_output_scales(0, {key.alpha});
    if (key.beta != 0.0f) {  // C = alpha A B + beta C
      dnnl::post_ops ops;
      ops.append_sum(key.beta);
      attr.set_post_ops(ops);
    }
    try {
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_any, b_any, c_user), attr, engine);
      if (pd.dst_desc() != c_user) return;  // C is written in place or not at all
      g.matmul = dnnl::matmul(pd);
      g.a.init(engine, a_user, pd.src_desc(), false);
      g.b.init(engine, b_user, pd.weights_desc(), false);
    } catch (const dnnl::error&) {
      return;  // no kernel for this shape: gemm_bf16's own computes it
    }
    g.c = memory(c_user, engine, DNNL_MEMORY_NONE);
    g.args = {{DNNL_ARG_SRC, g.a.kernel}, {DNNL_ARG_WEIGHTS, g.b.kernel}, {DNNL_ARG_DST, g.c}};
    g.supported = true;
  }
};

inline OneDnnGemmCache& onednn_gemm_cache() {
  thread_local OneDnnGemmCache cache;
  return cache;
}

}  // namespace detail

TESSERA_LINKAGE bool onednn_gemm_bf16(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                                      float alpha, const float* a, std::int64_t lda, const float* b,
                                      std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  detail::OneDnnGemmCache& cache = detail::onednn_gemm_cache();
  detail::OneDnnGemm& g = cache.get({trans_a, trans_b, m, n, k, lda, ldb, ldc, alpha, beta});
  if (!g.supported) return false;
  const std::int64_t words = detail::OneDnnArena::words(g.a.kernel_bytes() + g.b.kernel_bytes());
  if (static_cast<std::int64_t>(cache.buffer.size()) < words) cache.buffer.resize(static_cast<std::size_t>(words));
  detail::OneDnnArena arena(cache.buffer.data());
  try {
    g.a.read(a, arena, cache.stream);
    g.b.read(b, arena, cache.stream);
    g.c.set_data_handle(c);
    g.matmul.execute(cache.stream, g.args);
    cache.stream.wait();
  } catch (const dnnl::error& e) {
    throw Error(detail::cat("onednn_gemm_bf16 (", m, " x ", n, " x ", k, trans_a ? ", A transposed" : "",
                            trans_b ? ", B transposed" : "", "): oneDNN: ", e.what()));
  }
  return true;
}

#else  // no oneDNN in this build: onednn_gemm_chosen is false

TESSERA_LINKAGE bool onednn_gemm_bf16(bool, bool, std::int64_t, std::int64_t, std::int64_t, float, const float*,
                                      std::int64_t, const float*, std::int64_t, float, float*, std::int64_t) {
  return false;
}

#endif  // TESSERA_ONEDNN

}  // namespace tessera

#endif  // TESSERA_HEADER_DEFINITIONS
