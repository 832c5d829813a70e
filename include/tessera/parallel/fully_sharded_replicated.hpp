// ReplicatedFullyShardedOptimizer: FullyShardedDataParallel (ZeRO-2 and ZeRO-3) whose shards
// survive the loss of a rank, for ElasticTrainer (train/elastic.hpp). Under FSDP rank r alone holds
// shard r of every unit: the master copy of those parameters (stage 2 and 3), their gradients and
// their optimizer state. A dead rank takes them with it. Here each shard also lives on rank r-1,
// the ring of replicas of parallel/shard_ring.hpp (as ReplicatedZero1 does for ZeRO-1):
//
//   rank r holds   shard r of every unit     in the FSDP (its pieces), with the optimizer's state
//                  shard r+1 of every unit   here (a replica: values and the optimizer's state)
//
// Memory per rank, Ψ parameter elements, K tensors of optimizer state each, N ranks: FSDP's
// Ψ/N (stage 3) of values plus as much again for the replica, and 2 K Ψ/N of state.
//
// One step, L = Σ_u s_u elements per shard (the units' shards side by side):
//
//   FSDP's forward and backward, its reduce_scatters     rank r: the averaged gradients of shard r
//   the consistency check (the learning rate, every consistency_check_every steps)
//   ring exchange: shard r's gradients to rank r-1       rank r: shard r+1's (L)
//   commit: all_reduce of one int64 (sum = N)
//   both updates (local); FSDP gathers the new values at the next forward
//
// Nothing after the commit talks to another rank, so a failure leaves every survivor at step t
// (committed) or t-1 with both gradients of step t in hand (parallel/zero_replicated.hpp explains
// the argument), and regroup() rolls the latter forward.
//
// ElasticTrainer drives it in three moves per generation: regroup(comm) (collective) agrees on the
// layout and step, gathers every old shard's values and state from one of its holders into whole
// tensors and writes the values into the model; the strategy callback then builds the generation's
// FullyShardedDataParallel from the model; bind(fsdp) takes its shard (the optimizer made by the
// callback below, its state from the whole tensors) and builds the replica. Until bind() the old
// FSDP (its pieces are this rank's shard) must stay alive: ElasticTrainer keeps it. The shards
// this member held in the layout the regroup chose are kept as copies (detail::KeptShards) until
// the new layout's first commit, so a second failure before it finds them (shard_ring.hpp).
//
//   ReplicatedFullyShardedOptimizer<Fsdp, AdamW<E>> optimizer(model, [](const NamedTensors<E>& shard) {
//     return AdamW<E>(shard, {.lr = 1e-3});                // any element-wise optimizer
//   });
//   ElasticTrainer trainer(group, model, optimizer,
//       [&](std::optional<Fsdp>& fsdp, Comm& comm) { fsdp.emplace(model, comm, FullyShardedOptions{.stage = 3}); },
//       schedule, options);
//
// Checkpoints go through the generation's FullyShardedOptimizer (whole tensors or sharded files);
// after a load the replicas are refreshed from their primaries (one ring exchange).
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
#include "tessera/optim/optimizer.hpp"
#include "tessera/parallel/fully_sharded.hpp"
#include "tessera/parallel/shard_ring.hpp"

namespace tessera {

template <class Fsdp, class Optimizer>
class ReplicatedFullyShardedOptimizer final : UpdateGuard {
 public:
  using Env = typename Fsdp::Env;
  using S = typename Env::Scalar;
  using D = typename Env::Device;
  using Comm = typename Env::Comm;
  using MakeOptimizer = std::function<Optimizer(const NamedTensors<Env>&)>;
  static_assert(StatefulOptimizer<Optimizer>, "ReplicatedFullyShardedOptimizer: the shard's optimizer needs state "
                "(visit_state) and steps()");
  static_assert(D::host_accessible, "ReplicatedFullyShardedOptimizer packs its shards on the host");

