// Zero1: data parallelism with the optimizer state sharded across ranks (ZeRO stage 1,
// Rajbhandari et al. 2020). Every rank still holds all parameters and computes full gradients,
// but each rank keeps optimizer state (momentum, Adam moments) for 1/N of the parameters only:
//
//   per step:  flat gradient (all parameters, padded to a multiple of N)
//              reduce_scatter(Avg)  -> rank r holds the averaged gradient of shard r
//              optimizer step on shard r only (its state is 1/N of the whole)
//              all_gather           -> every rank gets every updated shard
//
// Communication volume equals DataParallel's all-reduce (a reduce-scatter plus an all-gather is
// how a ring all-reduce works anyway); memory for optimizer state drops N-fold.
//
//   Zero1 zero(model, comm);                          // Zero1<E>, E from the model; broadcasts rank 0's parameters
//   Sgd<E> sgd(zero.shard_parameters(), {...});       // any element-wise optimizer: SGD, Adam, AdamW
//   loop: sgd.zero_grad(); zero.zero_grad(); forward; backward; zero.step(sgd);
//
// The shard is presented to the optimizer as one Parameter per (model parameter ∩ shard)
// segment, with the model parameter's name and kind, so weight-decay masks work unchanged.
// Optimizers whose update needs whole-tensor norms (LARS, LAMB) would see partial norms and are
// rejected at compile time by a static_assert in step().
//
// Agreement: the constructor checks (one all_gather of two int64) that every rank holds the same
// parameter names and shapes, so the flat buffers and shards line up (parallel/agreement.hpp).
// Replicas cannot drift apart here (every step ends with every rank copying the same gathered
// values), but a rank can still update its shard with other settings or from other values: at
// the first and then every options.consistency_check_every steps, step() checks that every rank
// has the same optimizer learning rate and the same parameter checksums before the update, and
// throws AgreementError on every rank naming what differs.
//
// Timeline (options.timeline or set_timeline): each step records "reduce_scatter gradients"
// and "all_gather parameters" on the communication lane, with their sizes; the shard's update
// runs between the two (on the compute lane, a Trainer's "optimizer step" holds all three).
//
// Trainer and checkpoints take the pair as one optimizer, Zero1Optimizer:
//
//   Zero1Optimizer opt(zero, sgd);                    // step(): zero.step(sgd); zero_grad(): both
//   Trainer trainer(model, opt, schedule, {..., .checkpoint_group = CheckpointGroup(comm)});
//
// Its checkpoint state is rank-independent: on save the shards of every state tensor are gathered
// (one all_gather per kind of state: momentum_buffer, exp_avg, ...) into whole tensors with the
// model's shapes under the names the optimizer would give them unsharded
// ("optim.momentum_buffer.conv1.weight"), so the file is the one DataParallel with the same
// optimizer writes; on load every rank takes its own part of each whole tensor. A checkpoint of N
// ranks therefore resumes on any M (elastic resume, train/checkpoint.hpp), and from or into a run
// without ZeRO. The whole tensors exist only during a save or load (on every rank: the gather is
// an all_gather).
//
// A dead rank takes its shard of the optimizer state with it: the run must resume from a
// checkpoint. ReplicatedZero1 (parallel/zero_replicated.hpp) keeps each shard on two ranks so
// that ElasticTrainer goes on without one.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tessera/comm/communicator.hpp"
#include "tessera/core/env.hpp"
#include "tessera/core/parameter.hpp"
#include "tessera/core/span_sink.hpp"
#include "tessera/device/cpu.hpp"
#include "tessera/optim/lamb.hpp"
#include "tessera/optim/lars.hpp"
#include "tessera/parallel/agreement.hpp"

namespace tessera {

struct Zero1Options {
  // The learning rate and parameter checksums compared across ranks at the first and then every
  // this many steps; 0: never.
  int consistency_check_every = 100;
  // Optional (a Timeline): each step's reduce_scatter and all_gather as spans on the
  // communication lane; not compared across ranks.
  SpanSink* timeline = nullptr;
};

template <class E>
class Zero1 final : UpdateGuard {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Comm = typename E::Comm;
  static_assert(D::host_accessible, "Zero1 packs its shards on the host; on a GPU use DataParallel with a full optimizer");

