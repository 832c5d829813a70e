// ElasticTrainer: data-parallel training that goes on when a rank dies, stalls past the timeout or
// is cut off, and takes in replacements, without restarting the processes that stay and without a
// checkpoint file (torchft's model; TorchElastic restarts every worker from the last checkpoint).
//
//   auto group = ElasticGroupOf<Comm>::from_env();           // comm/elastic.hpp (Gloo: gloo_elastic.hpp)
//   auto model = lenet5<E>(...);
//   Sgd<E> sgd(named_tensors(model), {...});
//   ElasticTrainer trainer(group, model, sgd,
//       [&](std::optional<DataParallel<E>>& dp, Comm& comm) { dp.emplace(model, comm, dp_options); },
//       schedule, train_options);
//   trainer.fit(train_set, {.global_batch_size = 64, .shuffle = true, .seed = 1}, &test_loader);
//
// Each generation of the group (comm/elastic.hpp) gets a fresh strategy (the callback builds it on
// the generation's communicator), a fresh loader (the global batch split over however many ranks
// there are now, data/loader.hpp's global batches) and a fresh Trainer; the model and optimizer
// live on. Before the first step of each generation the members heal:
//
//   1. one all_gather of (holds a state, optimizer steps taken) per member;
//   2. the source is the member with the most steps (the lowest rank among equals): a step that
//      some members applied and others did not (the failure came between the all-reduce's end on
//      one rank and on another) counts as taken, because a member finishes the all-reduce only
//      with every rank's contribution in it, so its update is that of the full global batch;
//   3. the source broadcasts every parameter and buffer, the optimizer's state (momentum, step
//      count) and the training position (epoch, step, loader position) to all members.
//
// So after a failure the step in flight is finished consistently (or dropped, where nobody
// finished it) and every member continues from the same state; a replacement gets the whole state
// from the source, bit for bit. The global batch stays fixed, each batch covers the same samples
// at every group size, and each rank's gradient is weighted by its share (Batch::weight), so the
// run follows the one-process trajectory as far as floating-point summation order allows.
// Random generators a model owns (Dropout): survivors keep their own streams; a replacement takes
// the source's, mixed with its new rank, so no two members draw the same masks.
// Per-rank strategy state (top-k residuals) starts afresh at each generation, as in an elastic
// resume.
//
// A member that fails to heal (a death during the broadcasts) no longer counts as holding a
// state unless it was the source; if no member holds one, fit() throws: the run must resume
// from a checkpoint.
//
// A sharded optimizer has no member that holds the whole state. ReplicatedZero1
// (parallel/zero_replicated.hpp: ZeRO-1 with each shard on two ranks) heals through its
// regroup(comm): the shards are rebuilt for the new size from the members holding them (rolled
// forward to the agreed step where a member missed its commit) and the parameters written; then
// the lowest-ranked member whose Trainer counted that step broadcasts buffers, generators and the
// training position. Its step() keeps a failure that comes after the step's commit, and the
// after_step hook rethrows it, so the Trainer has counted the step when the heal starts:
//
//   ReplicatedZero1<E, Sgd<E>> zero(model, [](const NamedTensors<E>& s) { return Sgd<E>(s, {...}); });
//   ElasticTrainer trainer(group, model, zero, [](std::optional<NoStrategy<E>>& s, Comm&) { s.emplace(); }, ...);
//
// FSDP (stage 2 and 3) the same way through ReplicatedFullyShardedOptimizer
// (parallel/fully_sharded_replicated.hpp), whose shard lives in the strategy: after its regroup the
// callback builds the generation's FSDP from the model and the trainer hands it to the optimizer's
// bind(); the previous FSDP (its pieces are this member's shard) lives until then. fit() returns
// with the FSDP's parameters gathered into the model.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tessera/comm/communicator.hpp"
#include "tessera/comm/elastic.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/random.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/parallel/zero_replicated.hpp"
#include "tessera/train/checkpoint.hpp"
#include "tessera/train/trainer.hpp"

