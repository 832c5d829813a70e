// A pipeline over GPT blocks against one process, on any communicator: every rank builds the same
// GPT twice from one seed, trains one copy whole (the reference) and its stage of the other through
// Pipeline, on the same batches, and compares the loss, every gradient and, after SGD steps, every
// parameter of its stage. GPT's units are the embeddings, each block and the head (ln_f, lm_head);
// lm_head reads wte's weight, so the first and the last stage each hold a copy of it and sum their
// gradients: the two copies must stay equal bit for bit. Each stage's bytes sent must equal the
// formula: per micro-batch (B/M, T, C) activations plus a 64-byte shape header forward, the same
// activations' gradient backward, and wte's gradient (V, C) once per step between the two ends.
// With config.dropout > 0 both models draw one dropout key per step from the same generator, and
// each micro-batch's masks are those of its rows in the whole batch (models/gpt.hpp), so the
// comparison stays exact. Collective: every rank calls it. Returns failures as text.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "tessera/losses/cross_entropy.hpp"
#include "tessera/models/gpt.hpp"
#include "tessera/optim/sgd.hpp"
#include "tessera/parallel/pipeline.hpp"
#include "parallel/tp_gpt_equivalence.hpp"

namespace tessera::testing {

struct PpGptCase {
  GPTConfig config{.block_size = 16, .vocab_size = 23, .n_layer = 3, .n_head = 2, .n_embd = 16, .bias = true};
  std::int64_t batch = 4, t = 12;
  int micro_batches = 2;
  PipelineSchedule schedule = PipelineSchedule::OneFOneB;
  int stages_per_rank = 2;  // Interleaved1F1B's v (ZB-V always places two, in a V)
  int steps = 3;
  bool checkpointing = false;  // the staged GPT recomputes its blocks' forwards in backward
  bool measure_costs = false;  // balance by units' times measured on rank 0 (a sample of ids)
  double tolerance = 1e-6;     // of the largest magnitude of each compared tensor (float32)
};

// The bytes stage `stage` of `stages` sends in one training step (PipelineStepStats' three counts).
struct PpGptBytes {
  std::int64_t forward = 0, backward = 0, tied = 0;
};
template <class S>
PpGptBytes pp_gpt_bytes_per_step(const PpGptCase& k, int stage, int stages) {
  const std::int64_t activations = k.batch * k.t * k.config.n_embd * static_cast<std::int64_t>(sizeof(S));
  PpGptBytes b;
  if (stage < stages - 1) b.forward = activations + k.micro_batches * 8 * static_cast<std::int64_t>(sizeof(std::int64_t));
  if (stage > 0) b.backward = activations;
  if (stages > 1 && (stage == 0 || stage == stages - 1))
    b.tied = k.config.vocab_size * k.config.n_embd * static_cast<std::int64_t>(sizeof(S));
  return b;
}

template <class S, class Comm>
std::vector<std::string> pp_gpt_equivalence(Comm& comm, const PpGptCase& k = {}) {
  using E = Env<Cpu, Comm, S>;
  std::vector<std::string> failures;
  const int rank = comm.rank(), stages = comm.size();
  const std::string where = "Pipeline(" + std::string(schedule_name(k.schedule)) + (k.checkpointing ? ", checkpointed" : "") +
                            (k.measure_costs ? ", measured costs" : "") + ") over GPT" +
                            (k.config.dropout > 0 ? " with dropout " + tp_gpt_number(k.config.dropout) : "") + " on " +
                            std::to_string(stages) + " stages (stage " + std::to_string(rank) + "): ";
  Rng rng_reference(17), rng_staged(17);
  GPT<E> reference(k.config, rng_reference), staged(k.config, rng_staged);
  staged.set_activation_checkpointing(k.checkpointing);
  Tensor<std::int64_t, Cpu> sample({k.batch / k.micro_batches, k.t});
  for (std::int64_t i = 0; i < sample.numel(); ++i) sample.data()[i] = i % k.config.vocab_size;
  Pipeline pipe(staged, comm, {.micro_batches = k.micro_batches, .schedule = k.schedule, .stages_per_rank = k.stages_per_rank},
                k.measure_costs && rank == 0 ? &sample : nullptr);
  const PipelineScheduleTable& table = pipe.schedule();
  const int last_rank = table.rank_of(table.stage_count() - 1);
  // The byte counts' formula is for one stage per rank (several: messages between a rank's own
  // stages never leave it, and V placement keeps the tie on rank 0).
  const bool one_stage_per_rank = table.stage_count() == stages;
  auto reference_named = named_tensors(reference);
  auto stage_named = pipe.stage_parameters();
  Sgd<E> reference_sgd(reference_named, {.lr = 0.1, .momentum = 0.9});
  Sgd<E> stage_sgd(stage_named, {.lr = 0.1, .momentum = 0.9});
  typename GPT<E>::Cache cache;
  CrossEntropyLoss<E> ce;
  typename CrossEntropyLoss<E>::Cache ce_cache;
  // The stage's gradient (or, after the step, value) of `name` against the whole model's.
  const auto compare = [&](bool gradient, const std::string& name, const Tensor<S, Cpu>& mine, int step) {
    const auto it = std::find_if(reference_named.parameters.begin(), reference_named.parameters.end(),
                                 [&](const auto& d) { return d.first == name; });
    if (it == reference_named.parameters.end()) {
      failures.push_back(where + "the whole model has no parameter " + name);
      return;
    }
    const Tensor<S, Cpu>& expected = gradient ? it->second->grad : it->second->value;
    const char* what = gradient ? "the gradient" : "the value after the step";
    const double d = tp_gpt_relative_difference(mine.data(), expected.data(), mine.numel());
    if (!(d <= k.tolerance))
      failures.push_back(where + "step " + std::to_string(step) + ": " + what + " of " + name + " differs by " +
                         tp_gpt_number(d) + " (relative; tolerance " + tp_gpt_number(k.tolerance) + ")");
  };
  Rng data(5);
  Tensor<std::int64_t, Cpu> ids({k.batch, k.t});
  std::vector<std::int64_t> targets(static_cast<std::size_t>(k.batch * k.t));
  const PpGptBytes expected_bytes = pp_gpt_bytes_per_step<S>(k, rank, stages);
  for (int step = 0; step < k.steps; ++step) {
    for (std::int64_t i = 0; i < ids.numel(); ++i)
      ids.data()[i] = static_cast<std::int64_t>(data.below(static_cast<std::uint64_t>(k.config.vocab_size)));
    for (auto& v : targets) v = static_cast<std::int64_t>(data.below(static_cast<std::uint64_t>(k.config.vocab_size)));
    reference_sgd.zero_grad();
    stage_sgd.zero_grad();
    const S reference_loss = ce.forward(reference.forward(ids, cache), targets, ce_cache);
    reference.backward(ce.backward(ce_cache), cache);
    const S loss = pipe.train_step(ids, targets);
    if (!(std::abs(static_cast<double>(loss - reference_loss)) <= k.tolerance * std::max(1.0, std::abs(double(reference_loss)))))
      failures.push_back(where + "step " + std::to_string(step) + ": loss " + std::to_string(loss) + ", one process " +
                         std::to_string(reference_loss));
    const PipelineStepStats& sent = pipe.last_step();
    if (one_stage_per_rank && (sent.bytes_sent_forward != expected_bytes.forward ||
                               sent.bytes_sent_backward != expected_bytes.backward ||
                               sent.bytes_sent_tied != expected_bytes.tied))
      failures.push_back(where + "sent " + std::to_string(sent.bytes_sent_forward) + " / " +
                         std::to_string(sent.bytes_sent_backward) + " / " + std::to_string(sent.bytes_sent_tied) +
                         " bytes (activations / gradients / tied wte); the formula says " +
                         std::to_string(expected_bytes.forward) + " / " + std::to_string(expected_bytes.backward) +
                         " / " + std::to_string(expected_bytes.tied));
    for (auto& [name, p] : stage_named.parameters) compare(true, name, p->grad, step);
    reference_sgd.step();
    stage_sgd.step();
    for (auto& [name, p] : stage_named.parameters) compare(false, name, p->value, step);
  }
  // The two copies of the tie: the last stage's rank sends its wte, the first compares bit for bit
  // (in V placement both stages are rank 0's: one copy).
  if (last_rank != 0) {
    Tensor<S, Cpu>& wte = staged.wte().weight().value;
    const auto n = static_cast<std::size_t>(wte.numel());
    if (rank == last_rank) comm.send(std::span<const S>(wte.data(), n), 0);
    if (rank == 0) {
      Tensor<S, Cpu> last(wte.shape());
      comm.recv(std::span<S>(last.data(), n), last_rank);
      if (std::memcmp(last.data(), wte.data(), wte.bytes()) != 0)
        failures.push_back(where + "the first and the last stage's copies of transformer.wte.weight differ after " +
                           std::to_string(k.steps) + " steps");
    }
  }
  return failures;
}

}  // namespace tessera::testing
