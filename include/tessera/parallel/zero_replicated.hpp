// ReplicatedZero1: ZeRO-1 (parallel/zero.hpp) whose optimizer shards survive the loss of a rank,
// for ElasticTrainer (train/elastic.hpp). Plain Zero1 keeps shard r of the optimizer state on rank
// r only, so a dead rank takes 1/N of the momentum (or Adam's moments) with it and only a
// checkpoint can bring it back. Here each shard lives on two ranks, a ring of replicas:
//
//   rank r holds   shard r      (its primary: it updates it and all-gathers the new values)
//                  shard r+1    (a replica, mod N: it applies the same update to the same state)
//
// so the state is lost only when two neighbours in the ring die in the same step (ranks s and
// s-1 hold shard s). Optimizer state per rank: 2/N of the whole (Zero1: 1/N; DataParallel: 1).
//
// One step, N ranks, P parameters, K = ceil(P/N):
//
//   a. reduce_scatter(Avg) of the flat gradients        rank r: g_r (K)       volume as Zero1
//   b. ring exchange: g_r to rank r-1, g_{r+1} from r+1 rank r: g_{r+1} (K)   + K per rank
//   c. commit: all_reduce of one int64 (sum = N)        every rank entered it
//   d. update shard r with g_r and the replica with g_{r+1} (local: cannot fail)
//   e. all_gather of shard r's new values               every rank: the whole model
//
// Why the commit (c) makes a failure recoverable without an undo log: a rank that finishes the
// all-reduce holds every rank's contribution, so every rank had finished (b): each shard's
// averaged gradient of this step exists on two ranks. Nobody updates before (c). So after a
// failure the members' optimizer states are at step t-1 or t ("committed" counts them), and
//
//   - if any survivor committed step t, every survivor that did not holds both gradients of step
//     t and rolls forward (applies them with the step's learning rate): all are at t;
//   - otherwise no survivor updated anything: all are at t-1 and step t is redone.
//
// A failure in (e) comes after the commit: step() keeps it (the step is taken; the model's
// parameters may miss the gathered values, the shards have them) and rethrow_deferred_failure()
// or the next step() throws it; ElasticTrainer calls the former at the step boundary, so the
// Trainer has counted the step.
//
// regroup(comm) (collective over the new generation, from ElasticTrainer's heal) rebuilds the
// shards for the new size M: every member sends one record (its layout: generation, size, rank;
// steps committed; pending gradients), the members pick the newest layout whose shards all
// survive (shard s from rank s, else from its replica on rank s-1), roll forward where needed,
// broadcast each old shard's values and state from one holder (what a checkpoint's whole tensors
// hold: P values and P per kind of state), and each member keeps its new shard and replica. The
// model's parameters are written from the gathered values. A member keeps its old shards until
// the regroup completes, so a death during it leaves the next regroup the same data; and it keeps
// its shards of the layout the regroup chose (detail::KeptShards) until the new layout's first
// commit, so that a death after some members built the new layout and before others did leaves
// that layout whole on the survivors (the next regroup's records list both).
//
//   ReplicatedZero1<E, Sgd<E>> zero(model, [](const NamedTensors<E>& shard) {
//     return Sgd<E>(shard, {.lr = 0.05, .momentum = 0.9});     // any element-wise optimizer
//   });
//   ElasticTrainer trainer(group, model, zero,
//       [](std::optional<NoStrategy<E>>& s, Comm&) { s.emplace(); }, schedule, options);
//
// The shard optimizers are made by the callback, one for the shard and one for the replica, anew
// at each regroup (their parameters are the pieces of this generation's shards). Checkpoints hold
// whole tensors under the unsharded names, as Zero1Optimizer's do.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tessera/comm/communicator.hpp"
#include "tessera/core/env.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/parameter.hpp"
#include "tessera/optim/lamb.hpp"
#include "tessera/optim/lars.hpp"
#include "tessera/optim/optimizer.hpp"
#include "tessera/parallel/agreement.hpp"
#include "tessera/parallel/shard_ring.hpp"
#include "tessera/parallel/zero.hpp"

namespace tessera {

template <class E, StatefulOptimizer Optimizer>
class ReplicatedZero1 final : UpdateGuard {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Comm = typename E::Comm;
  using MakeOptimizer = std::function<Optimizer(const NamedTensors<E>&)>;
  static_assert(D::host_accessible, "ReplicatedZero1 packs its shards on the host");
  static_assert(!std::is_same_v<Optimizer, Lars<E>> && !std::is_same_v<Optimizer, Lamb<E>>,
                "ReplicatedZero1: LARS and LAMB need whole-tensor norms; a shard only has part of a tensor");

