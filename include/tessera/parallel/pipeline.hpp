// Pipeline: pipeline model parallelism. The model's units (a Sequential's layers, an MLP's
// Linear+ReLU pairs, a ResNet's stem, blocks and head) are split into P contiguous stages, one per
// rank of `comm`; each global batch is cut into M micro-batches that flow through the stages.
//
//   Pipeline pipe(model, comm, {.micro_batches = 8, .schedule = PipelineSchedule::OneFOneB});
//   Sgd<E> sgd(pipe.stage_parameters(), {...});          // this rank's units only
//   loop: sgd.zero_grad(); S loss = pipe.train_step(x, labels); sgd.step();
// The loss (a third template argument, cross-entropy by default) lives on the last stage.
//
// Stage s runs units [b_s, b_{s+1}). Per micro-batch i it receives activations from stage s-1
// (stage 0 slices them from x), runs its units forward and sends the result to stage s+1; the
// last stage computes the loss. Backward goes the other way with dL/d(activation). Each stage's
// parameter gradients accumulate over the M micro-batches (every layer's backward accumulates),
// and the loss gradient of each micro-batch is scaled by 1/M, so after train_step the gradients
// are exactly those of the mean loss over the whole batch: the optimizer steps once per batch,
// as in the unsplit model. BatchNorm is the exception: it normalizes each micro-batch with that
// micro-batch's statistics, so with BN and M > 1 the result differs from the unsplit model (as in
// GPipe); with M = 1 it is equal.
//
// Schedules (P ranks, M micro-batches; F_i / B_i = forward / backward of micro-batch i) are tables
// of actions per rank (parallel/pipeline_schedule.hpp), checked before the first step; this class
// runs any table of F and B actions:
//   GPipe:  F_0 .. F_{M-1}, then B_0 .. B_{M-1}. Every stage holds all M micro-batches'
//           activations at the peak.
//   1F1B:   PipeDream-flush. Stage s first runs w = min(P-1-s, M) forwards, then alternates one
//           forward and one backward, then drains the last w backwards. At most w + 1 <= P - s
//           micro-batches of activations are held at any time, whatever M is.
// Both leave every stage idle for the same (P-1)/(M+P-1) of the step (the bubble) when all stages
// cost the same; 1F1B's gain is memory.
//   Interleaved1F1B (options.stages_per_rank = v): the model is cut into S = v P stages, rank r
//           running stages r, r + P, ...; the bubble is (P-1)/(v M + P - 1), v times less, for
//           more activation memory and v times the messages.
//   options.table: any other table, e.g. one written by torch.distributed.pipelining
//           (read_pipeline_csv), including V placement (rank r runs stages r and 2P - 1 - r).
//   ZBH1, ZBV: zero bubble, each backward split into I (the input gradient, which the stage below
//           waits for) and W (the weight gradients, moved into idle time). A model whose units
//           split their backward (detail::SplitsUnitBackward: Mlp, ResNet, GPT, Sequential) runs
//           them apart; another runs its whole backward as I and nothing as W (the same result,
//           less of the gain).
// With several stages per rank, stage k's activations go to the rank of stage k + 1 (on the same
// rank: handed over without a message); a pair of ranks delivers in order, so a message that
// arrives before it is needed waits in a buffer. Each stage keeps as many activation slots as
// the table holds micro-batches in it at once.
//
// Messages: activations go k -> k+1 with a shape header (8 int64) first; gradients k+1 -> k
// without one (the receiver knows the shape it sent). Sends are asynchronous (a stage never blocks
// on a peer that is itself sending), receives blocking with the communicator's timeout, so a dead
// stage becomes a CommError naming the peer, not a hang.
//
// Balancing: options.boundaries fixes the split; otherwise the units are split to minimize the
// most expensive stage, with options.unit_costs if given, else costs measured on rank 0 (forward +
// backward of each unit on the sample micro-batch passed to rank 0's constructor, broadcast so
// every rank splits the same way), else the model's own unit_costs() where it has one (GPT: FLOPs
// per token), else each unit's parameter count plus one (a crude estimate).
// Every stage of a balanced split holds at least one unit with parameters: a stage of only ReLUs
// and poolings has nothing to train (its optimizer refused "no parameters to optimize", so
// example 06 at --stages=4 failed); more stages than such units is refused by name.
//
// Agreement: before anything else, the constructor checks (one all_gather of two int64) that every
// stage holds the same micro-batch count, schedule, boundaries and unit costs (if given), and the
// same model: unit count and names, every parameter's and buffer's name and shape
// (parallel/agreement.hpp). A stage with another schedule or micro-batch count would otherwise
// wait for messages that never come, or receive activations of the wrong size. Activation shapes
// between stages depend on the input and are checked per message (the shape header).
//
// Timeline (options.timeline or set_timeline, e.g. for one step after training): per stage, the
// compute lane holds one span per train_step, named with the stage's units ("train_step
// [conv2..fc1]"), and inside it every F_i / B_i; the communication lane holds every blocking
// receive ("recv A3 from stage 0": waiting for micro-batch 3's activations; "recv G3 from stage
// 2": its gradient) and every send as issued ("send A3 to stage 1, 12.5 KiB"). The stage's idle
// time is the step span minus its F/B spans: mostly the receive waits, the bubble.
//
// Language models: a model whose first unit takes token ids (GPT: embeddings, blocks, head) reads
// them on stage 0, (N, T) int64, and the last stage takes one label per row of logits (N T next
// tokens for (N, T, V)). A parameter two units read (GPT's wte, also lm_head: tied_parameters())
// whose units sit on two stages has a copy on each; after the last backward the two stages send
// each other their gradient of it and add (g_a + g_b on both, the same bits), before its
// grad_ready reaches a DataParallel over the stage, so the copies take the same steps.
//
// Requires: every rank builds the same model (same seed); the model outlives the Pipeline.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include "tessera/comm/communicator.hpp"
#include "tessera/core/env.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/parameter.hpp"
#include "tessera/core/span_sink.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/kernels/elementwise.hpp"
#include "tessera/losses/cross_entropy.hpp"
#include "tessera/parallel/agreement.hpp"
#include "tessera/parallel/pipeline_schedule.hpp"
#include "tessera/parallel/strategy.hpp"

