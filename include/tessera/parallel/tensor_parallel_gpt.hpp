// Tensor and sequence parallelism of a GPT over the p ranks of `comm` (Megatron-LM: Shoeybi et al.
// 2019, heads and MLP columns split; Korthikanti et al. 2022, sequence parallelism): every rank sees
// the same batch (B, T) and holds 1/p of each block's attention heads and MLP hidden units, and of
// the sequence between them.
//
// Per block, with Tl = T / p positions per rank (the sequence-parallel region) and h = n_embd:
//
//   x (B, Tl, h)  --ln_1-->  all_gather over the sequence --> (B, T, h)
//     --c_attn, column-parallel: rank r's heads [r H/p, (r+1) H/p) of q, k and v--> (B, T, 3h/p)
//     --causal attention on those heads--> (B, T, h/p) --c_proj, row-parallel--> (B, T, h), a partial sum
//     --reduce_scatter over the sequence (the sum, and rank r keeps positions [r Tl, (r+1) Tl))--> + bias
//   x + that = h1;  the MLP the same way: ln_2, all_gather, c_fc (4h/p columns), GELU, c_proj, reduce_scatter
//
// In backward each all_gather becomes a reduce_scatter and each reduce_scatter an all_gather (the
// conjugates). Megatron without sequence parallelism all-reduces the row layer's output instead
// and runs LayerNorm and the residual on the whole sequence, replicated: an all-reduce is a
// reduce_scatter plus an all_gather, so the bytes are the same, and sequence parallelism in
// addition keeps LayerNorm's and the residual's activations at 1/p per rank.
//
// Bytes per block and step, per rank, for a ring (or any bandwidth-optimal) collective: an
// all_gather or reduce_scatter of a (B, T, h) tensor of `s`-byte values sends (p-1)/p B T h s;
// forward 2 of each and backward 2 of each: 8 (p-1)/p B T h s (block_bytes_per_step). Outside the
// blocks: one all_gather of ln_f's output (the logits are computed whole on every rank: the loss is
// then the one-process loss on every rank, and the vocabulary here is small), and the all-reduce
// of the replicated parameters' gradients (embeddings, LayerNorms, the row layers' biases: each
// rank's gradient covers its positions only), 2 (p-1)/p x their size.
//
// Built from a dense GPT (the same seed on every rank, checked): each rank copies its slices, so
// the tensor-parallel model computes the dense one's logits, loss and gradients (their slices),
// to rounding. The replicated gradients are summed over the ranks at the end of backward (their
// growth since backward began, so gradient accumulation over micro-batches stays exact). T must
// divide over the ranks, and n_head as well. The replicated parameters' grad_ready is held back
// until that sum (GradReadyHold), so a DataParallel over the tensor groups' replicas
// (stack(dp, tensor), data x tensor parallelism) averages final gradients. Inference with a
// key/value cache is GPT's.
//
// Dropout (config.dropout > 0, Train mode): the dense GPT's four sites with its masks, which are
// functions of each element's global position (kernels/dropout_key.hpp): transformer.drop and the
// two residual dropouts on this rank's positions (seq_offset r Tl, after the reduce_scatter and
// the bias, where the dense model applies them to c_proj's output), attn_dropout on this rank's
// heads (head_offset r H/p) of the whole gathered sequence. Every rank draws the step's key from a
// copy of the dense model's dropout generator, so the ranks and the one process agree.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tessera/comm/communicator.hpp"
#include "tessera/core/parameter.hpp"
#include "tessera/core/span_sink.hpp"
#include "tessera/kernels/attention.hpp"
#include "tessera/kernels/dropout_key.hpp"
#include "tessera/kernels/elementwise.hpp"
#include "tessera/kernels/gemm.hpp"
#include "tessera/models/gpt.hpp"
#include "tessera/parallel/agreement.hpp"
#include "tessera/parallel/tensor_parallel.hpp"

namespace tessera {

template <class E>
class TensorParallelGPT {
 public:
  using Env = E;
  using Comm = typename E::Comm;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;

