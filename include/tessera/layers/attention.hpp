// Attention layers (the fused kernel, its maths and its memory: kernels/cpu/attention.hpp).
//
// ScaledDotProductAttention: torch.nn.functional.scaled_dot_product_attention(q, k, v,
// dropout_p, is_causal, scale) without a mask:
//   q (*, T, d), k (*, S, d), v (*, S, dv) -> out (*, T, dv) = softmax(scale q k^T [+ causal mask]) v
// with the leading dimensions (*) equal in all three (for example (B, H)), scale = 1/sqrt(d)
// unless given, and is_causal: query i sees keys j <= i. Backward gives dq, dk and dv. No (T, S)
// matrix is stored: the cache keeps the inputs' addresses, the output and one log-sum-exp per
// query row. dropout_p: each forward in Train mode draws one key from the object's generator
// (seed) and drops each probability with probability p (kernels/dropout_key.hpp: its mask a hash
// of (head, query, key), kept in the cache as its key, so backward computes it again); Eval mode
// drops nothing, as nn.MultiheadAttention passes dropout_p = 0 outside training.
//
// SelfAttention: multi-head self-attention as nanoGPT's CausalSelfAttention, with its parameter
// names (so its state_dict keys are nanoGPT's):
//   x (B, T, C) -> qkv = c_attn(x) (B, T, 3C), split into q, k, v of n_head heads of C / n_head
//   -> per head ScaledDotProductAttention (causal unless told otherwise) -> (B, T, C) -> c_proj
// c_attn is Linear(C, 3C) and c_proj Linear(C, C), both with bias unless bias = false. The heads
// are read from and written to qkv and the (B, T, C) result in place (strided), never transposed.
// Dropout (nanoGPT's attn_dropout on the probabilities and resid_dropout on c_proj's output):
// the caller puts a DropoutKey (kernels/dropout_key.hpp) for each into the cache before a training
// forward (GPT does, with its p and step); inactive keys, the default, make both the identity.
// The masks are functions of each element's global position, so backward computes them again and
// nothing of them is stored. The CPU and CUDA kernels compute the same masks.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

#include "tessera/comm/local_env.hpp"
#include "tessera/core/concepts.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/random.hpp"
#include "tessera/kernels/attention.hpp"
#include "tessera/kernels/dropout_key.hpp"
#include "tessera/kernels/elementwise.hpp"
#include "tessera/layers/linear.hpp"

namespace tessera {

template <class E>
class ScaledDotProductAttention {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  struct Cache {
    const Tensor *q = nullptr, *k = nullptr, *v = nullptr;
    Tensor out, lse;  // out (*, T, dv); lse (*, T): each query row's log-sum-exp
    Tensor dq, dk, dv;
    AttentionDims dims;  // dims.dropout: this forward's mask key (inactive: none)
    double scale = 0;
  };
  struct Grads {
    const Tensor& dq;
    const Tensor& dk;
    const Tensor& dv;
  };

  explicit ScaledDotProductAttention(bool is_causal = false, std::optional<double> scale = std::nullopt,
                                     double dropout_p = 0.0, std::uint64_t seed = 0)
      : causal_(is_causal), scale_(scale), dropout_p_(dropout_p), rng_(seed) {
    TESSERA_CHECK(!scale || std::isfinite(*scale), ArgumentError, "ScaledDotProductAttention: scale=", *scale,
                  " must be finite");
    TESSERA_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, ArgumentError, "ScaledDotProductAttention: dropout_p=",
                  dropout_p, " must lie in [0, 1)");
  }

  const Tensor& forward(const Tensor& q, const Tensor& k, const Tensor& v, Cache& c) {
    c.dims = checked_dims(q, k, v);
    if (dropout_p_ > 0 && mode_ == Mode::Train) c.dims.dropout = {.p = dropout_p_, .key = rng_.next_u64()};
    const AttentionDims& n = c.dims;
    c.q = &q;
    c.k = &k;
    c.v = &v;
    c.scale = scale_ ? *scale_ : 1.0 / std::sqrt(static_cast<double>(n.head_dim));
    Shape out_shape = q.shape();
    out_shape[out_shape.rank() - 1] = n.value_dim;
    c.out.resize(out_shape);
    c.lse.resize({n.heads, n.queries});
    attention_forward(D{}, n, q.data(), AttentionLayout::contiguous(n.heads, n.queries, n.head_dim), k.data(),
                      AttentionLayout::contiguous(n.heads, n.keys, n.head_dim), v.data(),
                      AttentionLayout::contiguous(n.heads, n.keys, n.value_dim), c.scale, causal_, c.out.data(),
                      AttentionLayout::contiguous(n.heads, n.queries, n.value_dim), c.lse.data());
    return c.out;
  }