  template <class Model, class C>
  Zero1(Model& model, C& comm, Zero1Options options = {})
      : comm_(comm_of_env<E>(comm)), options_(options), model_(parameters_of_env<E>(named_tensors(model))) {
    AgreementRecord record("Zero1");
    record.add("strategy", "Zero1");
    record.add("options.consistency_check_every", options.consistency_check_every);
    record.add_named_tensors(model_);
    check_agreement(comm_, record);
    TESSERA_CHECK(!model_.parameters.empty(), ArgumentError, "Zero1: the model has no parameters");
    TESSERA_CHECK(options.consistency_check_every >= 0, ArgumentError, "Zero1: consistency_check_every=",
                  options.consistency_check_every, " must be >= 0 (0: no check)");
    for (auto& [name, p] : model_.parameters) comm_.broadcast(std::span<S>(p->value.data(), p->value.numel()), 0);
    for (auto& [name, t] : model_.buffers) comm_.broadcast(std::span<S>(t->data(), t->numel()), 0);
    std::int64_t total = 0;
    for (auto& [name, p] : model_.parameters) total += p->value.numel();
    const std::int64_t ranks = comm_.size();
    shard_ = (total + ranks - 1) / ranks;
    flat_.resize({shard_ * ranks});
    flat_.zero();
    shard_buffer_.resize({shard_});
    shard_buffer_.zero();
    build_segments();
  }

  // The owned shard, as parameters for an optimizer (valid as long as this Zero1 lives).
  const NamedTensors<E>& shard_parameters() const { return shard_named_; }
  std::int64_t shard_elements() const { return shard_; }

  // Zeroes the model's gradients (backward accumulates into them).
  void zero_grad() {
    for (auto& [name, p] : model_.parameters) p->grad.zero();
  }

  template <class Optimizer>
  void step(Optimizer& optimizer) {
    static_assert(!std::is_same_v<Optimizer, Lars<typename Optimizer::Env>> &&
                      !std::is_same_v<Optimizer, Lamb<typename Optimizer::Env>>,
                  "Zero1: LARS and LAMB need whole-tensor norms; a shard only has part of a tensor");
    const int every = options_.consistency_check_every;
    if (every > 0 && steps_ % every == 0) check_consistency(optimizer);
    ++steps_;
    // The model is the source of truth for values (a checkpoint may have been loaded into it
    // since the last step): refresh the optimizer's pieces before updating them.
    for (auto& seg : segments_)
      std::copy_n(model_.parameters[seg.model_index].second->value.data() + seg.param_offset, seg.length,
                  seg.param.value.data());
    // Flatten gradients, average-and-scatter: shard r of the average lands on rank r.
    const auto packing = SpanSink::Clock::now();
    pack([](Parameter<S, D>& p) { return p.grad.data(); });
    comm_.reduce_scatter(std::span<const S>(flat_.data(), static_cast<std::size_t>(flat_.numel())), shard_buffer_.span(),
                         ReduceOp::Avg);
    for (auto& seg : segments_) std::copy_n(shard_buffer_.data() + seg.shard_offset, seg.length, seg.param.grad.data());
    record("reduce_scatter gradients", static_cast<std::size_t>(flat_.numel()), packing);
    in_step_ = true;
    try {
      optimizer.step();
    } catch (...) {
      in_step_ = false;
      throw;
    }
    in_step_ = false;
    const auto gathering = SpanSink::Clock::now();  // the update itself is the caller's "optimizer step"
    // Every rank's updated shard to everyone, then back into the model's parameters. The shard's
    // values are packed into the buffer that held its gradients (done with by now), and gathered
    // into the flat buffer: no third copy of the model.
    std::int64_t covered = 0;
    for (auto& seg : segments_) {
      std::copy_n(seg.param.value.data(), seg.length, shard_buffer_.data() + seg.shard_offset);
      covered = std::max(covered, seg.shard_offset + seg.length);
    }
    std::fill(shard_buffer_.data() + covered, shard_buffer_.data() + shard_, S(0));  // the last shard's padding
    comm_.all_gather(std::span<const S>(shard_buffer_.data(), static_cast<std::size_t>(shard_)), flat_.span());
    unpack();
    record("all_gather parameters", static_cast<std::size_t>(flat_.numel()), gathering);
  }

  // Records later steps into `timeline` (nullptr: stop recording).
  void set_timeline(SpanSink* timeline) { options_.timeline = timeline; }

 private:
  template <class, class>
  friend class Zero1Optimizer;

  struct Segment {
    std::size_t model_index;    // which model parameter
    std::int64_t param_offset;  // first element within it
    std::int64_t shard_offset;  // first element within the shard
    std::int64_t length;
    Parameter<S, D> param;  // the optimizer's view: value and grad of this piece
  };

