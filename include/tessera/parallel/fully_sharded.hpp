// FullyShardedDataParallel: data parallelism with the gradients and the optimizer state sharded
// across ranks (ZeRO stage 2), and the parameters too (stage 3, "fully sharded": PyTorch FSDP's
// FULL_SHARD, DeepSpeed ZeRO-3; Rajbhandari et al. 2020). Every rank trains on its own part of each
// global batch, as under DataParallel, and the N ranks step like one process on the whole batch.
//
//   FullyShardedDataParallel fsdp(model, comm, {.stage = 3});   // broadcasts rank 0's parameters
//   AdamW<E> adamw(fsdp.shard_parameters(), {...});             // any element-wise optimizer
//   FullyShardedOptimizer optimizer(fsdp, adamw);               // checks the settings agree
//   Trainer trainer(model, optimizer, fsdp, schedule, options); // or: optimizer.zero_grad();
//                                                               //  fsdp.train_step(x, labels);
//                                                               //  optimizer.step();
//
// Shard units. The model is cut into shard units: runs of its units (Sequential's layers, ResNet's
// blocks, an MLP's Linears: the Stageable models of parallel/pipeline.hpp), one model unit each by
// default, or the runs options.unit_boundaries gives. The parameters of shard unit u, flattened in
// the order of the model's parameter list, are F_u elements, padded to N s_u with
// s_u = ceil(F_u / N); rank r owns elements [r s_u, (r + 1) s_u) and keeps them, with their
// gradients and optimizer state, as one Parameter per (model parameter ∩ its range), under the
// model parameter's name and kind (shard_parameters(), as Zero1's), so weight-decay masks work.
//
// One micro-batch (the strategy runs the model: kRunsModel, as a pipeline does):
//   forward, u = 0 .. U-1:  all_gather u's shards into the model's tensors (u + 1's gather started
//                           before u computes: the prefetch), forward u; stage 3 then releases u's
//                           parameters (the last unit's stay: backward needs them at once)
//   loss, dL/dlogits / M    (M micro-batches: the mean over the batch)
//   backward, u = U-1 .. 0: stage 3 gathers u again (u - 1's gather prefetched), allocates u's
//                           gradients (zeros), backward u, releases u's parameters (stage 3) and,
//                           once packed, its gradients; reduce_scatter(Avg) of the packed gradients
//                           runs in the background while u - 1 computes, and its result, this
//                           rank's s_u averaged elements, is added to the shard's gradients
//   optimizer step:         on the shard only; stage 2 gathers the updated values at the next
//                           forward (all units, prefetched one ahead), stage 3 at each unit's use
// Communication per step: an all_gather per unit (stage 3: two, forward and backward) and a
// reduce_scatter per unit: 2 Ψ elements for stage 2 (as DataParallel's all-reduce), 3 Ψ for stage 3.
//
// Memory per rank, Ψ parameter elements of b bytes, N ranks, K tensors of optimizer state per
// parameter (Adam: 2):                 parameters     gradients     optimizer state
//   DataParallel                        Ψ b            Ψ b           K Ψ b
//   stage 2                             Ψ b + Ψ b / N  Ψ b / N       K Ψ b / N
//   stage 3                             Ψ b / N        Ψ b / N       K Ψ b / N
// plus, while a unit is in use, its gathered parameters and gradients and the flat buffers of the
// collectives in flight (a few units' worth: peak_unit_elements()). The shard's own values are the
// master copy (the Ψ b / N of both stages); stage 2's model tensors are a gathered replica of them.
//
// Outside a step the model's parameters are not current under stage 3 (they are released; empty
// tensors) and, under stage 2, not until the next forward after an optimizer step. gather_full()
// gathers every unit into the model (collective), e.g. to read or save it; release_full() gives the
// memory back (stage 3).
//
// Agreement: the constructor checks (one all_gather of two int64) that every rank holds the same
// stage, unit boundaries, micro-batch count and parameter names and shapes, before any collective
// whose size depends on them. FullyShardedOptimizer (below), the one way to step the shard,
// compares the learning rate across ranks at the first and then every
// options.consistency_check_every steps: each rank updates its own shard, so one rank stepping
// with other settings would train on silently with a model no process computes.
//
// Mixed precision (options.param_dtype, reduce_dtype; ShardDType below): units gathered and
// gradients reduce-scattered in bfloat16 or float16, half the bytes on the wire, the master shard
// and the optimizer's state in the Env's scalar.
//
// Checkpoints: FullyShardedOptimizer writes sharded ones (each rank its shard, no gather;
// train/sharded_checkpoint.hpp) and one-file ones (save_checkpoint: whole tensors, loadable by one
// process); both load at another world size. The Trainer writes the kind options.sharded_checkpoints
// says.
//
// Language models (GPT): unit 0 reads token ids (n, T), the loss takes n T labels (one per row of
// logits (n, T, V)). A parameter two units read (GPT's wte, also its lm_head: tied_parameters())
// forms a shard unit of its own, gathered before the first unit's forward and kept until after
// the first unit's backward (both uses add into its one gradient), then reduce-scattered: FSDP's
// rule that a shared parameter lives in the unit that encloses both users (here: the whole step).
// A model with position-keyed dropout masks (GPT) draws one key per step and holds it with each
// micro-batch's first row at rank x rows + micro-batch x its rows: every unit masks as one forward
// does, micro-batches do not change the masks, and ranks draw distinct masks for their rows.
//
// Not yet: LARS/LAMB (whole-tensor norms).
// A dead rank takes its shard (parameters, gradients, optimizer state) with it: the run resumes
// from a checkpoint. ReplicatedFullyShardedOptimizer (parallel/fully_sharded_replicated.hpp) keeps
// each shard on two ranks so that ElasticTrainer goes on without one; set_batch_weight() lets the
// ranks' shares of a global batch differ (the elastic loader's uneven splits).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tessera/comm/communicator.hpp"
#include "tessera/core/allocator.hpp"
#include "tessera/core/env.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/half.hpp"
#include "tessera/core/parameter.hpp"
#include "tessera/core/span_sink.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/device/cpu.hpp"
#include "tessera/kernels/elementwise.hpp"
#include "tessera/losses/cross_entropy.hpp"
#include "tessera/optim/lamb.hpp"
#include "tessera/optim/lars.hpp"
#include "tessera/parallel/agreement.hpp"
#include "tessera/parallel/pipeline.hpp"
#include "tessera/parallel/strategy.hpp"

