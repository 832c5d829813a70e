// The strategy protocol: how a parallelism strategy plugs into the Trainer's step.
//
// One training step, as the Trainer (train/trainer.hpp) drives a strategy `s` (a single strategy or
// a Stack of them; docs/design.md has the sequence diagram):
//
//   s.start()                                   once, before the first step (collective)
//   optimizer.zero_grad()
//   loss = s.run_micro_batches(batch, step)     the micro-batch loop; the default runs one,
//     step(micro, mb):                          what the Trainer does per micro-batch mb:
//       s.before_forward(mb)                      (gather sharded parameters)
//       forward, loss x mb.weight
//       s.before_backward(mb)                     (DataParallel: sync only on the last micro-batch,
//       backward                                   like no_sync; a sharded model gathers again)
//         -> parameters' grad_ready hooks          (the strategy's own: DataParallel buckets there)
//       s.after_backward(mb)                      (free gathered parameters)
//   s.before_optimizer_step()                   DataParallel: finish() (wait for the all-reduces)
//   optimizer.step()
//   s.after_optimizer_step()                    LocalSgd: average every k steps
//
// plus, outside the step: s.save_state / s.load_state (per-rank state kept in the checkpoint: top-k
// residuals, LocalSgd's step count) and s.set_timeline (where the strategy records its spans).
//
// A strategy that splits the model over ranks (Pipeline: each stage runs some of its units) runs
// forward, loss and backward itself: it says so with `static constexpr bool kRunsModel = true`,
// and the Trainer calls, instead of run_micro_batches,
//   r = s.run_model(input, labels, hooks)       its own micro-batch loop (input: the batch's images, or
//                                               its token ids for a TokenModel), calling hooks.before_forward,
//                                               hooks.before_backward and hooks.after_backward (the
//                                               whole stack's) around each micro-batch, in its order
//                                               (1F1B interleaves them); r: mean loss and correct
//                                               predictions, the same on every rank it spans
//   r = s.evaluate_batch(input, labels)         forward only, the same figures
// and s.sample_copies() tells how many ranks of the Trainer's group see each sample (a pipeline's
// P stages), so that the epoch's figures count each sample once.
//
// A strategy whose ranks' optimizer states differ (LocalSgd: each rank's momentum follows its own
// gradients, and averaging the parameters leaves it alone) says so with `static constexpr bool
// kPerRankOptimizerState = true`; the checkpoint holds rank 0's optimizer state, so the Trainer
// also keeps each rank's own beside it, with the strategy state, and a resume restores it.
//
// A strategy derives from StrategyBase<E>, whose members do nothing, and overrides what it needs
// (as a parameter-free layer derives from ParameterFree). check_strategy<S>() names each missing
// member in one sentence, as check_layer does for layers.
//
// Gradient ready is the one hook the Trainer does not call: gradients become final one parameter
// at a time inside model.backward, so a strategy that acts on them installs the parameters'
// on_grad_ready hook itself (at construction) and says so with kHooksGradients. Two such
// strategies on one model cannot stack: each parameter has one hook.
//
// Stacking. stack(a, b, ...) is a strategy that calls every member's hooks: the "before" hooks
// and start in the order given, the "after" hooks in reverse (the outermost strategy sees the
// step first and last), state from each. At most one member may own the micro-batch loop
// (kOwnsMicroBatchLoop: gradient accumulation, a pipeline schedule); the stack delegates the loop
// to it. check_stack<S...>() refuses, at compile time, members of different Envs, two loop owners
// and two gradient hooks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "tessera/core/concepts.hpp"
#include "tessera/core/env.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/span_sink.hpp"
#include "tessera/data/loader.hpp"