namespace tessera {

namespace detail {

// Thrown by the Trainer's after_step hook when the group grows at this step: leaves fit() there.
struct GroupGrows {
  std::int64_t step;
};

// Broadcasts, from `source`, everything visit_all visits: parameters, buffers, optimizer state,
// training position. Generators: a member that held no state takes the source's, mixed with its
// rank; the others keep their own.
template <class Comm>
struct HealBroadcast {
  Comm& comm;
  int source;
  bool fresh;  // this member held no state: it takes everything, generators included
  template <class P>
  void parameter(const std::string& name, P& p) {
    buffer(name, p.value);
  }
  template <class S, class D>
  void buffer(const std::string&, Tensor<S, D>& t) {
    if (t.numel() > 0) comm.broadcast(std::span<S>(t.data(), static_cast<std::size_t>(t.numel())), source);
  }
  void integer_buffer(const std::string&, std::int64_t& v) { comm.broadcast(std::span<std::int64_t>(&v, 1), source); }
  void integer(const std::string&, std::int64_t& v) { comm.broadcast(std::span<std::int64_t>(&v, 1), source); }
  void optional_integer(const std::string& name, std::int64_t& v) { integer(name, v); }
  void rng(const std::string&, Rng& r) {
    std::array<std::int64_t, kRngWords> words{};
    pack_rng(r.state(), words.data());
    comm.broadcast(std::span<std::int64_t>(words), source);
    if (!fresh) return;
    Rng::State s = unpack_rng(words.data());
    // A stream of its own: the source's state, each word mixed with the new rank (splitmix64).
    for (auto& w : s.words) {
      std::uint64_t z = w ^ (0x9e3779b97f4a7c15ULL * static_cast<std::uint64_t>(comm.rank() + 1));
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
      w = z ^ (z >> 31);
    }
    s.has_spare_normal = false;
    r.set_state(s);
  }
};

// HealBroadcast without the parameters (a sharded optimizer's regroup wrote them).
template <class Comm>
struct HealBroadcastBuffers : HealBroadcast<Comm> {
  template <class P>
  void parameter(const std::string&, P&) {}
};

}  // namespace detail

// What ElasticTrainer::fit saw of one membership change, for logs and benchmarks.
struct ElasticEvent {
  MembershipChange change;
  int source_rank = 0;         // the member whose state the group took (its new rank)
  std::int64_t healed_step = 0;  // optimizer steps taken in the state the group continues from
  double heal_seconds = 0;     // the heal's broadcasts
};

struct ElasticTrainOptions {
  // Called on every member after each heal (e.g. to print or check the members' parameters).
  std::function<void(const ElasticEvent&)> on_change;
};

template <ElasticGroup G, class Model, class Optimizer, class Strat>
class ElasticTrainer {
 public:
  using E = typename Model::Env;
  using S = typename E::Scalar;
  using Comm = typename G::Comm;
  using TrainerType = Trainer<Model, Optimizer, Strat>;
  using MakeStrategy = std::function<void(std::optional<Strat>& strategy, Comm& comm)>;

  ElasticTrainer(G& group, Model& model, Optimizer& optimizer, MakeStrategy make_strategy,
                 typename TrainerType::Schedule schedule, TrainOptions options, ElasticTrainOptions elastic = {})
      : group_(group),
        model_(model),
        optimizer_(optimizer),
        make_strategy_(std::move(make_strategy)),
        schedule_(std::move(schedule)),
        options_(std::move(options)),
        elastic_(std::move(elastic)) {
    TESSERA_CHECK(options_.checkpoint_group.size() <= 1, ArgumentError, "ElasticTrainer: leave TrainOptions::"
                  "checkpoint_group unset: each generation's communicator is the group");
  }