  struct BlockCache {
    typename LayerNorm<E>::Cache ln_1, ln_2;
    typename Linear<E>::Cache c_attn, attn_proj, c_fc, mlp_proj;
    typename GELU<E>::Cache gelu;
    Tensor g1, g2;          // ln_1's and ln_2's outputs gathered over the sequence (B, T, h)
    Tensor heads, lse;      // this rank's heads' outputs (B, T, h/p); their log-sum-exps (B, H/p, T)
    Tensor a, h, m, y;      // the branches' scattered outputs and the residual sums (B, Tl, h)
    Tensor dfull, dqkv;     // a gathered output gradient (B, T, h); attention's (B, T, 3h/p)
    Tensor dbranch, dh, dx; // (B, Tl, h)
    AttentionDims dims;
  };
  struct Cache {
    typename Embedding<E>::Cache wte, wpe;
    typename LayerNorm<E>::Cache ln_f;
    std::vector<std::int64_t> ids, positions;  // this rank's (B, Tl) ids and its Tl positions
    std::vector<BlockCache> h;
    Tensor x, xf, logits;                      // (B, Tl, h); ln_f's gathered (B, T, h); (B, T, V)
    Tensor dlogits, dxf, dpos;                 // this rank's rows (B, Tl, V) and (B, Tl, h); (Tl, h)
    Tensor blocks;                             // (p, B, Tl, h): what the collectives move
    std::vector<S> replicated_before;          // the replicated gradients when backward began
    std::int64_t batch = 0, t = 0;
    DropoutKey dropout;                        // this forward's: p (0: none), the step's draw
    Tensor demb;                               // dL/d(the embeddings' sum) through transformer.drop
  };

  // The rank's slices of `dense` (every rank builds it from the same seed: checked).
  TensorParallelGPT(GPT<E>& dense, Comm& comm)
      : comm_(&comm), config_(dense.config()), p_(comm.size()), rank_(comm.rank()),
        wte_(dense.wte()), wpe_(dense.wpe()), ln_f_(dense.ln_f()), dropout_rng_(dense.dropout_rng()),
        mode_(dense.mode()) {
    TESSERA_CHECK(config_.n_head % p_ == 0 && config_.n_embd % p_ == 0, ArgumentError, "TensorParallelGPT: n_head=",
                  config_.n_head, " and n_embd=", config_.n_embd, " must divide over ", p_, " ranks");
    AgreementRecord record("TensorParallelGPT");
    record.add("config", config_.str());
    const auto named = named_tensors(dense);
    record.add_checksums(named, "dense ");
    check_agreement(comm, record, "every rank must build the dense GPT with the same configuration and seed");
    blocks_.reserve(dense.blocks().size());
    for (auto& b : dense.blocks()) blocks_.emplace_back(b, config_, p_, rank_);
    for_each_replicated([&](Parameter<S, D>& p) { replicated_hold_.add(p); });
  }