  // A collective from `began` to now, when a timeline records: "<what> (<KiB>)".
  void record(const char* what, std::size_t elements, SpanSink::Clock::time_point began) {
    if (options_.timeline)
      options_.timeline->add(std::string(what) + " (" + std::to_string(elements * sizeof(S) / 1024) + " KiB)",
                             "communication", began, SpanSink::Clock::now(), SpanSink::kCommunication);
  }

  void build_segments() {
    const std::int64_t first = shard_ * comm_.rank(), last = first + shard_;
    std::int64_t offset = 0;
    for (std::size_t i = 0; i < model_.parameters.size(); ++i) {
      Parameter<S, D>& p = *model_.parameters[i].second;
      const std::int64_t begin = std::max(offset, first), end = std::min(offset + p.value.numel(), last);
      if (begin < end) {
        Segment seg{i, begin - offset, begin - first, end - begin, Parameter<S, D>(Shape{end - begin}, p.kind)};
        std::copy_n(p.value.data() + seg.param_offset, seg.length, seg.param.value.data());
        segments_.push_back(std::move(seg));
      }
      offset += p.value.numel();
    }
    // Names only after the vector stops growing (NamedTensors keeps pointers).
    for (auto& seg : segments_) shard_named_.parameter(model_.parameters[seg.model_index].first, seg.param);
    if (segments_.empty()) {  // more ranks than elements: an empty piece keeps optimizers happy
      segments_.push_back(Segment{0, 0, 0, 0, Parameter<S, D>(Shape{0}, ParamKind::Weight)});
      shard_named_.parameter(model_.parameters[0].first + ".empty_shard", segments_.back().param);
    }
    for (auto& seg : segments_) seg.param.update_guard = this;
  }

  // Every rank must update its shard with the same settings from the same values: the
  // optimizer's learning rate (when it has one) and every parameter's checksum, compared as one
  // record (one all_gather of two int64 when they agree).
  template <class Optimizer>
  void check_consistency(const Optimizer& optimizer) {
    AgreementRecord record("Zero1");
    if constexpr (requires { optimizer.lr(); }) record.add("optimizer.lr", static_cast<double>(optimizer.lr()));
    NamedTensors<E> parameters_only;  // buffers (BatchNorm statistics) may differ per rank
    parameters_only.parameters = model_.parameters;
    record.add_checksums(parameters_only);
    check_agreement(comm_, record,
                    "at step " + std::to_string(steps_ + 1) +
                        ": every rank must step with the same optimizer settings (learning rate, schedule) from the "
                        "same parameters; a checkpoint loaded on one rank only, or settings given per rank, cause "
                        "this. Zero1Options::consistency_check_every sets how often this is checked (0: never)");
  }

  // The shard's gradients exist only inside step(optimizer), after the reduce-scatter.
  void before_update() override {
    TESSERA_CHECK(in_step_, Error, "Zero1 on rank ", comm_.rank(),
                  ": optimizer.step() called directly on the shard; call zero.step(optimizer), which "
                  "reduce-scatters the gradients first and all-gathers the updated shards after");
  }

  // The model's tensors (data_of: value or grad) into flat_, in order, zeros in the padding.
  template <class Data>
  void pack(Data data_of) {
    std::int64_t offset = 0;
    for (auto& [name, p] : model_.parameters) {
      std::copy_n(data_of(*p), p->value.numel(), flat_.data() + offset);
      offset += p->value.numel();
    }
    std::fill(flat_.data() + offset, flat_.data() + flat_.numel(), S(0));  // padding
  }

  // flat_ (the gathered values) back into the model's parameters.
  void unpack() {
    std::int64_t offset = 0;
    for (auto& [name, p] : model_.parameters) {
      std::copy_n(flat_.data() + offset, p->value.numel(), p->value.data());
      offset += p->value.numel();
    }
  }

  Comm& comm_;
  Zero1Options options_;
  NamedTensors<E> model_;
  std::int64_t shard_ = 0;
  // Host tensors from the caching allocator, so its counters see them: flat_ holds every
  // parameter (padded to N shards): the gradients to reduce-scatter, then the gathered values;
  // shard_buffer_ the averaged gradients of this rank's shard, then its updated values.
  Tensor<S, D> flat_, shard_buffer_;
  std::vector<Segment> segments_;
  NamedTensors<E> shard_named_;
  bool in_step_ = false;
  std::int64_t steps_ = 0;
};

template <class Model, class C>
Zero1(Model&, C&, Zero1Options = {}) -> Zero1<typename Model::Env>;

// A Zero1 and the optimizer of its shard as one optimizer (the Optimizer concept and visit_state),
// for Trainer and save_checkpoint / load_checkpoint; see the top of this file. Refers to both (they
// must outlive it). The optimizer's state names must be "optim.<kind>.<parameter name>" with no dot
// in <kind> (Sgd, Adam, AdamW).
template <class E, class Optimizer>
class Zero1Optimizer {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;