  Grads backward(const Tensor& dout, Cache& c) {
    TESSERA_CHECK(c.q != nullptr, Error, name(), "::backward called before forward on this cache");
    TESSERA_CHECK(dout.shape() == c.out.shape(), ShapeError, name(), "::backward: dout ", dout.shape(),
                  " does not match the output ", c.out.shape());
    const AttentionDims& n = c.dims;
    TESSERA_CHECK(c.q->numel() == n.heads * n.queries * n.head_dim && c.k->numel() == n.heads * n.keys * n.head_dim &&
                      c.v->numel() == n.heads * n.keys * n.value_dim,
                  ShapeError, name(), "::backward: q, k or v changed shape since forward (keep them alive and unchanged)");
    c.dq.resize(c.q->shape());
    c.dk.resize(c.k->shape());
    c.dv.resize(c.v->shape());
    const auto ql = AttentionLayout::contiguous(n.heads, n.queries, n.head_dim);
    const auto kl = AttentionLayout::contiguous(n.heads, n.keys, n.head_dim);
    const auto vl = AttentionLayout::contiguous(n.heads, n.keys, n.value_dim);
    attention_backward(D{}, n, c.q->data(), ql, c.k->data(), kl, c.v->data(), vl, c.out.data(), dout.data(),
                       AttentionLayout::contiguous(n.heads, n.queries, n.value_dim), c.lse.data(), c.scale, causal_,
                       c.dq.data(), ql, c.dk.data(), kl, c.dv.data(), vl);
    return {c.dq, c.dk, c.dv};
  }

  bool is_causal() const { return causal_; }
  double dropout_p() const { return dropout_p_; }
  void set_mode(Mode mode) { mode_ = mode; }
  Rng& rng() { return rng_; }  // the dropout keys' generator: a checkpoint can save and restore it
  std::string name() const {
    return detail::cat("ScaledDotProductAttention(is_causal=", causal_, ", dropout_p=", dropout_p_, ")");
  }

 private:
  // The kernel's sizes: batch 1 and every leading index a "head".
  AttentionDims checked_dims(const Tensor& q, const Tensor& k, const Tensor& v) const {
    const auto shapes = [&] { return detail::cat("q ", q.shape(), ", k ", k.shape(), ", v ", v.shape()); };
    TESSERA_CHECK(q.rank() >= 2 && k.rank() == q.rank() && v.rank() == q.rank(), ShapeError, name(),
                  ": expected q (*, T, d), k (*, S, d), v (*, S, dv) of one rank >= 2, got ", shapes());
    bool lead = true;
    for (int i = 0; i + 2 < q.rank(); ++i) lead = lead && q.dim(i) == k.dim(i) && q.dim(i) == v.dim(i);
    TESSERA_CHECK(lead, ShapeError, name(), ": the leading dimensions of q, k and v differ: ", shapes());
    TESSERA_CHECK(q.dim(-1) == k.dim(-1), ShapeError, name(), ": q and k need the same last dimension d: ", shapes());
    TESSERA_CHECK(k.dim(-2) == v.dim(-2), ShapeError, name(), ": k and v need the same key count S: ", shapes());
    TESSERA_CHECK(q.dim(-2) > 0 && k.dim(-2) > 0 && q.dim(-1) > 0 && v.dim(-1) > 0, ShapeError, name(),
                  ": empty q, k or v: ", shapes());
    AttentionDims n;
    n.batch = 1;
    n.heads = q.numel() / (q.dim(-2) * q.dim(-1));
    n.queries = q.dim(-2);
    n.keys = k.dim(-2);
    n.head_dim = q.dim(-1);
    n.value_dim = v.dim(-1);
    return n;
  }

  bool causal_;
  std::optional<double> scale_;
  double dropout_p_;
  Rng rng_;
  Mode mode_ = Mode::Train;
};

template <class E>
class SelfAttention {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  static constexpr bool kBackwardReadsOutput = false;
  struct Cache {
    typename Linear<E>::Cache attn, proj;  // c_attn's (its y is qkv, (B, T, 3C)) and c_proj's
    Tensor heads;                          // (B, T, C): the heads' outputs side by side, c_proj's input
    Tensor lse;                            // (B, H, T)
    Tensor dheads, dqkv;                   // backward's (B, T, C) and (B, T, 3C)
    AttentionDims dims;
    bool cached = false;  // filled by forward_cached, which has no backward
    DropoutKey attn_dropout, resid_dropout;  // set by the caller per training forward; inactive: none
    Tensor dropped, dproj;                   // resid_dropout's output (B, T, C) and dL/d(c_proj's output)
  };