  // ids (B, T), row-major, the same on every rank -> logits (B, T, V), the same on every rank.
  const Tensor& forward(std::span<const std::int64_t> idx, std::int64_t batch, std::int64_t t, Cache& c) {
    TESSERA_CHECK(batch > 0 && t > 0 && static_cast<std::int64_t>(idx.size()) == batch * t, ShapeError, name(), ": ",
                  idx.size(), " token ids given for (B, T) = (", batch, ", ", t, ")");
    TESSERA_CHECK(t <= config_.block_size && t % p_ == 0, ShapeError, name(), ": a sequence of ", t, " tokens must "
                  "fit the block size ", config_.block_size, " and divide over the ", p_, " ranks");
    const std::int64_t tl = t / p_, t0 = rank_ * tl, ch = config_.n_embd;
    c.batch = batch;
    c.t = t;
    c.ids.resize(static_cast<std::size_t>(batch * tl));
    for (std::int64_t b = 0; b < batch; ++b)
      std::copy_n(idx.begin() + b * t + t0, tl, c.ids.begin() + b * tl);
    c.positions.resize(static_cast<std::size_t>(tl));
    for (std::int64_t i = 0; i < tl; ++i) c.positions[static_cast<std::size_t>(i)] = t0 + i;
    c.x = wte_.forward(c.ids, Shape{batch, tl}, c.wte);
    add_broadcast_rows(D{}, wpe_.forward(c.positions, Shape{tl}, c.wpe).data(), batch, tl * ch, c.x.data());
    c.dropout = {};
    if (mode_ == Mode::Train && config_.dropout > 0) c.dropout = {.p = config_.dropout, .key = dropout_rng_.next_u64()};
    if (c.dropout.active())  // transformer.drop on this rank's positions
      dropout_rows(D{}, sequence_site(c, 0), batch, tl, ch, c.x.data(), c.x.data());
    c.h.resize(blocks_.size());
    const Tensor* x = &c.x;
    for (std::size_t i = 0; i < blocks_.size(); ++i) {
      current_ = static_cast<int>(i);
      x = &blocks_[i].forward(*x, c.h[i], c, *this);
    }
    current_ = -1;
    gather_sequence(ln_f_.forward(*x, c.ln_f), c.xf, c, "all_gather ln_f (sequence)");
    c.logits.resize({batch, t, config_.vocab_size});
    gemm_in<typename E::Compute>(D{}, false, true, batch * t, config_.vocab_size, ch, S(1), c.xf.data(), ch,
                                 wte_.weight().value.data(), ch, S(0), c.logits.data(), config_.vocab_size);
    return c.logits;
  }
  const Tensor& forward(const tessera::Tensor<std::int64_t, Cpu>& idx, Cache& c) {
    TESSERA_CHECK(idx.rank() == 2, ShapeError, name(), ": expected token ids (B, T), got ", idx.shape());
    return forward(std::span<const std::int64_t>(idx.data(), static_cast<std::size_t>(idx.numel())), idx.dim(0),
                   idx.dim(1), c);
  }

  // dL/dlogits (B, T, V), the same on every rank (the loss of the whole batch): every parameter's
  // gradient, the split ones exact on their rank, the replicated ones summed over the ranks.
  void backward(const Tensor& dlogits, Cache& c) {
    TESSERA_CHECK(c.logits.rank() == 3 && dlogits.shape() == c.logits.shape(), ShapeError, name(),
                  "::backward: dlogits ", dlogits.shape(), " does not match the logits ", c.logits.shape(),
                  " (or backward before forward)");
    pack_replicated_grads(c.replicated_before);
    typename GradReadyHold<S, D>::Scope restore_hooks{replicated_hold_};
    replicated_hold_.hold();  // each rank's part of a replicated gradient is not the gradient yet
    const std::int64_t batch = c.batch, t = c.t, tl = t / p_, v = config_.vocab_size, ch = config_.n_embd;
    // This rank's positions of the logits: lm_head's gradient over them, and their dxf.
    c.dlogits.resize({batch, tl, v});
    copy_2d(D{}, c.dlogits.data(), tl * v, dlogits.data() + rank_ * tl * v, t * v, tl * v, batch);
    const S* xf_rows = ln_f_output(c);
    Parameter<S, D>& w = wte_.weight();
    gemm_in<typename E::Compute>(D{}, true, false, v, ch, batch * tl, S(1), c.dlogits.data(), v, xf_rows, ch, S(1),
                                 w.grad.data(), ch);
    c.dxf.resize({batch, tl, ch});
    gemm_in<typename E::Compute>(D{}, false, false, batch * tl, ch, v, S(1), c.dlogits.data(), v, w.value.data(), ch,
                                 S(0), c.dxf.data(), ch);
    const Tensor* dx = &ln_f_.backward(c.dxf, c.ln_f);
    for (std::size_t i = blocks_.size(); i-- > 0;) {
      current_ = static_cast<int>(i);
      dx = &blocks_[i].backward(*dx, c.h[i], c, *this);
    }
    current_ = -1;
    if (c.dropout.active()) {
      c.demb.resize(dx->shape());
      dropout_rows(D{}, sequence_site(c, 0), batch, tl, ch, dx->data(), c.demb.data());
      dx = &c.demb;
    }
    wte_.backward(*dx, c.wte);
    c.dpos.resize({tl, ch});
    c.dpos.fill(S(0));
    add_column_sums(D{}, dx->data(), batch, tl * ch, c.dpos.data());
    wpe_.backward(c.dpos, c.wpe);
    sum_replicated_grads(c.replicated_before);
    replicated_hold_.release(/*every_parameter_once=*/true);  // the row layers' biases are summed here, not in a layer
  }

