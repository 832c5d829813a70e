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
// Schedules (P stages, M micro-batches; F_i / B_i = forward / backward of micro-batch i):
//   GPipe:  F_0 .. F_{M-1}, then B_0 .. B_{M-1}. Every stage holds all M micro-batches'
//           activations at the peak.
//   1F1B:   PipeDream-flush. Stage s first runs w = min(P-1-s, M) forwards, then alternates one
//           forward and one backward, then drains the last w backwards. At most w + 1 <= P - s
//           micro-batches of activations are held at any time, whatever M is.
// Both leave every stage idle for the same (P-1)/(M+P-1) of the step (the bubble) when all stages
// cost the same; 1F1B's gain is memory.
//
// Messages: activations go s -> s+1 with a shape header (8 int64) first; gradients s+1 -> s
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
#include <span>
#include <string>
#include <type_traits>
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
// The parameters two units read (GPT's wte, also its lm_head): optional, none when absent.
template <class M>
auto tied_parameters(M& m) {
  using P = TiedParameter<typename M::Env::Scalar, typename M::Env::Device>;
  if constexpr (requires { { m.tied_parameters() } -> std::convertible_to<std::vector<P>>; }) return std::vector<P>(m.tied_parameters());
  else return std::vector<P>{};
}
}  // namespace detail

enum class PipelineSchedule { GPipe, OneFOneB };

inline const char* schedule_name(PipelineSchedule s) { return s == PipelineSchedule::GPipe ? "GPipe" : "1F1B"; }

struct PipelineOptions {
  int micro_batches = 4;
  PipelineSchedule schedule = PipelineSchedule::OneFOneB;
  std::vector<std::size_t> boundaries;  // P + 1 unit indices, 0 = b_0 < b_1 < ... < b_P = units
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

  // The part of the model on this rank, as a model-like object for optimizers, checkpoints and a
  // DataParallel over the stage (hybrid data x pipeline parallelism).
  class Stage {
   public:
    using Env = typename Model::Env;
    Stage(Model& model, std::size_t begin, std::size_t end) : model_(&model), begin_(begin), end_(end) {}
    template <class V>
    void visit(V& v, const std::string& prefix) {
      model_->visit_units(v, prefix, begin_, end_);
    }

   private:
    Model* model_;
    std::size_t begin_, end_;
  };

  // comm: the world, or a group from split, of the model Env's Comm type.
  template <class C>
  Pipeline(Model& model, C& comm, PipelineOptions options, const Input* sample = nullptr, Loss loss = Loss())
      : model_(model), comm_(comm_of_env<Env>(comm)), options_(std::move(options)), stage_(model, 0, 0), loss_(std::move(loss)) {
    check_agreement(comm_, agreement_record());
    TESSERA_CHECK(options_.micro_batches >= 1, ArgumentError, "Pipeline: micro_batches=", options_.micro_batches,
                  " must be at least 1");
    const std::size_t units = model_.unit_count();
    bounds_ = options_.boundaries.empty() ? balanced_boundaries(costs(sample), comm_.size(), trainable_units())
                                          : options_.boundaries;
    check_boundaries(units);
    begin_ = bounds_[static_cast<std::size_t>(comm_.rank())];
    end_ = bounds_[static_cast<std::size_t>(comm_.rank()) + 1];
    stage_ = Stage(model_, begin_, end_);
    const int p = comm_.size(), s = comm_.rank(), m = options_.micro_batches;
    slots_ = options_.schedule == PipelineSchedule::GPipe ? m : std::min(m, p - s);
    slot_.resize(static_cast<std::size_t>(slots_));
    loss_caches_.resize(static_cast<std::size_t>(slots_));
    find_ties();
  }