  template <class Model>
  ReplicatedFullyShardedOptimizer(Model& model, MakeOptimizer make_optimizer)
      : make_(std::move(make_optimizer)), model_(parameters_of_env<Env>(named_tensors(model))) {
    TESSERA_CHECK(!model_.parameters.empty(), ArgumentError, "ReplicatedFullyShardedOptimizer: the model has no "
                  "parameters");
    for (auto& [name, p] : model_.parameters) {
      shapes_.push_back(p->value.shape());
      param_offsets_.push_back(total_);
      total_ += p->value.numel();
    }
    auto probe = detail::probe_optimizer<Env>(make_, kWho);
    lr_ = probe.lr;
    kinds_ = std::move(probe.kinds);
    integer_names_ = std::move(probe.integer_names);
  }
  ReplicatedFullyShardedOptimizer(const ReplicatedFullyShardedOptimizer&) = delete;
  ReplicatedFullyShardedOptimizer& operator=(const ReplicatedFullyShardedOptimizer&) = delete;

  // --- the Optimizer interface (Trainer)

  void step() {
    Layout& l = bound("step()");
    Fsdp& f = *l.fsdp;
    f.finish_reductions();  // the Trainer's before_optimizer_step did; a loop of one's own may not
    f.check_consistency(lr_);  // collective: before the commit
    pending_ = primary_applied_ = false;
    pack_grads(l.primary, l.send);
    detail::exchange_shard_gradients(*l.comm, std::span<const S>(l.send.data(), static_cast<std::size_t>(l.send.numel())),
                                      l.received.span());
    pending_ = true;
    pending_lr_ = lr_;
    detail::commit_step(*l.comm, committed_ + 1, kWho);
    kept_ = {};  // every member built this layout (each contributed to the commit)
    apply_pending(l);
    counted_ = committed_;
  }
  void zero_grad() {
    if (layout_) layout_->primary_optimizer->zero_grad();  // the FSDP pieces' gradients
  }
  double lr() const { return lr_; }
  void set_lr(double lr) {
    lr_ = lr;
    if (!layout_) return;
    layout_->primary_optimizer->set_lr(lr);
    if (layout_->replica_optimizer) layout_->replica_optimizer->set_lr(lr);
  }
  std::int64_t steps() const { return committed_; }

  // Checkpoints: the generation's FullyShardedOptimizer's; a load refreshes the replicas.
  template <class V>
  void visit_state(V& v) {
    bound("visit_state()").full->visit_state(v);
  }
  void checkpoint_gather() { bound("checkpoint_gather()").full->checkpoint_gather(); }
  void checkpoint_before_load() { bound("checkpoint_before_load()").full->checkpoint_before_load(); }
  void checkpoint_scatter() {
    bound("checkpoint_scatter()").full->checkpoint_scatter();
    loaded();
  }
  void checkpoint_release() { bound("checkpoint_release()").full->checkpoint_release(); }
  bool sharded_checkpoints() const { return layout_ && layout_->full->sharded_checkpoints(); }
  template <class V>
  void visit_shards(V& v) {
    bound("visit_shards()").full->visit_shards(v);
  }
  void shards_loaded() {
    bound("shards_loaded()").full->shards_loaded();
    loaded();
  }

  // --- the elastic interface (ElasticTrainer)