  // nanoGPT's names; the split tensors hold this rank's slice (shard_of says which).
  template <class V>
  void visit(V& v, const std::string& prefix = "") {
    wte_.visit(v, prefix + "transformer.wte.");
    wpe_.visit(v, prefix + "transformer.wpe.");
    for (std::size_t i = 0; i < blocks_.size(); ++i) blocks_[i].visit(v, prefix + "transformer.h." + std::to_string(i) + ".");
    ln_f_.visit(v, prefix + "transformer.ln_f.");
    v.buffer(prefix + "lm_head.weight", wte_.weight().value);
    if constexpr (requires { v.rng(prefix, dropout_rng_); })
      if (config_.dropout > 0) v.rng(prefix + "transformer.drop.rng", dropout_rng_);
  }
  void set_mode(Mode mode) { mode_ = mode; }
  // Records every collective as a span on the communication lane (nullptr: stop).
  void set_timeline(SpanSink* timeline) { timeline_ = timeline; }

  // This rank's slice of a dense tensor of parameter `name` (a nanoGPT key; the dense model's
  // value or gradient, on the host): rows of each of q, k, v for c_attn, rows for c_fc, columns for
  // the c_proj weights, the whole tensor for a replicated one.
  tessera::Tensor<S, Cpu> shard_of(const std::string& name, const tessera::Tensor<S, Cpu>& dense) const {
    const auto ends = [&](const char* suffix) { return name.ends_with(suffix); };
    const std::int64_t ch = config_.n_embd;
    if (ends("attn.c_attn.weight") || ends("attn.c_attn.bias")) {
      const std::int64_t cols = dense.rank() == 2 ? dense.dim(1) : 1, w = ch / p_;
      Shape shape = dense.shape();
      shape[0] = 3 * w;
      tessera::Tensor<S, Cpu> out(shape);
      for (std::int64_t part = 0; part < 3; ++part)  // q, k, v
        std::copy_n(dense.data() + (part * ch + rank_ * w) * cols, w * cols, out.data() + part * w * cols);
      return out;
    }
    if (ends("mlp.c_fc.weight") || ends("mlp.c_fc.bias")) {
      const std::int64_t cols = dense.rank() == 2 ? dense.dim(1) : 1, w = dense.dim(0) / p_;
      Shape shape = dense.shape();
      shape[0] = w;
      tessera::Tensor<S, Cpu> out(shape);
      std::copy_n(dense.data() + rank_ * w * cols, w * cols, out.data());
      return out;
    }
    if (ends("attn.c_proj.weight") || ends("mlp.c_proj.weight")) {
      const std::int64_t rows = dense.dim(0), w = dense.dim(1) / p_;
      tessera::Tensor<S, Cpu> out({rows, w});
      copy_2d(Cpu{}, out.data(), w, dense.data() + rank_ * w, dense.dim(1), w, rows);
      return out;
    }
    return dense;
  }

  // By formula: bytes one rank sends per block and step (see the top), and outside the blocks.
  static double block_bytes_per_step(std::int64_t batch, std::int64_t t, std::int64_t n_embd, int ranks) {
    return 8.0 * (ranks - 1) / ranks * static_cast<double>(batch * t * n_embd) * sizeof(S);
  }
  double other_bytes_per_step(std::int64_t batch, std::int64_t t) {
    std::vector<S> replicated;
    pack_replicated_grads(replicated);
    return static_cast<double>(p_ - 1) / p_ *
           (static_cast<double>(batch * t * config_.n_embd) + 2.0 * static_cast<double>(replicated.size())) * sizeof(S);
  }

  // Measured, where the communicator counts the bytes it moves between the ranks
  // (ThreadComm::peer_bytes): what this rank's collectives moved inside each block since the last
  // reset_measured_bytes() (empty elsewhere).
  const std::vector<double>& measured_block_bytes() const { return measured_; }
  void reset_measured_bytes() { std::fill(measured_.begin(), measured_.end(), 0.0); }