namespace tessera {

// Micro-batch `index` of the step's `count`; `weight` is its share of the step's samples
// (n_i / n), by which the Trainer scales its loss: the summed gradients of the micro-batches are
// then the gradient of the mean loss over the whole batch.
struct MicroBatch {
  int index = 0;
  int count = 1;
  double weight = 1.0;
  bool last() const { return index + 1 == count; }
};

// What a model-running strategy (kRunsModel) returns for a batch: the mean loss over it and the
// count of correct top-1 predictions (0 where the loss is not a classification's).
struct ModelStepResult {
  double loss = 0;
  std::int64_t correct = 0;
};

// What a micro-batch loop calls for each micro-batch: forward, loss, backward with the strategy's
// hooks around them. Returns the micro-batch's mean loss (unweighted).
template <class S>
using MicroStep = std::function<double(const Batch<S>& micro_batch, const MicroBatch& mb)>;

// Per-rank state a strategy keeps across a checkpoint, as named arrays of float64 (exact for float
// and double values, and for counts below 2^53). The Trainer writes it beside the checkpoint, one
// file per rank (train/trainer.hpp).
class StrategyState {
 public:
  template <class T>
  void put(const std::string& name, std::span<const T> values) {
    TESSERA_CHECK(find(name) == nullptr, ArgumentError, "StrategyState: '", name,
                  "' is stored twice (two strategies of a stack use the same name)");
    entries_.emplace_back(name, std::vector<double>(values.begin(), values.end()));
  }
  void put(const std::string& name, std::int64_t value) { put(name, std::span<const std::int64_t>(&value, 1)); }
  // Copies entry `name` into `out`, which must hold exactly its values.
  template <class T>
  void get(const std::string& name, std::span<T> out) const {
    const std::vector<double>* v = find(name);
    TESSERA_CHECK(v != nullptr, ArgumentError, "StrategyState: no entry '", name, "'");
    TESSERA_CHECK(v->size() == out.size(), ArgumentError, "StrategyState: '", name, "' holds ", v->size(),
                  " values; ", out.size(), " expected");
    std::transform(v->begin(), v->end(), out.begin(), [](double x) { return static_cast<T>(x); });
  }
  std::int64_t get_int(const std::string& name) const {
    std::int64_t value = 0;
    get(name, std::span<std::int64_t>(&value, 1));
    return value;
  }
  const std::vector<double>* find(const std::string& name) const {
    for (const auto& [n, v] : entries_)
      if (n == name) return &v;
    return nullptr;
  }
  const std::vector<std::pair<std::string, std::vector<double>>>& entries() const { return entries_; }
  bool empty() const { return entries_.empty(); }

