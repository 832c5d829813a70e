// Example 09's four ways of training, one member of Runner each: sync (DataParallel), a
// parameter server with a staleness bound (ssp) or without (async), and Hogwild (threads build);
// each runs the same number of batches in sessions that run_sessions times and evaluates. Also
// the flags (parse) and a worker's endless stream of batches. main.cpp compares the four.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/accuracy.hpp"
#include "common/async_report.hpp"
#include "common/trace_files.hpp"
#include "common/traffic.hpp"
#include "tessera/build_env.hpp"
#include "tessera/tessera.hpp"

namespace async_example {

using namespace tessera;

using E = BuildEnv;  // CpuThreads, CpuMpi or CpuGloo: chosen by the build, nowhere else
using Comm = E::Comm;
using Clock = std::chrono::steady_clock;

struct Options {
  std::int64_t epochs = 2, batch = 32, limit = 0, evals = 4;
  double lr = 0.05, momentum = 0.9, ps_momentum = 0.6, weight_decay = 5e-4, hogwild_lr = 0.05, target = 0.85,
         min_accuracy = 0.6;
  int servers = 1, staleness = 2, straggler_ms = 0, ranks = 4, threads = 1;
  std::uint64_t seed = 1;
  std::string data_dir, out = "09_async_sgd.jsonl", plot = "09_async_sgd.png", trace;
  std::vector<std::string> modes = {"sync", "ssp", "async", "hogwild"};
};

using examples::AsyncPoint;
using ModeResult = examples::AsyncModeResult;

// A worker's endless stream of batches from its shard, epoch after epoch.
class BatchStream {
 public:
  BatchStream(const Dataset& data, const Options& o, int worker, int workers)
      : loader_(data, {.batch_size = o.batch, .shuffle = true, .seed = o.seed, .drop_last = true, .rank = worker,
                       .world_size = workers}) {}
  const Batch<float>& next() {
    while (!loader_.next(batch_)) loader_.start_epoch(++epoch_);
    return batch_;
  }

 private:
  DataLoader<float> loader_;
  Batch<float> batch_;
  std::int64_t epoch_ = 0;
};

// One forward/backward of the model on the next batch (gradients accumulate: zero them first).
template <class Model, class Loss>
void compute_gradients(Model& model, BatchStream& data, Loss& loss) {
  for (auto& [name, p] : named_tensors(model).parameters) p->grad.zero();
  typename Model::Cache cache;
  typename Loss::Cache loss_cache;
  const Batch<float>& b = data.next();
  loss.forward(model.forward(b.images, cache), b.labels, loss_cache);
  model.backward(loss.backward(loss_cache), cache);
}

// Everything one mode needs on every rank; run() trains it session by session.
struct Runner {
  Comm& comm;
  const Options& o;
  const Dataset& train_set;
  DataLoader<float>& test_loader;
  HogwildStore<float>& store;
  int workers;
  bool is_worker, is_evaluator;
  std::int64_t session_budget;  // gradients per session, all workers together
  Timeline* timeline = nullptr;  // during the first session with --trace (see run_sessions)

  void straggle(int worker) const {
    if (o.straggler_ms > 0 && worker == workers - 1) {
      std::optional<Timeline::Span> span;
      if (timeline) span.emplace(timeline->span("straggler's sleep"));
      std::this_thread::sleep_for(std::chrono::milliseconds(o.straggler_ms));
    }
  }
  // A worker's forward and backward, as a span when tracing.
  template <class Model, class Loss>
  void gradients(Model& model, BatchStream& data, Loss& loss) const {
    std::optional<Timeline::Span> span;
    if (timeline) span.emplace(timeline->span("forward + backward"));
    compute_gradients(model, data, loss);
  }