  // Collective over the members of `comm` (a new generation): see the top of this file. Leaves the
  // whole values in the model's parameters and the whole state here, for bind().
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
    const auto records = detail::gather_shard_records(comm, mine, kept_.record, kWho);
    const auto [chosen, size] = detail::choose_shard_layout(records, kWho);
    std::int64_t target = 0;
    whole_.assign(1 + kinds_.size(), {});
    integers_.clear();
    detail::KeptShards<S> kept;
    if (chosen < 0) {
      fresh_start(comm, records);
    } else {
      target = detail::agreed_shard_step(records, chosen, kWho);
      const detail::ShardRecord& me = records[static_cast<std::size_t>(comm.rank())];
      if (me.layout == chosen && me.committed == target - 1) apply_pending(*layout_);  // roll forward
      share_units(comm, detail::shard_holder(records, chosen, size, 0) % comm.size());
      std::map<std::pair<std::int64_t, std::size_t>, std::vector<S>> held;  // (shard, kind): this member's
      gather_shards(comm, records, chosen, size, held);
      kept = detail::keep_shards<S>(records, comm.rank(), chosen, size, target, kinds_.size(), integers_,
                                    [&](std::int64_t s, std::size_t k) { return std::span<const S>(held.at({s, k})); });
    }
    kept_ = std::move(kept);
    for (std::size_t i = 0; i < model_.parameters.size(); ++i) {
      Parameter<S, D>& p = *model_.parameters[i].second;
      p.value.resize(shapes_[i]);
      std::copy_n(whole_[0].data() + param_offset(i), p.value.numel(), p.value.data());
    }
    const bool current = holds_train_state && counted_ == target;
    committed_ = counted_ = target;
    pending_ = false;
    bind_generation_ = generation;
    return {target, current};
  }

  // Lets go of the bound FSDP (ElasticTrainer's destructor, before the FSDP goes): the shards go
  // with it, and a later step() or checkpoint says so.
  void unbind() { layout_.reset(); }

  // The generation's FSDP, built by the strategy callback after regroup(): its shard gets the
  // gathered state, and the replica (shard r+1 of every unit) is built from the whole tensors.
  void bind(Fsdp& fsdp) {
    TESSERA_CHECK(!whole_.empty(), Error, kWho, ": bind() without a regroup() before it");
    auto l = std::make_unique<Layout>();
    l->generation = bind_generation_;
    l->fsdp = &fsdp;
    l->comm = &fsdp.comm_;
    l->size = fsdp.comm_.size();
    l->rank = fsdp.comm_.rank();
    take_units(fsdp);
    for (const auto& unit : fsdp.units_) {
      l->unit_base.push_back(l->shard_total);
      l->unit_shard.push_back(unit.shard);
      l->shard_total += unit.shard;
    }
    // The primary: the FSDP's pieces, whose values its constructor took from the model.
    for (std::size_t u = 0; u < fsdp.units_.size(); ++u)
      for (std::size_t j : fsdp.units_[u].pieces) {
        auto& piece = fsdp.pieces_[j];
        l->primary.pieces.push_back({u, piece.param_index, piece.param_offset, piece.shard_offset, piece.length, &piece.param});
      }
    l->primary_optimizer.emplace(make_(fsdp.shard_parameters()));
    fill_state(*l->primary_optimizer, l->primary);
    if (l->size > 1) {
      build_replica(*l, (l->rank + 1) % l->size);
      l->replica_optimizer.emplace(make_(l->replica.named));
      fill_state(*l->replica_optimizer, l->replica);
    }
    l->full.emplace(fsdp, *l->primary_optimizer);
    l->send.resize({l->shard_total});
    l->received.resize({l->shard_total});
    layout_ = std::move(l);
    whole_.clear();
    set_lr(lr_);
  }

 private:
  static constexpr const char* kWho = "ReplicatedFullyShardedOptimizer";

  // One piece of a shard: the part of model parameter `param_index` in unit `unit`, at
  // `shard_offset` within the unit's shard.
  struct Piece {
    std::size_t unit, param_index;
    std::int64_t param_offset, shard_offset, length;
    Parameter<S, D>* param;
  };
  struct Held {
    std::vector<Piece> pieces;
    std::vector<Parameter<S, D>> own;  // the replica's values and gradients (the primary's are the FSDP's)
    NamedTensors<Env> named;
  };
  struct Layout {
    std::int64_t generation = 0;
    Fsdp* fsdp = nullptr;
    Comm* comm = nullptr;
    int size = 1, rank = 0;
    std::vector<std::int64_t> unit_shard;  // s_u
    std::vector<std::int64_t> unit_base;   // Σ_{v<u} s_v: where unit u's shard starts in a packed shard
    std::int64_t shard_total = 0;          // L = Σ_u s_u
    Held primary, replica;
    std::optional<Optimizer> primary_optimizer, replica_optimizer;
    std::optional<FullyShardedOptimizer<Fsdp, Optimizer>> full;  // the primary's checkpoints
    Tensor<S, D> send, received;  // L: this shard's gradients out, shard r+1's in
  };