  // Keys and values of the positions seen so far, for generation (forward_cached): k and v
  // (B, H, capacity, head size), rows [0, length) filled.
  struct KVCache {
    Tensor k, v;
    std::int64_t length = 0;
    void clear() { length = 0; }
  };

  SelfAttention(std::int64_t n_embd, std::int64_t n_head, Rng& rng, bool causal = true, bool bias = true)
      : n_embd_(n_embd), n_head_(checked_heads(n_embd, n_head)), causal_(causal),
        c_attn_(n_embd, 3 * n_embd, rng, bias), c_proj_(n_embd, n_embd, rng, bias) {}

  const Tensor& forward(const Tensor& x, Cache& c) {
    TESSERA_CHECK(x.rank() == 3 && x.dim(2) == n_embd_ && x.dim(0) > 0 && x.dim(1) > 0, ShapeError, name(),
                  ": expected input (B, T, ", n_embd_, "), got ", x.shape());
    const std::int64_t batch = x.dim(0), t = x.dim(1), hs = n_embd_ / n_head_;
    c.dims = {batch, n_head_, t, t, hs, hs};
    c.dims.dropout = c.attn_dropout;
    c.cached = false;
    const Tensor& qkv = c_attn_.forward(x, c.attn);
    c.heads.resize({batch, t, n_embd_});
    c.lse.resize({batch, n_head_, t});
    const S* base = qkv.data();
    attention_forward(D{}, c.dims, base, qkv_layout(t), base + n_embd_, qkv_layout(t), base + 2 * n_embd_,
                      qkv_layout(t), scale(), causal_, c.heads.data(), heads_layout(t), c.lse.data());
    const Tensor& y = c_proj_.forward(c.heads, c.proj);
    if (!c.resid_dropout.active()) return y;
    c.dropped.resize(y.shape());
    dropout_rows(D{}, c.resid_dropout, batch, t, n_embd_, y.data(), c.dropped.data());
    return c.dropped;
  }

