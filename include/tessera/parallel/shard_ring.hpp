// The ring of replicated shards that ReplicatedZero1 (zero_replicated.hpp) and
// ReplicatedFullyShardedOptimizer (fully_sharded_replicated.hpp) share: shard s of a generation of
// N ranks lives on rank s (its primary) and on rank s-1 mod N (its replica), and each step is
// committed by a one-int64 all-reduce before anyone updates (zero_replicated.hpp says why that makes
// a failure recoverable without an undo log). What is here: one step's gradient exchange and
// commit, and a regroup's agreement (which layout survives, which step the group continues from).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tessera/comm/communicator.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/parameter.hpp"
#include "tessera/optim/optimizer.hpp"
#include "tessera/parallel/agreement.hpp"

namespace tessera {

// What a regroup agreed on, for ElasticTrainer's heal.
struct RegroupResult {
  std::int64_t step = 0;  // optimizer steps taken in the state the group continues from
  bool current = false;   // this member had taken them before the regroup (its Trainer counted them)
};

namespace detail {

// Step, after the gradients of this rank's shard are averaged (`mine`): the replica holder (rank
// r-1) gets them too, and this rank gets shard r+1's (`replica`).
template <class Comm, class S>
void exchange_shard_gradients(Comm& comm, std::span<const S> mine, std::span<S> replica) {
  const int n = comm.size(), r = comm.rank();
  if (n == 1) return;
  Work received = comm.recv_async(replica, (r + 1) % n);
  comm.send(mine, (r + n - 1) % n);
  received.wait();
}

// The commit of `step`: its sum is N only when every rank holds both gradients of the step (a rank
// that finishes an all-reduce holds every rank's contribution). `who` names the caller.
template <class Comm>
void commit_step(Comm& comm, std::int64_t step, const char* who) {
  if (comm.size() == 1) return;
  std::int64_t entered = 1;
  comm.all_reduce(std::span<std::int64_t>(&entered, 1), ReduceOp::Sum);
  TESSERA_CHECK(entered == comm.size(), CommError, who, ": the commit of step ", step, " counted ", entered, " of ",
                comm.size(), " ranks");
}

// One member's state as every member sees it in a regroup: its layout (the generation that built
// it, its size and this member's rank in it; -1 without one), the steps it committed, whether it
// holds the gradients of the next, whether its Trainer state is valid, and what it was built for.
struct ShardRecord {
  std::int64_t layout = -1, size = 0, rank = -1, committed = 0, pending = 0, holds = 0, total = 0, kinds = 0,
               integers = 0;
  static constexpr std::size_t kWords = 9;
  std::array<std::int64_t, kWords> words() const {
    return {layout, size, rank, committed, pending, holds, total, kinds, integers};
  }
  static ShardRecord of(const std::int64_t* w) { return {w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7], w[8]}; }
};

// The shards of an earlier layout that a member keeps after a regroup, until the new layout's
// first commit: a second failure before that commit (during the regroup's broadcasts, once some
// members have built the new layout and others not) can leave the new layout without a shard while
// the old one still has all of them. `record` says which (layout -1: none); `packed[i][k]` is
// shard record.rank + i of that layout in the form the regroup broadcasts it (k = 0: values, then
// each kind of state); `integers`: the optimizer's. Memory: two shards' values and state, held
// from a change until the next step commits.
template <class S>
struct KeptShards {
  ShardRecord record;
  std::array<std::vector<std::vector<S>>, 2> packed;
  std::vector<std::int64_t> integers;
  const std::vector<S>& shard(std::int64_t s, std::size_t k) const {
    return packed[s == record.rank ? 0 : 1][k];
  }
};

// Every member's records (one all_gather): its current layout's, then its kept one's (layout -1:
// none), so records[q] is member q's current layout and records[N + q] the one it keeps; a
// holder index q >= N (shard_holder) means member q - N, from its kept shards. Members built for
// another model or optimizer are refused.
template <class Comm>
std::vector<ShardRecord> gather_shard_records(Comm& comm, const ShardRecord& mine, const ShardRecord& kept,
                                              const char* who) {
  std::array<std::int64_t, 2 * ShardRecord::kWords> words{};
  std::copy_n(mine.words().begin(), ShardRecord::kWords, words.begin());
  std::copy_n(kept.words().begin(), ShardRecord::kWords, words.begin() + ShardRecord::kWords);
  const std::size_t n = static_cast<std::size_t>(comm.size());
  std::vector<std::int64_t> gathered(words.size() * n);
  comm.all_gather(std::span<const std::int64_t>(words), std::span<std::int64_t>(gathered));
  std::vector<ShardRecord> all(2 * n);
  for (std::size_t q = 0; q < n; ++q) {
    const ShardRecord r = ShardRecord::of(&gathered[words.size() * q]);
    TESSERA_CHECK(r.total == mine.total && r.kinds == mine.kinds && r.integers == mine.integers, AgreementError, who,
                  ": rank ", q, " has ", r.total, " parameters, ", r.kinds, " kind(s) of optimizer state and ",
                  r.integers, " integer(s); rank ", comm.rank(), " has ", mine.total, ", ", mine.kinds, " and ",
                  mine.integers, ": the members were launched with different models or optimizers");
    all[q] = r;
    all[n + q] = ShardRecord::of(&gathered[words.size() * q + ShardRecord::kWords]);
  }
  return all;
}

// Member `rank`'s record of layout `id`, as its current layout or as kept shards; null if it holds none.
inline const ShardRecord* held_record(const std::vector<ShardRecord>& records, int rank, std::int64_t id) {
  const std::size_t n = records.size() / 2;
  for (const ShardRecord* r : {&records[static_cast<std::size_t>(rank)], &records[n + static_cast<std::size_t>(rank)]})
    if (r->layout == id) return r;
  return nullptr;
}

// What member `rank` keeps of layout `id` (`size` ranks) after a regroup that chose it: the two
// shards it held there, as its current layout or as kept ones, copied out of `shard_of(s, k)` (the
// broadcast form); nothing when it held none.
template <class S, class ShardOf>
KeptShards<S> keep_shards(const std::vector<ShardRecord>& records, int rank, std::int64_t id, std::int64_t size,
                          std::int64_t committed, std::size_t kinds, const std::vector<std::int64_t>& integers,
                          const ShardOf& shard_of) {
  KeptShards<S> kept;
  const ShardRecord* held = held_record(records, rank, id);
  if (held == nullptr) return kept;
  kept.record = *held;
  kept.record.committed = committed;
  kept.record.pending = kept.record.holds = 0;
  for (std::size_t i = 0; i < (size > 1 ? 2u : 1u); ++i)
    for (std::size_t k = 0; k <= kinds; ++k) {
      const auto piece = shard_of((kept.record.rank + static_cast<std::int64_t>(i)) % size, k);
      kept.packed[i].emplace_back(piece.begin(), piece.end());
    }
  kept.integers = integers;
  return kept;
}

// The record (gather_shard_records' index) of a member of layout `id` (of `size` ranks) holding
// shard s, preferring its primary (rank s) to its replica (rank s-1); -1 when both are gone.
inline int shard_holder(const std::vector<ShardRecord>& records, std::int64_t id, std::int64_t size, std::int64_t s) {
  int replica = -1;
  for (std::size_t q = 0; q < records.size(); ++q) {
    if (records[q].layout != id) continue;
    if (records[q].rank == s) return static_cast<int>(q);
    if (size > 1 && records[q].rank == (s + size - 1) % size) replica = static_cast<int>(q);
  }
  return replica;
}

// The newest layout among the members whose every shard survives, with its size; {-1, 0} when no
// member has one (the first regroup). Every layout with a lost shard and none complete: Error.
inline std::pair<std::int64_t, std::int64_t> choose_shard_layout(const std::vector<ShardRecord>& records,
                                                                 const char* who) {
  std::vector<std::pair<std::int64_t, std::int64_t>> layouts;  // (generation, size)
  for (const ShardRecord& r : records)
    if (r.layout >= 0 && std::find(layouts.begin(), layouts.end(), std::pair{r.layout, r.size}) == layouts.end())
      layouts.emplace_back(r.layout, r.size);
  if (layouts.empty()) return {-1, 0};
  std::sort(layouts.rbegin(), layouts.rend());
  std::string lost;
  for (const auto& [id, size] : layouts) {
    std::string missing;
    for (std::int64_t s = 0; s < size; ++s)
      if (shard_holder(records, id, size, s) < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(s);
    if (missing.empty()) return {id, size};
    lost += cat(lost.empty() ? "" : "; ", "generation ", id, " (", size, " ranks) lost shard(s) ", missing);
  }
  throw Error(cat(who, ": the optimizer state is lost: ", lost, ". Shard s lives on ranks s and s-1 of its "
                  "generation, and both died; resume from a checkpoint"));
}

// The step the group continues from in layout `id`: the most any member committed; the others
// must be one behind with that step's gradients.
inline std::int64_t agreed_shard_step(const std::vector<ShardRecord>& records, std::int64_t id, const char* who) {
  std::int64_t target = -1;
  for (const ShardRecord& r : records)
    if (r.layout == id) target = std::max(target, r.committed);
  const std::size_t n = records.size() / 2;  // gather_shard_records: current layouts, then kept ones
  for (std::size_t q = 0; q < records.size(); ++q) {
    const ShardRecord& r = records[q];
    if (r.layout != id) continue;
    TESSERA_CHECK(r.committed == target || (r.committed == target - 1 && r.pending != 0), Error, who, ": rank ", q % n,
                  (q >= n ? " (the shards it kept: " : " ("), "rank ", r.rank, " of generation ", id, ") has committed ",
                  r.committed, " steps and others ", target,
                  (r.committed == target - 1 ? " but it lacks the gradients of the step between" : ""),
                  ": their shards cannot be brought to one step; resume from a checkpoint");
  }
  return target;
}

// An optimizer's integers ("optim.step") in visit order, out of and into a vector.
struct IntegersOut {
  std::vector<std::int64_t>& out;
  void integer(const std::string&, std::int64_t& v) { out.push_back(v); }
};
struct IntegersIn {
  const std::vector<std::int64_t>& in;
  std::size_t next = 0;
  void integer(const std::string&, std::int64_t& v) { v = in[next++]; }
};
struct IntegerNames {
  std::vector<std::string>& names;
  void integer(const std::string& name, std::int64_t&) { names.push_back(name); }
};
template <class O>
std::vector<std::int64_t> optimizer_integers(O& optimizer) {
  std::vector<std::int64_t> values;
  IntegersOut out{values};
  StateIntegersOf<IntegersOut> visitor{out};
  optimizer.visit_state(visitor);
  return values;
}
template <class O>
void set_optimizer_integers(O& optimizer, const std::vector<std::int64_t>& values) {
  IntegersIn in{values};
  StateIntegersOf<IntegersIn> visitor{in};
  optimizer.visit_state(visitor);
}

// What every shard optimizer the callback `make` builds will have, read off a one-element probe so
// that the whole state is never allocated: its learning rate, its kinds of state
// ("optim.<kind>.<param>") and its integers ("optim.step").
struct OptimizerProbe {
  double lr = 0;
  std::vector<std::string> kinds, integer_names;
};
template <class E, class Make>
OptimizerProbe probe_optimizer(const Make& make, const char* who) {
  using S = typename E::Scalar;
  using D = typename E::Device;
  Parameter<S, D> param(Shape{1}, ParamKind::Weight);
  NamedTensors<E> named;
  named.parameter("probe", param);
  auto probe = make(named);
  OptimizerProbe out;
  out.lr = probe.lr();
  const std::map<std::string, std::size_t> piece_of{{"probe", 0}};
  for (auto& [kind, tensors] : state_by_kind<S, D>(probe, piece_of, 1, who)) out.kinds.push_back(kind);
  IntegerNames names{out.integer_names};
  StateIntegersOf<IntegerNames> ints{names};
  probe.visit_state(ints);
  return out;
}

}  // namespace detail
}  // namespace tessera