namespace tessera {

// What a shard unit's parameters are gathered in, and its gradients reduce-scattered in: the Env's
// scalar, or a 16-bit float (PyTorch FSDP's MixedPrecision param_dtype and reduce_dtype). The
// shard's master values, its gradients and the optimizer's state stay in the Env's scalar; the model
// then computes with 16-bit-rounded weights (in its own arithmetic), and each rank's gradients are
// rounded to 16 bits once before the average, which is reduced in float and rounded once more.
// The casts run on the device that holds the shard (cast_to_wire and its pair, kernels/elementwise).
enum class ShardDType { Same, BFloat16, Float16 };

inline const char* to_string(ShardDType t) {
  return t == ShardDType::Same ? "same" : t == ShardDType::BFloat16 ? "bfloat16" : "float16";
}

struct FullyShardedOptions {
  int stage = 3;  // 2: gradients and optimizer state sharded; 3: parameters too
  // Shard units as model-unit indices 0 = b_0 < b_1 < ... < b_K = unit_count(); empty: one shard
  // unit per model unit.
  std::vector<std::size_t> unit_boundaries;
  int micro_batches = 1;  // gradient accumulation: the batch splits into this many equal parts
  bool prefetch = true;   // start the next unit's gather before computing the current one
  ShardDType param_dtype = ShardDType::Same;   // parameters all-gathered in this type
  ShardDType reduce_dtype = ShardDType::Same;  // gradients reduce-scattered in this type
  // The optimizer's learning rate compared across ranks at the first and then every this many
  // steps; 0: never.
  int consistency_check_every = 100;
  SpanSink* timeline = nullptr;  // optional: each gather and reduce_scatter on the communication lane
  // The Trainer's checkpoints (TrainOptions::checkpoint_path): a directory with one shard file per
  // rank, no gather (train/sharded_checkpoint.hpp), or false: one file of whole tensors, what
  // save_checkpoint writes for one process (every rank gathers the whole model and optimizer state
  // for it). Both load at another world size, and a sharded one converts to one file
  // (consolidate_sharded_checkpoint).
  bool sharded_checkpoints = true;
};

// What the last step moved and held, on this rank.
struct FullyShardedStepStats {
  std::int64_t gathered_elements = 0;        // received by all_gathers (N s_u per unit gathered)
  std::int64_t reduce_scattered_elements = 0;  // sent into reduce_scatters (N s_u per unit)
  std::int64_t gathered_bytes = 0, reduce_scattered_bytes = 0;  // the same in bytes of the wire type
  int gathers = 0, reduce_scatters = 0;
};

// final, as Zero1: UpdateGuard's destructor is protected and not virtual, so nothing may derive
// from a strategy that is destroyed as itself (clang warns about it through std::optional).
template <Stageable Model, class Loss = CrossEntropyLoss<typename Model::Env>>
class FullyShardedDataParallel final : public StrategyBase<typename Model::Env>, UpdateGuard {
 public:
  using Env = typename Model::Env;
  using S = typename Env::Scalar;
  using D = typename Env::Device;
  using Comm = typename Env::Comm;
  using Tensor = typename Model::Tensor;
  static_assert(AsyncCommunicator<Comm>, "FullyShardedDataParallel needs all_gather_async and reduce_scatter_async");
  // What unit 0 reads: images (n, ...) for a Layer, token ids (n, T) for a language model.
  static constexpr bool kTokenInput = detail::TakesTokenIds<Model>;
  using Input = std::conditional_t<kTokenInput, tessera::Tensor<std::int64_t, Cpu>, Tensor>;
  static constexpr bool kHoldsDropout = detail::HoldsDropoutKey<Model>;
  // The strategy protocol (parallel/strategy.hpp): it runs the model (unit by unit, gathering and
  // releasing around each) and its micro-batch loop.
  static constexpr bool kOwnsMicroBatchLoop = true;
  static constexpr bool kRunsModel = true;

  template <class C>
  FullyShardedDataParallel(Model& model, C& comm, FullyShardedOptions options = {}, Loss loss = Loss())
      : model_(model), comm_(comm_of_env<Env>(comm)), options_(std::move(options)), loss_(std::move(loss)),
        named_(named_tensors(model)) {
    check_agreement(comm_, agreement_record());
    TESSERA_CHECK(options_.stage == 2 || options_.stage == 3, ArgumentError, "FullyShardedDataParallel: stage=",
                  options_.stage, " must be 2 (gradients and optimizer state sharded) or 3 (parameters too)");
    TESSERA_CHECK(options_.micro_batches >= 1, ArgumentError, "FullyShardedDataParallel: micro_batches=",
                  options_.micro_batches, " must be at least 1");
    TESSERA_CHECK(options_.consistency_check_every >= 0, ArgumentError,
                  "FullyShardedDataParallel: consistency_check_every=", options_.consistency_check_every,
                  " must be >= 0 (0: no check)");
    TESSERA_CHECK(!named_.parameters.empty(), ArgumentError, "FullyShardedDataParallel: the model has no parameters");
    for (auto& [name, p] : named_.parameters) comm_.broadcast(std::span<S>(p->value.data(), p->value.numel()), 0);
    for (auto& [name, t] : named_.buffers) comm_.broadcast(std::span<S>(t->data(), t->numel()), 0);
    // The model's gradients first, then (stage 3) each unit's values once its pieces are copied:
    // the construction's peak stays the model's own.
    for (auto& [name, p] : named_.parameters) p->grad.release();
    build_units();
    resident_.assign(units_.size(), options_.stage == 2);
  }
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;
  ~FullyShardedDataParallel() {
    for (auto& u : units_) {  // never leave a collective writing into freed memory
      try {
        u.gather_work.wait();
        u.reduce_work.wait();
      } catch (...) {
      }
    }
    for (auto& piece : pieces_)
      if (piece.param.update_guard == this) piece.param.update_guard = nullptr;
  }

  // This rank's shard, as parameters for an optimizer (valid as long as this object lives).
  const NamedTensors<Env>& shard_parameters() const { return shard_named_; }
  // Elements of the shard (the sum of s_u over the units), and of the whole model (Ψ).
  std::int64_t shard_elements() const {
    std::int64_t n = 0;
    for (const auto& u : units_) n += u.shard;
    return n;
  }
  std::int64_t model_elements() const {
    std::int64_t n = 0;
    for (const auto& u : units_) n += u.elements;
    return n;
  }
  // The largest unit's padded elements (N s_u): what one gathered unit and its buffers take.
  std::int64_t peak_unit_elements() const {
    std::int64_t n = 0;
    for (const auto& u : units_) n = std::max(n, u.shard * comm_.size());
    return n;
  }
  std::size_t unit_count() const { return units_.size(); }
  // Model units [begin, end) of shard unit k.
  std::pair<std::size_t, std::size_t> unit_range(std::size_t k) const { return {units_[k].begin, units_[k].end}; }
  int stage() const { return options_.stage; }
  const FullyShardedStepStats& last_step() const { return stats_; }