  Layout& bound(const char* what) {
    TESSERA_CHECK(layout_ != nullptr, Error, kWho, ": ", what, " before bind(fsdp) took a generation's shard "
                  "(ElasticTrainer does it before the first step)");
    return *layout_;
  }

  // The unit's shard of `held` side by side (unit u at Σ_{v<u} s_v), from what `data_of(piece)` points at.
  template <class Data>
  void pack(const Layout& l, const Held& held, S* out, Data data_of) const {
    std::fill(out, out + l.shard_total, S(0));
    for (const Piece& piece : held.pieces) {
      const S* from = data_of(piece);
      if (from) std::copy_n(from, piece.length, out + l.unit_base[piece.unit] + piece.shard_offset);
    }
  }
  template <class Data>
  void unpack(const Layout& l, Held& held, const S* in, Data data_of) const {
    for (const Piece& piece : held.pieces) {
      S* to = data_of(piece);
      if (to) std::copy_n(in + l.unit_base[piece.unit] + piece.shard_offset, piece.length, to);
    }
  }
  void pack_grads(Held& held, Tensor<S, D>& out) {
    pack(*layout_, held, out.data(), [](const Piece& p) -> const S* { return p.param->grad.data(); });
  }

  // The state tensor of kind k of each piece (null: none), by the optimizer's names.
  std::vector<std::vector<Tensor<S, D>*>> state_of(Optimizer& optimizer, const Held& held) {
    std::map<std::string, std::size_t> piece_of;
    for (std::size_t j = 0; j < held.pieces.size(); ++j) piece_of[model_.parameters[held.pieces[j].param_index].first] = j;
    std::vector<std::vector<Tensor<S, D>*>> out;
    for (auto& [kind, tensors] : detail::state_by_kind<S, D>(optimizer, piece_of, held.pieces.size(), kWho))
      out.push_back(std::move(tensors));
    TESSERA_CHECK(out.size() == kinds_.size(), Error, kWho, ": the shard's optimizer has ", out.size(), " kind(s) of "
                  "state and the probe had ", kinds_.size(), ": the callback must build the same optimizer every time");
    return out;
  }

  // Both updates of a step whose gradients this rank holds (the commit, or a roll-forward).
  // A primary update done before an exception in the replica's is not done twice.
  void apply_pending(Layout& l) {
    TESSERA_CHECK(pending_, Error, kWho, " (rank ", l.rank, " of ", l.size, "): no gradients of step ", committed_ + 1,
                  " to apply");
    const double lr = lr_;
    set_lr(pending_lr_);
    Fsdp& f = *l.fsdp;
    if (!primary_applied_) {
      f.in_step_ = true;
      try {
        l.primary_optimizer->step();
      } catch (...) {
        f.in_step_ = false;
        set_lr(lr);
        throw;
      }
      f.in_step_ = false;
      ++f.updates_;
      primary_applied_ = true;
    }
    if (l.replica_optimizer) {
      unpack(l, l.replica, l.received.data(), [](const Piece& p) -> S* { return p.param->grad.data(); });
      in_step_ = true;
      try {
        l.replica_optimizer->step();
      } catch (...) {
        in_step_ = false;
        set_lr(lr);
        throw;
      }
      in_step_ = false;
    }
    set_lr(lr);
    ++committed_;
    pending_ = primary_applied_ = false;
  }

