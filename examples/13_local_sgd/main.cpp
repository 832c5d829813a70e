// 13_local_sgd: local SGD (Lin et al. 2018) against synchronous data parallelism, on the same
// ranks, data and seed: LeNet-5 on Fashion-MNIST, SGD + momentum. Every rank steps on its own
// shard's gradients, and every k steps the ranks average their parameters: one all-reduce per k
// steps instead of one per step. The same Trainer::fit drives both strategies.
//
//   build/examples/13_local_sgd_threads --ranks=2
//   mpirun -n 2 build/examples/13_local_sgd_mpi
//   tools/tessera-run -n 2 build/examples/13_local_sgd_gloo
//
// It trains once with DataParallel, then once per period k of --periods, prints the all-reduces
// and bytes per step (formula, counted, and over TCP measured on the loopback interface), loss and
// accuracy, and exits 1 unless: k = 1 equals data parallelism parameter for parameter after 8
// steps (SGD's update is linear in the gradient); the all-reduces are ceil(steps / k); every k is
// within --tolerance points of data parallelism's accuracy (common/local_sgd_report.hpp).
// --trace=trace.json writes max(8, 2k) steps from step 3 of each run (trace.dp.json,
// trace.k4.json, ...): DataParallel's all-reduce every step against an average every k steps.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "tessera/tessera.hpp"
#include "tessera/build_env.hpp"
#include "common/fashion_mnist_data.hpp"
#include "common/local_sgd_report.hpp"
#include "common/memory.hpp"
#include "common/rank_status.hpp"
#include "common/trace_files.hpp"
#include "common/traffic.hpp"

using namespace tessera;