  // No communicator yet: the first regroup(comm) lays out the shards.
  template <class Model>
  ReplicatedZero1(Model& model, MakeOptimizer make_optimizer, Zero1Options options = {})
      : make_(std::move(make_optimizer)), options_(options), model_(parameters_of_env<E>(named_tensors(model))) {
    TESSERA_CHECK(!model_.parameters.empty(), ArgumentError, "ReplicatedZero1: the model has no parameters");
    TESSERA_CHECK(options.consistency_check_every >= 0, ArgumentError, "ReplicatedZero1: consistency_check_every=",
                  options.consistency_check_every, " must be >= 0 (0: no check)");
    for (auto& [name, p] : model_.parameters) total_ += p->value.numel();
    auto probe = detail::probe_optimizer<E>(make_, "ReplicatedZero1");
    lr_ = probe.lr;
    kinds_ = std::move(probe.kinds);
    integer_names_ = std::move(probe.integer_names);
  }

  ReplicatedZero1(const ReplicatedZero1&) = delete;
  ReplicatedZero1& operator=(const ReplicatedZero1&) = delete;

  // --- the Optimizer interface (Trainer, checkpoints)

  void step() {
    rethrow_deferred_failure();
    TESSERA_CHECK(layout_ != nullptr, Error, "ReplicatedZero1: step() before regroup(comm) laid out the shards "
                  "(ElasticTrainer does it before the first step)");
    Layout& l = *layout_;
    Comm& comm = *l.comm;
    const int every = options_.consistency_check_every;
    if (every > 0 && l.steps % every == 0) check_consistency(comm, l);
    ++l.steps;
    // The model is the source of truth for values (a checkpoint may have been loaded into it).
    refresh_values(l.primary);
    if (l.replica) refresh_values(*l.replica);
    pending_ = primary_applied_ = false;
    // a. the averaged gradient of shard r lands on rank r.
    pack_model([](Parameter<S, D>& p) { return p.grad.data(); });
    comm.reduce_scatter(std::span<const S>(flat_.data(), static_cast<std::size_t>(flat_.numel())),
                        l.primary.grad.span(), ReduceOp::Avg);
    // b. the replica holder (rank r-1) gets it too; this rank gets shard r+1's.
    if (l.replica)
      detail::exchange_shard_gradients(comm, std::span<const S>(l.primary.grad.data(), static_cast<std::size_t>(l.shard)),
                                       l.replica->grad.span());
    pending_ = true;
    pending_lr_ = lr_;
    // c. the commit. Every member has built this layout (each contributed to the commit), so
    // the shards kept from the last one can go.
    detail::commit_step(comm, committed_ + 1, "ReplicatedZero1");
    kept_ = {};
    // d. both updates, local.
    apply_pending(l);
    // e. every rank's new shard to everyone. A failure here is kept: the step is taken.
    try {
      pack_shard_values(l.primary, l.primary.grad.data());  // the gradient is done with
      comm.all_gather(std::span<const S>(l.primary.grad.data(), static_cast<std::size_t>(l.shard)), flat_.span());
      unpack_model(flat_.data());
    } catch (const CommError& e) {
      deferred_failure_ = e.what();
    }
    counted_ = committed_;
  }

  void zero_grad() {
    for (auto& [name, p] : model_.parameters) p->grad.zero();
  }
  double lr() const { return lr_; }
  void set_lr(double lr) {
    lr_ = lr;
    if (!layout_) return;
    layout_->primary.optimizer->set_lr(lr);
    if (layout_->replica) layout_->replica->optimizer->set_lr(lr);
  }
  std::int64_t steps() const { return committed_; }