  // After a checkpoint load into the primaries: each replica from its primary (a ring exchange of
  // the values and each kind of state), and the replica's integers from the primary's.
  void loaded() {
    Layout& l = *layout_;
    committed_ = counted_ = l.primary_optimizer->steps();
    kept_ = {};  // older than what was loaded
    if (!l.replica_optimizer) return;
    auto primary_state = state_of(*l.primary_optimizer, l.primary);
    auto replica_state = state_of(*l.replica_optimizer, l.replica);
    for (std::size_t k = 0; k <= kinds_.size(); ++k) {
      pack_kind(l, l.primary, primary_state, k, l.send.data());
      detail::exchange_shard_gradients(*l.comm, std::span<const S>(l.send.data(), static_cast<std::size_t>(l.send.numel())),
                                        l.received.span());
      unpack_kind(l, l.replica, replica_state, k, l.received.data());
    }
    detail::set_optimizer_integers(*l.replica_optimizer, detail::optimizer_integers(*l.primary_optimizer));
  }

  // Kind 0: the values; kind k > 0: the optimizer's state of kind k - 1.
  void pack_kind(const Layout& l, const Held& held, const std::vector<std::vector<Tensor<S, D>*>>& state, std::size_t k,
                 S* out) const {
    std::size_t j = 0;
    pack(l, held, out, [&](const Piece& p) -> const S* {
      const std::size_t at = j++;
      if (k == 0) return p.param->value.data();
      return state[k - 1][at] ? state[k - 1][at]->data() : nullptr;
    });
  }
  void unpack_kind(const Layout& l, Held& held, const std::vector<std::vector<Tensor<S, D>*>>& state, std::size_t k,
                   const S* in) const {
    std::size_t j = 0;
    unpack(l, held, in, [&](const Piece& p) -> S* {
      const std::size_t at = j++;
      if (k == 0) return p.param->value.data();
      return state[k - 1][at] ? state[k - 1][at]->data() : nullptr;
    });
  }

  std::int64_t param_offset(std::size_t i) const { return param_offsets_[i]; }

  // The first regroup: every member starts from the lowest-ranked holder's parameters and fresh state.
  void fresh_start(Comm& comm, const std::vector<detail::ShardRecord>& records) {
    int source = -1;
    for (std::size_t q = 0; q < records.size() && source < 0; ++q)
      if (records[q].holds != 0) source = static_cast<int>(q);
    TESSERA_CHECK(source >= 0, Error, kWho, ": no member holds a training state and none holds a shard");
    for (auto& t : whole_) {
      t.resize({total_});
      t.zero();
    }
    std::int64_t offset = 0;
    for (std::size_t i = 0; i < model_.parameters.size(); ++i) {
      Parameter<S, D>& p = *model_.parameters[i].second;
      TESSERA_CHECK(p.value.numel() == shapes_[i].numel(), Error, kWho, ": parameter '", model_.parameters[i].first,
                    "' is not in the model at the first regroup (an FSDP of stage 3 released it?)");
      comm.broadcast(std::span<S>(p.value.data(), static_cast<std::size_t>(p.value.numel())), source);
      std::copy_n(p.value.data(), p.value.numel(), whole_[0].data() + offset);
      offset += p.value.numel();
    }
  }

  // The units (which model parameters, in which order) from the holder of shard 0 to every member:
  // a replacement has no FSDP yet to read them from.
  void share_units(Comm& comm, int from) {
    std::int64_t count = static_cast<std::int64_t>(units_.size());
    comm.broadcast(std::span<std::int64_t>(&count, 1), from);
    std::vector<std::int64_t> sizes(static_cast<std::size_t>(count));
    for (std::size_t u = 0; u < units_.size() && comm.rank() == from; ++u) sizes[u] = static_cast<std::int64_t>(units_[u].size());
    comm.broadcast(std::span<std::int64_t>(sizes), from);
    std::vector<std::int64_t> flat;
    for (const auto n : sizes) flat.resize(flat.size() + static_cast<std::size_t>(n));
    if (comm.rank() == from) {
      flat.clear();
      for (const auto& unit : units_)
        for (const auto i : unit) flat.push_back(static_cast<std::int64_t>(i));
    }
    comm.broadcast(std::span<std::int64_t>(flat), from);
    units_.assign(static_cast<std::size_t>(count), {});
    std::size_t next = 0;
    for (std::size_t u = 0; u < units_.size(); ++u)
      for (std::int64_t n = 0; n < sizes[u]; ++n) units_[u].push_back(static_cast<std::size_t>(flat[next++]));
  }

