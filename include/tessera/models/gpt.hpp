// GPT: nanoGPT's model (Karpathy's model.py, itself GPT-2's architecture) with its parameter names,
// initialization and tied output layer, so that state dicts move between the two.
//
//   idx (B, T) token ids, T <= block_size
//   x = wte[idx] + wpe[0..T)                                   (B, T, C)
//   per block (transformer.h.i):  x = x + attn(ln_1(x));  x = x + mlp(ln_2(x))
//       attn: SelfAttention, causal (attn.c_attn, attn.c_proj); mlp: c_fc (C -> 4C), GELU tanh, c_proj
//   logits = ln_f(x) wte^T                                     (B, T, V): lm_head, tied to wte
//
// Pre-LayerNorm blocks, GELU's tanh form, learned positions, LayerNorm and Linear biases unless
// bias = false (nanoGPT's config.bias). Initialization (nanoGPT's _init_weights): every Linear
// weight and both embeddings N(0, 0.02), biases 0, LayerNorm 1 and 0, and the two residual
// projections (attn.c_proj, mlp.c_proj) N(0, 0.02 / sqrt(2 n_layer)), all drawn from the rng in
// model order.
//
// The tie: lm_head has no weight of its own. Its product reads transformer.wte.weight, and its
// gradient is added to that weight's (which then gets one grad_ready, after the embedding's own
// part). The visit hands the weight once as a parameter (transformer.wte.weight) and once more as
// the buffer lm_head.weight, so that a state dict holds both keys as nanoGPT's does, a strict load
// requires both, and optimizers and strategies see the parameter once.
//
// Dropout (config.dropout = p, nanoGPT's four sites, in Train mode only): transformer.drop on the
// embeddings' sum, and per block attn.attn_dropout on the attention probabilities (inside the fused
// kernel), attn.resid_dropout on attn.c_proj's output and mlp.dropout on mlp.c_proj's output. The
// masks are not drawn element by element from a stream as torch draws them: each is a hash of the
// step's draw, the site and the element's global position (kernels/dropout_key.hpp), so a pipeline
// stage's micro-batch, a tensor-parallel rank's heads and sequence positions and a recomputing
// backward see the very masks of one process, and backward stores none. One 64-bit draw per
// training forward comes from the model's dropout generator (seeded from the initialization rng
// after the weights, so the weights are those of dropout = 0; checkpoints keep it as
// "transformer.drop.rng"). A caller that runs one step as several forwards (a pipeline's
// micro-batches) holds one draw over them with hold_dropout_key. Eval mode and generate() drop
// nothing. The CPU and CUDA kernels compute the same masks.
// The (B, T, V) logits feed CrossEntropyLoss (classes last), as nanoGPT's
// F.cross_entropy(logits.view(-1, V), targets.view(-1), ignore_index=-1).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tessera/comm/local_env.hpp"
#include "tessera/core/concepts.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/init.hpp"
#include "tessera/kernels/dropout_key.hpp"
#include "tessera/kernels/elementwise.hpp"
#include "tessera/kernels/gemm.hpp"
#include "tessera/layers/activation.hpp"
#include "tessera/layers/attention.hpp"
#include "tessera/layers/embedding.hpp"
#include "tessera/layers/linear.hpp"
#include "tessera/layers/norm.hpp"

namespace tessera {

// nanoGPT's GPTConfig, same names and defaults (vocab 50304: GPT-2's 50257 rounded up to a multiple
// of 64, nanoGPT's choice for speed).
struct GPTConfig {
  std::int64_t block_size = 1024;
  std::int64_t vocab_size = 50304;
  std::int64_t n_layer = 12;
  std::int64_t n_head = 12;
  std::int64_t n_embd = 768;
  double dropout = 0.0;
  bool bias = true;

  // GPT-2 small (124M parameters) as OpenAI's checkpoint has it: vocabulary 50257.
  static GPTConfig gpt2() { return {.block_size = 1024, .vocab_size = 50257, .n_layer = 12, .n_head = 12, .n_embd = 768}; }
  // A model for tests and the byte-level examples: vocabulary 256 (one token per byte).
  static GPTConfig tiny() { return {.block_size = 64, .vocab_size = 256, .n_layer = 2, .n_head = 2, .n_embd = 32}; }

  std::string str() const {
    return detail::cat("GPTConfig(block_size=", block_size, ", vocab_size=", vocab_size, ", n_layer=", n_layer,
                       ", n_head=", n_head, ", n_embd=", n_embd, ", dropout=", dropout, ", bias=", bias, ")");
  }
  void check() const {
    TESSERA_CHECK(block_size > 0 && vocab_size > 0 && n_layer > 0 && n_head > 0 && n_embd > 0, ArgumentError, str(),
                  ": every size must be positive");
    TESSERA_CHECK(n_embd % n_head == 0, ArgumentError, str(), ": n_embd must be a multiple of n_head");
    TESSERA_CHECK(dropout >= 0.0 && dropout < 1.0, ArgumentError, str(), ": dropout must lie in [0, 1)");
  }
};

// nanoGPT's Block: x + attn(ln_1(x)), then + mlp(ln_2(x)). A Layer of (B, T, C).
template <class E>
class GPTBlock {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  static constexpr bool kBackwardReadsOutput = false;
  struct Cache {
    typename LayerNorm<E>::Cache ln_1, ln_2;
    typename SelfAttention<E>::Cache attn;
    typename Linear<E>::Cache c_fc, c_proj;
    typename GELU<E>::Cache gelu;
    Tensor h, y;    // x + attn(ln_1(x)); h + mlp(ln_2(h))
    Tensor dh, dx;  // backward's
    DropoutKey mlp_dropout;  // mlp.dropout (attn's two sites are in attn); set by GPT per forward
    Tensor mlp_out, dmlp;    // mlp.dropout's output and dL/d(mlp.c_proj's output)
  };