  // Whole state tensors under the unsharded names ("optim.<kind>.<parameter>"), as
  // Zero1Optimizer's: filled by checkpoint_gather, read by checkpoint_scatter.
  template <class V>
  void visit_state(V& v) {
    if (whole_.size() != kinds_.size() * model_.parameters.size()) {
      whole_.clear();
      for (std::size_t k = 0; k < kinds_.size(); ++k)
        for (auto& [name, p] : model_.parameters) whole_.emplace_back(p->value.shape()).zero();
    }
    for (std::size_t k = 0; k < kinds_.size(); ++k)
      for (std::size_t i = 0; i < model_.parameters.size(); ++i)
        v.buffer("optim." + kinds_[k] + "." + model_.parameters[i].first, whole_[k * model_.parameters.size() + i]);
    if (layout_) {
      detail::StateIntegersOf<V> integers{v};
      layout_->primary.optimizer->visit_state(integers);
    }
  }
  void checkpoint_gather() {
    Layout& l = require_layout("save a checkpoint");
    std::vector<S> mine(static_cast<std::size_t>(l.shard));
    Tensor<S, D> all;
    all.resize({l.shard * l.size});
    whole_.clear();
    for (std::size_t k = 0; k < kinds_.size(); ++k) {
      pack_shard_state(l.primary, k, mine.data());
      l.comm->all_gather(std::span<const S>(mine), all.span());
      std::int64_t offset = 0;
      for (auto& [name, p] : model_.parameters) {
        Tensor<S, D>& t = whole_.emplace_back(p->value.shape());
        std::copy_n(all.data() + offset, p->value.numel(), t.data());
        offset += p->value.numel();
      }
    }
  }
  void checkpoint_scatter() {
    Layout& l = require_layout("load a checkpoint");
    for (Shard* shard : {&l.primary, l.replica ? &*l.replica : nullptr}) {
      if (!shard) continue;
      auto pieces = state_pieces(*shard);
      for (std::size_t k = 0; k < pieces.size(); ++k)
        for (std::size_t j = 0; j < shard->segments.size(); ++j) {
          const Segment& seg = shard->segments[j];
          if (pieces[k].second[j])
            std::copy_n(whole_[k * model_.parameters.size() + seg.model_index].data() + seg.param_offset, seg.length,
                        pieces[k].second[j]->data());
        }
    }
    // The replica's integers (the step count) follow the primary's, as in a regroup.
    if (l.replica) detail::set_optimizer_integers(*l.replica->optimizer, detail::optimizer_integers(*l.primary.optimizer));
    committed_ = counted_ = l.primary.optimizer->steps();
    kept_ = {};  // older than what was loaded
  }
  void checkpoint_release() { whole_.clear(); }

  // --- the elastic interface (ElasticTrainer)

  // A failure of step()'s all_gather, after the commit, as CommError; nothing if none.
  void rethrow_deferred_failure() {
    if (!deferred_failure_) return;
    const std::string what = *deferred_failure_;
    throw CommError(detail::cat("ReplicatedZero1: after step ", committed_, " was committed: ", what));
  }

  // Collective over the members of `comm` (a new generation): see the top of this file.
  // `holds_train_state`: this member's Trainer state is valid (not a replacement's, not half
  // overwritten by a heal that failed); `generation` names the layout this builds.
  RegroupResult regroup(Comm& comm, bool holds_train_state, std::int64_t generation) {
    const detail::ShardRecord mine{layout_ ? layout_->generation : -1,
                                   layout_ ? layout_->size : 0,
                                   layout_ ? layout_->rank : -1,
                                   committed_,
                                   pending_ ? 1 : 0,
                                   holds_train_state ? 1 : 0,
                                   total_,
                                   static_cast<std::int64_t>(kinds_.size()),
                                   static_cast<std::int64_t>(integer_names_.size())};
    const auto records = detail::gather_shard_records(comm, mine, kept_.record, "ReplicatedZero1");
    const auto [chosen, size] = detail::choose_shard_layout(records, "ReplicatedZero1");
    std::int64_t target = 0;
    std::vector<Tensor<S, D>> whole(1 + kinds_.size());  // [values, kind...], each of every layout shard
    std::vector<std::int64_t> integers;
    detail::KeptShards<S> kept;
    if (chosen < 0) {
      fresh_start(comm, records, whole, integers);
    } else {
      target = detail::agreed_shard_step(records, chosen, "ReplicatedZero1");
      const detail::ShardRecord& me = records[static_cast<std::size_t>(comm.rank())];
      if (me.layout == chosen && me.committed == target - 1) apply_pending(*layout_);  // roll forward
      gather_shards(comm, records, chosen, whole, integers);
      // Shard s of the chosen layout is whole[k][s K, (s + 1) K).
      const std::int64_t shard = whole[0].numel() / size;
      kept = detail::keep_shards<S>(records, comm.rank(), chosen, size, target, kinds_.size(), integers,
                                    [&](std::int64_t s, std::size_t k) {
                                      return std::span<const S>(whole[k].data() + s * shard, static_cast<std::size_t>(shard));
                                    });
    }
    build_layout(comm, generation, whole, integers);
    kept_ = std::move(kept);
    // Current: this member's step() returned after committing the agreed step, so its Trainer
    // counted it (a roll-forward, here or in a regroup that failed, does not count).
    const bool current = holds_train_state && counted_ == target;
    committed_ = counted_ = target;
    pending_ = false;
    deferred_failure_.reset();
    return {target, current};
  }