  const GPTConfig& config() const { return config_; }
  int ranks() const { return p_; }
  std::string name() const { return "TensorParallelGPT(" + config_.str() + ", " + std::to_string(p_) + " ranks)"; }

 private:
  // One block's slices: the replicated LayerNorms and row-layer biases, the column layers' rows and
  // the row layers' columns (without their bias, which is added once, after the sum).
  class Block {
   public:
    // DenseBlock: GPTBlock<E>, or the local Env's GPTBlock that GPT<E> holds (comm/local_env.hpp).
    template <class DenseBlock>
    Block(DenseBlock& dense, const GPTConfig& c, int p, int rank)
        : ln_1_(dense.ln_1()), ln_2_(dense.ln_2()), heads_(c.n_head / p), ch_(c.n_embd), local_(c.n_embd / p),
          c_attn_(c.n_embd, 3 * local_, scratch_rng(), c.bias), attn_proj_(local_, c.n_embd, scratch_rng(), false),
          c_fc_(c.n_embd, 4 * local_, scratch_rng(), c.bias), gelu_(GeluOp{.approximate = GeluApproximate::Tanh}),
          mlp_proj_(4 * local_, c.n_embd, scratch_rng(), false), has_bias_(c.bias) {
      const S* qkv = dense.attn().c_attn().weight().value.data();
      for (std::int64_t part = 0; part < 3; ++part)
        D::copy(c_attn_.weight().value.data() + part * local_ * ch_, qkv + (part * ch_ + rank * local_) * ch_,
                static_cast<std::size_t>(local_ * ch_) * sizeof(S));
      copy_2d(D{}, attn_proj_.weight().value.data(), local_, dense.attn().c_proj().weight().value.data() + rank * local_,
              ch_, local_, ch_);
      D::copy(c_fc_.weight().value.data(), dense.mlp_c_fc().weight().value.data() + rank * 4 * local_ * ch_,
              static_cast<std::size_t>(4 * local_ * ch_) * sizeof(S));
      copy_2d(D{}, mlp_proj_.weight().value.data(), 4 * local_, dense.mlp_c_proj().weight().value.data() + rank * 4 * local_,
              4 * ch_, 4 * local_, ch_);
      if (has_bias_) {
        for (std::int64_t part = 0; part < 3; ++part)
          D::copy(c_attn_.bias().value.data() + part * local_, dense.attn().c_attn().bias().value.data() + part * ch_ + rank * local_,
                  static_cast<std::size_t>(local_) * sizeof(S));
        D::copy(c_fc_.bias().value.data(), dense.mlp_c_fc().bias().value.data() + rank * 4 * local_,
                static_cast<std::size_t>(4 * local_) * sizeof(S));
        attn_bias_ = dense.attn().c_proj().bias();
        mlp_bias_ = dense.mlp_c_proj().bias();
      }
    }

    const Tensor& forward(const Tensor& x, BlockCache& b, Cache& c, TensorParallelGPT& g) {
      const std::int64_t batch = c.batch, t = c.t;
      g.gather_sequence(ln_1_.forward(x, b.ln_1), b.g1, c, "all_gather ln_1 (sequence)");
      const Tensor& qkv = c_attn_.forward(b.g1, b.c_attn);
      b.dims = {batch, heads_, t, t, local_ / heads_, local_ / heads_};
      b.dims.dropout = g.head_site(c, g.block_site(GPTBlock<E>::kAttention));
      b.heads.resize({batch, t, local_});
      b.lse.resize({batch, heads_, t});
      attention_forward(D{}, b.dims, qkv.data(), qkv_layout(t), qkv.data() + local_, qkv_layout(t),
                        qkv.data() + 2 * local_, qkv_layout(t), scale(), true, b.heads.data(), heads_layout(t),
                        b.lse.data());
      g.scatter_sequence(attn_proj_.forward(b.heads, b.attn_proj), b.a, c, "reduce_scatter attn (sequence)");
      if (has_bias_) add_broadcast_rows(D{}, attn_bias_.value.data(), b.a.numel() / ch_, ch_, b.a.data());
      if (c.dropout.active())  // resid_dropout, on this rank's positions
        dropout_rows(D{}, g.sequence_site(c, g.block_site(GPTBlock<E>::kAttentionOutput)), batch, t / g.p_, ch_,
                     b.a.data(), b.a.data());
      b.h.resize(x.shape());
      add(D{}, x.data(), b.a.data(), x.numel(), b.h.data());
      g.gather_sequence(ln_2_.forward(b.h, b.ln_2), b.g2, c, "all_gather ln_2 (sequence)");
      const Tensor& f = gelu_.forward(c_fc_.forward(b.g2, b.c_fc), b.gelu);
      g.scatter_sequence(mlp_proj_.forward(f, b.mlp_proj), b.m, c, "reduce_scatter mlp (sequence)");
      if (has_bias_) add_broadcast_rows(D{}, mlp_bias_.value.data(), b.m.numel() / ch_, ch_, b.m.data());
      if (c.dropout.active())  // mlp.dropout, on this rank's positions
        dropout_rows(D{}, g.sequence_site(c, g.block_site(GPTBlock<E>::kMlpOutput)), batch, t / g.p_, ch_, b.m.data(),
                     b.m.data());
      b.y.resize(x.shape());
      add(D{}, b.h.data(), b.m.data(), x.numel(), b.y.data());
      return b.y;
    }