  // The dropout sites' numbers: 0 the embeddings' (GPT's), then per block i 3i + 1 the attention
  // probabilities, 3i + 2 attn.c_proj's output, 3i + 3 mlp.c_proj's output.
  enum DropoutSite : std::uint64_t { kAttention = 1, kAttentionOutput = 2, kMlpOutput = 3 };
  static std::uint64_t site_number(std::size_t i, DropoutSite s) { return 3 * static_cast<std::uint64_t>(i) + s; }
  // Block i's dropout keys in the step whose draw is step.key (step: p, the draw and this call's
  // offsets; p = 0: none).
  static void key_dropout(Cache& c, const DropoutKey& step, std::size_t i) {
    c.attn.attn_dropout = site(step, site_number(i, kAttention));
    c.attn.resid_dropout = site(step, site_number(i, kAttentionOutput));
    c.mlp_dropout = site(step, site_number(i, kMlpOutput));
  }
  static DropoutKey site(const DropoutKey& step, std::uint64_t number) {
    DropoutKey k = step;
    k.key = DropoutKey::site_key(step.key, number);
    return k;
  }

  GPTBlock(const GPTConfig& c, Rng& rng)
      : ln_1_(c.n_embd, 1e-5, true, c.bias), attn_(c.n_embd, c.n_head, rng, /*causal=*/true, c.bias),
        ln_2_(c.n_embd, 1e-5, true, c.bias), c_fc_(c.n_embd, 4 * c.n_embd, rng, c.bias),
        gelu_(GeluOp{.approximate = GeluApproximate::Tanh}), c_proj_(4 * c.n_embd, c.n_embd, rng, c.bias) {}

  const Tensor& forward(const Tensor& x, Cache& c) {
    return finish_forward(x, attn_.forward(ln_1_.forward(x, c.ln_1), c.attn), c);
  }
  // h = x + a (the attention branch's output), then h + mlp(ln_2(h)).
  const Tensor& finish_forward(const Tensor& x, const Tensor& a, Cache& c) {
    c.h.resize(x.shape());
    add(D{}, x.data(), a.data(), x.numel(), c.h.data());
    const Tensor* m = &c_proj_.forward(gelu_.forward(c_fc_.forward(ln_2_.forward(c.h, c.ln_2), c.c_fc), c.gelu), c.c_proj);
    if (c.mlp_dropout.active()) {
      c.mlp_out.resize(x.shape());
      dropout_rows(D{}, c.mlp_dropout, x.dim(0), x.dim(1), x.dim(2), m->data(), c.mlp_out.data());
      m = &c.mlp_out;
    }
    c.y.resize(x.shape());
    add(D{}, c.h.data(), m->data(), x.numel(), c.y.data());
    return c.y;
  }

  // forward for generation: the attention reads and extends the key/value cache kv.
  const Tensor& forward_cached(const Tensor& x, typename SelfAttention<E>::KVCache& kv, std::int64_t capacity,
                               Cache& c) {
    const Tensor& a = attn_.forward_cached(ln_1_.forward(x, c.ln_1), kv, capacity, c.attn);
    return finish_forward(x, a, c);
  }

  // dh = dy + d(mlp branch)/dh;  dx = dh + d(attn branch)/dx.
  const Tensor& backward(const Tensor& dy, Cache& c) { return backward_impl(dy, c, false); }
  // The backward in two halves, for zero-bubble pipeline schedules (parallel/pipeline_schedule.hpp):
  // backward_input runs every sublayer's input half (LayerNorm, SelfAttention and Linear split
  // theirs; GELU has no parameters), backward_weight their weight halves from what each kept in c.
  // Every intermediate gradient lives in c, so only dy itself must stay alive until backward_weight.
  const Tensor& backward_input(const Tensor& dy, Cache& c) { return backward_impl(dy, c, true); }
  void backward_weight(Cache& c) {
    c_proj_.backward_weight(c.c_proj);
    c_fc_.backward_weight(c.c_fc);
    ln_2_.backward_weight(c.ln_2);
    attn_.backward_weight(c.attn);
    ln_1_.backward_weight(c.ln_1);
  }

  template <class V>
  void visit(V& v, const std::string& prefix) {
    ln_1_.visit(v, prefix + "ln_1.");
    attn_.visit(v, prefix + "attn.");
    ln_2_.visit(v, prefix + "ln_2.");
    c_fc_.visit(v, prefix + "mlp.c_fc.");
    c_proj_.visit(v, prefix + "mlp.c_proj.");
  }
  void set_mode(Mode) {}

  LayerNorm<E>& ln_1() { return ln_1_; }
  LayerNorm<E>& ln_2() { return ln_2_; }
  SelfAttention<E>& attn() { return attn_; }
  Linear<E>& mlp_c_fc() { return c_fc_; }
  Linear<E>& mlp_c_proj() { return c_proj_; }