 private:
  std::vector<std::pair<std::string, std::vector<double>>> entries_;
};

// The do-nothing hooks. A strategy derives from it and defines name() and what it acts on.
template <class E>
struct StrategyBase {
  using Env = E;
  static constexpr bool kOwnsMicroBatchLoop = false;
  static constexpr bool kHooksGradients = false;
  void start() {}
  void before_forward(const MicroBatch&) {}
  void before_backward(const MicroBatch&) {}
  void after_backward(const MicroBatch&) {}
  void before_optimizer_step() {}
  void after_optimizer_step() {}
  double run_micro_batches(const Batch<typename E::Scalar>& batch, const MicroStep<typename E::Scalar>& step) {
    return step(batch, MicroBatch{});
  }
  void save_state(StrategyState&) const {}
  void load_state(const StrategyState&) {}
  void set_timeline(SpanSink*) {}
};

// One process, nothing to synchronize: the Trainer's strategy when it is given none.
template <class E>
struct NoStrategy : StrategyBase<E> {
  std::string name() const { return "none"; }
};

namespace detail {
template <class T> concept StrategyHasEnv = requires { typename T::Env; };
template <class T> concept StrategyHasName = requires(const T& s) { { s.name() } -> std::convertible_to<std::string>; };
template <class T> concept StrategyHasFlags = requires {
  { T::kOwnsMicroBatchLoop } -> std::convertible_to<bool>;
  { T::kHooksGradients } -> std::convertible_to<bool>;
};
template <class T> concept StrategyHasStart = requires(T& s) { s.start(); };
template <class T> concept StrategyHasForwardHooks = requires(T& s, const MicroBatch& mb) {
  s.before_forward(mb);
  s.before_backward(mb);
  s.after_backward(mb);
};
template <class T> concept StrategyHasStepHooks = requires(T& s) {
  s.before_optimizer_step();
  s.after_optimizer_step();
};
template <class T> concept StrategyHasLoop = StrategyHasEnv<T> &&
    requires(T& s, const Batch<typename T::Env::Scalar>& b, const MicroStep<typename T::Env::Scalar>& step) {
      { s.run_micro_batches(b, step) } -> std::convertible_to<double>;
    };
template <class T> concept StrategyHasState = requires(T& s, const T& cs, StrategyState& out, const StrategyState& in) {
  cs.save_state(out);
  s.load_state(in);
};
template <class T> concept StrategyHasTimeline = requires(T& s, SpanSink* t) { s.set_timeline(t); };

// Whether T runs the model itself (kRunsModel, optional: false when absent).
template <class T>
consteval bool strategy_runs_model() {
  if constexpr (requires { T::kRunsModel; }) return T::kRunsModel;
  else return false;
}
// Whether the ranks' optimizer states differ (kPerRankOptimizerState, optional: false when absent).
template <class T>
consteval bool strategy_per_rank_optimizer_state() {
  if constexpr (requires { T::kPerRankOptimizerState; }) return T::kPerRankOptimizerState;
  else return false;
}
// How many ranks of the Trainer's group see each sample (optional member; 1 when absent).
template <class T>
int sample_copies(const T& s) {
  if constexpr (requires { { s.sample_copies() } -> std::convertible_to<int>; }) return s.sample_copies();
  else return 1;
}
}  // namespace detail

template <class T>
concept Strategy = detail::StrategyHasEnv<T> && detail::StrategyHasName<T> && detail::StrategyHasFlags<T> &&
                   detail::StrategyHasStart<T> && detail::StrategyHasForwardHooks<T> &&
                   detail::StrategyHasStepHooks<T> && detail::StrategyHasLoop<T> && detail::StrategyHasState<T> &&
                   detail::StrategyHasTimeline<T>;

// check_strategy<S>(): the Strategy concept, one sentence per missing member; the compiler's "In
// instantiation of ... [with S = ...]" line above it names the type. Deriving from
// StrategyBase<E> supplies every member but name().
template <class T>
consteval bool check_strategy() {
  constexpr bool has_env = detail::StrategyHasEnv<T>, has_name = detail::StrategyHasName<T>,
                 has_flags = detail::StrategyHasFlags<T>, has_start = detail::StrategyHasStart<T>,
                 has_forward = detail::StrategyHasForwardHooks<T>, has_step = detail::StrategyHasStepHooks<T>,
                 has_state = detail::StrategyHasState<T>, has_timeline = detail::StrategyHasTimeline<T>;
  static_assert(has_env, "Tessera Strategy: missing `using Env = E;` (derive from tessera::StrategyBase<E>, which "
                         "supplies every hook but name())");
  static_assert(has_name, "Tessera Strategy: missing `std::string name() const` (named in traces and errors)");
  static_assert(has_flags, "Tessera Strategy: missing `static constexpr bool kOwnsMicroBatchLoop` and "
                           "`kHooksGradients` (what check_stack compares)");
  static_assert(has_start, "Tessera Strategy: missing `void start()` (collective, once before the first step: "
                           "agreement check, broadcast, sharding)");
  static_assert(has_forward, "Tessera Strategy: missing `void before_forward(const MicroBatch&)`, "
                             "`void before_backward(const MicroBatch&)` and `void after_backward(const MicroBatch&)` "
                             "(around each micro-batch)");
  static_assert(has_step, "Tessera Strategy: missing `void before_optimizer_step()` and "
                          "`void after_optimizer_step()` (around optimizer.step())");
  if constexpr (has_env) {
    constexpr bool has_loop = detail::StrategyHasLoop<T>;
    static_assert(has_loop, "Tessera Strategy: missing `double run_micro_batches(const Batch<S>&, const "
                            "MicroStep<S>&)` (the micro-batch loop; StrategyBase's runs one micro-batch)");
  }
  static_assert(has_state, "Tessera Strategy: missing `void save_state(StrategyState&) const` and "
                           "`void load_state(const StrategyState&)` (per-rank state kept in a checkpoint)");
  static_assert(has_timeline, "Tessera Strategy: missing `void set_timeline(SpanSink*)` (where it records its spans)");
  return Strategy<T>;
}

// check_stack<S...>(): strategies that can run together. The compiler names the pair above the
// sentence.
template <class First, class... Rest>
consteval bool check_stack() {
  constexpr bool each = check_strategy<First>() && (check_strategy<Rest>() && ...);
  if constexpr (each) {
    constexpr bool same_env = (std::is_same_v<typename First::Env, typename Rest::Env> && ...);
    static_assert(same_env, "Tessera strategy stack: the strategies belong to different Envs (one model, one Env: "
                            "build every strategy from the same model)");
    // A model-running strategy (a pipeline) owns its micro-batch loop as well.
    constexpr int loop_owners = (int{First::kOwnsMicroBatchLoop || detail::strategy_runs_model<First>()} + ... +
                                 int{Rest::kOwnsMicroBatchLoop || detail::strategy_runs_model<Rest>()});
    static_assert(loop_owners <= 1, "Tessera strategy stack: two strategies own the micro-batch loop (gradient "
                                    "accumulation, a pipeline schedule): a step has one loop; give its micro-batch "
                                    "count to the one that stays (a pipeline's micro-batches already accumulate)");
    constexpr int gradient_hooks = (int{First::kHooksGradients} + ... + int{Rest::kHooksGradients});
    static_assert(gradient_hooks <= 1, "Tessera strategy stack: two strategies hook the parameters' gradients (each "
                                       "parameter has one grad_ready hook): data parallelism over two groups is one "
                                       "DataParallel over their product, or LocalSgd over the outer group");
    return same_env && loop_owners <= 1 && gradient_hooks <= 1;
  }
  return each;
}

// Several strategies acting on one step (see the top of this file). Holds references: the
// strategies outlive the stack.
template <class... S>
class Stack {
  static_assert(sizeof...(S) >= 1, "Stack: at least one strategy");
  static_assert(check_stack<S...>());
  using First = std::tuple_element_t<0, std::tuple<S...>>;