  std::string name() const {
    return "FullyShardedDataParallel(stage " + std::to_string(options_.stage) + ", " + std::to_string(units_.size()) +
           " units)";
  }
  // Each rank trains on its own samples.
  int sample_copies() const { return 1; }
  void set_timeline(SpanSink* timeline) { options_.timeline = timeline; }

  // One training step as the Trainer calls it (parallel/strategy.hpp): the micro-batches of this
  // rank's batch x with hooks (the whole stack's) around each; the shard's gradients receive the
  // average over ranks of the batch's mean-loss gradient (added: the Trainer zeroes them before).
  // Returns this rank's mean loss and correct predictions.
  template <class Hooks>
  ModelStepResult run_model(const Input& x, std::span<const std::int64_t> labels, Hooks& hooks) {
    return step(x, labels, hooks);
  }
  // The same without a Trainer: then call the optimizer's step() (and zero_grad() before this).
  ModelStepResult train_step(const Input& x, std::span<const std::int64_t> labels) {
    return step(x, labels, static_cast<StrategyBase<Env>&>(*this));
  }
  // Forward only (the model in Eval or Inference mode): this batch's mean loss and correct
  // predictions.
  ModelStepResult evaluate_batch(const Input& x, std::span<const std::int64_t> labels) {
    const Tensor& logits = predict(x);
    ModelStepResult r;
    r.loss = static_cast<double>(loss_.forward(logits, labels, eval_loss_cache_));
    if constexpr (kCountsCorrect) r.correct = count_correct(logits, labels);
    return r;
  }
  // Forward only: the logits (valid until the next forward).
  const Tensor& predict(const Input& x) {
    finish_reductions();
    // A fixed key: a forward in Train mode must not draw once per unit.
    if constexpr (kHoldsDropout) model_.hold_dropout_key(0, 0);
    DropoutRelease release{kHoldsDropout ? &model_ : nullptr};
    return forward_pass(x, eval_cache_, /*keep_last=*/false);
  }

  // Every unit's parameters into the model's tensors (collective), current until the next
  // optimizer step; release_full() gives stage 3's memory back.
  void gather_full() {
    finish_reductions();
    for (std::size_t k = 0; k < units_.size(); ++k)
      if (!resident_[k]) finish_gather(k);  // starts the gather first
  }
  void release_full() {
    if (options_.stage == 3)
      for (std::size_t k = 0; k < units_.size(); ++k) release_parameters(k);
  }

  void before_optimizer_step() { finish_reductions(); }

  // This rank's share of an unevenly split global batch (Batch::weight = W n_r / g, data/loader.hpp):
  // the next steps scale the loss gradient by it, as the Trainer does for a model it runs itself.
  void set_batch_weight(double weight) {
    TESSERA_CHECK(weight > 0 && std::isfinite(weight), ArgumentError, "FullyShardedDataParallel: batch weight ",
                  weight, " must be positive and finite");
    batch_weight_ = weight;
  }

  // After the shard's values were replaced (a checkpoint loaded into the pieces): every unit is
  // gathered again before its next use.
  void shards_loaded() {
    finish_reductions();
    std::fill(resident_.begin(), resident_.end(), false);
  }

 private:
  template <class, class>
  friend class FullyShardedOptimizer;
  template <class, class>
  friend class ReplicatedFullyShardedOptimizer;  // parallel/fully_sharded_replicated.hpp: reads the units

  // The update guard of the shard's parameters: only FullyShardedOptimizer::step() may update
  // them (it checks the settings first); the shard's gradients must then be complete (the last
  // reduce_scatters waited for), and the model's gathered values are stale after it.
  void before_update() override {
    TESSERA_CHECK(in_step_, Error, "FullyShardedDataParallel on rank ", comm_.rank(),
                  ": optimizer.step() called directly on the shard; step through FullyShardedOptimizer(fsdp, "
                  "optimizer), which checks that every rank steps with the same settings");
    finish_reductions();
    std::fill(resident_.begin(), resident_.end(), false);
  }

  static constexpr bool kCountsCorrect = std::is_same_v<Loss, CrossEntropyLoss<Env>>;
  using Clock = SpanSink::Clock;

  // A unit's buffers on a 16-bit wire: send and gathered (N s_u) values, packed gradients (N s_u)
  // and their averaged shard (s_u). Tensors of the shard's device and its caching allocator
  // (released once used, so a step after the first takes them from its cache and its counters
  // see them).
  template <class W>
  struct Wire16 {
    tessera::Tensor<W, D> send, gathered, grad, shard;
  };

  // The part of one model parameter that this rank owns, as a parameter of its own.
  struct Piece {
    std::size_t param_index;    // into named_.parameters
    std::int64_t param_offset;  // first element within it
    std::int64_t shard_offset;  // first element within the unit's shard
    std::int64_t length;
    Parameter<S, D> param;
  };
  struct Unit {
    bool tied = false;                   // the tied parameters' unit (runs no model units)
    std::size_t begin = 0, end = 0;      // model units
    std::vector<std::size_t> params;     // into named_.parameters, in order
    std::vector<std::int64_t> offset;    // flat offset of each
    std::vector<Shape> shapes;           // each parameter's shape (stage 3 releases the tensors)
    std::int64_t elements = 0, shard = 0;  // F_u, s_u
    std::vector<std::size_t> pieces;     // into pieces_
    Tensor send, gathered;               // s_u values out, N s_u in (while gathering)
    Tensor grad_flat, grad_shard;        // N s_u packed gradients, s_u averaged (while reducing)
    Work gather_work, reduce_work;
    Wire16<BHalf> bf16;  // the same buffers on a 16-bit wire (param_dtype, reduce_dtype)
    Wire16<Half> fp16;
    bool gathering = false, reducing = false;
    Clock::time_point gather_began, reduce_began;
  };