 private:
  // input_only: the sublayers' input halves (backward_input).
  const Tensor& backward_impl(const Tensor& dy, Cache& c, bool input_only) {
    TESSERA_CHECK(c.h.rank() == 3 && dy.shape() == c.h.shape(), ShapeError, "GPTBlock::backward: dy ", dy.shape(),
                  " does not match the output ", c.h.shape(), " (or backward before forward)");
    const Tensor* dm = &dy;
    if (c.mlp_dropout.active()) {  // the same mask again, on the gradient
      c.dmlp.resize(dy.shape());
      dropout_rows(D{}, c.mlp_dropout, dy.dim(0), dy.dim(1), dy.dim(2), dy.data(), c.dmlp.data());
      dm = &c.dmlp;
    }
    const auto half = [input_only](auto& layer, const Tensor& g, auto& cache) -> const Tensor& {
      return backward_or_input(layer, g, cache, input_only);
    };
    const Tensor& dmlp =
        half(ln_2_, half(c_fc_, gelu_.backward(half(c_proj_, *dm, c.c_proj), c.gelu), c.c_fc), c.ln_2);
    c.dh.resize(dy.shape());
    add(D{}, dy.data(), dmlp.data(), dy.numel(), c.dh.data());
    const Tensor& dattn = half(ln_1_, half(attn_, c.dh, c.attn), c.ln_1);
    c.dx.resize(dy.shape());
    add(D{}, c.dh.data(), dattn.data(), dy.numel(), c.dx.data());
    return c.dx;
  }

  LayerNorm<E> ln_1_;
  SelfAttention<E> attn_;
  LayerNorm<E> ln_2_;
  Linear<E> c_fc_;
  GELU<E> gelu_;
  Linear<E> c_proj_;
};

template <class E>
class GPT {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  struct Cache {
    typename Embedding<E>::Cache wte, wpe;
    std::vector<typename GPTBlock<E>::Cache> h;
    typename LayerNorm<E>::Cache ln_f;
    std::vector<std::int64_t> positions;  // 0, 1, ..., T - 1
    Tensor x;                             // (B, T, C) token + position embeddings
    Tensor logits;                        // (B, T, V)
    Tensor dx, dpos;                      // backward's (B, T, C) and (T, C)
    // Activation checkpointing: each block's output (B, T, C), the one cache every block runs in,
    // and the gradient carried between blocks (the next recompute overwrites that cache).
    std::vector<Tensor> outputs;
    typename GPTBlock<E>::Cache scratch;
    Tensor dcarry;
    bool checkpointed = false;  // how forward ran
    DropoutKey dropout;         // this forward's dropout: p (0: none), the step's draw, the batch offset
    Tensor demb;                // dL/d(the embeddings' sum) through transformer.drop
    const Tensor* blocks_input = nullptr;  // the first block's input (c.x, or a pipeline stage's received one)
    // Between backward_units_input and backward_units_weight: the units, dlogits, dL/d(embeddings).
    bool weight_pending = false;
    std::size_t pending_begin = 0, pending_end = 0;
    const Tensor* dlogits = nullptr;
    const Tensor* demb_source = nullptr;
    std::size_t first_block = 0;           // the blocks this forward ran: [first_block, end_block)
    std::size_t end_block = 0;
  };

  GPT(const GPTConfig& config, Rng& rng) : config_(checked(config)), wte_(config.vocab_size, config.n_embd, rng),
                                            wpe_(config.block_size, config.n_embd, rng), ln_f_(config.n_embd, 1e-5, true, config.bias) {
    h_.reserve(static_cast<std::size_t>(config.n_layer));
    for (std::int64_t i = 0; i < config.n_layer; ++i) h_.emplace_back(config, rng);
    init_weights(rng);
    if (config_.dropout > 0) dropout_rng_.reseed(rng.next_u64());  // after the weights: they stay dropout 0's
  }

  // idx: B T token ids (row-major (B, T)) -> logits (B, T, V).
  const Tensor& forward(std::span<const std::int64_t> idx, std::int64_t batch, std::int64_t t, Cache& c) {
    return run(idx, batch, t, 0, c, nullptr, /*dropout=*/true);
  }

  const Tensor& forward(const tessera::Tensor<std::int64_t, Cpu>& idx, Cache& c) {
    TESSERA_CHECK(idx.rank() == 2, ShapeError, name(), ": expected token ids (B, T), got ", idx.shape());
    return forward(std::span<const std::int64_t>(idx.data(), static_cast<std::size_t>(idx.numel())), idx.dim(0),
                   idx.dim(1), c);
  }

  // The key/value caches of every block, for forward_cached: the positions [0, length()) of the B
  // sequences seen so far.
  struct KVState {
    std::vector<typename SelfAttention<E>::KVCache> blocks;
    std::int64_t length() const { return blocks.empty() ? 0 : blocks.front().length; }
    void clear() {
      for (auto& b : blocks) b.clear();
    }
  };

  // The next t positions of B sequences (idx (B, t), row-major) after the kv.length() already seen:
  // logits (B, t, V) equal to the last t rows of a forward over the whole sequence, and kv extended.
  // Inference only (no backward); the sequence must stay within block_size.
  const Tensor& forward_cached(std::span<const std::int64_t> idx, std::int64_t batch, std::int64_t t, KVState& kv,
                               Cache& c) {
    kv.blocks.resize(h_.size());
    return run(idx, batch, t, kv.length(), c, &kv.blocks, /*dropout=*/false);
  }

