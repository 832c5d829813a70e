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
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "tessera/comm/communicator.hpp"
#include "tessera/core/env.hpp"
#include "tessera/core/parameter.hpp"
#include "tessera/device/cpu.hpp"
#include "tessera/optim/lamb.hpp"
#include "tessera/optim/lars.hpp"
#include "tessera/parallel/agreement.hpp"

namespace tessera {

struct Zero1Options {
  // The learning rate and parameter checksums compared across ranks at the first and then every
  // this many steps; 0: never.
  int consistency_check_every = 100;
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
    flat_grad_.assign(static_cast<std::size_t>(shard_ * ranks), S(0));
    flat_value_.assign(static_cast<std::size_t>(shard_ * ranks), S(0));
    shard_grad_.assign(static_cast<std::size_t>(shard_), S(0));
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
    pack([](Parameter<S, D>& p) { return p.grad.data(); }, flat_grad_);
    comm_.reduce_scatter(std::span<const S>(flat_grad_), std::span<S>(shard_grad_), ReduceOp::Avg);
    for (auto& seg : segments_) std::copy_n(shard_grad_.data() + seg.shard_offset, seg.length, seg.param.grad.data());
    in_step_ = true;
    try {
      optimizer.step();
    } catch (...) {
      in_step_ = false;
      throw;
    }
    in_step_ = false;
    // Every rank's updated shard to everyone, then back into the model's parameters.
    const std::int64_t first = shard_ * comm_.rank();
    for (auto& seg : segments_)
      std::copy_n(seg.param.value.data(), seg.length, flat_value_.data() + first + seg.shard_offset);
    std::vector<S>& gathered = flat_grad_;  // reused as the all_gather output
    comm_.all_gather(std::span<const S>(flat_value_.data() + first, static_cast<std::size_t>(shard_)),
                     std::span<S>(gathered));
    unpack(gathered);
  }

 private:
  struct Segment {
    std::size_t model_index;    // which model parameter
    std::int64_t param_offset;  // first element within it
    std::int64_t shard_offset;  // first element within the shard
    std::int64_t length;
    Parameter<S, D> param;  // the optimizer's view: value and grad of this piece
  };

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

  template <class Data>
  void pack(Data data_of, std::vector<S>& flat) {
    std::int64_t offset = 0;
    for (auto& [name, p] : model_.parameters) {
      std::copy_n(data_of(*p), p->value.numel(), flat.data() + offset);
      offset += p->value.numel();
    }
    std::fill(flat.begin() + offset, flat.end(), S(0));  // padding
  }

  void unpack(const std::vector<S>& flat) {
    std::int64_t offset = 0;
    for (auto& [name, p] : model_.parameters) {
      std::copy_n(flat.data() + offset, p->value.numel(), p->value.data());
      offset += p->value.numel();
    }
  }

  Comm& comm_;
  Zero1Options options_;
  NamedTensors<E> model_;
  std::int64_t shard_ = 0;
  std::vector<S> flat_grad_, flat_value_, shard_grad_;
  std::vector<Segment> segments_;
  NamedTensors<E> shard_named_;
  bool in_step_ = false;
  std::int64_t steps_ = 0;
};

template <class Model, class C>
Zero1(Model&, C&, Zero1Options = {}) -> Zero1<typename Model::Env>;

}  // namespace tessera