  // Every shard of layout `id` (`size` ranks) from one of its holders to every member: its values
  // and each kind of state, unit by unit, into whole_ (model order); the optimizer's integers from
  // shard 0's holder.
  void gather_shards(Comm& comm, const std::vector<detail::ShardRecord>& records, std::int64_t id, std::int64_t size,
                     std::map<std::pair<std::int64_t, std::size_t>, std::vector<S>>& held) {
    std::vector<std::int64_t> unit_shard, unit_elements;
    for (const auto& unit : units_) {
      std::int64_t elements = 0;
      for (const auto i : unit) elements += shapes_[i].numel();
      unit_elements.push_back(elements);
      unit_shard.push_back((elements + size - 1) / size);
    }
    std::int64_t shard_total = 0;
    for (const auto s : unit_shard) shard_total += s;
    for (auto& t : whole_) t.resize({total_});
    std::vector<S> buffer(static_cast<std::size_t>(shard_total));
    // This member's rank in layout `id` (current or kept), whose two shards it keeps after the regroup.
    const int n = comm.size();  // a holder index q >= n: member q - n, from the shards it kept
    const detail::ShardRecord* held_here = detail::held_record(records, comm.rank(), id);
    const std::int64_t my_rank = held_here ? held_here->rank : -1;
    for (std::int64_t s = 0; s < size; ++s) {
      const int holder = detail::shard_holder(records, id, size, s);
      const bool mine = holder == comm.rank();
      const bool primary = mine && layout_->rank == s;
      const bool keep = my_rank >= 0 && (s == my_rank || s == (my_rank + 1) % size);
      for (std::size_t k = 0; k < whole_.size(); ++k) {
        if (mine) {
          Held& held_shard = primary ? layout_->primary : layout_->replica;
          Optimizer& optimizer = primary ? *layout_->primary_optimizer : *layout_->replica_optimizer;
          const auto state = state_of(optimizer, held_shard);
          pack_kind(*layout_, held_shard, state, k, buffer.data());
        } else if (holder == n + comm.rank()) {
          const auto& from = kept_.shard(s, k);
          std::copy(from.begin(), from.end(), buffer.begin());
        }
        comm.broadcast(std::span<S>(buffer), holder % n);
        if (keep) held[{s, k}] = buffer;
        // Shard s of unit u holds the unit's flat elements [s s_u, (s + 1) s_u).
        std::int64_t base = 0;
        for (std::size_t u = 0; u < units_.size(); ++u) {
          std::int64_t flat = 0;  // the unit's flat offset of its parameter j
          for (const auto i : units_[u]) {
            const std::int64_t n = shapes_[i].numel();
            const std::int64_t begin = std::max(flat, s * unit_shard[u]), end = std::min(flat + n, (s + 1) * unit_shard[u]);
            if (begin < end)
              std::copy_n(buffer.data() + base + (begin - s * unit_shard[u]), end - begin,
                          whole_[k].data() + param_offset(i) + (begin - flat));
            flat += n;
          }
          base += unit_shard[u];
        }
      }
    }
    const int first = detail::shard_holder(records, id, size, 0);
    integers_.assign(integer_names_.size(), 0);
    if (first == comm.rank())
      integers_ = detail::optimizer_integers(layout_->rank == 0 ? *layout_->primary_optimizer : *layout_->replica_optimizer);
    if (first == n + comm.rank()) integers_ = kept_.integers;
    if (!integers_.empty()) comm.broadcast(std::span<std::int64_t>(integers_), first % n);
  }