    // dy (B, Tl, h) -> dx (B, Tl, h); each branch: its bias (this rank's positions), the gathered
    // gradient through the row and column layers, scattered back and through the LayerNorm.
    const Tensor& backward(const Tensor& dy, BlockCache& b, Cache& c, TensorParallelGPT& g) {
      const std::int64_t rows = dy.numel() / ch_, t = c.t;
      const Tensor* dm = &dy;  // dL/d(the MLP branch before mlp.dropout)
      if (c.dropout.active()) {
        b.dbranch.resize(dy.shape());
        dropout_rows(D{}, g.sequence_site(c, g.block_site(GPTBlock<E>::kMlpOutput)), c.batch, t / g.p_, ch_, dy.data(),
                     b.dbranch.data());
        dm = &b.dbranch;
      }
      if (has_bias_) add_column_sums(D{}, dm->data(), rows, ch_, mlp_bias_.grad.data());
      g.gather_sequence(*dm, b.dfull, c, "all_gather d mlp (sequence)");
      const Tensor& dfc = c_fc_.backward(gelu_.backward(mlp_proj_.backward(b.dfull, b.mlp_proj), b.gelu), b.c_fc);
      g.scatter_sequence(dfc, b.dbranch, c, "reduce_scatter d ln_2 (sequence)");
      const Tensor& dln2 = ln_2_.backward(b.dbranch, b.ln_2);
      b.dh.resize(dy.shape());
      add(D{}, dy.data(), dln2.data(), dy.numel(), b.dh.data());
      const Tensor* da = &b.dh;  // dL/d(the attention branch before resid_dropout)
      if (c.dropout.active()) {
        b.dbranch.resize(dy.shape());
        dropout_rows(D{}, g.sequence_site(c, g.block_site(GPTBlock<E>::kAttentionOutput)), c.batch, t / g.p_, ch_,
                     b.dh.data(), b.dbranch.data());
        da = &b.dbranch;
      }
      if (has_bias_) add_column_sums(D{}, da->data(), rows, ch_, attn_bias_.grad.data());
      g.gather_sequence(*da, b.dfull, c, "all_gather d attn (sequence)");
      const Tensor& dheads = attn_proj_.backward(b.dfull, b.attn_proj);
      const Tensor& qkv = b.c_attn.y;
      b.dqkv.resize(qkv.shape());
      attention_backward(D{}, b.dims, qkv.data(), qkv_layout(t), qkv.data() + local_, qkv_layout(t),
                         qkv.data() + 2 * local_, qkv_layout(t), b.heads.data(), dheads.data(), heads_layout(t),
                         b.lse.data(), scale(), true, b.dqkv.data(), qkv_layout(t), b.dqkv.data() + local_,
                         qkv_layout(t), b.dqkv.data() + 2 * local_, qkv_layout(t));
      g.scatter_sequence(c_attn_.backward(b.dqkv, b.c_attn), b.dbranch, c, "reduce_scatter d ln_1 (sequence)");
      const Tensor& dln1 = ln_1_.backward(b.dbranch, b.ln_1);
      b.dx.resize(dy.shape());
      add(D{}, b.dh.data(), dln1.data(), dy.numel(), b.dx.data());
      return b.dx;
    }