  // nanoGPT's generate: max_new_tokens times, the logits of the last position (the context cropped
  // to the last block_size tokens), divided by temperature, cut to the top_k largest (the rest -inf),
  // softmax, one token drawn from rng and appended. prompt: B sequences of T0 >= 1 ids, row-major.
  // Returns (B, T0 + max_new_tokens) ids, row-major. With kv_cache, each block keeps the keys and
  // values of the positions seen and a step runs the new token alone; while the sequence fits the
  // block this gives the tokens the full forward gives (its logits agree to rounding), and once the
  // window slides every position shifts, so the cache is filled again from the cropped context.
  struct GenerateOptions {
    std::int64_t max_new_tokens = 100;
    double temperature = 1.0;
    std::optional<std::int64_t> top_k;
    bool kv_cache = true;
  };
  std::vector<std::int64_t> generate(std::span<const std::int64_t> prompt, std::int64_t batch,
                                     const GenerateOptions& o, Rng& rng) {
    TESSERA_CHECK(batch > 0 && !prompt.empty() && static_cast<std::int64_t>(prompt.size()) % batch == 0, ShapeError,
                  name(), "::generate: ", prompt.size(), " prompt ids do not make ", batch, " sequences of >= 1 id");
    TESSERA_CHECK(o.max_new_tokens >= 0 && o.temperature > 0 && std::isfinite(o.temperature) &&
                      (!o.top_k || *o.top_k >= 1),
                  ArgumentError, name(), "::generate: max_new_tokens=", o.max_new_tokens, ", temperature=", o.temperature,
                  " and top_k=", o.top_k ? *o.top_k : 0, " must be >= 0, > 0 and >= 1");
    const std::int64_t t0 = static_cast<std::int64_t>(prompt.size()) / batch, v = config_.vocab_size;
    const std::int64_t total = t0 + o.max_new_tokens;
    std::vector<std::int64_t> seq(static_cast<std::size_t>(batch * total));
    for (std::int64_t b = 0; b < batch; ++b)
      std::copy_n(prompt.begin() + b * t0, t0, seq.begin() + b * total);
    Cache c;
    KVState kv;
    std::vector<std::int64_t> window;
    tessera::Tensor<S, Cpu> last({batch, v});
    for (std::int64_t len = t0; len < total; ++len) {
      const std::int64_t ctx = std::min(len, config_.block_size);
      // The tokens to run: the whole cropped context, or (cache filled and the window not sliding)
      // only the newest one.
      const bool incremental = o.kv_cache && kv.length() == ctx - 1 && len <= config_.block_size;
      const std::int64_t first = incremental ? len - 1 : len - ctx, t = len - first;
      window.resize(static_cast<std::size_t>(batch * t));
      for (std::int64_t b = 0; b < batch; ++b)
        std::copy_n(seq.begin() + b * total + first, t, window.begin() + b * t);
      if (o.kv_cache && !incremental) kv.clear();
      const Tensor& logits =
          o.kv_cache ? forward_cached(window, batch, t, kv, c) : run(window, batch, t, 0, c, nullptr, /*dropout=*/false);
      for (std::int64_t b = 0; b < batch; ++b)
        D::copy_to_host(last.data() + b * v, logits.data() + ((b * t) + t - 1) * v, static_cast<std::size_t>(v) * sizeof(S));
      for (std::int64_t b = 0; b < batch; ++b)
        seq[static_cast<std::size_t>(b * total + len)] = sample(last.data() + b * v, o, rng);
    }
    return seq;
  }

  // Accumulates every parameter's gradient from dL/dlogits (B, T, V).
  void backward(const Tensor& dlogits, Cache& c) { backward_units(dlogits, c, 0, unit_count()); }