  // The FSDP's units as model parameter indices; they must be the ones the regroup used.
  void take_units(const Fsdp& fsdp) {
    std::vector<std::vector<std::size_t>> units;
    for (const auto& unit : fsdp.units_) units.push_back(unit.params);
    TESSERA_CHECK(units_.empty() || units == units_, Error, kWho, ": the FSDP of generation ", bind_generation_,
                  " cuts the model into other units than the last one: give every generation the same "
                  "FullyShardedOptions");
    units_ = std::move(units);
  }

  // Shard `index` of every unit as parameters of this object's, from the whole values.
  void build_replica(Layout& l, int index) {
    Held& held = l.replica;
    std::vector<Piece> pieces;
    for (std::size_t u = 0; u < units_.size(); ++u) {
      const std::int64_t first = l.unit_shard[u] * index, last = first + l.unit_shard[u];
      std::int64_t flat = 0;
      for (const auto i : units_[u]) {
        const std::int64_t n = shapes_[i].numel();
        const std::int64_t begin = std::max(flat, first), end = std::min(flat + n, last);
        if (begin < end) {
          pieces.push_back({u, i, begin - flat, begin - first, end - begin, nullptr});
          Parameter<S, D>& own = held.own.emplace_back(Shape{end - begin}, model_.parameters[i].second->kind);
          std::copy_n(whole_[0].data() + param_offset(i) + (begin - flat), end - begin, own.value.data());
        }
        flat += n;
      }
    }
    if (pieces.empty()) {  // more ranks than elements: an empty piece keeps optimizers happy
      held.own.emplace_back(Shape{0}, ParamKind::Weight);
      held.named.parameter(model_.parameters[0].first + ".empty_shard", held.own.back());
    }
    // Pointers only once the vector stops growing.
    for (std::size_t j = 0; j < pieces.size(); ++j) {
      pieces[j].param = &held.own[j];
      held.own[j].update_guard = this;
      held.named.parameter(model_.parameters[pieces[j].param_index].first, held.own[j]);
    }
    held.pieces = std::move(pieces);
  }

  // A new shard optimizer's state and integers from the whole tensors (fresh: zeros and its own).
  void fill_state(Optimizer& optimizer, const Held& held) {
    const auto state = state_of(optimizer, held);
    for (std::size_t k = 0; k < kinds_.size(); ++k)
      for (std::size_t j = 0; j < held.pieces.size(); ++j)
        if (state[k][j])
          std::copy_n(whole_[1 + k].data() + param_offset(held.pieces[j].param_index) + held.pieces[j].param_offset,
                      held.pieces[j].length, state[k][j]->data());
    if (!integers_.empty()) detail::set_optimizer_integers(optimizer, integers_);
  }

  void before_update() override {
    TESSERA_CHECK(in_step_, Error, kWho, ": an optimizer stepped the replica directly; only step() may");
  }

  MakeOptimizer make_;
  NamedTensors<Env> model_;
  std::vector<Shape> shapes_;
  std::int64_t total_ = 0;
  std::vector<std::string> kinds_, integer_names_;
  std::vector<std::vector<std::size_t>> units_;  // the FSDP's units as model parameter indices
  double lr_ = 0, pending_lr_ = 0;
  std::unique_ptr<Layout> layout_;
  std::vector<Tensor<S, D>> whole_;        // between regroup() and bind(): [values, kind...], model order
  std::vector<std::int64_t> integers_;     // between regroup() and bind(): the optimizer's integers
  std::int64_t bind_generation_ = 0;
  detail::KeptShards<S> kept_;  // the last regroup's chosen layout, until this layout's first commit
  std::int64_t committed_ = 0, counted_ = 0;
  bool pending_ = false, in_step_ = false;
  bool primary_applied_ = false;  // of the pending step
  std::vector<std::int64_t> param_offsets_;  // each model parameter's first element in model order
};

}  // namespace tessera