    template <class V>
    void visit(V& v, const std::string& prefix) {
      ln_1_.visit(v, prefix + "ln_1.");
      c_attn_.visit(v, prefix + "attn.c_attn.");
      attn_proj_.visit(v, prefix + "attn.c_proj.");
      if (has_bias_) v.parameter(prefix + "attn.c_proj.bias", attn_bias_);
      ln_2_.visit(v, prefix + "ln_2.");
      c_fc_.visit(v, prefix + "mlp.c_fc.");
      mlp_proj_.visit(v, prefix + "mlp.c_proj.");
      if (has_bias_) v.parameter(prefix + "mlp.c_proj.bias", mlp_bias_);
    }
    // The replicated parameters, whose gradients cover this rank's positions only.
    template <class F>
    void for_each_replicated(F f) {
      f(ln_1_.weight());
      if (has_bias_) f(ln_1_.bias());
      f(ln_2_.weight());
      if (has_bias_) f(ln_2_.bias());
      if (has_bias_) {
        f(attn_bias_);
        f(mlp_bias_);
      }
    }

   private:
    static Rng& scratch_rng() {  // the local layers' own draws are overwritten by the dense slices
      thread_local Rng rng(0);
      return rng;
    }
    double scale() const { return 1.0 / std::sqrt(static_cast<double>(local_ / heads_)); }
    AttentionLayout qkv_layout(std::int64_t t) const { return {t * 3 * local_, local_ / heads_, 3 * local_}; }
    AttentionLayout heads_layout(std::int64_t t) const { return {t * local_, local_ / heads_, local_}; }

    LayerNorm<E> ln_1_, ln_2_;
    std::int64_t heads_, ch_, local_;
    Linear<E> c_attn_, attn_proj_, c_fc_;
    GELU<E> gelu_;
    Linear<E> mlp_proj_;
    bool has_bias_;
    Parameter<S, D> attn_bias_{Shape{0}, ParamKind::Bias}, mlp_bias_{Shape{0}, ParamKind::Bias};
  };

  const S* ln_f_output(Cache& c) const { return c.ln_f.y.data(); }

  // x (B, Tl, h) of every rank -> out (B, T, h): an all_gather of the (B, Tl, h) blocks, then each
  // rank's block into its positions.
  void gather_sequence(const Tensor& x, Tensor& out, Cache& c, const char* what) {
    const std::int64_t batch = c.batch, t = c.t, tl = t / p_, row = x.numel() / (batch * tl);
    c.blocks.resize({p_ * x.numel()});
    const auto began = SpanSink::Clock::now();
    const double counted = peer_bytes();
    comm_->all_gather(std::span<const S>(x.data(), static_cast<std::size_t>(x.numel())), c.blocks.span());
    measure(counted);
    detail::record_collective(timeline_, what, c.blocks.bytes(), began);
    out.resize({batch, t, row});
    for (std::int64_t r = 0; r < p_; ++r)
      copy_2d(D{}, out.data() + r * tl * row, t * row, c.blocks.data() + r * x.numel(), tl * row, tl * row, batch);
  }
  // x (B, T, h), this rank's partial sum -> out (B, Tl, h): the sum over the ranks, this rank's
  // positions (the blocks laid out by destination rank, then a reduce_scatter).
  void scatter_sequence(const Tensor& x, Tensor& out, Cache& c, const char* what) {
    const std::int64_t batch = c.batch, t = c.t, tl = t / p_, row = x.numel() / (batch * t);
    c.blocks.resize({x.numel()});
    for (std::int64_t r = 0; r < p_; ++r)
      copy_2d(D{}, c.blocks.data() + r * batch * tl * row, tl * row, x.data() + r * tl * row, t * row, tl * row, batch);
    out.resize({batch, tl, row});
    const auto began = SpanSink::Clock::now();
    const double counted = peer_bytes();
    comm_->reduce_scatter(std::span<const S>(c.blocks.data(), static_cast<std::size_t>(x.numel())), out.span(),
                          ReduceOp::Sum);
    measure(counted);
    detail::record_collective(timeline_, what, c.blocks.bytes(), began);
  }