  // Pipeline units (parallel/pipeline.hpp): 0 the embeddings (token ids -> x (B, T, C)), 1 to
  // n_layer the blocks (transformer.h.0 ...), n_layer + 1 the head (ln_f, lm_head -> logits
  // (B, T, V)). The head reads wte's weight (the tie): a stage holding the head without unit 0
  // holds wte as its own parameter too, and tied_parameters() tells the pipeline to sum the two
  // stages' gradients of it.
  std::size_t unit_count() const { return h_.size() + 2; }
  std::string unit_name(std::size_t u) const {
    if (u == 0) return "embeddings";
    if (u <= h_.size()) return "h." + std::to_string(u - 1);
    return "head";
  }
  // Units [0, end) from token ids (B, T).
  const Tensor& forward_units(const tessera::Tensor<std::int64_t, Cpu>& idx, Cache& c, std::size_t begin,
                              std::size_t end) {
    TESSERA_CHECK(begin == 0 && end >= 1 && end <= unit_count(), ArgumentError, name(), ": units [", begin, ", ", end,
                  ") from token ids: token ids enter unit 0 (of ", unit_count(), ")");
    TESSERA_CHECK(idx.rank() == 2, ShapeError, name(), ": expected token ids (B, T), got ", idx.shape());
    begin_dropout(c);
    embed(std::span<const std::int64_t>(idx.data(), static_cast<std::size_t>(idx.numel())), idx.dim(0), idx.dim(1), 0, c);
    return forward_from(c.x, c, 1, end);
  }
  // Units [begin, end), begin >= 1, from unit begin - 1's output x (B, T, C).
  const Tensor& forward_units(const Tensor& x, Cache& c, std::size_t begin, std::size_t end) {
    TESSERA_CHECK(begin >= 1 && begin < end && end <= unit_count(), ArgumentError, name(), ": units [", begin, ", ",
                  end, ") of ", unit_count(), " from activations (unit 0 takes token ids)");
    TESSERA_CHECK(x.rank() == 3 && x.dim(2) == config_.n_embd && x.dim(1) <= config_.block_size, ShapeError, name(),
                  ": unit ", begin, " (", unit_name(begin), ") takes activations (B, T <= ", config_.block_size, ", ",
                  config_.n_embd, "), got ", x.shape());
    begin_dropout(c);
    return forward_from(x, c, begin, end);
  }
  // Backward of units [begin, end) from dL/d(unit end - 1's output): accumulates their parameters'
  // gradients and returns dL/d(unit begin's input) (an empty tensor when begin is 0: ids have none).
  const Tensor& backward_units(const Tensor& dy, Cache& c, std::size_t begin, std::size_t end) {
    return backward_units_impl(dy, c, begin, end, /*input_only=*/false);
  }
  // The same backward in two halves, for zero-bubble pipeline schedules (parallel/pipeline_schedule.hpp):
  // backward_units_input returns dL/d(unit begin's input) and leaves the weight gradients to
  // backward_units_weight, which adds them from what the caches kept, in backward_units' order
  // (the head's share of the tied wte first, the embedding's last), so the bits are backward_units'.
  // The embeddings (unit 0) have no input gradient: all their work is the W half. With activation
  // checkpointing the blocks share one recomputed cache, so their backward runs whole in the input
  // half (correct; no weight work left to fill a bubble). dy must stay alive until the W half.
  const Tensor& backward_units_input(const Tensor& dy, Cache& c, std::size_t begin, std::size_t end) {
    return backward_units_impl(dy, c, begin, end, /*input_only=*/true);
  }
  void backward_units_weight(Cache& c, std::size_t begin, std::size_t end) {
    TESSERA_CHECK(c.weight_pending && c.pending_begin == begin && c.pending_end == end, Error, name(),
                  "::backward_units_weight: units [", begin, ", ", end, ") had no backward_units_input on this cache");
    c.weight_pending = false;
    if (end == unit_count()) {
      wte_weight_grad(*c.dlogits, c, /*fire_tie=*/begin > 0);
      ln_f_.backward_weight(c.ln_f);
    }
    if (!c.checkpointed) {
      const std::size_t blocks_end = std::min(end - 1, h_.size()), blocks_begin = std::max<std::size_t>(begin, 1) - 1;
      for (std::size_t i = blocks_end; i-- > blocks_begin;) h_[i].backward_weight(c.h[i]);
    }
    if (begin == 0) embeddings_backward(*c.demb_source, c);
  }
  template <class V>
  void visit_units(V& v, const std::string& prefix, std::size_t begin, std::size_t end) {
    if (begin == 0) {
      wte_.visit(v, prefix + "transformer.wte.");
      wpe_.visit(v, prefix + "transformer.wpe.");
    }
    for (std::size_t u = std::max<std::size_t>(begin, 1); u < end && u <= h_.size(); ++u)
      h_[u - 1].visit(v, prefix + "transformer.h." + std::to_string(u - 1) + ".");
    if (end == unit_count()) {
      if (begin > 0) wte_.visit(v, prefix + "transformer.wte.");  // the head's copy of the tie
      ln_f_.visit(v, prefix + "transformer.ln_f.");
      v.buffer(prefix + "lm_head.weight", wte_.weight().value);  // the tie (see the top)
    }
    // The dropout generator, on every stage (each draws the step's key): checkpoints keep it. A
    // state dict has no generators (its visitor ignores them).
    if constexpr (requires { v.rng(prefix, dropout_rng_); })
      if (config_.dropout > 0) v.rng(prefix + "transformer.drop.rng", dropout_rng_);
  }
  // Each unit's training FLOPs per token (forward and backward, nanoGPT's estimate_mfu terms at
  // T = block_size): a block 72 C^2 (its 12 C^2 weights, 6 FLOPs each) + 12 C T (attention), the
  // head 6 V C (lm_head), the embeddings 6 C (a lookup and an add). The pipeline balances its
  // stages by them: by parameter count the embeddings would weigh as much as the head and cost
  // next to nothing.
  std::vector<double> unit_costs() const {
    const auto ch = static_cast<double>(config_.n_embd);
    std::vector<double> costs(unit_count(), 72 * ch * ch + 12 * ch * static_cast<double>(config_.block_size));
    costs.front() = 6 * ch;
    costs.back() = 6 * static_cast<double>(config_.vocab_size) * ch;
    return costs;
  }
  std::vector<TiedParameter<S, D>> tied_parameters() {
    return {{"transformer.wte.weight", 0, unit_count() - 1, &wte_.weight()}};
  }

  template <class V>
  void visit(V& v, const std::string& prefix = "") {
    visit_units(v, prefix, 0, unit_count());
  }
  void set_mode(Mode mode) { mode_ = mode; }
  Mode mode() const { return mode_; }