 private:
  struct Segment {
    std::size_t model_index;    // which model parameter
    std::int64_t param_offset;  // first element within it
    std::int64_t shard_offset;  // first element within the shard
    std::int64_t length;
    Parameter<S, D> param;  // the optimizer's view: value and grad of this piece
  };
  // One shard held by this rank (its primary or its replica), with its optimizer.
  struct Shard {
    int index = 0;
    std::vector<Segment> segments;
    NamedTensors<E> named;
    std::optional<Optimizer> optimizer;
    Tensor<S, D> grad;  // this step's averaged gradient of the whole shard (K)
  };
  struct Layout {
    std::int64_t generation = 0;
    Comm* comm = nullptr;
    int size = 1, rank = 0;
    std::int64_t shard = 0;  // K
    std::int64_t steps = 0;  // steps taken in this layout (the consistency check's clock)
    Shard primary;
    std::optional<Shard> replica;
  };
  Layout& require_layout(const char* what) {
    TESSERA_CHECK(layout_ != nullptr, Error, "ReplicatedZero1: cannot ", what, " before regroup(comm) laid out the "
                  "shards (ElasticTrainer does it before the first step)");
    return *layout_;
  }

  // The first regroup: every holder starts from the same parameters (the lowest-ranked holder's,
  // as Zero1's constructor takes rank 0's) and fresh optimizer state.
  void fresh_start(Comm& comm, const std::vector<detail::ShardRecord>& records, std::vector<Tensor<S, D>>& whole,
                   std::vector<std::int64_t>& integers) {
    int source = -1;
    for (std::size_t q = 0; q < records.size() && source < 0; ++q)
      if (records[q].holds != 0) source = static_cast<int>(q);
    TESSERA_CHECK(source >= 0, Error, "ReplicatedZero1: no member holds a training state and none holds a shard");
    for (auto& [name, p] : model_.parameters) comm.broadcast(std::span<S>(p->value.data(), p->value.numel()), source);
    whole[0].resize({total_});
    pack_model_into(whole[0].data(), [](Parameter<S, D>& p) { return p.value.data(); });
    for (std::size_t k = 1; k < whole.size(); ++k) {
      whole[k].resize({total_});
      whole[k].zero();
    }
    integers.clear();  // the new optimizers' own (step 0)
  }

  // Every shard of layout `id` from one of its holders to every member: values and each kind of
  // state into `whole`, and the optimizer's integers (the step count) from shard 0's holder.
  void gather_shards(Comm& comm, const std::vector<detail::ShardRecord>& records, std::int64_t id, std::vector<Tensor<S, D>>& whole,
                     std::vector<std::int64_t>& integers) {
    std::int64_t size = 0;
    for (const detail::ShardRecord& r : records)
      if (r.layout == id) size = r.size;
    const std::int64_t shard = (total_ + size - 1) / size;
    for (auto& t : whole) t.resize({shard * size});
    const int n = comm.size();  // a holder index q >= n: member q - n, from the shards it kept
    for (std::int64_t s = 0; s < size; ++s) {
      const int holder = detail::shard_holder(records, id, size, s);
      const Shard* mine = nullptr;
      if (holder == comm.rank()) mine = layout_->primary.index == s ? &layout_->primary : &*layout_->replica;
      for (std::size_t k = 0; k < whole.size(); ++k) {
        S* out = whole[k].data() + s * shard;
        if (mine) {
          if (k == 0) pack_shard_values(*mine, out);
          else pack_shard_state(*mine, k - 1, out);
        } else if (holder == n + comm.rank()) {
          std::copy_n(kept_.shard(s, k).data(), shard, out);
        }
        comm.broadcast(std::span<S>(out, static_cast<std::size_t>(shard)), holder % n);
      }
    }
    const int first = detail::shard_holder(records, id, size, 0);
    integers.assign(integer_names_.size(), 0);
    if (first == comm.rank()) integers = detail::optimizer_integers(*layout_->primary.optimizer);
    if (first == n + comm.rank()) integers = kept_.integers;
    if (!integers.empty()) comm.broadcast(std::span<std::int64_t>(integers), first % n);
  }