  Stage& stage() { return stage_; }
  NamedTensors<Env> stage_parameters() { return named_tensors(stage_); }
  int stage_index() const { return comm_.rank(); }
  int stage_count() const { return comm_.size(); }
  // Unit boundaries of every stage: stage s runs [boundaries()[s], boundaries()[s+1]).
  const std::vector<std::size_t>& boundaries() const { return bounds_; }
  const PipelineStepStats& last_step() const { return stats_; }
  // Micro-batch activation sets this stage keeps allocated (M for GPipe, min(M, P - s) for 1F1B).
  int activation_slots() const { return slots_; }
  // Records later steps into `timeline` (nullptr: stop recording); the split stays as it is.
  void set_timeline(SpanSink* timeline) { options_.timeline = timeline; }

  std::string name() const {
    return std::string("Pipeline(") + schedule_name(options_.schedule) + ", " + std::to_string(comm_.size()) +
           " stages, " + std::to_string(options_.micro_batches) + " micro-batches)";
  }
  // Every stage of the pipeline sees each sample of its batch.
  int sample_copies() const { return comm_.size(); }

  // One training step, as the Trainer calls it: train_step with `hooks` (the Trainer's whole
  // strategy stack) called around each micro-batch i of M: hooks.before_forward before F_i,
  // hooks.before_backward before B_i and hooks.after_backward after it, in the schedule's order,
  // with MicroBatch{i, M, 1/M}. B_{M-1} is every stage's last backward under both schedules, so a
  // DataParallel over the replicas of this stage (hybrid data x pipeline) all-reduces there,
  // overlapping it with that backward. Returns the batch's mean loss and correct predictions
  // (classification losses), the same on every stage.
  template <class Hooks>
  ModelStepResult run_model(const Input& x, std::span<const std::int64_t> labels, Hooks& hooks) {
    return step(x, labels, hooks);
  }
  // Forward only (the model in Eval or Inference mode): the batch's mean loss and correct
  // predictions, computed on the last stage and the same on every stage.
  ModelStepResult evaluate_batch(const Input& x, std::span<const std::int64_t> labels) {
    const int p = comm_.size(), s = comm_.rank();
    const Tensor& logits = predict(x);
    std::array<double, 2> result{0, 0};
    if (s == p - 1) {
      result[0] = static_cast<double>(loss_.forward(logits, labels, loss_caches_[0]));
      if constexpr (kCountsCorrect) result[1] = static_cast<double>(count_correct(logits, labels));
    }
    comm_.broadcast(std::span<double>(result), p - 1);
    return {result[0], static_cast<std::int64_t>(result[1])};
  }

  // One training step on the global batch x (N, ...) with labels (N): x is read on stage 0 and
  // labels on the last stage only (other ranks may pass empty ones). Accumulates this stage's
  // parameter gradients (the caller zeroes them and steps the optimizer) and returns the mean loss
  // over the batch on every rank.
  // Forward only, the whole batch as one micro-batch (for evaluation; put the model in Eval mode
  // first). Returns the logits on the last stage and an empty tensor on the others.
  const Tensor& predict(const Input& x) {
    const int p = comm_.size(), s = comm_.rank();
    Slot& sl = slot_[0];
    sl.wait_sends();
    if (s > 0) {
      std::array<std::int64_t, 8> header{};
      comm_.recv(std::span<std::int64_t>(header), s - 1);
      sl.input.resize(shape_from_header(header, s - 1));
      comm_.recv(std::span<S>(sl.input.data(), static_cast<std::size_t>(sl.input.numel())), s - 1);
    }
    const Tensor& out = s == 0 ? model_.forward_units(x, sl.cache, begin_, end_)
                               : model_.forward_units(sl.input, sl.cache, begin_, end_);
    if (s == p - 1) return out;
    send_activation(sl, out);
    sl.wait_sends();  // the next predict or step may reuse the buffers
    return empty_;
  }

  S train_step(const Input& x, std::span<const std::int64_t> labels) {
    return static_cast<S>(step(x, labels, static_cast<StrategyBase<Env>&>(*this)).loss);
  }

 private:
  static constexpr bool kCountsCorrect = std::is_same_v<Loss, CrossEntropyLoss<Env>>;