  // Dropout's draws. A training forward draws one key from dropout_rng() unless a caller holds one:
  // a pipeline draws next_dropout_key() once per step on every stage and holds it over the step's
  // micro-batches, each with its first row's place in the whole batch (batch_offset), so that each
  // micro-batch sees the rows' masks of the one-process step. release_dropout_key() ends the hold.
  std::uint64_t next_dropout_key() { return dropout_rng_.next_u64(); }
  void hold_dropout_key(std::uint64_t key, std::int64_t batch_offset = 0) {
    TESSERA_CHECK(batch_offset >= 0, ArgumentError, name(), "::hold_dropout_key: batch_offset=", batch_offset,
                  " must be >= 0");
    held_key_ = key;
    held_batch_offset_ = batch_offset;
  }
  void release_dropout_key() { held_key_.reset(); }
  Rng& dropout_rng() { return dropout_rng_; }

  // nanoGPT's get_num_params(non_embedding=True): every parameter once, without the position
  // embedding (the token embedding stays: it is also lm_head).
  std::int64_t num_params(bool non_embedding = true) {
    std::int64_t n = 0;
    struct Counter {
      std::int64_t* n;
      void parameter(const std::string&, Parameter<S, D>& p) { *n += p.value.numel(); }
      void buffer(const std::string&, Tensor&) {}
      void rng(const std::string&, Rng&) {}
    } counter{&n};
    visit(counter);
    return non_embedding ? n - wpe_.weight().value.numel() : n;
  }

  // Activation checkpointing (torch.utils.checkpoint around every block): forward keeps each
  // block's (B, T, C) output only and backward recomputes the block's forward before its backward.
  // The gradients are the same bit for bit; the activations held go from about n_layer (18 C + H)
  // values per token (a block's caches: ln_1 C, qkv 3C, heads C, c_proj C, h C, ln_2 C, c_fc 4C,
  // GELU 4C, mlp c_proj C, y C, and H log-sum-exps) to n_layer C plus one block's; one more block
  // forward per step (about a third more compute). bench/activation_memory.cpp measures it.
  void set_activation_checkpointing(bool on) { checkpointing_ = on; }
  bool activation_checkpointing() const { return checkpointing_; }

  const GPTConfig& config() const { return config_; }
  Embedding<E>& wte() { return wte_; }
  Embedding<E>& wpe() { return wpe_; }
  std::vector<GPTBlock<E>>& blocks() { return h_; }
  LayerNorm<E>& ln_f() { return ln_f_; }
  std::string name() const { return "GPT(" + config_.str() + ")"; }

 private:
  // The forward of positions [pos0, pos0 + t) of B sequences; with kv, through the blocks' key/value
  // caches (which must hold positions [0, pos0) already).
  // dropout: a training forward's (false: generation, which drops nothing).
  const Tensor& run(std::span<const std::int64_t> idx, std::int64_t batch, std::int64_t t, std::int64_t pos0, Cache& c,
                    std::vector<typename SelfAttention<E>::KVCache>* kv, bool dropout) {
    if (dropout)
      begin_dropout(c);
    else
      c.dropout = {};
    embed(idx, batch, t, pos0, c);
    if (kv == nullptr) return forward_from(c.x, c, 1, unit_count());
    c.checkpointed = false;  // generation: no backward
    c.outputs.clear();
    c.h.resize(h_.size());
    const Tensor* x = &c.x;
    for (std::size_t i = 0; i < h_.size(); ++i) {
      GPTBlock<E>::key_dropout(c.h[i], c.dropout, i);
      x = &h_[i].forward_cached(*x, (*kv)[i], config_.block_size, c.h[i]);
    }
    c.blocks_input = &c.x, c.first_block = 0, c.end_block = h_.size();
    return head(*x, c);
  }

  // c.x = wte[idx] + wpe[pos0 .. pos0 + t): (B, T, C).
  void embed(std::span<const std::int64_t> idx, std::int64_t batch, std::int64_t t, std::int64_t pos0, Cache& c) {
    TESSERA_CHECK(batch > 0 && t > 0 && static_cast<std::int64_t>(idx.size()) == batch * t, ShapeError, name(),
                  ": ", idx.size(), " token ids given for (B, T) = (", batch, ", ", t, ")");
    TESSERA_CHECK(pos0 + t <= config_.block_size, ShapeError, name(), ": cannot forward a sequence of length ",
                  pos0 + t, ", the block size is only ", config_.block_size);
    const std::int64_t ch = config_.n_embd;
    const Tensor& tok = wte_.forward(idx, Shape{batch, t}, c.wte);  // checks every id against the vocabulary
    c.positions.resize(static_cast<std::size_t>(t));
    for (std::int64_t i = 0; i < t; ++i) c.positions[static_cast<std::size_t>(i)] = pos0 + i;
    const Tensor& pos = wpe_.forward(c.positions, Shape{t}, c.wpe);
    c.x = tok;
    add_broadcast_rows(D{}, pos.data(), batch, t * ch, c.x.data());
    if (c.dropout.active())  // transformer.drop, in place (the blocks read the dropped sum)
      dropout_rows(D{}, GPTBlock<E>::site(c.dropout, 0), batch, t, ch, c.x.data(), c.x.data());
  }