  AgreementRecord agreement_record() {
    AgreementRecord record("FullyShardedDataParallel");
    record.add("strategy", "FullyShardedDataParallel");
    record.add("device", D::name);
    record.add("options.stage", options_.stage);
    record.add_list("options.unit_boundaries", options_.unit_boundaries);
    record.add("options.micro_batches", options_.micro_batches);
    record.add("options.prefetch", options_.prefetch);
    record.add("options.param_dtype", to_string(options_.param_dtype));
    record.add("options.reduce_dtype", to_string(options_.reduce_dtype));
    record.add("options.consistency_check_every", options_.consistency_check_every);
    record.add("options.sharded_checkpoints", options_.sharded_checkpoints);
    const std::size_t units = model_.unit_count();
    record.add("model.units", units);
    for (std::size_t u = 0; u < units; ++u) record.add("model.unit[" + std::to_string(u) + "]", model_.unit_name(u));
    record.add_named_tensors(named_, "model.");
    for (const auto& t : detail::tied_parameters(model_))
      record.add("model.tied." + t.name, std::to_string(t.first_unit) + " " + std::to_string(t.second_unit));
    return record;
  }

  void build_units() {
    const std::size_t model_units = model_.unit_count();
    std::vector<std::size_t> bounds = options_.unit_boundaries;
    if (bounds.empty())
      for (std::size_t u = 0; u <= model_units; ++u) bounds.push_back(u);
    TESSERA_CHECK(bounds.size() >= 2 && bounds.front() == 0 && bounds.back() == model_units, ArgumentError,
                  "FullyShardedDataParallel: unit_boundaries must run from 0 to the model's ", model_units, " units");
    for (std::size_t k = 0; k + 1 < bounds.size(); ++k)
      TESSERA_CHECK(bounds[k] < bounds[k + 1], ArgumentError, "FullyShardedDataParallel: shard unit ", k,
                    " would be empty (boundaries ", bounds[k], " and ", bounds[k + 1], ")");
    for (const auto& [name, p] : named_.parameters) param_shapes_.push_back(p->value.shape());
    // Which model parameter each model unit holds: visit_units names them, in the order of the
    // model's whole list.
    // A tied parameter (read by two units) belongs to the tied unit, after the others.
    std::vector<std::size_t> owner(named_.parameters.size(), model_units);
    std::vector<bool> tied(named_.parameters.size(), false);
    for (const auto& t : detail::tied_parameters(model_))
      for (std::size_t i = 0; i < named_.parameters.size(); ++i) tied[i] = tied[i] || named_.parameters[i].second == t.parameter;
    for (std::size_t u = 0; u < model_units; ++u) {
      NamedTensors<Env> in_unit;
      model_.visit_units(in_unit, "", u, u + 1);
      for (const auto& entry : in_unit.parameters) {
        const auto it = std::find_if(named_.parameters.begin(), named_.parameters.end(),
                                     [&](const auto& e) { return e.second == entry.second; });
        TESSERA_CHECK(it != named_.parameters.end(), ArgumentError, "FullyShardedDataParallel: unit ", u,
                      " holds a parameter '", entry.first, "' that the model's visit does not list");
        owner[static_cast<std::size_t>(it - named_.parameters.begin())] = u;
      }
    }
    const bool has_tied = std::find(tied.begin(), tied.end(), true) != tied.end();
    if (has_tied) bounds.push_back(model_units);  // the tied unit: [model_units, model_units)
    const std::int64_t ranks = comm_.size(), rank = comm_.rank();
    for (std::size_t k = 0; k + 1 < bounds.size(); ++k) {
      Unit& unit = units_.emplace_back();
      unit.tied = has_tied && k + 2 == bounds.size();
      unit.begin = unit.tied ? 0 : bounds[k];
      unit.end = unit.tied ? 0 : bounds[k + 1];
      for (std::size_t i = 0; i < named_.parameters.size(); ++i) {
        if (unit.tied ? !tied[i] : (tied[i] || owner[i] < unit.begin || owner[i] >= unit.end)) continue;
        const Parameter<S, D>& p = *named_.parameters[i].second;
        unit.params.push_back(i);
        unit.offset.push_back(unit.elements);
        unit.shapes.push_back(p.value.shape());
        unit.elements += p.value.numel();
      }
      unit.shard = (unit.elements + ranks - 1) / ranks;
      // This rank's range [first, last) of the unit's flat parameters, cut at parameter edges.
      const std::int64_t first = unit.shard * rank, last = first + unit.shard;
      for (std::size_t j = 0; j < unit.params.size(); ++j) {
        const Parameter<S, D>& p = *named_.parameters[unit.params[j]].second;
        const std::int64_t begin = std::max(unit.offset[j], first), end = std::min(unit.offset[j] + p.value.numel(), last);
        if (begin >= end) continue;
        Piece piece{unit.params[j], begin - unit.offset[j], begin - first, end - begin, Parameter<S, D>(Shape{end - begin}, p.kind)};
        D::copy(piece.param.value.data(), p.value.data() + piece.param_offset, static_cast<std::size_t>(piece.length) * sizeof(S));
        unit.pieces.push_back(pieces_.size());
        pieces_.push_back(std::move(piece));
      }
      if (options_.stage == 3)
        for (std::size_t i : unit.params) named_.parameters[i].second->value.release();
    }
    run_units_ = units_.size() - (has_tied ? 1 : 0);
    tied_unit_ = has_tied ? run_units_ : units_.size();
    for (std::size_t i = 0; i < owner.size(); ++i)
      TESSERA_CHECK(owner[i] < model_units || tied[i], ArgumentError, "FullyShardedDataParallel: parameter '",
                    named_.parameters[i].first, "' belongs to no unit of the model (visit_units never names it)");
    // Names only once the vector stops growing (NamedTensors keeps pointers).
    for (auto& piece : pieces_) {
      shard_named_.parameter(named_.parameters[piece.param_index].first, piece.param);
      piece.param.update_guard = this;
    }
    if (pieces_.empty()) {  // more ranks than elements: an empty piece keeps optimizers happy
      empty_piece_ = Parameter<S, D>(Shape{0});
      shard_named_.parameter(named_.parameters[0].first + ".empty_shard", empty_piece_);
    }
  }