  // Trains on `data` (a Dataset or SampleSource) until options.epochs are complete, through any
  // number of membership changes. `loader` gives the global batch (global_batch_size) and the
  // order (shuffle, seed); its rank and world_size are each generation's. Returns every epoch
  // completed (the figures of an epoch interrupted by a change count from the change on).
  template <class Data, class TestLoader>
  std::vector<EpochResult> fit(const Data& data, LoaderOptions loader, TestLoader* test) {
    TESSERA_CHECK(loader.global_batch_size > 0 && loader.batch_size == 0, ArgumentError, "ElasticTrainer::fit: give "
                  "the loader a global_batch_size (and batch_size 0): the group's size changes, the global batch "
                  "does not");
    std::vector<EpochResult> results;
    TrainState state;
    bool holds = !group_.joined_late();
    std::optional<ElasticEvent> pending;  // the change to report after the next heal
    if (group_.joined_late()) {  // this process's own arrival
      pending.emplace();
      pending->change.generation = group_.generation();
      pending->change.joined = {group_.member()};
      pending->change.cause = "joined as a replacement";
    }
    for (;;) {
      const int slot = bound_ == 0 ? 1 : 0;
      std::optional<Strat>& strategy = strategies_[static_cast<std::size_t>(slot)];
      std::optional<DataLoader<S>> train;
      std::optional<TrainerType> trainer;
      try {
        Comm& comm = group_.comm();
        const auto heal_start = std::chrono::steady_clock::now();
        const int source = heal(comm, state, holds);
        holds = true;
        if (pending) {
          pending->source_rank = source;
          pending->healed_step = state.global_step;
          pending->heal_seconds =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - heal_start).count();
          pending->change.step = state.global_step;
          report(*pending);
          pending.reset();
        }
        LoaderOptions mine = loader;
        mine.rank = comm.rank();
        mine.world_size = comm.size();
        train.emplace(data, mine);
        strategy.reset();
        make_strategy_(strategy, comm);
        TESSERA_CHECK(strategy.has_value(), ArgumentError, "ElasticTrainer: the strategy callback built no strategy");
        if constexpr (kBinds) {
          optimizer_.bind(*strategy);
          bound_ = slot;
          strategies_[static_cast<std::size_t>(1 - slot)].reset();
        }
        TrainOptions o = options_;
        o.checkpoint_group = CheckpointGroup(comm);
        o.verbose = options_.verbose && comm.rank() == 0;
        o.after_step = [this, &trainer] {
          // A sharded optimizer's failure after its commit (the step is taken and counted).
          if constexpr (requires { optimizer_.rethrow_deferred_failure(); }) optimizer_.rethrow_deferred_failure();
          if (options_.after_step) options_.after_step();
          const std::int64_t step = trainer->state().global_step;
          if (group_.growth_due(step)) throw detail::GroupGrows{step};
        };
        trainer.emplace(model_, optimizer_, *strategy, schedule_, o);
        trainer->set_state(state);
        // One epoch per fit(), so that the epochs a generation completes are kept when a later
        // one is interrupted (fit() returns nothing when it throws).
        while (trainer->state().epoch < options_.epochs) {
          const auto done = trainer->fit(*train, test, trainer->state().epoch + 1);
          results.insert(results.end(), done.begin(), done.end());
          if (done.empty()) break;  // stopped: stop_after_steps, or a stop signal
        }
        // A sharded strategy's parameters into the model (FSDP: collective), for the caller to read.
        if constexpr (requires { strategy->gather_full(); }) strategy->gather_full();
        // A replacement still waiting for admission stops (Gloo: a key in the store).
        if constexpr (requires { group_.finished(std::int64_t{}); }) group_.finished(trainer->state().global_step);
        return results;
      } catch (const detail::GroupGrows& grows) {
        state = trainer->state();
        trainer.reset();
        if (bound_ != slot) strategy.reset();
        train.reset();
        const auto before = group_.history().size();
        group_.grow(grows.step);
        pending = event_since(before);
      } catch (const CommError& e) {
        if (trainer) state = trainer->state();
        trainer.reset();
        if (bound_ != slot) strategy.reset();
        train.reset();
        // A death during the heal's broadcasts may have left this member's state half overwritten.
        if (state_at_risk_ && !was_source_) holds = false;
        state_at_risk_ = false;
        if (options_.verbose) {
          std::fprintf(stderr, "tessera: elastic: member %s (rank %d of %d, generation %lld) after step %lld: %s\n",
                       group_.member().c_str(), group_.comm().rank(), group_.comm().size(),
                       static_cast<long long>(group_.generation()), static_cast<long long>(state.global_step),
                       e.what());
          std::fflush(stderr);
        }
        const auto before = group_.history().size();
        group_.reform(e.what());
        pending = event_since(before);
      }
    }
  }

  const std::vector<ElasticEvent>& events() const { return events_; }

  // A bound optimizer lets go of the strategy that holds its shard before the strategy goes.
  ~ElasticTrainer() {
    if constexpr (kBinds) optimizer_.unbind();
  }
  ElasticTrainer(const ElasticTrainer&) = delete;
  ElasticTrainer& operator=(const ElasticTrainer&) = delete;

 private:
  std::optional<ElasticEvent> event_since(std::size_t before) const {
    if (group_.history().size() <= before) return std::nullopt;
    ElasticEvent event;
    event.change = group_.history().back();
    return event;
  }