  // Times `session` (all ranks, barrier to barrier), then measures test accuracy on the evaluator
  // (outside the clock) and shares it. With --trace, the first session is recorded (`timeline`,
  // which `on_trace` hands to the mode's strategy) and written to <trace>.<mode>.json. Thread
  // ranks count a session's bytes on `traffic` (ThreadComm::peer_bytes, per group; null: comm).
  template <class Model, class Session, class OnTrace = void (*)(Timeline*)>
  void run_sessions(ModeResult& r, Model& model, Session&& session, OnTrace on_trace = [](Timeline*) {},
                    const Comm* traffic = nullptr) {
    const Comm& counted = traffic ? *traffic : comm;
    double elapsed = 0;
    const std::int64_t sessions = o.epochs * o.evals;
    for (std::int64_t s = 0; s < sessions; ++s) {
      std::optional<Timeline> trace;
      if (s == 0 && !o.trace.empty()) trace.emplace(comm);
      timeline = trace ? &*trace : nullptr;
      on_trace(timeline);
      comm.barrier();
      const double lo_before = is_evaluator ? examples::loopback_bytes() : 0;
      const double peer_before = examples::peer_bytes(counted);  // -1 but for threads
      const auto start = Clock::now();
      session();
      comm.barrier();
      elapsed += std::chrono::duration<double>(Clock::now() - start).count();
      if (is_evaluator) r.loopback += examples::loopback_bytes() - lo_before;
      const double peer_moved = peer_before >= 0 ? examples::peer_bytes(counted) - peer_before : 0;
      if (trace) {
        on_trace(nullptr);
        timeline = nullptr;
        const std::string path = examples::tagged_path(o.trace, r.mode);
        trace->write(comm, path);
        if (is_evaluator) std::printf("  [%-7s] timeline of the first session: %s\n", r.mode.c_str(), path.c_str());
      }
      std::vector<double> accuracy = {is_evaluator ? examples::accuracy(model, test_loader) : 0.0, peer_moved};
      comm.all_reduce(std::span<double>(accuracy), ReduceOp::Sum);  // and the bytes all ranks moved
      r.points.push_back({elapsed, accuracy[0]});
      if (peer_before >= 0) r.peer = std::max(r.peer, 0.0) + accuracy[1];
      if (is_evaluator)
        std::printf("  [%-7s] epoch %5.2f  %7.1f s  test accuracy %.2f%%\n", r.mode.c_str(),
                    static_cast<double>(s + 1) / static_cast<double>(o.evals), elapsed, 100 * accuracy[0]);
    }
  }

  ModeResult sync() {
    ModeResult r{.mode = "sync"};
    Comm worker_comm = comm.split(is_worker ? 0 : 1, comm.rank());
    auto model = lenet5<E>(1, 28, 10, o.seed);
    CrossEntropyLoss<E> loss;
    if (!is_worker) {  // servers idle in this mode; they still keep the clock and the model in step
      run_sessions(r, model, [] {});
      return r;
    }
    DataParallel dp(model, worker_comm);
    Sgd<E> sgd(dp.parameters(), {.lr = o.lr, .momentum = o.momentum, .weight_decay = o.weight_decay});
    const int worker = worker_comm.rank();
    BatchStream data(train_set, o, worker, workers);
    const std::int64_t steps = session_budget / workers;
    run_sessions(r, model, [&] {
      for (std::int64_t step = 0; step < steps; ++step) {
        gradients(model, data, loss);
        straggle(worker);
        if (timeline) {  // the all-reduce's wait apart from the step (DataParallel records its buckets)
          {
            auto span = timeline->span("gradient sync wait");
            dp.finish();
          }
          auto span = timeline->span("optimizer step");
          sgd.step();
        } else {
          sgd.step();  // finishes DataParallel's all-reduce first
        }
      }
    }, [&](Timeline* t) { dp.set_timeline(t); }, &worker_comm);  // the all-reduce's group
    r.gradients = steps * workers * o.epochs * o.evals;
    return r;
  }

  ModeResult parameter_server(const std::string& mode, int bound) {
    ModeResult r{.mode = mode};
    auto model = lenet5<E>(1, 28, 10, o.seed);
    ParameterServer ps(model, comm, {.num_servers = o.servers, .staleness_bound = bound});
    if (bound > 0) r.staleness_bound = static_cast<std::int64_t>(workers - 1) * (2 * bound + 1);
    CrossEntropyLoss<E> loss;
    if (ps.is_server()) {
      Sgd<E> sgd(ps.server_parameters(), {.lr = o.lr, .momentum = o.ps_momentum, .weight_decay = o.weight_decay});
      run_sessions(
          r, model,
          [&] {
            ps.serve(sgd, session_budget);
            ps.gather_parameters();
          },
          [&](Timeline* t) { ps.set_timeline(t); });
    } else {
      BatchStream data(train_set, o, ps.worker_index(), workers);
      run_sessions(
          r, model,
          [&] {
            ps.pull();
            for (std::int64_t step = 0; step <= session_budget; ++step) {  // the servers' budget ends it sooner
              gradients(model, data, loss);
              straggle(ps.worker_index());
              if (!ps.push_pull()) break;
            }
            ps.done();
            ps.gather_parameters();
          },
          [&](Timeline* t) { ps.set_timeline(t); });
    }
    const StalenessStats stats = ps.gather_staleness();
    r.gradients = stats.applied;  // server 0 applies every gradient (BSP: counted per gradient too)
    r.staleness_mean = stats.mean();
    r.staleness_max = stats.max;
    return r;
  }

