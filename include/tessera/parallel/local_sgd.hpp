// LocalSgd: every rank takes optimizer steps on its own gradients, and every k steps the ranks
// average their parameters (Lin et al. 2018, "Don't use large mini-batches, use local SGD";
// the async/periodic-averaging family of the seeds). One all-reduce per k steps instead of one
// per step; the models drift apart in between.
//
//   LocalSgd local(model, comm, {.period = 4});   // LocalSgd<E>, E from the model; broadcasts rank 0's parameters
//   loop: opt.zero_grad(); forward; backward; opt.step(); local.after_step();
//   or:   Trainer trainer(model, opt, local, schedule, options);  (after_optimizer_step is after_step)
//
// With period 1 and SGD (momentum and weight decay included: the update is linear in the
// gradient, so averaging parameters equals averaging gradients) this is synchronous data
// parallelism exactly. Optimizer state (momentum buffers) stays per rank (kPerRankOptimizerState:
// the Trainer keeps each rank's with a checkpoint); buffers such as BatchNorm running statistics
// are averaged with the parameters when average_buffers is set.
//
// Agreement: the constructor checks (one all_gather of two int64) that every rank has the same
// period, average_buffers and parameter and buffer names and shapes (parallel/agreement.hpp): a
// rank averaging on another period, or over another flat size, would otherwise mismatch the
// all-reduce. The replicas differ between averages by design, so there is no checksum check.
//
// Timeline (options.timeline or set_timeline): each average is a span on the communication lane,
// "average parameters: all_reduce <bytes>", so a trace shows one all-reduce per k steps.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "tessera/comm/communicator.hpp"
#include "tessera/core/env.hpp"
#include "tessera/core/parameter.hpp"
#include "tessera/core/span_sink.hpp"
#include "tessera/device/cpu.hpp"
#include "tessera/parallel/agreement.hpp"
#include "tessera/parallel/strategy.hpp"

namespace tessera {

struct LocalSgdOptions {
  int period = 4;  // k: average parameters after every k-th step
  bool average_buffers = true;
  SpanSink* timeline = nullptr;  // optional (a Timeline): records each average; not compared across ranks
};

template <class E>
class LocalSgd : public StrategyBase<E> {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Comm = typename E::Comm;

  template <class Model, class C>
  LocalSgd(Model& model, C& comm, LocalSgdOptions options = {})
      : comm_(comm_of_env<E>(comm)), options_(options), named_(parameters_of_env<E>(named_tensors(model))) {
    AgreementRecord record("LocalSgd");
    record.add("strategy", "LocalSgd");
    record.add("options.period", options.period);
    record.add("options.average_buffers", options.average_buffers);
    record.add_named_tensors(named_);
    check_agreement(comm_, record);
    TESSERA_CHECK(options.period >= 1, ArgumentError, "LocalSgd: period=", options.period, " must be >= 1");
    for (auto& [name, p] : named_.parameters) comm_.broadcast(std::span<S>(p->value.data(), p->value.numel()), 0);
    for (auto& [name, t] : named_.buffers) comm_.broadcast(std::span<S>(t->data(), t->numel()), 0);
    std::int64_t total = 0;
    for (auto& [name, p] : named_.parameters) total += p->value.numel();
    if (options.average_buffers)
      for (auto& [name, t] : named_.buffers) total += t->numel();
    flat_.resize({total});
  }

  // Call after every optimizer step; averages parameters when a period is complete. Returns
  // whether it did.
  bool after_step() {
    if (++steps_ % options_.period != 0) return false;
    average();
    return true;
  }