namespace {

using E = BuildEnv;  // CpuThreads, CpuMpi or CpuGloo: chosen by the build, nowhere else
using Comm = E::Comm;
using Device = E::Device;

struct Options {
  std::int64_t epochs = 2, batch = 64, limit = 0;
  double lr = 0.05, tolerance = 2.0;
  int threads = 1, ranks = 2;
  std::uint64_t seed = 1;
  std::vector<int> periods;
  std::string data_dir, trace;
};

constexpr int kCheckSteps = 8;
constexpr int kTraceFrom = 2;  // --trace skips the first steps (they fill caches and buffers)

// period 0: DataParallel (gradients averaged every step); k >= 1: LocalSgd with period k.
// max_steps > 0: stop after that many steps and keep the parameters (no evaluation).
// trace: where to write max(8, 2k) steps, from step 3, as a Chrome trace (empty: none).
examples::LocalSgdRun train(Comm& comm, const Options& o, int period, std::int64_t max_steps = 0,
                            const std::string& trace = "") {
  auto [train_set, test_set] = examples::load_normalized_fashion_mnist(o.data_dir, o.limit);
  DataLoader<float> loader(train_set, {.batch_size = o.batch / comm.size(), .shuffle = true, .seed = o.seed,
                                       .rank = comm.rank(), .world_size = comm.size()});
  DataLoader<float> test_loader(test_set, {.batch_size = 500, .shuffle = false});
  examples::RankMemory<Device, Comm> memory(comm);  // the model and the strategy's buffer, measured
  memory.start();
  // Ranks start from different weights; both strategies broadcast rank 0's.
  auto model = lenet5<E>(1, 28, 10, o.seed + static_cast<std::uint64_t>(comm.rank()));
  examples::LocalSgdRun out;
  Timeline timeline(comm);
  // One loop for both: the Trainer drives whichever strategy it is given.
  auto fit = [&](auto& strategy, NamedTensors<E> parameters) {
    Sgd<E> sgd(parameters, {.lr = o.lr, .momentum = 0.9, .weight_decay = 5e-4, .decay_norm_and_bias = false});
    out.model_bytes = memory.held().requested;
    Trainer trainer(model, sgd, strategy, CosineLr{o.lr, static_cast<double>(o.epochs), 0.0},
                    {.epochs = o.epochs, .verbose = false, .timeline = trace.empty() ? nullptr : &timeline,
                     .timeline_first_step = kTraceFrom, .timeline_steps = std::max(8, 2 * period), .trace_path = trace,
                     .checkpoint_group = CheckpointGroup(comm), .stop_after_steps = max_steps});
    comm.barrier();
    const double lo_before = comm.rank() == 0 ? examples::loopback_bytes() : -1;
    const auto epochs = trainer.fit(loader);
    out.steps = trainer.state().global_step;
    out.all_reduces = out.steps;  // DataParallel: the gradients, in buckets, every step
    if constexpr (requires { strategy.averages(); }) {
      strategy.average_if_pending();  // the model local SGD delivers is the average
      out.all_reduces = strategy.averages();
    }
    comm.barrier();
    if (lo_before >= 0) out.loopback = examples::loopback_bytes() - lo_before;
    if (!epochs.empty()) out.loss = epochs.back().train_loss;
    if (max_steps > 0) {
      for (auto& [name, p] : named_tensors(model).parameters) {
        const auto host = to_host(p->value);
        out.parameters.insert(out.parameters.end(), host.data(), host.data() + host.numel());
      }
    } else {  // the replicas are equal after the last average: any rank can evaluate
      out.accuracy = 100.0 * trainer.evaluate(test_loader).second;
    }
  };
  if (period == 0) {
    DataParallel<E> dp(model, comm);
    fit(dp, dp.parameters());
  } else {
    LocalSgd<E> local(model, comm, {.period = period});
    fit(local, named_tensors(model));
  }
  if (!trace.empty() && comm.rank() == 0) std::printf("timeline from step %d: %s\n", kTraceFrom + 1, trace.c_str());
  return out;
}

int run(Comm& comm, const Options& o) {
  TESSERA_CHECK(o.batch % comm.size() == 0, ArgumentError, "--batch=", o.batch,
                " (the global batch) must be divisible by the ", comm.size(), " ranks");
  Cpu::set_num_threads(o.threads);
  auto probe = lenet5<E>(1, 28, 10, o.seed);
  const double params = static_cast<double>(count_parameters(named_tensors(probe)));
  if (comm.rank() == 0)
    std::printf("13_local_sgd: LeNet-5 (%.0f parameters) on %d rank(s), global batch %lld, %lld epoch(s)\n", params,
                comm.size(), static_cast<long long>(o.batch), static_cast<long long>(o.epochs));
  // k = 1 against data parallelism, step for step: the same parameters within summation order
  // (over thousands of steps such differences grow as in any two float runs: the full runs are
  // compared by accuracy).
  const examples::LocalSgdRun dp_steps = train(comm, o, 0, kCheckSteps), k1_steps = train(comm, o, 1, kCheckSteps);
  const bool k1_is_dp = examples::check_k1_is_data_parallel(comm, dp_steps, k1_steps, 1e-5);
  const auto traced = [&](const std::string& tag) { return o.trace.empty() ? "" : examples::tagged_path(o.trace, tag); };
  const examples::LocalSgdRun dp = train(comm, o, 0, 0, traced("dp"));
  std::vector<examples::LocalSgdRun> runs;
  for (int k : o.periods) runs.push_back(train(comm, o, k, 0, traced("k" + std::to_string(k))));
  const bool ok = comm.rank() != 0 ||
                  examples::report_local_sgd(comm.size(), params, SharedMemoryCommunicator<Comm>, dp, o.periods, runs, o.tolerance);
  return k1_is_dp && ok ? 0 : 1;
}

Options parse(int argc, char** argv) {
  Flags flags(argc, argv);
  Options o;
  o.epochs = flags.get("epochs", o.epochs, {.min = 1}, "passes over the training set, per run");
  o.batch = flags.get("batch", o.batch, {.min = 1}, "global batch in images, split over the ranks");
  o.lr = flags.get("lr", o.lr, {.above = 0}, "SGD learning rate (momentum 0.9), cosine decay to 0");
  o.periods = flags.int_list("periods", "1,4,16", {.min = 1}, "local SGD periods k to run: average every k steps");
  o.tolerance = flags.get("tolerance", o.tolerance, {.min = 0}, "accuracy points each k may differ from DataParallel");
  o.threads = flags.threads("threads", o.threads, "OpenMP threads per rank");
  o.ranks = flags.ranks("ranks", o.ranks, !SharedMemoryCommunicator<Comm>, "data-parallel ranks");
  check_thread_budget(SharedMemoryCommunicator<Comm> ? o.ranks : 1, "--ranks", o.threads, "--threads");
  o.seed = static_cast<std::uint64_t>(flags.get("seed", std::int64_t{1}, "seed of the weights and the shuffling"));
  o.limit = flags.get("limit", o.limit, {.min = 0}, "training images to use (0: all 60,000)");
  o.data_dir = flags.get("data-dir", o.data_dir, "Fashion-MNIST directory (empty: the default locations)");
  o.trace = flags.output_path("trace", o.trace, "Chrome trace of max(8, 2k) steps from step 3, one file per run");
  flags.finish();
  return o;
}

}  // namespace

int main(int argc, char** argv) { return examples::run_checked<E>("13_local_sgd", argc, argv, parse, run); }