  Zero1Optimizer(Zero1<E>& zero, Optimizer& optimizer) : zero_(zero), optimizer_(optimizer) {}

  void step() { zero_.step(optimizer_); }
  void zero_grad() {
    optimizer_.zero_grad();
    zero_.zero_grad();
  }
  double lr() const { return optimizer_.lr(); }
  void set_lr(double lr) { optimizer_.set_lr(lr); }
  std::int64_t steps() const { return optimizer_.steps(); }
  Optimizer& optimizer() { return optimizer_; }

  // The whole state tensors (allocated as zeros of the model's shapes if no save or load has
  // filled them) and the optimizer's integers ("optim.step").
  template <class V>
  void visit_state(V& v) {
    const auto kinds = state_kinds();
    auto& model = zero_.model_.parameters;
    if (whole_.size() != kinds.size() * model.size()) {
      whole_.clear();
      for (std::size_t k = 0; k < kinds.size(); ++k)
        for (auto& [name, p] : model) whole_.emplace_back(p->value.shape()).zero();
    }
    for (std::size_t k = 0; k < kinds.size(); ++k)
      for (std::size_t i = 0; i < model.size(); ++i)
        v.buffer("optim." + kinds[k] + "." + model[i].first, whole_[k * model.size() + i]);
    IntegersOf<V> integers{v};
    optimizer_.visit_state(integers);
  }

  // Before a save, on every rank: each kind of state, shard by shard, into whole tensors.
  void checkpoint_gather() {
    auto pieces = state_pieces();
    auto& model = zero_.model_.parameters;
    const std::int64_t shard = zero_.shard_;
    std::vector<S> mine(static_cast<std::size_t>(shard)), all(static_cast<std::size_t>(shard * zero_.comm_.size()));
    whole_.clear();
    for (auto& [kind, tensors] : pieces) {
      std::fill(mine.begin(), mine.end(), S(0));
      for (std::size_t j = 0; j < zero_.segments_.size(); ++j)
        if (tensors[j]) std::copy_n(tensors[j]->data(), zero_.segments_[j].length, mine.data() + zero_.segments_[j].shard_offset);
      zero_.comm_.all_gather(std::span<const S>(mine), std::span<S>(all));
      std::int64_t offset = 0;
      for (auto& [name, p] : model) {
        Tensor<S, D>& t = whole_.emplace_back(p->value.shape());
        std::copy_n(all.data() + offset, p->value.numel(), t.data());
        offset += p->value.numel();
      }
    }
  }
  // After a load: this rank's part of each whole tensor into the optimizer's state.
  void checkpoint_scatter() {
    auto pieces = state_pieces();
    auto& model = zero_.model_.parameters;
    std::size_t k = 0;
    for (auto& [kind, tensors] : pieces) {
      for (std::size_t j = 0; j < zero_.segments_.size(); ++j) {
        const auto& seg = zero_.segments_[j];
        if (tensors[j])
          std::copy_n(whole_[k * model.size() + seg.model_index].data() + seg.param_offset, seg.length, tensors[j]->data());
      }
      ++k;
    }
  }
  void checkpoint_release() { whole_.clear(); }

 private:
  template <class V>
  using IntegersOf = detail::StateIntegersOf<V>;
  // Kinds of state in first-seen order, each with its tensor per segment (null: the empty piece
  // of a rank with no elements). The same on every rank (one optimizer type and settings).
  std::vector<std::pair<std::string, std::vector<Tensor<S, D>*>>> state_pieces() {
    std::map<std::string, std::size_t> segment_of;
    for (std::size_t j = 0; j < zero_.segments_.size(); ++j) segment_of[zero_.shard_named_.parameters[j].first] = j;
    return detail::state_by_kind<S, D>(optimizer_, segment_of, zero_.segments_.size(), "Zero1Optimizer");
  }
  std::vector<std::string> state_kinds() {
    std::vector<std::string> kinds;
    for (auto& [kind, tensors] : state_pieces()) kinds.push_back(kind);
    return kinds;
  }

  Zero1<E>& zero_;
  Optimizer& optimizer_;
  std::vector<Tensor<S, D>> whole_;  // [kind][model parameter], during a save or load only
};

template <class E, class Optimizer>
Zero1Optimizer(Zero1<E>&, Optimizer&) -> Zero1Optimizer<E, Optimizer>;

}  // namespace tessera