namespace tessera {

// A model that can be cut into pipeline stages.
template <class M>
concept Stageable = requires(M& m, const typename M::Tensor& t, typename M::Cache& c, std::size_t i) {
  { m.unit_count() } -> std::convertible_to<std::size_t>;
  { m.forward_units(t, c, i, i) } -> std::same_as<const typename M::Tensor&>;
  { m.backward_units(t, c, i, i) } -> std::same_as<const typename M::Tensor&>;
  { m.unit_name(i) } -> std::convertible_to<std::string>;
};

namespace detail {
// A language model's first unit takes token ids (B, T) (GPT's embeddings), the others activations.
template <class M>
concept TakesTokenIds = requires(M& m, const Tensor<std::int64_t, Cpu>& ids, typename M::Cache& c, std::size_t i) {
  { m.forward_units(ids, c, i, i) } -> std::same_as<const typename M::Tensor&>;
};
// A model whose dropout masks are keyed by position (GPT, models/gpt.hpp): a strategy that runs it
// unit by unit or in micro-batches draws one key per step and holds it, with each micro-batch's
// first row's place in the batch, so that every unit and micro-batch masks as the one-process step.
template <class M>
concept HoldsDropoutKey = requires(M& m) {
  { m.next_dropout_key() } -> std::same_as<std::uint64_t>;
  m.hold_dropout_key(std::uint64_t{}, std::int64_t{});
  m.release_dropout_key();
};
// A model whose units run their backward in two halves (Mlp, ResNet, GPT, Sequential: their
// layers' backward_input and backward_weight): the input gradient, then the weight gradients from
// the same cache. A model without them runs its whole backward for a schedule's I and nothing for
// its W: the same result, without the time W would have moved.
template <class M>
concept SplitsUnitBackward = requires(M& m, const typename M::Tensor& t, typename M::Cache& c, std::size_t i) {
  { m.backward_units_input(t, c, i, i) } -> std::same_as<const typename M::Tensor&>;
  m.backward_units_weight(c, i, i);
};
// A visitor that forwards each object (parameter, buffer, generator) to v the first time only.
template <class V>
struct VisitOnce {
  V& v;
  std::unordered_set<const void*> seen;
  bool first(const void* p) { return seen.insert(p).second; }
  template <class P>
  void parameter(const std::string& name, P& p) {
    if (first(&p)) v.parameter(name, p);
  }
  template <class T>
    requires requires(V& w, const std::string& n, T& t) { w.buffer(n, t); }
  void buffer(const std::string& name, T& t) {
    if (first(&t)) v.buffer(name, t);
  }
  template <class R>
    requires requires(V& w, const std::string& n, R& r) { w.rng(n, r); }
  void rng(const std::string& name, R& r) {
    if (first(&r)) v.rng(name, r);
  }
  template <class I>
    requires requires(V& w, const std::string& n, I& i) { w.integer_buffer(n, i); }
  void integer_buffer(const std::string& name, I& i) {
    if (first(&i)) v.integer_buffer(name, i);
  }
};
// The parameters two units read (GPT's wte, also its lm_head): optional, none when absent.
template <class M>
auto tied_parameters(M& m) {
  using P = TiedParameter<typename M::Env::Scalar, typename M::Env::Device>;
  if constexpr (requires { { m.tied_parameters() } -> std::convertible_to<std::vector<P>>; }) return std::vector<P>(m.tied_parameters());
  else return std::vector<P>{};
}
}  // namespace detail

// The built-in schedules (parallel/pipeline_schedule.hpp writes their tables).
enum class PipelineSchedule { GPipe, OneFOneB, Interleaved1F1B, ZBH1, ZBV };

inline const char* schedule_name(PipelineSchedule s) {
  switch (s) {
    case PipelineSchedule::GPipe: return "GPipe";
    case PipelineSchedule::OneFOneB: return "1F1B";
    case PipelineSchedule::Interleaved1F1B: return "Interleaved1F1B";
    case PipelineSchedule::ZBH1: return "ZBH1";
    case PipelineSchedule::ZBV: return "ZBV";
  }
  return "?";
}

struct PipelineOptions {
  int micro_batches = 4;
  PipelineSchedule schedule = PipelineSchedule::OneFOneB;
  int stages_per_rank = 2;  // Interleaved1F1B's v (ZBV always has 2; the others 1)
  // Any table that check_pipeline_table accepts (e.g. read_pipeline_csv of torch's CSV), in place
  // of `schedule`; its micro-batch count must be micro_batches.
  std::optional<PipelineScheduleTable> table;
  std::vector<std::size_t> boundaries;  // S + 1 unit indices (S = P x stages per rank), 0 = b_0 < ... < b_S = units
  std::vector<double> unit_costs;       // one per unit: relative cost used for balancing
  SpanSink* timeline = nullptr;         // optional (a Timeline): see "Timeline" in the header comment
};

// What the last train_step did on this rank.
struct PipelineStepStats {
  double step_seconds = 0;  // train_step, start to end
  double busy_seconds = 0;  // in this stage's forward and backward compute
  int peak_in_flight = 0;   // most micro-batches whose activations were held at once
  // Bytes this stage sent: activations to the next stage (shape headers included) and
  // gradients to the previous one.
  std::int64_t bytes_sent_forward = 0, bytes_sent_backward = 0;
  // Bytes of tied parameters' gradients sent to the stage holding the other unit (GPT's wte,
  // between the first and the last stage).
  std::int64_t bytes_sent_tied = 0;
  double idle_fraction() const { return step_seconds > 0 ? 1.0 - busy_seconds / step_seconds : 0.0; }
};

// Splits costs into `parts` contiguous runs minimizing the largest run's sum (linear partition,
// O(parts n^2) dynamic programme; n is at most a few hundred units). Returns parts + 1 boundaries.
// With `trainable` (one flag per unit: it holds parameters), every run holds a trainable unit.
inline std::vector<std::size_t> balanced_boundaries(const std::vector<double>& costs, int parts,
                                                    const std::vector<bool>& trainable = {}) {
  const std::size_t n = costs.size();
  TESSERA_CHECK(parts >= 1 && static_cast<std::size_t>(parts) <= n, ArgumentError, "Pipeline: cannot split ", n,
                " units into ", parts, " stages (every stage needs at least one unit)");
  TESSERA_CHECK(trainable.empty() || trainable.size() == n, ArgumentError, "Pipeline: ", trainable.size(),
                " trainable flags for ", n, " units");
  // trained[i]: trainable units among the first i (every run needs one when any is given).
  std::vector<std::size_t> trained(n + 1, 0);
  for (std::size_t i = 0; i < n; ++i) trained[i + 1] = trained[i] + (!trainable.empty() && trainable[i] ? 1 : 0);
  const bool need_trainable = trained[n] > 0;
  TESSERA_CHECK(!need_trainable || trained[n] >= static_cast<std::size_t>(parts), ArgumentError, "Pipeline: ", parts,
                " stages, but only ", trained[n], " of the model's ", n, " units hold parameters: a stage without any "
                "would have nothing to train; use at most ", trained[n], " stages, or give options.boundaries");
  std::vector<double> prefix(n + 1, 0.0);
  for (std::size_t i = 0; i < n; ++i) {
    TESSERA_CHECK(costs[i] >= 0, ArgumentError, "Pipeline: unit cost ", i, " is negative (", costs[i], ")");
    prefix[i + 1] = prefix[i] + costs[i];
  }
  const double inf = std::numeric_limits<double>::infinity();
  const auto p = static_cast<std::size_t>(parts);
  // best[k][j]: the smallest possible maximum when the first j units form k stages.
  std::vector<std::vector<double>> best(p + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<std::size_t>> cut(p + 1, std::vector<std::size_t>(n + 1, 0));
  best[0][0] = 0;
  for (std::size_t k = 1; k <= p; ++k)
    for (std::size_t j = k; j <= n; ++j)
      for (std::size_t i = k - 1; i < j; ++i) {
        if (need_trainable && trained[j] == trained[i]) continue;  // units i..j-1 have nothing to train
        const double candidate = std::max(best[k - 1][i], prefix[j] - prefix[i]);
        if (candidate < best[k][j]) best[k][j] = candidate, cut[k][j] = i;
      }
  std::vector<std::size_t> bounds(p + 1);
  bounds[p] = n;
  for (std::size_t k = p; k > 0; --k) bounds[k - 1] = cut[k][bounds[k]];
  return bounds;
}

template <Stageable Model, class Loss = CrossEntropyLoss<typename Model::Env>>
class Pipeline : public StrategyBase<typename Model::Env> {
 public:
  using Env = typename Model::Env;
  // The strategy protocol (parallel/strategy.hpp): a pipeline runs the model itself (each stage
  // its units) in its own micro-batch loop, so the Trainer hands it whole batches (run_model).
  static constexpr bool kOwnsMicroBatchLoop = true;
  static constexpr bool kRunsModel = true;
  using Comm = typename Env::Comm;
  static_assert(AsyncCommunicator<Comm>, "Pipeline needs send_async (stages must not block on each other's sends)");
  using S = typename Env::Scalar;
  using D = typename Env::Device;
  using Tensor = typename Model::Tensor;
  // What stage 0 reads: images (N, ...) for a Layer, token ids (N, T) for a language model.
  static constexpr bool kTokenInput = detail::TakesTokenIds<Model>;
  using Input = std::conditional_t<kTokenInput, tessera::Tensor<std::int64_t, Cpu>, Tensor>;
  // A model with dropout masks keyed by position (GPT, models/gpt.hpp) draws one key per step on
  // every stage, held over the step's micro-batches, each with its first row's place in the whole
  // batch: every stage and micro-batch then masks exactly as the one-process step does.
  static constexpr bool kHoldsDropout = detail::HoldsDropoutKey<Model>;
  // Whether a schedule's I and W run apart (detail::SplitsUnitBackward), or I runs the whole backward.
  static constexpr bool kSplitsBackward = detail::SplitsUnitBackward<Model>;

  // The part of the model on this rank (one run of units per stage it holds), as a model-like
  // object for optimizers, checkpoints and a DataParallel over the stage (hybrid data x pipeline).
  class Stage {
   public:
    using Env = typename Model::Env;
    Stage(Model& model, std::vector<std::pair<std::size_t, std::size_t>> ranges)
        : model_(&model), ranges_(std::move(ranges)) {}
    // Every parameter, buffer and generator once: in V placement rank 0 holds the first and the
    // last stage, and a GPT's two units of the tie (wte) then hand over the same parameter.
    template <class V>
    void visit(V& v, const std::string& prefix) {
      detail::VisitOnce<V> once{v, {}};
      for (const auto& [begin, end] : ranges_) model_->visit_units(once, prefix, begin, end);
    }

   private:
    Model* model_;
    std::vector<std::pair<std::size_t, std::size_t>> ranges_;
  };

  // comm: the world, or a group from split, of the model Env's Comm type.
  template <class C>
  Pipeline(Model& model, C& comm, PipelineOptions options, const Input* sample = nullptr, Loss loss = Loss())
      : model_(model), comm_(comm_of_env<Env>(comm)), options_(std::move(options)), stage_(model, {}), loss_(std::move(loss)) {
    TESSERA_CHECK(options_.micro_batches >= 1, ArgumentError, "Pipeline: micro_batches=", options_.micro_batches,
                  " must be at least 1");
    std::string table_error;
    try {
      table_ = make_table();
    } catch (const ArgumentError& e) {
      table_error = e.what();
    }
    check_agreement(comm_, agreement_record(table_error));  // every rank, even one whose table was refused
    if (!table_error.empty()) throw ArgumentError(table_error);
    const std::size_t units = model_.unit_count();
    const int stages = table_.stage_count();
    bounds_ = options_.boundaries.empty() ? balanced_boundaries(costs(sample), stages, trainable_units())
                                          : options_.boundaries;
    check_boundaries(units);
    mine_ = table_.stages_of(comm_.rank());
    std::vector<std::pair<std::size_t, std::size_t>> ranges;
    for (const int k : mine_) ranges.emplace_back(bounds_[static_cast<std::size_t>(k)], bounds_[static_cast<std::size_t>(k) + 1]);
    stage_ = Stage(model_, ranges);
    plan();
    find_ties();
  }

  Stage& stage() { return stage_; }
  NamedTensors<Env> stage_parameters() { return named_tensors(stage_); }
  // The stage's parameters with each tied one (held by two stages, summed equal after the step)
  // counted by the lower rank only: what clip_grad_norm(..., pipeline group) sums over the stages.
  NamedTensors<Env> norm_parameters() {
    NamedTensors<Env> named = named_tensors(stage_);
    for (const Tie& t : ties_)
      if (comm_.rank() > t.peer)
        std::erase_if(named.parameters, [&](const auto& entry) { return entry.second == t.parameter; });
    return named;
  }
  int stage_index() const { return comm_.rank(); }
  int stage_count() const { return comm_.size(); }
  // The schedule this pipeline runs (compute actions only; the transfers follow from them).
  const PipelineScheduleTable& schedule() const { return table_; }
  // The model stages this rank runs (one per rank, or v with interleaving, 2 with ZB-V).
  const std::vector<int>& stages() const { return mine_; }
  // Unit boundaries of every model stage: stage k runs [boundaries()[k], boundaries()[k+1]). With
  // one stage per rank, stage k is rank k's.
  const std::vector<std::size_t>& boundaries() const { return bounds_; }
  const PipelineStepStats& last_step() const { return stats_; }
  // Micro-batch activation sets this rank keeps allocated, over its stages (M for GPipe,
  // min(M, P - s) for 1F1B, what the table needs otherwise).
  int activation_slots() const {
    int n = 0;
    for (const auto& c : chunks_) n += static_cast<int>(c.slots.size());
    return n;
  }
  // Records later steps into `timeline` (nullptr: stop recording); the split stays as it is.
  void set_timeline(SpanSink* timeline) { options_.timeline = timeline; }

  std::string name() const {
    return "Pipeline(" + table_.name + ", " + std::to_string(comm_.size()) + " stages" +
           (table_.stages_per_rank > 1 ? " x " + std::to_string(table_.stages_per_rank) : std::string()) + ", " +
           std::to_string(options_.micro_batches) + " micro-batches)";
  }
  // Every stage of the pipeline sees each sample of its batch.
  int sample_copies() const { return comm_.size(); }

  // One training step, as the Trainer calls it: train_step with `hooks` (the Trainer's whole
  // strategy stack) called around each micro-batch i of M, with MicroBatch{i, M, 1/M}:
  // hooks.before_forward before this rank's first F of i, hooks.before_backward before its first
  // backward of i and hooks.after_backward after its last. When micro-batch M - 1's backwards are
  // this rank's last (GPipe, 1F1B), a DataParallel over the replicas of this stage (hybrid data x
  // pipeline) all-reduces during them, overlapping that backward; otherwise (interleaving, split
  // backwards) the parameters' grad_ready is held until the step's last backward and given once
  // per parameter then. Returns the batch's mean loss and correct predictions (classification
  // losses), the same on every stage.
  template <class Hooks>
  ModelStepResult run_model(const Input& x, std::span<const std::int64_t> labels, Hooks& hooks) {
    return step(x, labels, hooks);
  }
  // Forward only (the model in Eval or Inference mode): the batch's mean loss and correct
  // predictions, computed on the last stage and the same on every stage.
  ModelStepResult evaluate_batch(const Input& x, std::span<const std::int64_t> labels) {
    const int last_rank = table_.rank_of(table_.stage_count() - 1);
    const Tensor& logits = predict(x);
    std::array<double, 2> result{0, 0};
    if (comm_.rank() == last_rank) {
      result[0] = static_cast<double>(loss_.forward(logits, labels, loss_caches_[0]));
      if constexpr (kCountsCorrect) result[1] = static_cast<double>(count_correct(logits, labels));
    }
    comm_.broadcast(std::span<double>(result), last_rank);
    return {result[0], static_cast<std::int64_t>(result[1])};
  }

  // Forward only, the whole batch as one micro-batch (for evaluation; put the model in Eval mode
  // first): every stage in model order. Returns the logits on the rank of the last stage and an
  // empty tensor on the others.
  const Tensor& predict(const Input& x) {
    const int me = comm_.rank(), last = table_.stage_count() - 1;
    const Tensor* out = nullptr;
    for (std::size_t c = 0; c < mine_.size(); ++c) {
      const int k = mine_[c];
      Slot& sl = chunks_[c].slots[0];
      sl.wait_sends();
      const Tensor* in = nullptr;
      if (k > 0 && table_.rank_of(k - 1) != me) {
        const int from = table_.rank_of(k - 1);
        std::array<std::int64_t, 8> header{};
        comm_.recv(std::span<std::int64_t>(header), from);
        sl.input.resize(shape_from_header(header, from));
        comm_.recv(std::span<S>(sl.input.data(), static_cast<std::size_t>(sl.input.numel())), from);
        in = &sl.input;
      } else if (k > 0) {
        in = out;  // the stage before, on this rank (V placement)
      }
      out = k == 0 ? &model_.forward_units(x, sl.cache, chunks_[c].begin, chunks_[c].end)
                   : &model_.forward_units(*in, sl.cache, chunks_[c].begin, chunks_[c].end);
      if (k < last && table_.rank_of(k + 1) != me) {
        send_activation(sl, *out, table_.rank_of(k + 1));
        sl.wait_sends();  // the next predict or step may reuse the buffers
      }
    }
    return mine_.back() == last ? *out : empty_;
  }

  // One training step on the global batch x (N, ...) with labels (N): x is read on stage 0 and
  // labels on the last stage only (other ranks may pass empty ones). Accumulates this rank's
  // parameter gradients (the caller zeroes them and steps the optimizer) and returns the mean loss
  // over the batch on every rank.
  S train_step(const Input& x, std::span<const std::int64_t> labels) {
    return static_cast<S>(step(x, labels, static_cast<StrategyBase<Env>&>(*this)).loss);
  }

 private:
  static constexpr bool kCountsCorrect = std::is_same_v<Loss, CrossEntropyLoss<Env>>;

  // The table to run: options.table, or the built-in schedule's; checked before any step.
  PipelineScheduleTable make_table() const {
    PipelineScheduleTable t = options_.table ? options_.table->compute_only()
                                             : pipeline_table(schedule_name(options_.schedule), comm_.size(),
                                                              options_.micro_batches, options_.stages_per_rank);
    TESSERA_CHECK(t.ranks == comm_.size(), ArgumentError, "Pipeline: schedule '", t.name, "' has ", t.ranks,
                  " rows (ranks), the communicator ", comm_.size(), " ranks");
    TESSERA_CHECK(t.micro_batches == options_.micro_batches, ArgumentError, "Pipeline: schedule '", t.name,
                  "' runs ", t.micro_batches, " micro-batches, options.micro_batches is ", options_.micro_batches);
    check_pipeline_table(t);
    return t;
  }

  // From the table, once: each stage's activation slots (a slot holds a micro-batch from its F to
  // the end of its backward; micro-batches reuse freed ones), where the hooks go, and the order of
  // the messages each other rank sends this one (a pair of ranks delivers in order, so a message
  // that arrives before it is needed waits in a buffer).
  void plan() {
    const int me = comm_.rank(), m = options_.micro_batches, stages = table_.stage_count();
    local_.assign(static_cast<std::size_t>(stages), -1);
    chunks_.clear();
    for (std::size_t c = 0; c < mine_.size(); ++c) {
      const auto k = static_cast<std::size_t>(mine_[c]);
      local_[k] = static_cast<int>(c);
      chunks_.push_back(Chunk{mine_[c], bounds_[k], bounds_[k + 1], {}, std::vector<int>(static_cast<std::size_t>(m), -1)});
    }
    const auto& row = table_.actions[static_cast<std::size_t>(me)];
    std::vector<std::vector<char>> busy(chunks_.size());
    first_forward_.assign(static_cast<std::size_t>(m), -1);
    first_backward_.assign(static_cast<std::size_t>(m), -1);
    last_backward_.assign(static_cast<std::size_t>(m), -1);
    for (std::size_t pos = 0; pos < row.size(); ++pos) {
      const PipelineAction& a = row[pos];
      const auto c = static_cast<std::size_t>(local_[static_cast<std::size_t>(a.stage)]);
      const auto i = static_cast<std::size_t>(a.micro_batch);
      auto& used = busy[c];
      if (a.op == PipelineOp::Forward) {
        const auto free = std::find(used.begin(), used.end(), 0);
        const auto slot = static_cast<int>(free - used.begin());
        if (free == used.end()) used.push_back(1);
        else *free = 1;
        chunks_[c].slot_of[i] = slot;
        if (first_forward_[i] < 0) first_forward_[i] = static_cast<int>(pos);
      } else {
        if (first_backward_[i] < 0) first_backward_[i] = static_cast<int>(pos);
        last_backward_[i] = static_cast<int>(pos);
        if (a.op != PipelineOp::BackwardInput) used[static_cast<std::size_t>(chunks_[c].slot_of[i])] = 0;  // W still reads it
      }
    }
    for (std::size_t c = 0; c < chunks_.size(); ++c) chunks_[c].slots.resize(std::max<std::size_t>(busy[c].size(), 1));
    const int last = stages - 1;
    loss_caches_.resize(local_[static_cast<std::size_t>(last)] >= 0
                            ? chunks_[static_cast<std::size_t>(local_[static_cast<std::size_t>(last)])].slots.size()
                            : 1);
    // Micro-batch M - 1's backwards last on this rank: a DataParallel over the stage all-reduces
    // during them. Otherwise every parameter's grad_ready waits for the end of the step.
    hold_all_ = false;
    for (std::size_t pos = static_cast<std::size_t>(first_backward_.back()) + 1; pos < row.size(); ++pos)
      hold_all_ = hold_all_ || (row[pos].op != PipelineOp::Forward && row[pos].micro_batch != m - 1);
    if (hold_all_)
      for (auto& [name, p] : named_tensors(stage_).parameters) all_hold_.add(*p);
    incoming_.assign(static_cast<std::size_t>(comm_.size()), {});
    next_incoming_.assign(static_cast<std::size_t>(comm_.size()), 0);
    for (int q = 0; q < comm_.size(); ++q) {
      if (q == me) continue;
      for (const PipelineAction& a : table_.actions[static_cast<std::size_t>(q)]) {
        if (a.op == PipelineOp::Forward && a.stage < last && table_.rank_of(a.stage + 1) == me)
          incoming_[static_cast<std::size_t>(q)].push_back({true, a.stage, a.micro_batch});
        if ((a.op == PipelineOp::Backward || a.op == PipelineOp::BackwardInput) && a.stage > 0 &&
            table_.rank_of(a.stage - 1) == me)
          incoming_[static_cast<std::size_t>(q)].push_back({false, a.stage, a.micro_batch});
      }
    }
  }

  template <class Hooks>
  ModelStepResult step(const Input& x, std::span<const std::int64_t> labels, Hooks& hooks) {
    const auto started = std::chrono::steady_clock::now();
    stats_ = {};
    in_flight_ = 0;
    loss_sum_ = 0;
    correct_ = 0;
    x_ = &x;
    labels_ = labels;
    const int me = comm_.rank(), m = options_.micro_batches, last_rank = table_.rank_of(table_.stage_count() - 1);
    if constexpr (kHoldsDropout) dropout_key_ = model_.next_dropout_key();  // this step's, on every stage
    if (me == 0) {
      TESSERA_CHECK(x.rank() >= 1 && x.dim(0) % m == 0 && x.dim(0) > 0, ShapeError, "Pipeline: the batch of ",
                    x.rank() >= 1 ? x.dim(0) : 0, " samples (input ", x.shape(), ") does not split into ", m,
                    " equal micro-batches");
    }
    std::fill(next_incoming_.begin(), next_incoming_.end(), std::size_t{0});
    auto micro = [m](int i) { return MicroBatch{i, m, 1.0 / m}; };
    // A tied parameter's gradient is final only once the other stage's part is added: its
    // grad_ready (a DataParallel over the stage's replicas launches its bucket there) is held back
    // during the last backward and given after the exchange below.
    typename GradReadyHold<S, D>::Scope restore_ties{tie_hold_};
    typename GradReadyHold<S, D>::Scope restore_all{all_hold_};
    if (hold_all_) all_hold_.hold();
    const auto& row = table_.actions[static_cast<std::size_t>(me)];
    for (std::size_t pos = 0; pos < row.size(); ++pos) {
      const PipelineAction& a = row[pos];
      const auto i = static_cast<std::size_t>(a.micro_batch);
      if (a.op == PipelineOp::Forward) {
        if (static_cast<int>(pos) == first_forward_[i]) hooks.before_forward(micro(a.micro_batch));
        forward_micro_batch(a.stage, a.micro_batch);
        continue;
      }
      if (static_cast<int>(pos) == first_backward_[i]) {
        hooks.before_backward(micro(a.micro_batch));
        if (a.micro_batch == m - 1 && !hold_all_) tie_hold_.hold();
      }
      if (a.op == PipelineOp::BackwardWeight) weight_micro_batch(a.stage, a.micro_batch);
      else backward_micro_batch(a.stage, a.micro_batch, a.op == PipelineOp::BackwardInput);
      if (static_cast<int>(pos) == last_backward_[i]) hooks.after_backward(micro(a.micro_batch));
    }
    {
      const auto waiting = std::chrono::steady_clock::now();
      for (auto& c : chunks_)
        for (auto& sl : c.slots) sl.wait_sends();
      note_communication("wait for sends", waiting);
    }
    exchange_tied_gradients();
    if (hold_all_) all_hold_.release(/*every_parameter_once=*/true);
    else tie_hold_.release();
    // The mean loss (and the correct predictions) live on the last stage; every rank returns them.
    std::array<double, 2> result{static_cast<double>(loss_sum_ / static_cast<S>(m)), static_cast<double>(correct_)};
    const auto broadcasting = std::chrono::steady_clock::now();
    comm_.broadcast(std::span<double>(result), last_rank);
    note_communication("broadcast loss", broadcasting);
    const auto ended = std::chrono::steady_clock::now();
    stats_.step_seconds = std::chrono::duration<double>(ended - started).count();
    if (options_.timeline)
      options_.timeline->add("train_step [" + model_.unit_name(chunks_.front().begin) + ".." +
                                 model_.unit_name(chunks_.back().end - 1) + "]",
                             "step", started, ended, SpanSink::kCompute);
    return {result[0], static_cast<std::int64_t>(result[1])};
  }

  // One micro-batch's worth of state of one stage on this rank, reused by the micro-batches the
  // plan assigns to it (never two at once).
  struct Slot {
    typename Model::Cache cache{};
    Tensor input;                        // received activations (or stage 0's slice of images)
    Input ids;                           // stage 0's slice of token ids (a language model)
    Tensor output_grad;                  // dL/d(output): received, handed down, or the scaled loss gradient
    const Tensor* output = nullptr;      // the stage's output (in cache), for the next stage on this rank
    std::array<std::int64_t, 8> header{};  // shape of the activations sent forward
    Shape output_shape;
    Work send_activation_header, send_activation, send_grad;
    void wait_sends() {
      send_activation_header.wait();
      send_activation.wait();
      send_grad.wait();
    }
  };
  // A stage this rank runs: units [begin, end), its slots, and each micro-batch's slot.
  struct Chunk {
    int stage;
    std::size_t begin, end;
    std::vector<Slot> slots;
    std::vector<int> slot_of;
  };
  // A message another rank sends this one: activations of `stage` (to stage + 1) or its input
  // gradient (to stage - 1), of micro-batch i.
  struct Message {
    bool activation;
    int stage;
    int micro_batch;
  };

  Slot& slot(int stage, int i) {
    Chunk& c = chunks_[static_cast<std::size_t>(local_[static_cast<std::size_t>(stage)])];
    return c.slots[static_cast<std::size_t>(c.slot_of[static_cast<std::size_t>(i)])];
  }

  void forward_micro_batch(int k, int i) {
    const int me = comm_.rank(), m = options_.micro_batches, last = table_.stage_count() - 1;
    Chunk& ch = chunks_[static_cast<std::size_t>(local_[static_cast<std::size_t>(k)])];
    Slot& sl = slot(k, i);
    sl.wait_sends();  // the previous user of this slot may still be sending from its buffers
    const Tensor* in = nullptr;
    if (k == 0) {
      const std::int64_t per = x_->dim(0) / m;
      Shape shape = x_->shape();
      shape[0] = per;
      const std::int64_t row = x_->numel() / x_->dim(0);
      if constexpr (kTokenInput) {
        sl.ids.resize(shape);
        std::copy_n(x_->data() + i * per * row, per * row, sl.ids.data());
      } else {
        sl.input.resize(shape);
        D::copy(sl.input.data(), x_->data() + i * per * row, static_cast<std::size_t>(per * row) * sizeof(S));
        in = &sl.input;
      }
    } else if (table_.rank_of(k - 1) == me) {
      in = slot(k - 1, i).output;  // the stage before, on this rank (V placement)
    } else {
      take(true, k - 1, i, sl.input);
      in = &sl.input;
    }
    const auto began = std::chrono::steady_clock::now();
    const Tensor& out = run_units(in, sl, ch, i);
    sl.output = &out;
    sl.output_shape = out.shape();
    if (k == last) {
      // One label per row of logits: (n, classes) per image, (n, T, V) per token.
      const std::int64_t per = out.rank() >= 1 ? out.numel() / std::max<std::int64_t>(out.dim(out.rank() - 1), 1) : 0;
      TESSERA_CHECK(static_cast<std::int64_t>(labels_.size()) == per * m, ShapeError, "Pipeline: ",
                    labels_.size(), " labels on the last stage for a batch of ", per * m, " predictions (", m,
                    " micro-batches of logits ", out.shape(), ")");
      const auto micro_labels = labels_.subspan(static_cast<std::size_t>(i * per), static_cast<std::size_t>(per));
      auto& loss_cache = loss_caches_[static_cast<std::size_t>(ch.slot_of[static_cast<std::size_t>(i)])];
      loss_sum_ += loss_.forward(out, micro_labels, loss_cache);
      if constexpr (kCountsCorrect) correct_ += count_correct(out, micro_labels);
    }
    note_busy('F', i, k, began);
    if (k < last && table_.rank_of(k + 1) != me) send_activation(sl, out, table_.rank_of(k + 1), i, k + 1);
    stats_.peak_in_flight = std::max(stats_.peak_in_flight, ++in_flight_);
  }

  // B (input_only false) or I of micro-batch i on stage k.
  void backward_micro_batch(int k, int i, bool input_only) {
    const int me = comm_.rank(), m = options_.micro_batches, last = table_.stage_count() - 1;
    Chunk& ch = chunks_[static_cast<std::size_t>(local_[static_cast<std::size_t>(k)])];
    Slot& sl = slot(k, i);
    sl.send_grad.wait();
    if (k == last) {
      // d(mean over the batch)/d(logits) = (1/M) d(mean over the micro-batch)/d(logits).
      const Tensor& g = loss_.backward(loss_caches_[static_cast<std::size_t>(ch.slot_of[static_cast<std::size_t>(i)])]);
      sl.output_grad.resize(g.shape());
      scale_elements(D{}, g.data(), g.numel(), S(1) / static_cast<S>(m), sl.output_grad.data());
    } else if (table_.rank_of(k + 1) != me) {
      take(false, k + 1, i, sl.output_grad);
    }  // else the stage after, on this rank, wrote it into sl.output_grad
    const auto began = std::chrono::steady_clock::now();
    const Tensor& dx = input_only ? backward_input(sl, ch) : model_.backward_units(sl.output_grad, sl.cache, ch.begin, ch.end);
    note_busy(input_only ? 'I' : 'B', i, k, began);
    if (k > 0) {
      const bool local = table_.rank_of(k - 1) == me;
      const Shape& input_shape = local ? slot(k - 1, i).output_shape : sl.input.shape();
      TESSERA_CHECK(dx.shape() == input_shape, ShapeError, "Pipeline: stage ", k, " produced dL/dx ", dx.shape(),
                    " for an input of ", input_shape, " (does its first unit compute input gradients?)");
      if (local) {  // into the slot of the stage before, which holds micro-batch i until its backward
        Tensor& to = slot(k - 1, i).output_grad;
        to.resize(dx.shape());
        D::copy(to.data(), dx.data(), dx.bytes());
      } else {
        const int to = table_.rank_of(k - 1);
        const auto sending = std::chrono::steady_clock::now();
        sl.send_grad = comm_.send_async(std::span<const S>(dx.data(), static_cast<std::size_t>(dx.numel())), to);
        stats_.bytes_sent_backward += dx.numel() * static_cast<std::int64_t>(sizeof(S));
        note_message("send G", i, " to stage ", k - 1, dx.numel() * static_cast<std::int64_t>(sizeof(S)), sending);
      }
    }
    if (!input_only) --in_flight_;
  }
  const Tensor& backward_input(Slot& sl, Chunk& ch) {
    if constexpr (detail::SplitsUnitBackward<Model>) return model_.backward_units_input(sl.output_grad, sl.cache, ch.begin, ch.end);
    else return model_.backward_units(sl.output_grad, sl.cache, ch.begin, ch.end);  // the whole backward now
  }
  // W of micro-batch i on stage k: the weight gradients from what I left in the slot (nothing left
  // for a model whose units do not split their backward); the slot is free after it.
  void weight_micro_batch(int k, int i) {
    const auto began = std::chrono::steady_clock::now();
    if constexpr (detail::SplitsUnitBackward<Model>) {
      Chunk& ch = chunks_[static_cast<std::size_t>(local_[static_cast<std::size_t>(k)])];
      model_.backward_units_weight(slot(k, i).cache, ch.begin, ch.end);
    }
    note_busy('W', i, k, began);
    --in_flight_;
  }

  // The stage's units on its input: stage 0 reads its slice of the batch (token ids for a
  // language model), the others `in`. Micro-batch i (of equal ones) starts at row i x its rows of
  // the whole batch.
  const Tensor& run_units(const Tensor* in, Slot& sl, Chunk& ch, int i) {
    if constexpr (kHoldsDropout) {
      const std::int64_t rows = kTokenInput && ch.stage == 0 ? sl.ids.dim(0) : in->dim(0);
      model_.hold_dropout_key(dropout_key_, i * rows);
    }
    DropoutRelease release{kHoldsDropout ? &model_ : nullptr};
    if constexpr (kTokenInput) {
      if (ch.stage == 0) return model_.forward_units(sl.ids, sl.cache, ch.begin, ch.end);
    }
    return model_.forward_units(*in, sl.cache, ch.begin, ch.end);
  }
  struct DropoutRelease {
    Model* model;
    ~DropoutRelease() {
      if constexpr (kHoldsDropout)
        if (model != nullptr) model->release_dropout_key();
    }
  };

  // Message (activation?, stage, i) into `into`: from the buffer if it came already, else
  // received from its sender, after the messages that sender sent before it (into buffers).
  void take(bool activation, int stage, int i, Tensor& into) {
    const auto key = std::make_tuple(activation, stage, i);
    auto found = arrived_.find(key);
    if (found == arrived_.end()) {
      receive_until(table_.rank_of(stage), key);
      found = arrived_.find(key);
    }
    std::swap(into, found->second);
    spare_.push_back(std::move(found->second));
    arrived_.erase(found);
  }
  void receive_until(int from, const std::tuple<bool, int, int>& wanted) {
    auto& plan = incoming_[static_cast<std::size_t>(from)];
    auto& next = next_incoming_[static_cast<std::size_t>(from)];
    for (;;) {
      TESSERA_CHECK(next < plan.size(), Error, "Pipeline rank ", comm_.rank(), ": waiting for ",
                    std::get<0>(wanted) ? "activations" : "gradients", " of stage ", std::get<1>(wanted),
                    ", micro-batch ", std::get<2>(wanted), ", which rank ", from, "'s schedule never sends");
      const Message msg = plan[next++];
      Tensor buffer;
      if (!spare_.empty()) buffer = std::move(spare_.back()), spare_.pop_back();
      const auto waiting = std::chrono::steady_clock::now();
      if (msg.activation) {
        std::array<std::int64_t, 8> header{};
        comm_.recv(std::span<std::int64_t>(header), from);
        buffer.resize(shape_from_header(header, msg.stage));
      } else {
        buffer.resize(slot(msg.stage - 1, msg.micro_batch).output_shape);  // the gradient of what this rank sent
      }
      comm_.recv(std::span<S>(buffer.data(), static_cast<std::size_t>(buffer.numel())), from);
      note_message(msg.activation ? "recv A" : "recv G", msg.micro_batch, " from stage ", msg.stage, 0, waiting);
      const auto key = std::make_tuple(msg.activation, msg.stage, msg.micro_batch);
      arrived_[key] = std::move(buffer);
      if (key == wanted) return;
    }
  }

  // Tied parameters (detail::tied_parameters) whose two units sit on this stage and another: the
  // parameter and the peer stage.
  struct Tie {
    Parameter<S, D>* parameter;
    int peer;
    std::string name;
  };
  void find_ties() {
    auto rank_of_unit = [&](std::size_t unit) {
      return table_.rank_of(static_cast<int>(std::upper_bound(bounds_.begin(), bounds_.end(), unit) - bounds_.begin()) - 1);
    };
    for (const auto& t : detail::tied_parameters(model_)) {
      // Both units on one rank (ZB-V's first and last stage share rank 0) share one copy: nothing to exchange.
      const int a = rank_of_unit(t.first_unit), b = rank_of_unit(t.second_unit), me = comm_.rank();
      if (a != b && (me == a || me == b)) ties_.push_back({t.parameter, me == a ? b : a, t.name});
    }
    for (const Tie& t : ties_) {
      tie_buffers_.emplace_back(t.parameter->grad.shape());
      tie_hold_.add(*t.parameter);
    }
  }
  // Both stages of a tie send their gradient and add the other's: g = g_mine + g_peer, the same
  // bits on both (addition commutes), as one process's single copy gets both parts.
  void exchange_tied_gradients() {
    for (std::size_t k = 0; k < ties_.size(); ++k) {
      const auto started = std::chrono::steady_clock::now();
      Tensor& g = ties_[k].parameter->grad;
      Tensor& other = tie_buffers_[k];
      const auto n = static_cast<std::size_t>(g.numel());
      Work sent = comm_.send_async(std::span<const S>(g.data(), n), ties_[k].peer);
      comm_.recv(std::span<S>(other.data(), n), ties_[k].peer);
      sent.wait();
      add(D{}, g.data(), other.data(), g.numel(), g.data());
      stats_.bytes_sent_tied += g.numel() * static_cast<std::int64_t>(sizeof(S));
      if (options_.timeline) {
        char kib[48];
        std::snprintf(kib, sizeof kib, " with stage %d, %.1f KiB", ties_[k].peer, static_cast<double>(g.bytes()) / 1024.0);
        options_.timeline->add("sum tied " + ties_[k].name + kib, "p2p", started, std::chrono::steady_clock::now(),
                               SpanSink::kCommunication);
      }
    }
  }
  // Activations to the rank of the next stage: their shape (rank, dims) first, then the values.
  // i: the micro-batch and `stage` the receiving one, for the timeline; predict() sends with
  // i = -1 (not recorded).
  void send_activation(Slot& sl, const Tensor& out, int next, int i = -1, int stage = -1) {
    TESSERA_CHECK(out.rank() <= 7, ShapeError, "Pipeline: activations of rank ", out.rank(), " (at most 7)");
    sl.header.fill(0);
    sl.header[0] = out.rank();
    for (std::int64_t d = 0; d < out.rank(); ++d) sl.header[static_cast<std::size_t>(d + 1)] = out.dim(d);
    const auto sending = std::chrono::steady_clock::now();
    sl.send_activation_header = comm_.send_async(std::span<const std::int64_t>(sl.header), next);
    sl.send_activation = comm_.send_async(std::span<const S>(out.data(), static_cast<std::size_t>(out.numel())), next);
    if (i >= 0)
      stats_.bytes_sent_forward += static_cast<std::int64_t>(sizeof sl.header) + out.numel() * static_cast<std::int64_t>(sizeof(S));
    if (i >= 0) note_message("send A", i, " to stage ", stage, out.numel() * static_cast<std::int64_t>(sizeof(S)), sending);
  }

  Shape shape_from_header(const std::array<std::int64_t, 8>& h, int from) const {
    TESSERA_CHECK(h[0] >= 1 && h[0] <= 7, CommError, "Pipeline stage ", comm_.rank(), ": activation header from stage ",
                  from, " has rank ", h[0], " (stages disagree about the model or the schedule)");
    Shape shape;
    for (std::int64_t d = 0; d < h[0]; ++d) {
      TESSERA_CHECK(h[static_cast<std::size_t>(d + 1)] >= 0, CommError, "Pipeline stage ", comm_.rank(),
                    ": activation header from stage ", from, " has a negative dimension");
      shape.push_back(h[static_cast<std::size_t>(d + 1)]);
    }
    return shape;
  }

  // kind 'F', 'B', 'I' or 'W' of micro-batch i on stage k ("F3", or "F3 (stage 5)" when a rank runs several);
  // the span's name is built only when a timeline records it.
  void note_busy(char kind, int i, int k, std::chrono::steady_clock::time_point began) {
    const auto ended = std::chrono::steady_clock::now();
    stats_.busy_seconds += std::chrono::duration<double>(ended - began).count();
    if (options_.timeline)
      options_.timeline->add(kind + std::to_string(i) + (mine_.size() > 1 ? " (stage " + std::to_string(k) + ")" : ""),
                             "compute", began, ended, SpanSink::kCompute);
  }
  // A point-to-point message of micro-batch i on the communication lane, from `began` to now:
  // "recv A3 from stage 0", "send G3 to stage 1, 12.5 KiB" (bytes > 0 for sends).
  void note_message(const char* what, int i, const char* direction, int peer, std::int64_t bytes,
                    std::chrono::steady_clock::time_point began) {
    if (!options_.timeline) return;
    std::string name = what + std::to_string(i) + direction + std::to_string(peer);
    if (bytes > 0) {
      char kib[32];
      std::snprintf(kib, sizeof kib, ", %.1f KiB", static_cast<double>(bytes) / 1024.0);
      name += kib;
    }
    options_.timeline->add(std::move(name), "p2p", began, std::chrono::steady_clock::now(), SpanSink::kCommunication);
  }
  void note_communication(const char* name, std::chrono::steady_clock::time_point began) {
    if (options_.timeline)
      options_.timeline->add(name, "p2p", began, std::chrono::steady_clock::now(), SpanSink::kCommunication);
  }
  static double seconds_since(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  }

  // What every stage must hold alike. The whole model, not only this stage: every rank builds it.
  // table_error: why this rank's table was refused ("" when it was not), so that ranks with
  // different settings fail together on the difference rather than one alone.
  AgreementRecord agreement_record(const std::string& table_error) {
    AgreementRecord record("Pipeline");
    record.add("strategy", "Pipeline");
    record.add("options.micro_batches", options_.micro_batches);
    record.add("options.schedule", table_error.empty() ? table_.name : "refused: " + table_error);
    record.add("schedule.table", table_error.empty() ? to_csv(table_) : std::string("(none)"));
    record.add_list("options.boundaries", options_.boundaries);
    record.add_list("options.unit_costs", options_.unit_costs);
    const std::size_t units = model_.unit_count();
    record.add("model.units", units);
    for (std::size_t u = 0; u < units; ++u) record.add("model.unit[" + std::to_string(u) + "]", model_.unit_name(u));
    record.add_named_tensors(named_tensors(model_), "model.");
    return record;
  }

  // Parameters held by each unit (every rank holds the whole model).
  std::vector<double> unit_parameters() {
    std::vector<double> counts(model_.unit_count(), 0.0);
    for (std::size_t u = 0; u < counts.size(); ++u) {
      struct Count {
        double n = 0;
        void parameter(const std::string&, Parameter<S, D>& p) { n += static_cast<double>(p.value.numel()); }
        void buffer(const std::string&, tessera::Tensor<S, D>&) {}
      } count;
      model_.visit_units(count, "", u, u + 1);
      counts[u] = count.n;
    }
    return counts;
  }
  std::vector<bool> trainable_units() {
    std::vector<bool> trainable;
    for (const double n : unit_parameters()) trainable.push_back(n > 0);
    return trainable;
  }

  // Per-unit costs for balancing (see the header comment), identical on every rank.
  std::vector<double> costs(const Input* sample) {
    const std::size_t units = model_.unit_count();
    if (!options_.unit_costs.empty()) {
      TESSERA_CHECK(options_.unit_costs.size() == units, ArgumentError, "Pipeline: ", options_.unit_costs.size(),
                    " unit costs for a model of ", units, " units");
      return options_.unit_costs;
    }
    // Only rank 0 needs a sample (other stages may have no input data): it tells the others
    // whether it measured.
    std::array<std::int32_t, 1> measured{sample != nullptr ? 1 : 0};
    comm_.broadcast(std::span<std::int32_t>(measured), 0);
    std::vector<double> c(units, 1.0);
    if (measured[0] && comm_.rank() == 0) {
      // Measuring runs the model once in its current mode: keep its buffers (BatchNorm running
      // statistics) as they were, so that rank 0 does not start different from the others.
      auto named = named_tensors(model_);
      std::vector<Tensor> saved;  // device copies (Tensor's copy is a device-to-device copy)
      for (auto& [name, t] : named.buffers) saved.push_back(*t);
      // The fastest of three passes per unit: the first pass also allocates and touches memory.
      typename Model::Cache cache{};
      // A fixed dropout key: measuring must not draw from the generator, or rank 0's draws would
      // run ahead of the other stages'.
      if constexpr (kHoldsDropout) model_.hold_dropout_key(0, 0);
      DropoutRelease release{kHoldsDropout ? &model_ : nullptr};
      std::vector<const Tensor*> inputs(units + 1);  // inputs[u]: unit u's, for u >= 1
      std::vector<double> best(units, std::numeric_limits<double>::infinity());
      for (int pass = 0; pass < 3; ++pass) {
        std::vector<double> t_unit(units, 0.0);
        for (std::size_t u = 0; u < units; ++u) {
          const auto t = std::chrono::steady_clock::now();
          inputs[u + 1] = u == 0 ? &model_.forward_units(*sample, cache, 0, 1) : &model_.forward_units(*inputs[u], cache, u, u + 1);
          t_unit[u] = seconds_since(t);
        }
        Tensor dy(inputs[units]->shape());
        dy.fill(S(1) / static_cast<S>(dy.numel()));
        const Tensor* g = &dy;
        for (std::size_t u = units; u-- > 0;) {
          const auto t = std::chrono::steady_clock::now();
          g = &model_.backward_units(*g, cache, u, u + 1);
          t_unit[u] += seconds_since(t);
        }
        for (std::size_t u = 0; u < units; ++u) best[u] = std::min(best[u], t_unit[u]);
      }
      c = best;
      // That backward accumulated into the gradients: leave them zero, and the buffers as before.
      for (auto& [name, p] : named.parameters) p->grad.zero();
      for (std::size_t k = 0; k < saved.size(); ++k) *named.buffers[k].second = saved[k];
    } else if (!measured[0]) {
      if constexpr (requires { { model_.unit_costs() } -> std::convertible_to<std::vector<double>>; }) {
        c = model_.unit_costs();  // the model's own estimate (GPT: FLOPs per token)
        TESSERA_CHECK(c.size() == units, ArgumentError, "Pipeline: the model's unit_costs() gives ", c.size(),
                      " costs for ", units, " units");
      } else {
        c = unit_parameters();
        for (double& n : c) n += 1.0;
      }
    }
    if (measured[0]) comm_.broadcast(std::span<double>(c), 0);
    return c;
  }

  void check_boundaries(std::size_t units) const {
    const auto p = static_cast<std::size_t>(table_.stage_count());
    TESSERA_CHECK(bounds_.size() == p + 1 && bounds_.front() == 0 && bounds_.back() == units, ArgumentError,
                  "Pipeline: boundaries must be ", p + 1, " unit indices from 0 to ", units, " (", p,
                  " stages: ", comm_.size(), " ranks x ", table_.stages_per_rank, " per rank)");
    for (std::size_t k = 0; k < p; ++k)
      TESSERA_CHECK(bounds_[k] < bounds_[k + 1], ArgumentError, "Pipeline: stage ", k, " would be empty (boundaries ",
                    bounds_[k], " and ", bounds_[k + 1], ")");
  }

  Model& model_;
  Comm& comm_;
  PipelineOptions options_;
  PipelineScheduleTable table_;  // compute actions only
  std::vector<std::size_t> bounds_;  // S + 1
  std::vector<int> mine_;            // the stages this rank runs, in model order
  std::vector<int> local_;           // [stage]: its index in mine_ / chunks_, or -1
  Stage stage_;
  std::vector<Chunk> chunks_;
  std::vector<int> first_forward_, first_backward_, last_backward_;  // [micro-batch]: positions in this rank's row
  bool hold_all_ = false;
  GradReadyHold<S, D> all_hold_;  // every parameter of the rank, when hold_all_
  std::vector<std::vector<Message>> incoming_;  // [rank]: what it sends this one, in its order
  std::vector<std::size_t> next_incoming_;
  std::map<std::tuple<bool, int, int>, Tensor> arrived_;  // received before they are needed
  std::vector<Tensor> spare_;                             // buffers to receive into, reused
  Loss loss_;
  std::vector<typename Loss::Cache> loss_caches_;
  PipelineStepStats stats_;
  std::vector<Tie> ties_;
  std::vector<Tensor> tie_buffers_;
  GradReadyHold<S, D> tie_hold_;  // the ties' grad_ready, held from the last backward to their sum
  int in_flight_ = 0;
  S loss_sum_ = 0;
  std::int64_t correct_ = 0;  // the step's correct predictions (last stage)
  const Input* x_ = nullptr;
  std::span<const std::int64_t> labels_;
  std::uint64_t dropout_key_ = 0;  // this step's dropout draw (kHoldsDropout)
  Tensor empty_;
};

// The sample (images or token ids, or nullptr) does not change the type.
template <class Model, class C, class... Sample>
Pipeline(Model&, C&, PipelineOptions, Sample...) -> Pipeline<Model>;

}  // namespace tessera