  // The strategy protocol (parallel/strategy.hpp).
  static constexpr bool kPerRankOptimizerState = true;  // each rank's momentum follows its own gradients
  std::string name() const { return "LocalSgd(period " + std::to_string(options_.period) + ")"; }
  void after_optimizer_step() { after_step(); }
  // The step count, so that a resumed run averages at the same steps as an uninterrupted one, and,
  // in the middle of a period, this rank's own parameters and buffers: the checkpoint holds rank
  // 0's, and the replicas differ until the next average. (The Trainer adds this rank's optimizer
  // state: kPerRankOptimizerState.)
  void save_state(StrategyState& state) const {
    state.put("LocalSgd.steps", steps_);
    if (steps_ % options_.period == 0) return;  // just averaged: every rank holds the same values
    std::vector<S> values;
    for_each_tensor([&](const Tensor<S, D>& t) {
      const std::size_t at = values.size();
      values.resize(at + static_cast<std::size_t>(t.numel()));
      D::copy_to_host(values.data() + at, t.data(), t.bytes());
    });
    state.put("LocalSgd.rank_values", std::span<const S>(values));
  }
  void load_state(const StrategyState& state) {
    steps_ = state.get_int("LocalSgd.steps");
    const std::vector<double>* saved = state.find("LocalSgd.rank_values");
    if (saved == nullptr) return;
    std::size_t total = 0;
    for_each_tensor([&](const Tensor<S, D>& t) { total += static_cast<std::size_t>(t.numel()); });
    TESSERA_CHECK(saved->size() == total, ArgumentError, "LocalSgd: the saved per-rank values hold ", saved->size(),
                  " numbers; this model's parameters and buffers hold ", total);
    std::vector<S> values(saved->begin(), saved->end());
    std::size_t at = 0;
    for_each_tensor([&](Tensor<S, D>& t) {
      D::copy_to_device(t.data(), values.data() + at, t.bytes());
      at += static_cast<std::size_t>(t.numel());
    });
  }

  // At the end of training: the model local SGD delivers is the average, so a last, incomplete
  // period is averaged too. Returns whether it was (collective: every rank took as many steps).
  bool average_if_pending() {
    if (steps_ % options_.period == 0) return false;
    average();
    return true;
  }

  // Averages parameters (and buffers) now: one all_reduce over a flat copy.
  void average() {
    ++averages_;
    const auto began = SpanSink::Clock::now();
    std::int64_t offset = 0;
    auto each = [&](auto&& visit) {
      offset = 0;
      for (auto& [name, p] : named_.parameters) visit(p->value);
      if (options_.average_buffers)
        for (auto& [name, t] : named_.buffers) visit(*t);
    };
    each([&](Tensor<S, D>& t) {
      D::copy(flat_.data() + offset, t.data(), t.bytes());
      offset += t.numel();
    });
    comm_.all_reduce(flat_.span(), ReduceOp::Avg);
    each([&](Tensor<S, D>& t) {
      D::copy(t.data(), flat_.data() + offset, t.bytes());
      offset += t.numel();
    });
    if (options_.timeline)
      options_.timeline->add("average parameters: all_reduce " + std::to_string(flat_.bytes() / 1024) + " KiB",
                             "communication", began, SpanSink::Clock::now(), SpanSink::kCommunication);
  }

  // Records later averages into `timeline` (nullptr: stop recording).
  void set_timeline(SpanSink* timeline) { options_.timeline = timeline; }

  std::int64_t steps() const { return steps_; }
  // All-reduces of the parameters so far (every period's, and average()'s called directly).
  std::int64_t averages() const { return averages_; }

 private:
  // Every parameter, then every buffer (whether or not averaged: all differ by rank mid-period).
  template <class F>
  void for_each_tensor(F&& f) const {
    for (const auto& [name, p] : named_.parameters) f(p->value);
    for (const auto& [name, t] : named_.buffers) f(*t);
  }

  Comm& comm_;
  LocalSgdOptions options_;
  NamedTensors<E> named_;
  Tensor<S, D> flat_;
  std::int64_t steps_ = 0;
  std::int64_t averages_ = 0;
};

template <class Model, class C>
LocalSgd(Model&, C&, LocalSgdOptions = {}) -> LocalSgd<typename Model::Env>;

}  // namespace tessera