  // The communicator's count of bytes moved (-1 where it keeps none); what a collective inside
  // block current_ moved is added to that block's measurement.
  double peer_bytes() const {
    if constexpr (requires { comm_->peer_bytes(); }) return static_cast<double>(comm_->peer_bytes());
    else return -1;
  }
  void measure(double before) {
    if (before < 0 || current_ < 0) return;
    measured_.resize(blocks_.size());
    measured_[static_cast<std::size_t>(current_)] += peer_bytes() - before;
  }

  template <class F>
  void for_each_replicated(F f) {
    f(wte_.weight());
    f(wpe_.weight());
    for (auto& b : blocks_) b.for_each_replicated(f);
    f(ln_f_.weight());
    if (config_.bias) f(ln_f_.bias());
  }
  // The replicated gradients, flat, on the host.
  void pack_replicated_grads(std::vector<S>& out) {
    std::size_t n = 0;
    for_each_replicated([&](Parameter<S, D>& p) { n += static_cast<std::size_t>(p.grad.numel()); });
    out.resize(n);
    std::size_t at = 0;
    for_each_replicated([&](Parameter<S, D>& p) {
      D::copy_to_host(out.data() + at, p.grad.data(), p.grad.bytes());
      at += static_cast<std::size_t>(p.grad.numel());
    });
  }
  // grad = before + sum over ranks of (grad - before): this backward's contributions summed, what
  // accumulated before left as it was (and equal on every rank already).
  void sum_replicated_grads(const std::vector<S>& before) {
    pack_replicated_grads(now_);
    for (std::size_t i = 0; i < now_.size(); ++i) now_[i] -= before[i];
    const auto began = SpanSink::Clock::now();
    comm_->all_reduce(std::span<S>(now_), ReduceOp::Sum);
    detail::record_collective(timeline_, "all_reduce replicated gradients", now_.size() * sizeof(S), began);
    std::size_t at = 0;
    for_each_replicated([&](Parameter<S, D>& p) {
      for (std::int64_t i = 0; i < p.grad.numel(); ++i) now_[at + static_cast<std::size_t>(i)] += before[at + static_cast<std::size_t>(i)];
      D::copy_to_device(p.grad.data(), now_.data() + at, p.grad.bytes());
      at += static_cast<std::size_t>(p.grad.numel());
    });
  }

  // Dropout site `number` (GPTBlock::key_dropout's numbering) of this forward: on this rank's
  // positions of a (B, Tl, h) activation, or on this rank's heads of the attention probabilities.
  DropoutKey sequence_site(const Cache& c, std::uint64_t number) const {
    DropoutKey k = GPTBlock<E>::site(c.dropout, number);
    k.seq_offset = rank_ * (c.t / p_);
    return k;
  }
  // Site `s` of the block running now (GPTBlock's numbering).
  std::uint64_t block_site(typename GPTBlock<E>::DropoutSite s) const {
    return GPTBlock<E>::site_number(static_cast<std::size_t>(current_), s);
  }
  DropoutKey head_site(const Cache& c, std::uint64_t number) const {
    DropoutKey k = GPTBlock<E>::site(c.dropout, number);
    k.head_offset = rank_ * (config_.n_head / p_);
    return k;
  }

  Comm* comm_;
  GPTConfig config_;
  int p_, rank_;
  SpanSink* timeline_ = nullptr;
  Embedding<E> wte_, wpe_;
  std::vector<Block> blocks_;
  LayerNorm<E> ln_f_;
  Rng dropout_rng_;  // a copy of the dense model's: every rank draws the step's key the one process draws
  Mode mode_;
  std::vector<S> now_;
  GradReadyHold<S, D> replicated_hold_;  // the replicated parameters' grad_ready until their sum
  int current_ = -1;               // the block running now, or -1
  std::vector<double> measured_;   // bytes moved inside each block (counting communicators only)
};

}  // namespace tessera