  template <class Hooks>
  ModelStepResult step(const Input& x, std::span<const std::int64_t> labels, Hooks& hooks) {
    const int m = options_.micro_batches;
    TESSERA_CHECK(x.rank() >= (kTokenInput ? 2 : 1) && x.dim(0) > 0 && x.dim(0) % m == 0, ShapeError,
                  "FullyShardedDataParallel: the batch of ", x.rank() >= 1 ? x.dim(0) : 0, " samples (input ", x.shape(),
                  ") does not split into ", m, " equal micro-batches");
    // One label per row of logits: per sample (n, classes), per token (n, T, V).
    const std::int64_t labels_per_sample = kTokenInput ? x.dim(1) : 1;
    TESSERA_CHECK(static_cast<std::int64_t>(labels.size()) == x.dim(0) * labels_per_sample, ShapeError,
                  "FullyShardedDataParallel: ", labels.size(), " labels for a batch of ", x.dim(0), " samples",
                  kTokenInput ? " of " + std::to_string(labels_per_sample) + " tokens" : std::string());
    finish_reductions();
    stats_ = {};
    const std::int64_t per = x.dim(0) / m, row = x.numel() / x.dim(0);
    Shape shape = x.shape();
    shape[0] = per;
    double loss_sum = 0;
    std::int64_t correct = 0;
    if constexpr (kHoldsDropout) dropout_key_ = model_.next_dropout_key();  // this step's
    for (int i = 0; i < m; ++i) {
      const MicroBatch mb{i, m, 1.0 / m};
      hooks.before_forward(mb);
      const Input* input = &x;
      if (m > 1) {
        Input& part = micro_input();
        part.resize(shape);
        if constexpr (kTokenInput) std::copy_n(x.data() + i * per * row, per * row, part.data());
        else D::copy(part.data(), x.data() + i * per * row, static_cast<std::size_t>(per * row) * sizeof(S));
        input = &part;
      }
      // Rows [rank x n + i x per, ...) of the N ranks' batch: masks as one process's, distinct per rank.
      if constexpr (kHoldsDropout) model_.hold_dropout_key(dropout_key_, comm_.rank() * x.dim(0) + i * per);
      DropoutRelease release{kHoldsDropout ? &model_ : nullptr};
      const Tensor& logits = [&]() -> const Tensor& {
        const MemoryScope memory("the forward pass (activations)");
        return forward_pass(*input, cache_, /*keep_last=*/true);
      }();
      const auto micro_labels = labels.subspan(static_cast<std::size_t>(i * per * labels_per_sample),
                                               static_cast<std::size_t>(per * labels_per_sample));
      loss_sum += static_cast<double>(loss_.forward(logits, micro_labels, loss_cache_));
      if constexpr (kCountsCorrect) correct += count_correct(logits, micro_labels);
      // d(mean over the batch)/d(logits) = (1/M) d(mean over the micro-batch)/d(logits), times this
      // rank's share of the global batch (1 when the batch splits evenly).
      const Tensor& g = loss_.backward(loss_cache_);
      output_grad_.resize(g.shape());
      scale_elements(D{}, g.data(), g.numel(), static_cast<S>(batch_weight_ / m), output_grad_.data());
      hooks.before_backward(mb);
      {
        const MemoryScope memory("the backward pass (gradients)");
        backward_pass(output_grad_);
      }
      hooks.after_backward(mb);
    }
    return {loss_sum / m, correct};
  }

  // Forward through every unit, each gathered first: the next unit holding parameters has its
  // gather started before this one computes (parameter-free units, a ReLU or a pooling, in between
  // do not use up the prefetch). keep_last: the last unit's parameters stay for the backward that
  // follows.
  const Tensor& forward_pass(const Input& x, typename Model::Cache& cache, bool keep_last) {
    const std::size_t n = run_units_;
    if (tied_unit_ < units_.size() && !resident_[tied_unit_]) finish_gather(tied_unit_);  // kept over the step
    const Tensor* h = nullptr;
    for (std::size_t k = 0; k < n; ++k) {
      const std::size_t next = next_with_parameters(k);
      if (options_.prefetch && next < n && !resident_[next]) start_gather(next);
      if (!resident_[k]) finish_gather(k);
      const auto began = Clock::now();
      if constexpr (kTokenInput) {
        h = k == 0 ? &model_.forward_units(x, cache, units_[k].begin, units_[k].end)
                   : &model_.forward_units(*h, cache, units_[k].begin, units_[k].end);
      } else {
        h = &model_.forward_units(k == 0 ? x : *h, cache, units_[k].begin, units_[k].end);
      }
      note_compute("forward ", k, began);
      if (options_.stage == 3 && !(keep_last && k + 1 == n)) release_parameters(k);
    }
    if (options_.stage == 3 && !keep_last && tied_unit_ < units_.size()) release_parameters(tied_unit_);
    return *h;
  }

  // Backward through every unit, last first: gather (stage 3; the previous unit with parameters
  // prefetched), gradients allocated, backward, gradients packed and reduce-scattered in the
  // background.
  void backward_pass(const Tensor& output_grad) {
    const std::size_t n = run_units_;
    if (tied_unit_ < units_.size()) {  // gradients for both uses of the tied parameters, zeroed once
      if (!resident_[tied_unit_]) finish_gather(tied_unit_);
      allocate_gradients(units_[tied_unit_]);
    }
    const Tensor* g = &output_grad;
    for (std::size_t k = n; k-- > 0;) {
      const std::size_t previous = previous_with_parameters(k);
      if (options_.prefetch && previous < n && !resident_[previous]) start_gather(previous);
      if (!resident_[k]) finish_gather(k);
      Unit& unit = units_[k];
      allocate_gradients(unit);
      const auto began = Clock::now();
      g = &model_.backward_units(*g, cache_, unit.begin, unit.end);
      note_compute("backward ", k, began);
      if (options_.stage == 3) release_parameters(k);
      start_reduction(k);
    }
    if (tied_unit_ < units_.size()) {
      if (options_.stage == 3) release_parameters(tied_unit_);
      start_reduction(tied_unit_);
    }
  }
  void allocate_gradients(Unit& unit) {
    const MemoryScope memory("a shard unit's gradients (FullyShardedDataParallel)");
    for (std::size_t j = 0; j < unit.params.size(); ++j) {
      Parameter<S, D>& p = *named_.parameters[unit.params[j]].second;
      p.grad.resize(unit.shapes[j]);
      p.grad.zero();
    }
  }

  // The first unit after k, or before k, that holds parameters (units_.size() when none).
  std::size_t next_with_parameters(std::size_t k) const {
    for (std::size_t j = k + 1; j < run_units_; ++j)
      if (units_[j].elements > 0) return j;
    return units_.size();
  }
  std::size_t previous_with_parameters(std::size_t k) const {
    for (std::size_t j = k; j-- > 0;)
      if (units_[j].elements > 0) return j;
    return units_.size();
  }

