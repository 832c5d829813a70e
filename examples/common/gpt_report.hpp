// What examples 15, 16 and 17 (a GPT on English text, data-, tensor- and pipeline-parallel) prepare,
// print and check around their training, kept out of their mains: the corpus's token files, the
// cost models (compute per token, all-reduce bytes per step; all_gather and reduce_scatter bytes per
// block; activation, gradient and tied-embedding bytes per pipeline stage) beside the measured
// figures, a generated sample (with and without the key/value cache: the same tokens), the split
// model's first step against the dense one, and a run as one JSON line for bench/compare_gpt.py.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <numbers>
#include <string>
#include <vector>

#include "common/data_parallel_report.hpp"
#include "tessera/tessera.hpp"

namespace examples {

// The fortunes package's text as byte tokens, dir/train.bin and dir/val.bin (the last 10%): rank 0
// writes them when they are missing (each file atomically), the other ranks wait at a barrier and
// open what it wrote (ranks of other hosts need dir on a shared file system). Without the package,
// rank 0 throws an IoError naming it and the apt-get command; the others would wait forever, so
// every rank learns the outcome from an all-reduce first.
template <class Comm>
tessera::PreparedCorpus fortunes_tokens(Comm& comm, const std::string& dir) {
  tessera::PreparedCorpus out{dir + "/train.bin", dir + "/val.bin"};
  std::string failure;
  if (comm.rank() == 0 && !(std::filesystem::exists(out.train) && std::filesystem::exists(out.val))) {
    try {
      const auto prepared = tessera::prepare_byte_corpus(tessera::TextCorpus::fortunes(), dir);
      std::printf("prepared %s: %lld training and %lld validation byte tokens\n", dir.c_str(),
                  static_cast<long long>(prepared.train_tokens), static_cast<long long>(prepared.val_tokens));
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  std::int64_t failed = failure.empty() ? 0 : 1;
  comm.all_reduce(std::span<std::int64_t>(&failed, 1), tessera::ReduceOp::Sum);
  TESSERA_CHECK(failed == 0, tessera::IoError, failure.empty() ? "rank 0 could not prepare the corpus in " + dir : failure);
  return out;
}

// The entropy of the tokens' frequencies in nats: the loss of the best model that ignores context.
inline double unigram_entropy(tessera::TokenSpan tokens, std::int64_t vocab) {
  std::vector<double> count(static_cast<std::size_t>(vocab), 0.0);
  for (std::int64_t i = 0; i < tokens.size; ++i) count[static_cast<std::size_t>(tokens[i])] += 1;
  double h = 0;
  for (const double c : count)
    if (c > 0) h -= c / static_cast<double>(tokens.size) * std::log(c / static_cast<double>(tokens.size));
  return h;
}

// Compute per token (Kaplan et al.; nanoGPT's estimate_mfu): every parameter in a product costs 2
// FLOPs forward and 4 backward, 6N per token (N without the position table, which is a lookup),
// and attention's two products 12 L T C per token (forward and backward, T = block size, the
// causal triangle counted whole as nanoGPT does). Communication: DataParallel's all-reduce of the
// gradients, 2(p-1)/p x 4P bytes per rank and step (print_traffic).
inline void print_gpt_cost(const tessera::GPTConfig& c, double params, double non_embedding, int ranks,
                           double tokens_per_second, double steps, double peer_before, double peer_after,
                           double loopback_before, double loopback_after) {
  const double per_token = 6 * non_embedding + 12.0 * static_cast<double>(c.n_layer * c.block_size * c.n_embd);
  std::printf("cost: compute per token = 6 N + 12 L T C = 6 x %.0f + 12 x %lld x %lld x %lld = %.2f MFLOP\n",
              non_embedding, static_cast<long long>(c.n_layer), static_cast<long long>(c.block_size),
              static_cast<long long>(c.n_embd), per_token / 1e6);
  std::printf("cost: measured: %.0f tokens/s over all ranks = %.1f GFLOP/s (%.1f per rank)\n", tokens_per_second,
              tokens_per_second * per_token / 1e9, tokens_per_second * per_token / 1e9 / ranks);
  print_traffic(ranks, params, 4.0, steps, peer_before >= 0 ? peer_after - peer_before : -1,
                loopback_before >= 0 ? loopback_after - loopback_before : -1);
}

// The training recipe examples 15, 16 and 17 share (nanoGPT's small-data defaults), how they run
// (threads, ranks, seed, output) and the flags of both.
struct GptRecipe {
  std::int64_t steps = 1000, eval_every = 250, batch = 16, block = 64, layers = 4, heads = 4, embd = 128;
  std::int64_t val_batches = 0;
  double lr = 1e-3, min_lr = 1e-4, warmup = 100, weight_decay = 0.1, beta2 = 0.99;
  double max_val_loss = 0, dropout = 0;
  int threads = 1, ranks = 2, progress = -1;
  std::uint64_t seed = 1;
  std::string data_dir, trace;
};
inline void parse_gpt_recipe(tessera::Flags& flags, GptRecipe& o) {
  o.steps = flags.get("steps", o.steps, {.min = 1}, "optimizer steps in all");
  o.eval_every = flags.get("eval-every", o.eval_every, {.min = 1}, "steps between validations (divides --steps)");
  TESSERA_CHECK(o.steps % o.eval_every == 0, tessera::ArgumentError, "--eval-every=", o.eval_every,
                " must divide --steps=", o.steps);
  o.layers = flags.get("layers", o.layers, {.min = 1}, "transformer blocks");
  o.embd = flags.get("embd", o.embd, {.min = 1}, "embedding width");
  o.dropout = flags.get("dropout", o.dropout, {.min = 0, .below = 1}, "nanoGPT's dropout p (0: none, its pretraining value)");
  o.lr = flags.get("lr", o.lr, {.above = 0}, "AdamW's peak learning rate");
  o.min_lr = flags.get("min-lr", o.min_lr, {.min = 0}, "the learning rate the cosine ends at");
  o.warmup = flags.get("warmup", o.warmup, {.min = 0}, "steps of linear warmup");
  o.weight_decay = flags.get("weight-decay", o.weight_decay, {.min = 0}, "AdamW's decay of the 2-D weights");
  o.beta2 = flags.get("beta2", o.beta2, {.min = 0, .max = 1}, "AdamW's beta2 (nanoGPT: 0.99 for small data)");
  o.val_batches = flags.get("val-batches", o.val_batches, {.min = 0}, "validation batches of 32 windows (0: all)");
}
// The run's flags, after the example's own: what the ranks are (ranks_help), the check's bound,
// threads, seed, progress, the corpus's folder and the trace of `traced` steps.
template <class Comm>
void parse_gpt_run(tessera::Flags& flags, GptRecipe& o, const char* ranks_help, const char* traced) {
  o.max_val_loss = flags.get("max-val-loss", o.max_val_loss, {.min = 0}, "the check's bound (0: the unigram entropy)");
  o.threads = flags.threads("threads", o.threads, "OpenMP threads per rank");
  o.ranks = flags.ranks("ranks", o.ranks, !tessera::SharedMemoryCommunicator<Comm>, ranks_help);
  tessera::check_thread_budget(tessera::SharedMemoryCommunicator<Comm> ? o.ranks : 1, "--ranks", o.threads, "--threads");
  o.seed = static_cast<std::uint64_t>(flags.get("seed", std::int64_t{1}, "seed of the weights and the windows (and of 15's sample)"));
  o.progress = flags.get("progress", o.progress, {.min = -1, .max = 1}, "1 bar, 0 lines, -1 bar on a terminal");
  o.data_dir = flags.get("data-dir", std::string("data/fortunes"), "where the corpus's token files are (made if missing)");
  o.trace = flags.output_path("trace", o.trace, std::string("Chrome trace of steps ") + traced);
}
// The Trainer's options for a GPT run: an "epoch" is one evaluation interval; progress and
// figures on rank 0; steps 4 to 3 + traced_steps recorded when --trace is given.
template <class Comm>
tessera::TrainOptions gpt_train_options(Comm& comm, const GptRecipe& o, tessera::Timeline& timeline,
                                        std::int64_t traced_steps) {
  return {.epochs = o.steps / o.eval_every, .progress = comm.rank() == 0 ? o.progress : 0,
          .verbose = comm.rank() == 0, .timeline = o.trace.empty() ? nullptr : &timeline, .timeline_first_step = 3,
          .timeline_steps = traced_steps, .trace_path = o.trace, .checkpoint_group = tessera::CheckpointGroup(comm)};
}

// nanoGPT's get_lr(it) as the Trainer's schedule (a function of the fractional epoch; an epoch here
// is steps_per_epoch steps): linear warmup to lr over `warmup` steps, then a cosine to min_lr at the
// last step.
struct NanoGptLr {
  double lr, min_lr, warmup, steps, steps_per_epoch;
  double operator()(double epoch) const {
    const double it = std::round(epoch * steps_per_epoch);
    if (it < warmup) return lr * (it + 1) / (warmup + 1);
    const double r = std::min(1.0, (it - warmup) / std::max(1.0, steps - warmup));
    return min_lr + 0.5 * (1 + std::cos(std::numbers::pi * r)) * (lr - min_lr);
  }
};

// What a training run of the example measured.
struct GptRun {
  double steps = 0;
  int ranks = 1, threads = 1;
  double parameters = 0, seconds = 0, tokens_per_second = 0, val_loss = 0, train_loss = 0;
};

// The run's figures from the Trainer's epochs: all `steps` steps of batch x block tokens each.
template <class Epochs>
GptRun gpt_run(const Epochs& epochs, double steps, int ranks, int threads, double parameters, std::int64_t tokens_per_step) {
  GptRun r{.steps = steps, .ranks = ranks, .threads = threads, .parameters = parameters};
  for (const auto& e : epochs) r.seconds += e.seconds;
  r.tokens_per_second = r.steps * static_cast<double>(tokens_per_step) / r.seconds;
  r.val_loss = epochs.back().test_loss;
  r.train_loss = epochs.back().train_loss;
  return r;
}

// The check: the validation loss below max_val_loss, or (0) below the unigram entropy of the
// training bytes, which a model that ignores context cannot beat. Writes the run as one JSON line
// to `json` (empty: none). Returns whether the check holds.
inline bool check_val_loss(const GptRun& r, tessera::TokenSpan train, double max_val_loss, const std::string& json) {
  const double unigram = unigram_entropy(train, 256), bound = max_val_loss > 0 ? max_val_loss : unigram;
  std::printf("check: validation loss %.4f nats (%.3f bits per byte) < %.4f (%s)\n", r.val_loss,
              r.val_loss / std::numbers::ln2, bound, max_val_loss > 0 ? "--max-val-loss" : "the bytes' unigram entropy");
  if (!json.empty())
    tessera::MetricsWriter(json).write(tessera::JsonRecord()
                                           .add("val_loss", r.val_loss)
                                           .add("train_loss", r.train_loss)
                                           .add("tokens_per_second", r.tokens_per_second)
                                           .add("train_seconds", r.seconds)
                                           .add("steps", r.steps)
                                           .add("ranks", r.ranks)
                                           .add("threads", r.threads)
                                           .add("parameters", r.parameters)
                                           .add("unigram_entropy", unigram)
                                           .add("gemm", tessera::cpu_gemm_kernel()));
  return r.val_loss < bound;
}

// A sample from the prompt, drawn twice from the same seed: through the key/value cache and through
// the full forward. Prints the first; returns whether the two are the same tokens.
template <class Model>
bool print_sample(Model& model, const std::string& prompt, std::int64_t tokens, double temperature,
                  std::int64_t top_k, std::uint64_t seed) {
  const auto ids = tessera::ByteTokenizer::encode(prompt.empty() ? std::string("\n") : prompt);
  typename Model::GenerateOptions o{.max_new_tokens = tokens, .temperature = temperature, .top_k = top_k};
  tessera::Rng cached_rng(seed), full_rng(seed);
  const auto cached = model.generate(ids, 1, o, cached_rng);
  o.kv_cache = false;
  const auto full = model.generate(ids, 1, o, full_rng);
  std::printf("sample (temperature %.2f, top-k %lld):\n----\n%s\n----\n", temperature, static_cast<long long>(top_k),
              tessera::ByteTokenizer::decode(cached).c_str());
  const bool same = cached == full;
  std::printf("check: the sample through the key/value cache and through the full forward %s\n",
              same ? "are the same tokens" : "DIFFER");
  return same;
}

// The largest |a - b| over the largest |b| (or 1, where that is smaller).
inline double relative_difference(const float* a, const float* b, std::int64_t n) {
  double worst = 0, scale = 1;
  for (std::int64_t i = 0; i < n; ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return worst / scale;
}

// Example 16's check before training: one forward + backward of the split model and of the dense
// GPT on the same batch, on every rank; the logits and every gradient (each rank's slice of the
// dense one) compared, the worst relative difference over all ranks printed against `tolerance`.
// Beside it the bytes per block and step: the formula (TensorParallelGPT's header derives it) and
// what the collectives inside each block moved, where the communicator counts it (threads), or the
// whole step's bytes on the loopback interface (Gloo). Returns whether the step matches and any
// counted bytes equal the formula.
template <class Comm, class Dense, class Split>
bool check_tensor_parallel_step(Comm& comm, Dense& dense, Split& split, const tessera::Batch<float>& batch,
                                double tolerance) {
  using E = typename Split::Env;
  tessera::CrossEntropyLoss<E> ce;
  typename tessera::CrossEntropyLoss<E>::Cache ce_dense, ce_split;
  typename Dense::Cache dense_cache;
  typename Split::Cache split_cache;
  auto dense_named = tessera::named_tensors(dense), split_named = tessera::named_tensors(split);
  for (auto* named : {&dense_named, &split_named})
    for (auto& [name, p] : named->parameters) p->grad.zero();
  const auto& dense_logits = dense.forward(batch.tokens, dense_cache);
  ce.forward(dense_logits, batch.labels, ce_dense);
  dense.backward(ce.backward(ce_dense), dense_cache);
  split.reset_measured_bytes();
  comm.barrier();
  const double lo0 = comm.rank() == 0 ? loopback_bytes() : -1;
  const auto& split_logits = split.forward(batch.tokens, split_cache);
  ce.forward(split_logits, batch.labels, ce_split);
  split.backward(ce.backward(ce_split), split_cache);
  comm.barrier();
  const double lo1 = comm.rank() == 0 ? loopback_bytes() : -1;
  double worst[1] = {relative_difference(split_logits.data(), dense_logits.data(), dense_logits.numel())};
  for (auto& [name, p] : split_named.parameters)
    for (auto& [dense_name, q] : dense_named.parameters)
      if (dense_name == name) {
        const auto expected = split.shard_of(name, q->grad);
        worst[0] = std::max(worst[0], relative_difference(p->grad.data(), expected.data(), expected.numel()));
      }
  comm.all_reduce(std::span<double>(worst), tessera::ReduceOp::Max);
  const auto& c = split.config();
  const double formula = Split::block_bytes_per_step(batch.tokens.dim(0), batch.tokens.dim(1), c.n_embd, comm.size());
  bool bytes_ok = true;
  if (comm.rank() == 0) {
    std::printf("check: one step against the dense GPT: logits and every gradient within %.2e relative (tolerance "
                "%.0e)\n", worst[0], tolerance);
    std::printf("cost: per block and step, per rank: 8 (p-1)/p x B T h x 4 B = 8 x %d/%d x %lld x %lld x %lld x 4 B = "
                "%.1f KiB (forward: all_gather ln_1, reduce_scatter attn, all_gather ln_2, reduce_scatter mlp; "
                "backward: the conjugates)\n", comm.size() - 1, comm.size(), static_cast<long long>(batch.tokens.dim(0)),
                static_cast<long long>(batch.tokens.dim(1)), static_cast<long long>(c.n_embd), formula / 1024);
    const auto& measured = split.measured_block_bytes();
    for (std::size_t i = 0; i < measured.size(); ++i) {
      std::printf("cost: block %zu: measured %.1f KiB moved between the ranks' buffers (%.3fx the formula)\n", i,
                  measured[i] / 1024, measured[i] / formula);
      bytes_ok = bytes_ok && measured[i] == formula;
    }
    const double whole = static_cast<double>(c.n_layer) * formula +
                         split.other_bytes_per_step(batch.tokens.dim(0), batch.tokens.dim(1));
    if (measured.empty() && lo0 >= 0)
      std::printf("cost: the whole step by formula %.1f KiB per rank (blocks, ln_f's all_gather, the replicated "
                  "gradients' all-reduce); on the loopback interface %.1f KiB per rank (%.2fx; 0 where the backend "
                  "moves bytes through shared memory)\n", whole / 1024, (lo1 - lo0) / comm.size() / 1024,
                  (lo1 - lo0) / comm.size() / whole);
  }
  return worst[0] <= tolerance && bytes_ok;
}

// Example 17's check before training: one step of the pipeline and of the whole GPT (the same
// weights, on every rank) on the same batch; each stage's gradients compared with the whole model's,
// the worst relative difference over all stages printed against `tolerance`. Then, per stage, the
// units it holds and the bytes it sent in that step beside the formula: per micro-batch the (B/M,
// T, C) activations and a 64-byte shape header forward, their gradient backward, and once per step
// wte's (V, C) gradient between the first and the last stage (the tie with lm_head), each at
// sizeof(float). The step's gradients are left zero. Returns whether both agree.
template <class Comm, class Model, class Pipe>
bool check_pipeline_step(Comm& comm, Model& whole, Pipe& pipe, const tessera::Batch<float>& batch, int micro_batches,
                         double tolerance) {
  using E = typename Model::Env;
  tessera::CrossEntropyLoss<E> ce;
  typename tessera::CrossEntropyLoss<E>::Cache ce_cache;
  typename Model::Cache cache;
  auto whole_named = tessera::named_tensors(whole);
  auto stage_named = pipe.stage_parameters();
  for (auto* named : {&whole_named, &stage_named})
    for (auto& [name, p] : named->parameters) p->grad.zero();
  ce.forward(whole.forward(batch.tokens, cache), batch.labels, ce_cache);
  whole.backward(ce.backward(ce_cache), cache);
  pipe.train_step(batch.tokens, batch.labels);
  double worst[1] = {0};
  for (auto& [name, p] : stage_named.parameters)
    for (auto& [whole_name, q] : whole_named.parameters)
      if (whole_name == name) worst[0] = std::max(worst[0], relative_difference(p->grad.data(), q->grad.data(), q->grad.numel()));
  for (auto& [name, p] : stage_named.parameters) p->grad.zero();
  comm.all_reduce(std::span<double>(worst), tessera::ReduceOp::Max);
  const auto& st = pipe.last_step();
  const std::int64_t mine[5] = {static_cast<std::int64_t>(pipe.boundaries()[static_cast<std::size_t>(comm.rank())]),
                                static_cast<std::int64_t>(pipe.boundaries()[static_cast<std::size_t>(comm.rank()) + 1]),
                                st.bytes_sent_forward, st.bytes_sent_backward, st.bytes_sent_tied};
  std::vector<std::int64_t> all(5 * static_cast<std::size_t>(comm.size()));
  comm.all_gather(std::span<const std::int64_t>(mine), std::span<std::int64_t>(all));
  const auto& c = whole.config();
  const std::int64_t p = comm.size(), activations = batch.tokens.numel() * c.n_embd * 4;
  bool bytes_ok = true;
  if (comm.rank() == 0) {
    std::printf("check: one step against the whole GPT: every stage's gradients within %.2e relative (tolerance "
                "%.0e)\n", worst[0], tolerance);
    std::printf("cost: per step, B T C x 4 B = %lld x %lld x %lld x 4 B = %.1f KiB of activations forward over each "
                "stage boundary (plus %d x 64 B of shape headers) and as much gradient backward; wte's V C x 4 B = "
                "%.1f KiB between the first and the last stage\n", static_cast<long long>(batch.tokens.dim(0)),
                static_cast<long long>(batch.tokens.dim(1)), static_cast<long long>(c.n_embd), activations / 1024.0,
                micro_batches, static_cast<double>(c.vocab_size * c.n_embd * 4) / 1024.0);
    for (std::int64_t s = 0; s < p; ++s) {
      const std::int64_t* r = all.data() + 5 * s;
      const std::int64_t forward = s < p - 1 ? activations + micro_batches * 64 : 0, backward = s > 0 ? activations : 0,
                         tied = p > 1 && (s == 0 || s == p - 1) ? c.vocab_size * c.n_embd * 4 : 0;
      std::printf("cost: stage %lld, units %s..%s: sent %.1f / %.1f / %.1f KiB (activations / gradients / wte), "
                  "formula %.1f / %.1f / %.1f KiB\n", static_cast<long long>(s),
                  whole.unit_name(static_cast<std::size_t>(r[0])).c_str(),
                  whole.unit_name(static_cast<std::size_t>(r[1] - 1)).c_str(), r[2] / 1024.0, r[3] / 1024.0,
                  r[4] / 1024.0, forward / 1024.0, backward / 1024.0, tied / 1024.0);
      bytes_ok = bytes_ok && r[2] == forward && r[3] == backward && r[4] == tied;
    }
  }
  return worst[0] <= tolerance && bytes_ok;
}

}  // namespace examples