  // Inference with a key/value cache: x (B, T, C) holds the next T positions of sequences whose
  // first kv.length positions went through here before; their keys and values are appended to kv
  // (capacity: positions in all, allocated on first use) and the T queries attend to every key up
  // to their own position (causal_offset = kv.length). The result equals the rows of a forward
  // over the whole sequence. No backward.
  const Tensor& forward_cached(const Tensor& x, KVCache& kv, std::int64_t capacity, Cache& c) {
    TESSERA_CHECK(x.rank() == 3 && x.dim(2) == n_embd_ && x.dim(0) > 0 && x.dim(1) > 0, ShapeError, name(),
                  ": expected input (B, T, ", n_embd_, "), got ", x.shape());
    const std::int64_t batch = x.dim(0), t = x.dim(1), hs = n_embd_ / n_head_;
    if (kv.length == 0 || kv.k.rank() != 4 || kv.k.dim(0) != batch || kv.k.dim(2) != capacity) {
      TESSERA_CHECK(kv.length == 0, ShapeError, name(), ": the key/value cache holds ", kv.length,
                    " positions of another batch or capacity (clear() it to start new sequences)");
      kv.k.resize({batch, n_head_, capacity, hs});
      kv.v.resize({batch, n_head_, capacity, hs});
    }
    TESSERA_CHECK(kv.length + t <= capacity, ShapeError, name(), ": ", kv.length, " cached positions plus ", t,
                  " new ones exceed the cache's capacity of ", capacity);
    const Tensor& qkv = c_attn_.forward(x, c.attn);
    const S* base = qkv.data();
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t h = 0; h < n_head_; ++h) {
        const S* src = base + b * t * 3 * n_embd_ + h * hs;
        const std::int64_t dst = ((b * n_head_ + h) * capacity + kv.length) * hs;
        copy_2d(D{}, kv.k.data() + dst, hs, src + n_embd_, 3 * n_embd_, hs, t);
        copy_2d(D{}, kv.v.data() + dst, hs, src + 2 * n_embd_, 3 * n_embd_, hs, t);
      }
    kv.length += t;
    c.dims = {batch, n_head_, t, kv.length, hs, hs, /*causal_offset=*/kv.length - t};  // inference: no dropout
    c.cached = true;
    c.heads.resize({batch, t, n_embd_});
    c.lse.resize({batch, n_head_, t});
    const AttentionLayout cached{n_head_ * capacity * hs, capacity * hs, hs};
    attention_forward(D{}, c.dims, base, qkv_layout(t), kv.k.data(), cached, kv.v.data(), cached, scale(), causal_,
                      c.heads.data(), heads_layout(t), c.lse.data());
    return c_proj_.forward(c.heads, c.proj);
  }

  const Tensor& backward(const Tensor& dy, Cache& c) { return backward_impl(dy, c, false); }
  // The backward in two halves, for zero-bubble pipeline schedules (parallel/pipeline_schedule.hpp):
  // backward_input runs c_proj's and c_attn's input halves around the attention's own backward
  // (which has no parameters); backward_weight adds both projections' weight gradients from what
  // they kept. The same products as backward's, so the same bits. x and dy must stay alive and
  // unchanged until backward_weight.
  const Tensor& backward_input(const Tensor& dy, Cache& c) { return backward_impl(dy, c, true); }
  void backward_weight(Cache& c) {
    c_proj_.backward_weight(c.proj);
    c_attn_.backward_weight(c.attn);
  }

  template <class V>
  void visit(V& v, const std::string& prefix) {
    c_attn_.visit(v, prefix + "c_attn.");
    c_proj_.visit(v, prefix + "c_proj.");
  }
  void set_mode(Mode) {}
  void set_needs_input_grad(bool needed) { c_attn_.set_needs_input_grad(needed); }

  Linear<E>& c_attn() { return c_attn_; }
  Linear<E>& c_proj() { return c_proj_; }
  std::int64_t n_embd() const { return n_embd_; }
  std::int64_t n_head() const { return n_head_; }
  bool is_causal() const { return causal_; }
  std::string name() const {
    return detail::cat("SelfAttention(n_embd=", n_embd_, ", n_head=", n_head_, ", causal=", causal_, ")");
  }

 private:
  // input_only: the projections' input halves (backward_input), their weight halves left for later.
  const Tensor& backward_impl(const Tensor& dy, Cache& c, bool input_only) {
    TESSERA_CHECK(c.heads.rank() == 3, Error, name(), "::backward called before forward on this cache");
    TESSERA_CHECK(!c.cached, Error, name(), "::backward after forward_cached: the key/value cache path is inference only");
    const std::int64_t t = c.dims.queries;
    const Tensor* dproj = &dy;
    if (c.resid_dropout.active()) {  // the same mask again, on the gradient
      TESSERA_CHECK(dy.shape() == c.dropped.shape(), ShapeError, name(), "::backward: dy ", dy.shape(),
                    " does not match the output ", c.dropped.shape());
      c.dproj.resize(dy.shape());
      dropout_rows(D{}, c.resid_dropout, c.dims.batch, t, n_embd_, dy.data(), c.dproj.data());
      dproj = &c.dproj;
    }
    const Tensor& dheads = backward_or_input(c_proj_, *dproj, c.proj, input_only);
    const Tensor& qkv = c.attn.y;
    c.dqkv.resize(qkv.shape());
    const S* base = qkv.data();
    S* dbase = c.dqkv.data();
    attention_backward(D{}, c.dims, base, qkv_layout(t), base + n_embd_, qkv_layout(t), base + 2 * n_embd_,
                       qkv_layout(t), c.heads.data(), dheads.data(), heads_layout(t), c.lse.data(), scale(), causal_,
                       dbase, qkv_layout(t), dbase + n_embd_, qkv_layout(t), dbase + 2 * n_embd_, qkv_layout(t));
    return backward_or_input(c_attn_, c.dqkv, c.attn, input_only);
  }

  static std::int64_t checked_heads(std::int64_t n_embd, std::int64_t n_head) {
    TESSERA_CHECK(n_embd > 0 && n_head > 0 && n_embd % n_head == 0, ArgumentError, "SelfAttention: n_embd=", n_embd,
                  " must be a positive multiple of n_head=", n_head);
    return n_head;
  }
  double scale() const { return 1.0 / std::sqrt(static_cast<double>(n_embd_ / n_head_)); }
  // Head h of q (k, v) in qkv (B, T, 3C): column offset h hs, rows 3C apart.
  AttentionLayout qkv_layout(std::int64_t t) const { return {t * 3 * n_embd_, n_embd_ / n_head_, 3 * n_embd_}; }
  AttentionLayout heads_layout(std::int64_t t) const { return {t * n_embd_, n_embd_ / n_head_, n_embd_}; }

  std::int64_t n_embd_, n_head_;
  bool causal_;
  Linear<E> c_attn_, c_proj_;
};

// The class of any other Env is this one renamed (comm/local_env.hpp).
TESSERA_SAME_CODE_AS_LOCAL(ScaledDotProductAttention);
TESSERA_SAME_CODE_AS_LOCAL(SelfAttention);
TESSERA_LOCAL_EXTERN(ScaledDotProductAttention)
TESSERA_LOCAL_EXTERN(SelfAttention)

}  // namespace tessera