  // This member's shards of the new generation, from the gathered values and state; the model's
  // parameters from the values. `integers` empty: the new optimizers keep their own (step 0).
  void build_layout(Comm& comm, std::int64_t generation, const std::vector<Tensor<S, D>>& whole,
                    const std::vector<std::int64_t>& integers) {
    auto l = std::make_unique<Layout>();
    l->generation = generation;
    l->comm = &comm;
    l->size = comm.size();
    l->rank = comm.rank();
    l->shard = (total_ + l->size - 1) / l->size;
    unpack_model(whole[0].data());
    make_shard(*l, l->primary, l->rank, whole, integers);
    if (l->size > 1) make_shard(*l, l->replica.emplace(), (l->rank + 1) % l->size, whole, integers);
    flat_.resize({l->shard * l->size});
    flat_.zero();
    layout_ = std::move(l);  // the old shards go only now: a failure above leaves them for the next regroup
  }

  void make_shard(const Layout& l, Shard& shard, int index, const std::vector<Tensor<S, D>>& whole,
                  const std::vector<std::int64_t>& integers) {
    shard.index = index;
    const std::int64_t first = l.shard * index, last = first + l.shard;
    std::int64_t offset = 0;
    for (std::size_t i = 0; i < model_.parameters.size(); ++i) {
      Parameter<S, D>& p = *model_.parameters[i].second;
      const std::int64_t begin = std::max(offset, first), end = std::min(offset + p.value.numel(), last);
      if (begin < end) {
        Segment seg{i, begin - offset, begin - first, end - begin, Parameter<S, D>(Shape{end - begin}, p.kind)};
        std::copy_n(p.value.data() + seg.param_offset, seg.length, seg.param.value.data());
        shard.segments.push_back(std::move(seg));
      }
      offset += p.value.numel();
    }
    for (auto& seg : shard.segments) shard.named.parameter(model_.parameters[seg.model_index].first, seg.param);
    if (shard.segments.empty()) {  // more ranks than elements: an empty piece keeps optimizers happy
      shard.segments.push_back(Segment{0, 0, 0, 0, Parameter<S, D>(Shape{0}, ParamKind::Weight)});
      shard.named.parameter(model_.parameters[0].first + ".empty_shard", shard.segments.back().param);
    }
    for (auto& seg : shard.segments) seg.param.update_guard = this;
    shard.optimizer.emplace(make_(shard.named));
    shard.optimizer->set_lr(lr_);
    shard.grad.resize({l.shard});
    shard.grad.zero();
    // Its state: the whole tensors' elements of this shard.
    auto pieces = state_pieces(shard);
    for (std::size_t k = 0; k < pieces.size(); ++k)
      for (std::size_t j = 0; j < shard.segments.size(); ++j)
        if (pieces[k].second[j])
          std::copy_n(whole[1 + k].data() + first + shard.segments[j].shard_offset, shard.segments[j].length,
                      pieces[k].second[j]->data());
    if (!integers.empty()) detail::set_optimizer_integers(*shard.optimizer, integers);
  }

  std::vector<std::pair<std::string, std::vector<Tensor<S, D>*>>> state_pieces(Shard& shard) {
    std::map<std::string, std::size_t> segment_of;
    for (std::size_t j = 0; j < shard.segments.size(); ++j) segment_of[shard.named.parameters[j].first] = j;
    auto pieces = detail::state_by_kind<S, D>(*shard.optimizer, segment_of, shard.segments.size(), "ReplicatedZero1");
    TESSERA_CHECK(pieces.size() == kinds_.size(), Error, "ReplicatedZero1: the shard's optimizer has ", pieces.size(),
                  " kind(s) of state and the probe had ", kinds_.size(), ": the optimizer callback must build the same "
                  "optimizer every time");
    return pieces;
  }