  void report(const ElasticEvent& event) {
    events_.push_back(event);
    if (options_.verbose && group_.comm().rank() == 0) {
      std::string left, joined;
      for (const auto& m : event.change.left) left += (left.empty() ? "" : ", ") + m;
      for (const auto& m : event.change.joined) joined += (joined.empty() ? "" : ", ") + m;
      std::printf("elastic: generation %lld: %d -> %d ranks%s%s%s%s at step %lld, state from rank %d; membership "
                  "%.3f s, heal %.3f s\n",
                  static_cast<long long>(event.change.generation), event.change.size_before, event.change.size_after,
                  left.empty() ? "" : " (left: ", left.c_str(), left.empty() ? "" : ")",
                  joined.empty() ? "" : (" (joined: " + joined + ")").c_str(),
                  static_cast<long long>(event.healed_step), event.source_rank, event.change.seconds,
                  event.heal_seconds);
      std::fflush(stdout);
    }
    if (elastic_.on_change) elastic_.on_change(event);
  }

  // The heal (see the top of this file). Returns the source's rank.
  int heal(Comm& comm, TrainState& state, bool holds) {
    if constexpr (requires { optimizer_.regroup(comm, holds, std::int64_t{}); }) return heal_sharded(comm, state, holds);
    was_source_ = false;
    const std::int64_t mine[2] = {holds ? 1 : 0, holds ? state.global_step : -1};
    std::vector<std::int64_t> all(2 * static_cast<std::size_t>(comm.size()));
    comm.all_gather(std::span<const std::int64_t>(mine, 2), std::span<std::int64_t>(all));
    int source = -1;
    for (int q = 0; q < comm.size(); ++q)
      if (all[2 * static_cast<std::size_t>(q)] != 0 &&
          (source < 0 || all[2 * static_cast<std::size_t>(q) + 1] > all[2 * static_cast<std::size_t>(source) + 1]))
        source = q;
    TESSERA_CHECK(source >= 0, Error, "ElasticTrainer: no member of generation ", group_.generation(), " holds the "
                  "training state (every holder died, or died while handing it over); resume from a checkpoint");
    was_source_ = source == comm.rank();
    detail::HealBroadcast<Comm> broadcast{comm, source, !holds};
    state_at_risk_ = true;
    detail::visit_all(model_, optimizer_, state, broadcast);
    state_at_risk_ = false;
    return source;
  }

  // The heal of a sharded optimizer (parallel/zero_replicated.hpp): its regroup rebuilds the
  // shards from the members that hold them and writes the parameters; then the lowest-ranked
  // member whose Trainer counted the agreed step broadcasts buffers, generators and position.
  int heal_sharded(Comm& comm, TrainState& state, bool holds) {
    was_source_ = false;
    const RegroupResult agreed = optimizer_.regroup(comm, holds, group_.generation());
    // A member behind the agreed step (rolled forward) holds the training position only once the
    // broadcast below gave it: if the heal fails before, it must not count as holding one.
    state_at_risk_ = !agreed.current;
    const std::int64_t mine = agreed.current ? 1 : 0;
    std::vector<std::int64_t> all(static_cast<std::size_t>(comm.size()));
    comm.all_gather(std::span<const std::int64_t>(&mine, 1), std::span<std::int64_t>(all));
    const auto it = std::find(all.begin(), all.end(), 1);
    TESSERA_CHECK(it != all.end(), Error, "ElasticTrainer: no member of generation ", group_.generation(), " holds the "
                  "training position at step ", agreed.step, " (every holder died, or died while handing it over); "
                  "resume from a checkpoint");
    const int source = static_cast<int>(it - all.begin());
    was_source_ = source == comm.rank();
    detail::HealBroadcastBuffers<Comm> broadcast{{comm, source, !holds}};
    state_at_risk_ = true;
    model_.visit(broadcast, "");
    detail::visit_train_state(state, broadcast);
    state_at_risk_ = false;
    return source;
  }

  G& group_;
  Model& model_;
  Optimizer& optimizer_;
  MakeStrategy make_strategy_;
  typename TrainerType::Schedule schedule_;
  TrainOptions options_;
  ElasticTrainOptions elastic_;
  std::vector<ElasticEvent> events_;
  bool was_source_ = false;
  bool state_at_risk_ = false;
  // A strategy bound to the optimizer (ReplicatedFullyShardedOptimizer::bind: the FSDP's pieces
  // are this member's shard) lives until the next generation's is bound, and as long as this
  // trainer (a second fit() goes on from it); the others are rebuilt at each generation. Two
  // slots, used in turn; bound_ is the bound one's (-1: none).
  static constexpr bool kBinds = requires(Optimizer& o, Strat& s) { o.bind(s); };
  std::array<std::optional<Strat>, 2> strategies_;
  int bound_ = -1;  // in a heal's broadcasts, where a failure leaves the state half overwritten
};

}  // namespace tessera