  // A template so that the Hogwild branch is only compiled for communicators whose ranks share a
  // process (if constexpr discards only inside templates).
  template <class C = Comm>
  ModeResult hogwild() {
    ModeResult r{.mode = "hogwild"};
    using EC = Env<E::Device, C, E::Scalar>;  // E itself; dependent on C
    auto model = lenet5<EC>(1, 28, 10, o.seed);
    if constexpr (SharedMemoryCommunicator<C>) {
      Hogwild hog(model, comm, store, {.lr = o.hogwild_lr, .weight_decay = o.weight_decay});
      CrossEntropyLoss<EC> loss;
      const int worker = comm.rank() - o.servers;
      std::optional<BatchStream> data;
      if (is_worker) data.emplace(train_set, o, worker, workers);
      std::int64_t target = 0;
      run_sessions(r, model, [&] {
        target += session_budget;
        while (is_worker && store.updates() < target) {
          hog.pull();
          gradients(model, *data, loss);
          straggle(worker);
          hog.step();
        }
        hog.gather_parameters();
      });
      std::vector<double> stats = {static_cast<double>(hog.staleness().sum),
                                   static_cast<double>(hog.staleness().applied),
                                   static_cast<double>(hog.staleness().max)};
      std::vector<double> max_only = {stats[2]};
      stats.pop_back();
      comm.all_reduce(std::span<double>(stats), ReduceOp::Sum);
      comm.all_reduce(std::span<double>(max_only), ReduceOp::Max);
      r.gradients = static_cast<std::int64_t>(stats[1]);
      r.staleness_mean = stats[1] > 0 ? stats[0] / stats[1] : 0;
      r.staleness_max = static_cast<std::int64_t>(max_only[0]);
    }
    return r;
  }
};

inline Options parse(int argc, char** argv) {
  Flags flags(argc, argv);
  Options o;
  o.epochs = flags.get("epochs", o.epochs, {.min = 1}, "epochs' worth of batches each mode trains");
  o.batch = flags.get("batch", o.batch, {.min = 1}, "images per batch, per worker");  // nothing to split
  o.limit = flags.get("limit", o.limit, {.min = 0}, "training images to use (0: all 60,000)");
  o.evals = flags.get("evals", o.evals, {.min = 1}, "test-accuracy evaluations per epoch");
  o.lr = flags.get("lr", o.lr, {.above = 0}, "learning rate of sync, SSP and async");
  o.momentum = flags.get("momentum", o.momentum, {.min = 0, .below = 1}, "SGD momentum of sync");
  o.ps_momentum = flags.get("ps-momentum", o.ps_momentum, {.min = 0, .below = 1},
                            "the servers' SGD momentum (SSP, async): staleness adds its own");
  o.hogwild_lr = flags.get("hogwild-lr", o.hogwild_lr, {.above = 0}, "Hogwild's learning rate (plain SGD)");
  o.weight_decay = flags.get("weight-decay", o.weight_decay, {.min = 0}, "L2 weight decay of every mode");
  // Accuracies are fractions.
  o.target = flags.get("target", o.target, {.min = 0, .max = 1}, "test accuracy whose time to reach the table reports");
  o.min_accuracy = flags.get("min-accuracy", o.min_accuracy, {.min = 0, .max = 1},
                             "test accuracy every mode must reach, else exit 1 (self-check)");
  o.servers = flags.get("servers", o.servers, {.min = 1}, "parameter-server ranks (the other ranks are workers)");
  o.staleness = flags.get("staleness", o.staleness, {.min = 1},  // 0 is the sync row
                          "SSP's bound s: steps a worker may run ahead of the slowest");
  o.straggler_ms = flags.get("straggler-ms", o.straggler_ms, {.min = 0, .max = 60000},
                             "ms one worker sleeps every step, a straggler (0: none)");
  o.ranks = flags.ranks("ranks", o.ranks, !SharedMemoryCommunicator<Comm>, "ranks in all: servers plus workers");
  o.threads = flags.threads("threads", o.threads, "OpenMP threads per rank");
  // Ranks of the threads build share this process's cores (a process backend runs one rank here).
  check_thread_budget(SharedMemoryCommunicator<Comm> ? o.ranks : 1, "--ranks", o.threads, "--threads");
  o.seed = static_cast<std::uint64_t>(flags.get("seed", std::int64_t{1}, "seed of the weights and the shuffling"));
  o.data_dir = flags.get("data-dir", std::string(), "Fashion-MNIST directory (empty: the default locations)");
  o.modes = flags.list("modes", "sync,ssp,async,hogwild", {"sync", "ssp", "async", "hogwild"},
                       "modes to compare (hogwild: threads build only)");
  o.out = flags.output_path("out", o.out, "accuracy against wall time, as JSON lines");
  o.plot = flags.output_path("plot", o.plot, "accuracy against wall time, as a PNG");
  o.trace = flags.output_path("trace", o.trace, "Chrome trace of each mode's first session, one file per mode");
  flags.finish();
  TESSERA_CHECK(!SharedMemoryCommunicator<Comm> || o.ranks > o.servers, ArgumentError, "--ranks=",
                o.ranks, " must leave at least one worker besides --servers=", o.servers);
  return o;
}

}  // namespace async_example