 public:
  using Env = typename First::Env;
  static constexpr bool kOwnsMicroBatchLoop = (S::kOwnsMicroBatchLoop || ...);
  static constexpr bool kHooksGradients = (S::kHooksGradients || ...);
  static constexpr bool kRunsModel = (detail::strategy_runs_model<S>() || ...);
  static constexpr bool kPerRankOptimizerState = (detail::strategy_per_rank_optimizer_state<S>() || ...);

  explicit Stack(S&... strategies) : members_(strategies...) {}

  std::string name() const {
    std::string out;
    std::apply([&](const auto&... s) { ((out += (out.empty() ? "" : " x ") + s.name()), ...); }, members_);
    return out;
  }
  void start() { forward_order([](auto& s) { s.start(); }); }
  void before_forward(const MicroBatch& mb) { forward_order([&](auto& s) { s.before_forward(mb); }); }
  void before_backward(const MicroBatch& mb) { forward_order([&](auto& s) { s.before_backward(mb); }); }
  void after_backward(const MicroBatch& mb) { reverse_order([&](auto& s) { s.after_backward(mb); }); }
  void before_optimizer_step() { forward_order([](auto& s) { s.before_optimizer_step(); }); }
  void after_optimizer_step() { reverse_order([](auto& s) { s.after_optimizer_step(); }); }
  double run_micro_batches(const Batch<typename Env::Scalar>& batch, const MicroStep<typename Env::Scalar>& step) {
    double loss = 0;
    bool ran = false;
    forward_order([&](auto& s) {
      if constexpr (std::remove_reference_t<decltype(s)>::kOwnsMicroBatchLoop) {
        loss = s.run_micro_batches(batch, step);
        ran = true;
      }
    });
    return ran ? loss : step(batch, MicroBatch{});
  }
  // Delegated to the member that runs the model, with `hooks` (the Trainer passes the stack
  // itself, so every member's per-micro-batch hooks run).
  template <class X, class Hooks>
    requires kRunsModel
  ModelStepResult run_model(const X& images, std::span<const std::int64_t> labels, Hooks& hooks) {
    ModelStepResult r;
    forward_order([&](auto& s) {
      if constexpr (detail::strategy_runs_model<std::remove_reference_t<decltype(s)>>()) r = s.run_model(images, labels, hooks);
    });
    return r;
  }
  template <class X>
    requires kRunsModel
  ModelStepResult evaluate_batch(const X& images, std::span<const std::int64_t> labels) {
    ModelStepResult r;
    forward_order([&](auto& s) {
      if constexpr (detail::strategy_runs_model<std::remove_reference_t<decltype(s)>>()) r = s.evaluate_batch(images, labels);
    });
    return r;
  }
  int sample_copies() const {
    int copies = 1;
    std::apply([&](const auto&... s) { ((copies *= detail::sample_copies(s)), ...); }, members_);
    return copies;
  }
  void save_state(StrategyState& state) const {
    std::apply([&](const auto&... s) { (s.save_state(state), ...); }, members_);
  }
  void load_state(const StrategyState& state) { forward_order([&](auto& s) { s.load_state(state); }); }
  void set_timeline(SpanSink* timeline) { forward_order([&](auto& s) { s.set_timeline(timeline); }); }

 private:
  template <class F>
  void forward_order(F&& f) {
    std::apply([&](auto&... s) { (f(s), ...); }, members_);
  }
  template <class F>
  void reverse_order(F&& f) {
    reverse_from<sizeof...(S)>(f);
  }
  template <std::size_t I, class F>
  void reverse_from(F& f) {
    if constexpr (I > 0) {
      f(std::get<I - 1>(members_));
      reverse_from<I - 1>(f);
    }
  }

  std::tuple<S&...> members_;
};

// stack(dp, accumulation): a Stack of references to the strategies.
template <class... S>
Stack<S...> stack(S&... strategies) {
  return Stack<S...>(strategies...);
}

}  // namespace tessera