  // This forward's dropout (c.dropout): none outside Train mode or with p = 0; else the held key or
  // a new draw.
  void begin_dropout(Cache& c) {
    c.dropout = {};
    if (mode_ != Mode::Train || config_.dropout == 0) return;
    c.dropout.p = config_.dropout;
    c.dropout.key = held_key_ ? *held_key_ : next_dropout_key();
    c.dropout.batch_offset = held_key_ ? held_batch_offset_ : 0;
  }

  // Units [begin, end), begin >= 1, from x: the blocks among them (each block's output kept in its
  // cache, or with checkpointing only the output), then the head if end is the last unit.
  const Tensor& forward_from(const Tensor& x_in, Cache& c, std::size_t begin, std::size_t end) {
    const std::size_t first = begin - 1, last = std::min(end - 1, h_.size());
    c.checkpointed = checkpointing_;
    // The blocks backward may run: these, or (one unit after another on one cache, as the pipeline
    // measures each unit's cost) these and those the calls before ran up to here.
    if (c.blocks_input == nullptr || first != c.end_block) c.blocks_input = &x_in, c.first_block = first;
    c.end_block = std::max(first, last);
    const Tensor* x = &x_in;
    if (c.checkpointed) {
      // Keep only each block's output; its activations are dropped and recomputed in backward.
      c.h.clear();
      c.outputs.resize(h_.size());
      for (std::size_t i = first; i < last; ++i) {
        GPTBlock<E>::key_dropout(c.scratch, c.dropout, i);
        c.outputs[i] = h_[i].forward(*x, c.scratch);
        x = &c.outputs[i];
      }
      c.scratch = {};
    } else {
      c.outputs.clear();
      c.h.resize(h_.size());
      for (std::size_t i = first; i < last; ++i) {
        GPTBlock<E>::key_dropout(c.h[i], c.dropout, i);
        x = &h_[i].forward(*x, c.h[i]);
      }
    }
    return end == unit_count() ? head(*x, c) : *x;
  }

  // logits = ln_f(x) wte^T: (B T, C) x (C, V), the weight being wte's (V, C).
  const Tensor& head(const Tensor& x, Cache& c) {
    const std::int64_t batch = x.dim(0), t = x.dim(1), ch = config_.n_embd;
    const Tensor& xf = ln_f_.forward(x, c.ln_f);
    c.logits.resize({batch, t, config_.vocab_size});
    gemm_in<typename E::Compute>(D{}, false, true, batch * t, config_.vocab_size, ch, S(1), xf.data(), ch,
                                 wte_.weight().value.data(), ch, S(0), c.logits.data(), config_.vocab_size);
    return c.logits;
  }

  // lm_head: dW += dlogits^T xf (V, C), into wte's gradient; dxf = dlogits W (B T, C); then ln_f's
  // backward. fire_tie: this stage does not run the embedding, whose backward would signal the
  // weight's gradient ready, so the head does.
  // input_only: backward_units_input (the weight halves wait in the caches).
  const Tensor& backward_units_impl(const Tensor& dy, Cache& c, std::size_t begin, std::size_t end, bool input_only) {
    TESSERA_CHECK(begin < end && end <= unit_count(), ArgumentError, name(), "::backward_units: units [", begin, ", ",
                  end, ") of ", unit_count());
    TESSERA_CHECK(c.blocks_input != nullptr, Error, name(), "::backward called before forward on this cache");
    const std::size_t blocks_end = std::min(end - 1, h_.size()), blocks_begin = std::max<std::size_t>(begin, 1) - 1;
    TESSERA_CHECK(blocks_begin >= c.first_block && blocks_end <= c.end_block, ArgumentError, name(),
                  "::backward_units: units [", begin, ", ", end, ") were not all run forward on this cache");
    if (input_only) {
      c.weight_pending = true;
      c.pending_begin = begin;
      c.pending_end = end;
    }
    const Tensor* dx = &dy;
    if (end == unit_count()) dx = &head_backward(dy, c, /*fire_tie=*/begin > 0, input_only);
    for (std::size_t i = blocks_end; i-- > blocks_begin;) {
      if (c.checkpointed) {
        const Tensor& input = i == c.first_block ? *c.blocks_input : c.outputs[i - 1];
        // Its forward again from its saved input (the same numbers, bit for bit: the kernels are
        // deterministic and the dropout masks functions of the key forward used), then its
        // backward; the next recompute overwrites the one cache.
        c.dcarry = *dx;
        GPTBlock<E>::key_dropout(c.scratch, c.dropout, i);
        h_[i].forward(input, c.scratch);
        dx = &h_[i].backward(c.dcarry, c.scratch);
      } else {
        dx = &backward_or_input(h_[i], *dx, c.h[i], input_only);
      }
    }
    if (begin > 0) return *dx;
    TESSERA_CHECK(dx->rank() == 3 && c.x.rank() == 3 && dx->shape() == c.x.shape(), ShapeError, name(),
                  "::backward_units: dL/dx ", dx->shape(), " does not match the embeddings ", c.x.shape());
    if (c.dropout.active()) {  // transformer.drop's mask again, on the gradient
      c.demb.resize(dx->shape());
      dropout_rows(D{}, GPTBlock<E>::site(c.dropout, 0), c.x.dim(0), c.x.dim(1), config_.n_embd, dx->data(),
                   c.demb.data());
      dx = &c.demb;
    }
    if (input_only) c.demb_source = dx;  // the embeddings' backward is all weight: it waits
    else embeddings_backward(*dx, c);
    return no_input_grad_;
  }
  // wte and wpe from dL/d(the embeddings' sum) (B, T, C).
  void embeddings_backward(const Tensor& demb, Cache& c) {
    const std::int64_t batch = c.x.dim(0), t = c.x.dim(1), ch = config_.n_embd;
    wte_.backward(demb, c.wte);
    c.dpos.resize({t, ch});
    c.dpos.fill(S(0));
    add_column_sums(D{}, demb.data(), batch, t * ch, c.dpos.data());
    wpe_.backward(c.dpos, c.wpe);
  }
  // The tied lm_head's share of wte's gradient: += dlogits^T ln_f(x) (V, C).
  void wte_weight_grad(const Tensor& dlogits, Cache& c, bool fire_tie) {
    const std::int64_t rows = c.logits.dim(0) * c.logits.dim(1), v = config_.vocab_size, ch = config_.n_embd;
    Parameter<S, D>& w = wte_.weight();
    gemm_in<typename E::Compute>(D{}, true, false, v, ch, rows, S(1), dlogits.data(), v, c.ln_f.y.data(), ch, S(1),
                                 w.grad.data(), ch);
    if (fire_tie) w.grad_ready();
  }
  const Tensor& head_backward(const Tensor& dlogits, Cache& c, bool fire_tie, bool input_only) {
    TESSERA_CHECK(c.logits.rank() == 3 && dlogits.shape() == c.logits.shape(), ShapeError, name(),
                  "::backward: dlogits ", dlogits.shape(), " does not match the logits ", c.logits.shape(),
                  " (or backward before forward)");
    const std::int64_t batch = c.logits.dim(0), t = c.logits.dim(1), v = config_.vocab_size, ch = config_.n_embd;
    if (input_only) c.dlogits = &dlogits;
    else wte_weight_grad(dlogits, c, fire_tie);
    c.dx.resize({batch, t, ch});
    gemm_in<typename E::Compute>(D{}, false, false, batch * t, ch, v, S(1), dlogits.data(), v, wte_.weight().value.data(),
                                 ch, S(0), c.dx.data(), ch);
    return backward_or_input(ln_f_, c.dx, c.ln_f, input_only);
  }