  // all_gather of unit k's shards into its flat buffer, in the background.
  void start_gather(std::size_t k) {
    Unit& unit = units_[k];
    if (unit.gathering || unit.elements == 0) return;
    const std::int64_t ranks = comm_.size();
    const MemoryScope memory("a shard unit's all_gather (FullyShardedDataParallel)");
    unit.gather_began = Clock::now();
    if (options_.param_dtype == ShardDType::BFloat16) {
      start_gather_16<BHalf>(unit);
    } else if (options_.param_dtype == ShardDType::Float16) {
      start_gather_16<Half>(unit);
    } else {
      unit.send.resize({unit.shard});
      unit.send.zero();  // the last rank's padding
      for (std::size_t j : unit.pieces) {
        const Piece& piece = pieces_[j];
        D::copy(unit.send.data() + piece.shard_offset, piece.param.value.data(), static_cast<std::size_t>(piece.length) * sizeof(S));
      }
      unit.gathered.resize({unit.shard * ranks});
      unit.gather_work = comm_.all_gather_async(std::span<const S>(unit.send.data(), static_cast<std::size_t>(unit.shard)),
                                                std::span<S>(unit.gathered.data(), static_cast<std::size_t>(unit.shard * ranks)));
    }
    unit.gathering = true;
    stats_.gathered_elements += unit.shard * ranks;
    stats_.gathered_bytes += unit.shard * ranks * wire_bytes(options_.param_dtype);
    ++stats_.gathers;
  }
  // Waits for unit k's gather and copies it into the model's parameters (allocated if released).
  void finish_gather(std::size_t k) {
    Unit& unit = units_[k];
    if (unit.elements == 0) {
      resident_[k] = true;
      return;
    }
    if (!unit.gathering) start_gather(k);
    unit.gather_work.wait();
    unit.gathering = false;
    note_communication("all_gather ", k, unit.gather_began);
    const MemoryScope memory("a shard unit's gathered parameters (FullyShardedDataParallel)");
    if (options_.param_dtype == ShardDType::BFloat16) {
      finish_gather_16<BHalf>(unit);
    } else if (options_.param_dtype == ShardDType::Float16) {
      finish_gather_16<Half>(unit);
    } else {
      for (std::size_t j = 0; j < unit.params.size(); ++j) {
        Parameter<S, D>& p = *named_.parameters[unit.params[j]].second;
        p.value.resize(unit.shapes[j]);
        D::copy(p.value.data(), unit.gathered.data() + unit.offset[j], p.value.bytes());
      }
      unit.send.release();
      unit.gathered.release();
    }
    resident_[k] = true;
  }
  void release_parameters(std::size_t k) {
    for (std::size_t i : units_[k].params) named_.parameters[i].second->value.release();
    resident_[k] = units_[k].elements == 0;
  }

  // Unit k's gradients packed (then released) and reduce-scattered in the background; the previous
  // reduction of this unit, if any, is finished first.
  void start_reduction(std::size_t k) {
    Unit& unit = units_[k];
    if (unit.elements == 0) return;
    finish_reduction(k);
    const std::int64_t ranks = comm_.size();
    const MemoryScope memory("a shard unit's reduce_scatter (FullyShardedDataParallel)");
    unit.reduce_began = Clock::now();
    if (options_.reduce_dtype == ShardDType::BFloat16) {
      start_reduction_16<BHalf>(unit);
    } else if (options_.reduce_dtype == ShardDType::Float16) {
      start_reduction_16<Half>(unit);
    } else {
      unit.grad_flat.resize({unit.shard * ranks});
      for (std::size_t j = 0; j < unit.params.size(); ++j) {
        Parameter<S, D>& p = *named_.parameters[unit.params[j]].second;
        D::copy(unit.grad_flat.data() + unit.offset[j], p.grad.data(), p.grad.bytes());
        p.grad.release();
      }
      fill_elements(D{}, unit.grad_flat.data() + unit.elements, unit.shard * ranks - unit.elements, S(0));  // padding
      unit.grad_shard.resize({unit.shard});
      unit.reduce_work = comm_.reduce_scatter_async(
          std::span<const S>(unit.grad_flat.data(), static_cast<std::size_t>(unit.shard * ranks)),
          std::span<S>(unit.grad_shard.data(), static_cast<std::size_t>(unit.shard)), ReduceOp::Avg);
    }
    unit.reducing = true;
    stats_.reduce_scattered_elements += unit.shard * ranks;
    stats_.reduce_scattered_bytes += unit.shard * ranks * wire_bytes(options_.reduce_dtype);
    ++stats_.reduce_scatters;
    // The reduction started before this one ran while this unit computed: done by now, most
    // likely. Finishing it here keeps two units' gradient buffers alive, not every unit's.
    if (reducing_ < units_.size() && reducing_ != k) finish_reduction(reducing_);
    reducing_ = k;
  }
  // Waits for unit k's reduction and adds the averaged gradients to the shard's.
  void finish_reduction(std::size_t k) {
    Unit& unit = units_[k];
    if (!unit.reducing) return;
    unit.reduce_work.wait();
    unit.reducing = false;
    note_communication("reduce_scatter ", k, unit.reduce_began);
    if (options_.reduce_dtype == ShardDType::BFloat16) {
      finish_reduction_16<BHalf>(unit);
    } else if (options_.reduce_dtype == ShardDType::Float16) {
      finish_reduction_16<Half>(unit);
    } else {
      for (std::size_t j : unit.pieces) {
        Piece& piece = pieces_[j];
        add(D{}, piece.param.grad.data(), unit.grad_shard.data() + piece.shard_offset, piece.length, piece.param.grad.data());
      }
      unit.grad_flat.release();
      unit.grad_shard.release();
    }
  }