  template <class Hooks>
  ModelStepResult step(const Input& x, std::span<const std::int64_t> labels, Hooks& hooks) {
    const auto started = std::chrono::steady_clock::now();
    stats_ = {};
    in_flight_ = 0;
    loss_sum_ = 0;
    correct_ = 0;
    x_ = &x;
    labels_ = labels;
    const int p = comm_.size(), s = comm_.rank(), m = options_.micro_batches;
    if constexpr (kHoldsDropout) dropout_key_ = model_.next_dropout_key();  // this step's, on every stage
    if (s == 0) {
      TESSERA_CHECK(x.rank() >= 1 && x.dim(0) % m == 0 && x.dim(0) > 0, ShapeError, "Pipeline: the batch of ",
                    x.rank() >= 1 ? x.dim(0) : 0, " samples (input ", x.shape(), ") does not split into ", m,
                    " equal micro-batches");
    }
    auto micro = [m](int i) { return MicroBatch{i, m, 1.0 / m}; };
    auto fwd = [&](int i) {
      hooks.before_forward(micro(i));
      forward_micro_batch(i);
    };
    // A tied parameter's gradient is final only once the other stage's part is added: its
    // grad_ready (a DataParallel over the stage's replicas launches its bucket there) is held back
    // during the last backward and given after the exchange below.
    typename GradReadyHold<S, D>::Scope restore_hooks{tie_hold_};
    auto bwd = [&](int i) {
      hooks.before_backward(micro(i));
      if (i == m - 1) tie_hold_.hold();
      backward_micro_batch(i);
      hooks.after_backward(micro(i));
    };
    if (options_.schedule == PipelineSchedule::GPipe) {
      for (int i = 0; i < m; ++i) fwd(i);
      for (int i = 0; i < m; ++i) bwd(i);
    } else {
      const int warmup = std::min(p - 1 - s, m);
      for (int i = 0; i < warmup; ++i) fwd(i);
      for (int i = 0; i < m - warmup; ++i) {
        fwd(warmup + i);
        bwd(i);
      }
      for (int i = m - warmup; i < m; ++i) bwd(i);
    }
    {
      const auto waiting = std::chrono::steady_clock::now();
      for (auto& sl : slot_) sl.wait_sends();
      note_communication("wait for sends", waiting);
    }
    exchange_tied_gradients();
    tie_hold_.release();
    // The mean loss (and the correct predictions) live on the last stage; every rank returns them.
    std::array<double, 2> result{static_cast<double>(loss_sum_ / static_cast<S>(m)), static_cast<double>(correct_)};
    const auto broadcasting = std::chrono::steady_clock::now();
    comm_.broadcast(std::span<double>(result), p - 1);
    note_communication("broadcast loss", broadcasting);
    const auto ended = std::chrono::steady_clock::now();
    stats_.step_seconds = std::chrono::duration<double>(ended - started).count();
    if (options_.timeline)
      options_.timeline->add("train_step [" + model_.unit_name(begin_) + ".." + model_.unit_name(end_ - 1) + "]",
                             "step", started, ended, SpanSink::kCompute);
    return {result[0], static_cast<std::int64_t>(result[1])};
  }

  // One micro-batch's worth of state on this stage, reused round-robin by micro-batches i, i +
  // slots, ... (the schedule guarantees i's backward is done before i + slots's forward).
  struct Slot {
    typename Model::Cache cache{};
    Tensor input;                        // received activations (or stage 0's slice of images)
    Input ids;                           // stage 0's slice of token ids (a language model)
    Tensor output_grad;                  // received dL/d(output), or the scaled loss gradient
    std::array<std::int64_t, 8> header{};  // shape of the activations sent forward
    Shape output_shape;
    Work send_activation_header, send_activation, send_grad;
    void wait_sends() {
      send_activation_header.wait();
      send_activation.wait();
      send_grad.wait();
    }
  };