  // One token from a row of logits: temperature, top-k, softmax (in double), inverse CDF of rng.
  std::int64_t sample(const S* logits, const GenerateOptions& o, Rng& rng) const {
    const std::int64_t v = config_.vocab_size;
    std::vector<double> p(static_cast<std::size_t>(v));
    for (std::int64_t j = 0; j < v; ++j) p[static_cast<std::size_t>(j)] = static_cast<double>(logits[j]) / o.temperature;
    if (o.top_k && *o.top_k < v) {
      std::vector<double> sorted = p;
      std::nth_element(sorted.begin(), sorted.begin() + (*o.top_k - 1), sorted.end(), std::greater<double>());
      const double kth = sorted[static_cast<std::size_t>(*o.top_k - 1)];
      for (double& x : p)
        if (x < kth) x = -std::numeric_limits<double>::infinity();
    }
    const double m = *std::max_element(p.begin(), p.end());
    double sum = 0;
    for (double& x : p) sum += (x = std::exp(x - m));
    double u = rng.uniform() * sum;
    for (std::int64_t j = 0; j < v; ++j) {
      u -= p[static_cast<std::size_t>(j)];
      if (u < 0) return j;
    }
    for (std::int64_t j = v; j-- > 0;)  // rounding left u >= 0: the last token with mass
      if (p[static_cast<std::size_t>(j)] > 0) return j;
    return v - 1;
  }

  static const GPTConfig& checked(const GPTConfig& c) {
    c.check();
    return c;
  }
  // nanoGPT's _init_weights and its scaled residual projections, in model order.
  void init_weights(Rng& rng) {
    const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(config_.n_layer));
    normal_(wte_.weight().value, 0.0, 0.02, rng);
    normal_(wpe_.weight().value, 0.0, 0.02, rng);
    const auto linear = [&](Linear<E>& l, double std) {
      normal_(l.weight().value, 0.0, std, rng);
      if (config_.bias) l.bias().value.fill(S(0));
    };
    for (auto& b : h_) {
      linear(b.attn().c_attn(), 0.02);
      linear(b.attn().c_proj(), residual_std);
      linear(b.mlp_c_fc(), 0.02);
      linear(b.mlp_c_proj(), residual_std);
    }
  }

  GPTConfig config_;
  bool checkpointing_ = false;
  Mode mode_ = Mode::Train;
  Rng dropout_rng_;                        // one draw per training step (used when dropout > 0)
  std::optional<std::uint64_t> held_key_;  // hold_dropout_key's
  std::int64_t held_batch_offset_ = 0;
  Embedding<E> wte_, wpe_;
  std::vector<GPTBlock<E>> h_;
  LayerNorm<E> ln_f_;
  Tensor no_input_grad_;  // what backward_units returns for unit 0 (token ids have no gradient)
};

// The class of any other Env is this one renamed (comm/local_env.hpp).
TESSERA_SAME_CODE_AS_LOCAL(GPTBlock);
TESSERA_SAME_CODE_AS_LOCAL(GPT);
TESSERA_LOCAL_EXTERN(GPTBlock)
TESSERA_LOCAL_EXTERN(GPT)

}  // namespace tessera