  // The 16-bit wire (param_dtype, reduce_dtype other than Same): values and gradients cast on the
  // way out and back, on the shard's device.
  std::int64_t wire_bytes(ShardDType t) const {
    return t == ShardDType::Same ? static_cast<std::int64_t>(sizeof(S)) : std::int64_t{2};
  }
  template <class W>
  Wire16<W>& wire16(Unit& unit) {
    if constexpr (std::is_same_v<W, BHalf>) return unit.bf16;
    else return unit.fp16;
  }
  template <class W>
  void start_gather_16(Unit& unit) {
    Wire16<W>& w = wire16<W>(unit);
    w.send.resize({unit.shard});
    w.send.zero();  // the last rank's padding
    for (std::size_t j : unit.pieces) {
      const Piece& piece = pieces_[j];
      cast_to_wire(D{}, piece.param.value.data(), piece.length, w.send.data() + piece.shard_offset);
    }
    w.gathered.resize({unit.shard * comm_.size()});
    unit.gather_work = comm_.all_gather_async(std::span<const W>(w.send.data(), static_cast<std::size_t>(unit.shard)),
                                              std::span<W>(w.gathered.data(), static_cast<std::size_t>(unit.shard * comm_.size())));
  }
  template <class W>
  void finish_gather_16(Unit& unit) {
    Wire16<W>& w = wire16<W>(unit);
    for (std::size_t j = 0; j < unit.params.size(); ++j) {
      Parameter<S, D>& p = *named_.parameters[unit.params[j]].second;
      p.value.resize(unit.shapes[j]);
      cast_from_wire(D{}, w.gathered.data() + unit.offset[j], p.value.numel(), p.value.data());
    }
    w.send.release();
    w.gathered.release();
  }
  template <class W>
  void start_reduction_16(Unit& unit) {
    Wire16<W>& w = wire16<W>(unit);
    const std::int64_t packed = unit.shard * comm_.size();
    w.grad.resize({packed});
    fill_elements(D{}, w.grad.data() + unit.elements, packed - unit.elements, W(0.0f));  // zeros in the padding
    for (std::size_t j = 0; j < unit.params.size(); ++j) {
      Parameter<S, D>& p = *named_.parameters[unit.params[j]].second;
      cast_to_wire(D{}, p.grad.data(), p.grad.numel(), w.grad.data() + unit.offset[j]);
      p.grad.release();
    }
    w.shard.resize({unit.shard});
    unit.reduce_work = comm_.reduce_scatter_async(std::span<const W>(w.grad.data(), static_cast<std::size_t>(packed)),
                                                  std::span<W>(w.shard.data(), static_cast<std::size_t>(unit.shard)), ReduceOp::Avg);
  }
  template <class W>
  void finish_reduction_16(Unit& unit) {
    Wire16<W>& w = wire16<W>(unit);
    for (std::size_t j : unit.pieces) {
      Piece& piece = pieces_[j];
      add_from_wire(D{}, w.shard.data() + piece.shard_offset, piece.length, piece.param.grad.data());
    }
    w.grad.release();
    w.shard.release();
  }
  void finish_reductions() {
    for (std::size_t k = units_.size(); k-- > 0;) finish_reduction(k);
  }

  // Every rank must update its shard with the same settings: each rank updates its own part, so
  // one rank stepping with another learning rate trains on silently with a model no process
  // computes. Compared at the first and then every options.consistency_check_every steps.
  void check_consistency(double lr) {
    const int every = options_.consistency_check_every;
    if (every <= 0 || updates_ % every != 0) return;
    AgreementRecord record("FullyShardedDataParallel");
    record.add("optimizer.lr", lr);
    check_agreement(comm_, record,
                    "at optimizer step " + std::to_string(updates_ + 1) +
                        ": every rank must step its shard with the same optimizer settings (learning rate, "
                        "schedule); settings given per rank cause this. FullyShardedOptions::consistency_check_every "
                        "sets how often this is checked (0: never)");
  }

 private:
  std::string unit_label(std::size_t k) const {
    const Unit& u = units_[k];
    if (u.tied) return "tied parameters";
    return u.end - u.begin == 1 ? model_.unit_name(u.begin)
                                : model_.unit_name(u.begin) + ".." + model_.unit_name(u.end - 1);
  }
  // Spans on the timeline, their names built only when one records (a step allocates nothing else).
  void note_compute(const char* what, std::size_t k, Clock::time_point began) {
    if (options_.timeline)
      options_.timeline->add(what + unit_label(k), "compute", began, Clock::now(), SpanSink::kCompute);
  }
  void note_communication(const char* what, std::size_t k, Clock::time_point began) {
    if (!options_.timeline) return;
    const std::int64_t bytes = units_[k].shard * comm_.size() * static_cast<std::int64_t>(sizeof(S));
    options_.timeline->add(what + unit_label(k) + " (" + std::to_string(bytes / 1024) + " KiB)", "communication", began,
                           Clock::now(), SpanSink::kCommunication);
  }

  Model& model_;
  Comm& comm_;
  FullyShardedOptions options_;
  Loss loss_;
  NamedTensors<Env> named_;
  std::vector<Unit> units_;
  std::vector<Piece> pieces_;
  Parameter<S, D> empty_piece_;
  NamedTensors<Env> shard_named_;
  std::vector<Shape> param_shapes_;  // of named_.parameters (stage 3 releases the tensors)
  std::vector<bool> resident_;  // unit k's parameters are in the model and current
  std::size_t reducing_ = static_cast<std::size_t>(-1);  // the unit whose reduction started last
  bool in_step_ = false;        // inside FullyShardedOptimizer::step()
  std::int64_t updates_ = 0;
  double batch_weight_ = 1.0;   // set_batch_weight's
  typename Model::Cache cache_{}, eval_cache_{};
  typename Loss::Cache loss_cache_{}, eval_loss_cache_{};
  Tensor micro_input_, output_grad_;
  tessera::Tensor<std::int64_t, Cpu> micro_ids_;  // a micro-batch's token ids (kTokenInput)
  Input& micro_input() {
    if constexpr (kTokenInput) return micro_ids_;
    else return micro_input_;
  }
  std::size_t run_units_ = 0;   // the units that run model units (all but the tied unit)
  std::size_t tied_unit_ = 0;   // the tied parameters' unit (units_.size() when none)
  std::uint64_t dropout_key_ = 0;  // this step's (kHoldsDropout)
  struct DropoutRelease {
    Model* model;
    ~DropoutRelease() {
      if constexpr (kHoldsDropout)
        if (model != nullptr) model->release_dropout_key();
    }
  };
  FullyShardedStepStats stats_;
};

template <class Model, class C>
FullyShardedDataParallel(Model&, C&, FullyShardedOptions = {}) -> FullyShardedDataParallel<Model>;

// A FullyShardedDataParallel and the optimizer of its shard as one optimizer (the Optimizer
// concept), for the Trainer:
//
//   FullyShardedDataParallel fsdp(model, comm, {.stage = 3});
//   AdamW<E> adamw(fsdp.shard_parameters(), {...});
//   FullyShardedOptimizer optimizer(fsdp, adamw);
//   Trainer trainer(model, optimizer, fsdp, schedule, options);
//
// step() compares the learning rate across ranks (at the first and every consistency_check_every
// steps), then steps the shard. Refers to both (they must outlive it).
template <class Strategy, class Optimizer>
class FullyShardedOptimizer {
 public:
  using Env = typename Strategy::Env;
  static_assert(!std::is_same_v<Optimizer, Lars<typename Optimizer::Env>> &&
                    !std::is_same_v<Optimizer, Lamb<typename Optimizer::Env>>,
                "FullyShardedOptimizer: LARS and LAMB need whole-tensor norms; a shard only has part of a tensor");