  void forward_micro_batch(int i) {
    const int p = comm_.size(), s = comm_.rank(), m = options_.micro_batches;
    Slot& sl = slot_[static_cast<std::size_t>(i % slots_)];
    sl.wait_sends();  // the previous user of this slot may still be sending from its buffers
    if (s == 0) {
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
      }
    } else {
      const auto waiting = std::chrono::steady_clock::now();
      std::array<std::int64_t, 8> header{};
      comm_.recv(std::span<std::int64_t>(header), s - 1);
      sl.input.resize(shape_from_header(header, s - 1));
      comm_.recv(std::span<S>(sl.input.data(), static_cast<std::size_t>(sl.input.numel())), s - 1);
      note_message("recv A", i, " from stage ", s - 1, 0, waiting);
    }
    const auto began = std::chrono::steady_clock::now();
    const Tensor& out = stage_forward(sl, i);
    sl.output_shape = out.shape();
    if (s == p - 1) {
      // One label per row of logits: (n, classes) per image, (n, T, V) per token.
      const std::int64_t per = out.rank() >= 1 ? out.numel() / std::max<std::int64_t>(out.dim(out.rank() - 1), 1) : 0;
      TESSERA_CHECK(static_cast<std::int64_t>(labels_.size()) == per * m, ShapeError, "Pipeline: ",
                    labels_.size(), " labels on the last stage for a batch of ", per * m, " predictions (", m,
                    " micro-batches of logits ", out.shape(), ")");
      const auto micro_labels = labels_.subspan(static_cast<std::size_t>(i * per), static_cast<std::size_t>(per));
      loss_sum_ += loss_.forward(out, micro_labels, loss_caches_[static_cast<std::size_t>(i % slots_)]);
      if constexpr (kCountsCorrect) correct_ += count_correct(out, micro_labels);
    }
    note_busy('F', i, began);
    if (s < p - 1) send_activation(sl, out, i);
    stats_.peak_in_flight = std::max(stats_.peak_in_flight, ++in_flight_);
  }

  void backward_micro_batch(int i) {
    const int p = comm_.size(), s = comm_.rank(), m = options_.micro_batches;
    Slot& sl = slot_[static_cast<std::size_t>(i % slots_)];
    sl.send_grad.wait();
    if (s == p - 1) {
      // d(mean over the batch)/d(logits) = (1/M) d(mean over the micro-batch)/d(logits).
      const Tensor& g = loss_.backward(loss_caches_[static_cast<std::size_t>(i % slots_)]);
      sl.output_grad.resize(g.shape());
      scale_elements(D{}, g.data(), g.numel(), S(1) / static_cast<S>(m), sl.output_grad.data());
    } else {
      const auto waiting = std::chrono::steady_clock::now();
      sl.output_grad.resize(sl.output_shape);
      comm_.recv(std::span<S>(sl.output_grad.data(), static_cast<std::size_t>(sl.output_grad.numel())), s + 1);
      note_message("recv G", i, " from stage ", s + 1, 0, waiting);
    }
    const auto began = std::chrono::steady_clock::now();
    const Tensor& dx = model_.backward_units(sl.output_grad, sl.cache, begin_, end_);
    note_busy('B', i, began);
    if (s > 0) {
      TESSERA_CHECK(dx.shape() == sl.input.shape(), ShapeError, "Pipeline: stage ", s, " produced dL/dx ", dx.shape(),
                    " for an input of ", sl.input.shape(), " (does its first unit compute input gradients?)");
      const auto sending = std::chrono::steady_clock::now();
      sl.send_grad = comm_.send_async(std::span<const S>(dx.data(), static_cast<std::size_t>(dx.numel())), s - 1);
      stats_.bytes_sent_backward += dx.numel() * static_cast<std::int64_t>(sizeof(S));
      note_message("send G", i, " to stage ", s - 1, dx.numel() * static_cast<std::int64_t>(sizeof(S)), sending);
    }
    --in_flight_;
  }

  // This stage's units on slot sl's input: stage 0 reads its slice of the batch (token ids for a
  // language model), the others the activations received.
  // Micro-batch i (of equal ones) starts at row i x its rows of the whole batch.
  const Tensor& stage_forward(Slot& sl, int i) {
    if constexpr (kHoldsDropout) {
      const std::int64_t rows = kTokenInput && comm_.rank() == 0 ? sl.ids.dim(0) : sl.input.dim(0);
      model_.hold_dropout_key(dropout_key_, i * rows);
    }
    DropoutRelease release{kHoldsDropout ? &model_ : nullptr};
    if constexpr (kTokenInput) {
      if (comm_.rank() == 0) return model_.forward_units(sl.ids, sl.cache, begin_, end_);
    }
    return model_.forward_units(sl.input, sl.cache, begin_, end_);
  }
  struct DropoutRelease {
    Model* model;
    ~DropoutRelease() {
      if constexpr (kHoldsDropout)
        if (model != nullptr) model->release_dropout_key();
    }
  };

  // Tied parameters (detail::tied_parameters) whose two units sit on this stage and another: the
  // parameter and the peer stage.
  struct Tie {
    Parameter<S, D>* parameter;
    int peer;
    std::string name;
  };
  void find_ties() {
    auto stage_of = [&](std::size_t unit) {
      return static_cast<int>(std::upper_bound(bounds_.begin(), bounds_.end(), unit) - bounds_.begin()) - 1;
    };
    for (const auto& t : detail::tied_parameters(model_)) {
      const int a = stage_of(t.first_unit), b = stage_of(t.second_unit), me = comm_.rank();
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
  // Activations to the next stage: their shape (rank, dims) first, then the values.
  // i: the micro-batch, for the timeline; predict() sends with i = -1 (not recorded).
  void send_activation(Slot& sl, const Tensor& out, int i = -1) {
    TESSERA_CHECK(out.rank() <= 7, ShapeError, "Pipeline: activations of rank ", out.rank(), " (at most 7)");
    sl.header.fill(0);
    sl.header[0] = out.rank();
    for (std::int64_t d = 0; d < out.rank(); ++d) sl.header[static_cast<std::size_t>(d + 1)] = out.dim(d);
    const int next = comm_.rank() + 1;
    const auto sending = std::chrono::steady_clock::now();
    sl.send_activation_header = comm_.send_async(std::span<const std::int64_t>(sl.header), next);
    sl.send_activation = comm_.send_async(std::span<const S>(out.data(), static_cast<std::size_t>(out.numel())), next);
    if (i >= 0)
      stats_.bytes_sent_forward += static_cast<std::int64_t>(sizeof sl.header) + out.numel() * static_cast<std::int64_t>(sizeof(S));
    if (i >= 0) note_message("send A", i, " to stage ", next, out.numel() * static_cast<std::int64_t>(sizeof(S)), sending);
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

  // kind 'F' or 'B' of micro-batch i; the span's name is built only when a timeline records it.
  void note_busy(char kind, int i, std::chrono::steady_clock::time_point began) {
    const auto ended = std::chrono::steady_clock::now();
    stats_.busy_seconds += std::chrono::duration<double>(ended - began).count();
    if (options_.timeline)
      options_.timeline->add(kind + std::to_string(i), "compute", began, ended, SpanSink::kCompute);
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
  AgreementRecord agreement_record() {
    AgreementRecord record("Pipeline");
    record.add("strategy", "Pipeline");
    record.add("options.micro_batches", options_.micro_batches);
    record.add("options.schedule", schedule_name(options_.schedule));
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
    const auto p = static_cast<std::size_t>(comm_.size());
    TESSERA_CHECK(bounds_.size() == p + 1 && bounds_.front() == 0 && bounds_.back() == units, ArgumentError,
                  "Pipeline: boundaries must be ", p + 1, " unit indices from 0 to ", units, " (one stage per rank)");
    for (std::size_t k = 0; k < p; ++k)
      TESSERA_CHECK(bounds_[k] < bounds_[k + 1], ArgumentError, "Pipeline: stage ", k, " would be empty (boundaries ",
                    bounds_[k], " and ", bounds_[k + 1], ")");
  }

  Model& model_;
  Comm& comm_;
  PipelineOptions options_;
  std::vector<std::size_t> bounds_;
  std::size_t begin_ = 0, end_ = 0;
  Stage stage_;
  int slots_ = 1;
  std::vector<Slot> slot_;
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