  // Both updates of a step whose gradients this rank holds (the commit, or a roll-forward).
  // A primary update done before an exception in the replica's is not done twice.
  void apply_pending(Layout& l) {
    TESSERA_CHECK(pending_, Error, "ReplicatedZero1 (rank ", l.rank, " of ", l.size, "): no gradients of step ",
                  committed_ + 1, " to apply");
    const double lr = lr_;
    set_lr(pending_lr_);
    try {
      if (!primary_applied_) apply(l.primary);
      primary_applied_ = true;
      if (l.replica) apply(*l.replica);
    } catch (...) {
      set_lr(lr);
      throw;
    }
    set_lr(lr);
    ++committed_;
    pending_ = primary_applied_ = false;
  }
  void apply(Shard& shard) {
    for (auto& seg : shard.segments) std::copy_n(shard.grad.data() + seg.shard_offset, seg.length, seg.param.grad.data());
    in_step_ = true;
    try {
      shard.optimizer->step();
    } catch (...) {
      in_step_ = false;
      throw;
    }
    in_step_ = false;
  }

  void refresh_values(Shard& shard) {
    for (auto& seg : shard.segments)
      std::copy_n(model_.parameters[seg.model_index].second->value.data() + seg.param_offset, seg.length,
                  seg.param.value.data());
  }
  // The shard's values (K elements, zeros past the model's end) into `out`.
  void pack_shard_values(const Shard& shard, S* out) const {
    std::fill(out, out + layout_->shard, S(0));
    for (const auto& seg : shard.segments) std::copy_n(seg.param.value.data(), seg.length, out + seg.shard_offset);
  }
  // The shard's state of kind k (K elements) into `out`.
  void pack_shard_state(const Shard& shard, std::size_t k, S* out) {
    std::fill(out, out + layout_->shard, S(0));
    auto pieces = state_pieces(const_cast<Shard&>(shard));
    for (std::size_t j = 0; j < shard.segments.size(); ++j)
      if (pieces[k].second[j]) std::copy_n(pieces[k].second[j]->data(), shard.segments[j].length, out + shard.segments[j].shard_offset);
  }

  template <class Data>
  void pack_model_into(S* out, Data data_of) {
    for (auto& [name, p] : model_.parameters) {
      std::copy_n(data_of(*p), p->value.numel(), out);
      out += p->value.numel();
    }
  }
  template <class Data>
  void pack_model(Data data_of) {
    pack_model_into(flat_.data(), data_of);
    std::fill(flat_.data() + total_, flat_.data() + flat_.numel(), S(0));  // padding
  }
  void unpack_model(const S* in) {
    for (auto& [name, p] : model_.parameters) {
      std::copy_n(in, p->value.numel(), p->value.data());
      in += p->value.numel();
    }
  }

  // As Zero1's: the learning rate and every parameter's checksum agree across ranks.
  void check_consistency(Comm& comm, const Layout& l) {
    AgreementRecord record("ReplicatedZero1");
    record.add("optimizer.lr", lr_);
    record.add("layout.generation", l.generation);
    NamedTensors<E> parameters_only;
    parameters_only.parameters = model_.parameters;
    record.add_checksums(parameters_only);
    check_agreement(comm, record,
                    "at step " + std::to_string(committed_ + 1) +
                        ": every rank must step with the same optimizer settings from the same parameters. "
                        "Zero1Options::consistency_check_every sets how often this is checked (0: never)");
  }

  void before_update() override {
    TESSERA_CHECK(in_step_, Error, "ReplicatedZero1: an optimizer stepped a shard directly; call step() on the "
                  "ReplicatedZero1, which reduce-scatters the gradients first and all-gathers the new values after");
  }

  MakeOptimizer make_;
  Zero1Options options_;
  NamedTensors<E> model_;
  std::int64_t total_ = 0;                  // P
  std::vector<std::string> kinds_;          // kinds of state, in the optimizer's order
  std::vector<std::string> integer_names_;  // the optimizer's integers ("optim.step")
  double lr_ = 0, pending_lr_ = 0;
  std::unique_ptr<Layout> layout_;
  detail::KeptShards<S> kept_;  // the last regroup's chosen layout, until this layout's first commit
  Tensor<S, D> flat_;  // every parameter, padded to N shards: gradients to reduce-scatter, then gathered values
  std::int64_t committed_ = 0;
  std::int64_t counted_ = 0;  // committed_ as the caller last saw step() return (a roll-forward is not seen)
  bool pending_ = false;  // both gradients of step committed_+1 are here
  bool primary_applied_ = false;  // of the pending step
  bool in_step_ = false;
  std::optional<std::string> deferred_failure_;
  std::vector<Tensor<S, D>> whole_;  // [kind][model parameter], during a save or load only
};

}  // namespace tessera