  FullyShardedOptimizer(Strategy& fsdp, Optimizer& optimizer) : fsdp_(fsdp), optimizer_(optimizer) {}

  void step() {
    fsdp_.check_consistency(static_cast<double>(optimizer_.lr()));
    ++fsdp_.updates_;
    fsdp_.in_step_ = true;
    try {
      optimizer_.step();
    } catch (...) {
      fsdp_.in_step_ = false;
      throw;
    }
    fsdp_.in_step_ = false;
  }
  void zero_grad() { optimizer_.zero_grad(); }
  double lr() const { return optimizer_.lr(); }
  void set_lr(double lr) { optimizer_.set_lr(lr); }
  std::int64_t steps() const { return optimizer_.steps(); }
  Optimizer& optimizer() { return optimizer_; }

  // Checkpoints. Sharded (train/sharded_checkpoint.hpp): each rank its pieces, of the model's
  // parameters and of each kind of the optimizer's state, under the whole tensors' names.
  bool sharded_checkpoints() const { return fsdp_.options_.sharded_checkpoints; }
  template <class V>
  void visit_shards(V& v) {
    auto& f = fsdp_;
    for (auto& piece : f.pieces_)
      v.piece(f.named_.parameters[piece.param_index].first, f.param_shapes_[piece.param_index], piece.param_offset,
              piece.param.value);
    for (auto& [kind, tensors] : state_pieces())
      for (std::size_t j = 0; j < tensors.size(); ++j)
        if (tensors[j]) {
          const auto& piece = f.pieces_[j];
          v.piece("optim." + kind + "." + f.named_.parameters[piece.param_index].first,
                  f.param_shapes_[piece.param_index], piece.param_offset, *tensors[j]);
        }
    IntegersOf<V> integers{v};
    optimizer_.visit_state(integers);
  }
  void shards_loaded() { fsdp_.shards_loaded(); }

  // One file of whole tensors (save_checkpoint / load_checkpoint with the optional members of
  // train/checkpoint.hpp): the model gathered into its tensors, the state as whole tensors under the
  // names a one-process optimizer gives them ("optim.exp_avg.fc.weight"), so that one process, or
  // any world size, loads the file. The whole tensors exist during a save or load only.
  template <class V>
  void visit_state(V& v) {
    const auto pieces = state_pieces();
    auto& f = fsdp_;
    const std::size_t params = f.named_.parameters.size();
    if (whole_.size() != pieces.size() * params) {
      whole_.clear();
      for (std::size_t k = 0; k < pieces.size(); ++k)
        for (const Shape& shape : f.param_shapes_) whole_.emplace_back(shape).zero();
    }
    for (std::size_t k = 0; k < pieces.size(); ++k)
      for (std::size_t i = 0; i < params; ++i)
        v.buffer("optim." + pieces[k].first + "." + f.named_.parameters[i].first, whole_[k * params + i]);
    IntegersOf<V> integers{v};
    optimizer_.visit_state(integers);
  }
  // Before a save, collective: the model's values gathered, and each kind of state, unit by unit.
  void checkpoint_gather() {
    auto& f = fsdp_;
    f.gather_full();
    const auto pieces = state_pieces();
    const std::int64_t ranks = f.comm_.size();
    whole_.clear();
    for (const auto& [kind, tensors] : pieces) {
      const std::size_t first = whole_.size();
      for (const Shape& shape : f.param_shapes_) whole_.emplace_back(shape);
      for (auto& unit : f.units_) {
        if (unit.elements == 0) continue;
        typename Strategy::Tensor send({unit.shard}), all({unit.shard * ranks});
        send.zero();
        for (std::size_t j : unit.pieces)
          if (tensors[j])
            D::copy(send.data() + f.pieces_[j].shard_offset, tensors[j]->data(),
                    static_cast<std::size_t>(f.pieces_[j].length) * sizeof(S));
        f.comm_.all_gather(std::span<const S>(send.data(), static_cast<std::size_t>(unit.shard)),
                           std::span<S>(all.data(), static_cast<std::size_t>(unit.shard * ranks)));
        for (std::size_t j = 0; j < unit.params.size(); ++j) {
          auto& t = whole_[first + unit.params[j]];
          D::copy(t.data(), all.data() + unit.offset[j], t.bytes());
        }
      }
    }
  }
  // Before a load reads the file, collective: the model's tensors back (stage 3), to be loaded into.
  void checkpoint_before_load() { fsdp_.gather_full(); }
  // After a load: this rank's pieces of what the model's tensors and the whole state now hold.
  void checkpoint_scatter() {
    auto& f = fsdp_;
    const auto pieces = state_pieces();
    const std::size_t params = f.named_.parameters.size();
    for (auto& piece : f.pieces_)
      D::copy(piece.param.value.data(), f.named_.parameters[piece.param_index].second->value.data() + piece.param_offset,
              static_cast<std::size_t>(piece.length) * sizeof(S));
    for (std::size_t k = 0; k < pieces.size(); ++k)
      for (std::size_t j = 0; j < f.pieces_.size(); ++j)
        if (pieces[k].second[j])
          D::copy(pieces[k].second[j]->data(), whole_[k * params + f.pieces_[j].param_index].data() + f.pieces_[j].param_offset,
                  static_cast<std::size_t>(f.pieces_[j].length) * sizeof(S));
  }
  void checkpoint_release() {
    whole_.clear();
    fsdp_.release_full();
  }

 private:
  using S = typename Strategy::S;
  using D = typename Strategy::D;

  template <class V>
  using IntegersOf = detail::StateIntegersOf<V>;
  // The kinds of the optimizer's state ("exp_avg", "exp_avg_sq"), each with its tensor per piece.
  std::vector<std::pair<std::string, std::vector<tessera::Tensor<S, D>*>>> state_pieces() {
    auto& f = fsdp_;
    std::map<std::string, std::size_t> piece_of;
    for (std::size_t j = 0; j < f.pieces_.size(); ++j) piece_of[f.named_.parameters[f.pieces_[j].param_index].first] = j;
    return detail::state_by_kind<S, D>(optimizer_, piece_of, f.pieces_.size(), "FullyShardedOptimizer");
  }

  Strategy& fsdp_;
  Optimizer& optimizer_;
  std::vector<tessera::Tensor<S, D>> whole_;  // [kind][model parameter], during a save or load only
};

}  // namespace tessera
