// 12_zero: ZeRO stage 1 (Rajbhandari et al., 2020) against plain data parallelism, on the same
// ranks, data and seed: LeNet-5 on Fashion-MNIST with Adam, whose state (two moments per
// parameter) is twice the model. One source, one binary per communicator:
//
//   build/examples/12_zero_threads --ranks=2
//   mpirun -n 2 build/examples/12_zero_mpi
//   tools/tessera-run -n 2 build/examples/12_zero_gloo
//
// It trains twice: DataParallel + Adam (every rank holds all of Adam's state), then Zero1 + Adam
// (rank r holds the state of its 1/N shard of the flattened parameters only), and checks its
// claims, exiting 1 when one fails: Zero1 applies the same update (8 SGD steps under each, every
// parameter within 1e-5), trains the same with Adam (test accuracies within --tolerance points)
// and divides the optimizer state by N (common/zero_report.hpp). --help lists the flags.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>

#include "tessera/tessera.hpp"
#include "tessera/build_env.hpp"
#include "common/rank_status.hpp"
#include "common/fashion_mnist_data.hpp"
#include "common/memory.hpp"
#include "common/trace_files.hpp"
#include "common/zero_report.hpp"

using namespace tessera;

namespace {

constexpr std::int64_t kCheckSteps = 8;  // SGD steps under each strategy, compared parameter by parameter
using E = BuildEnv;  // CpuThreads, CpuMpi or CpuGloo: chosen by the build, nowhere else
using Comm = E::Comm;
using Device = E::Device;

struct Options {
  std::int64_t epochs = 1, batch = 64, limit = 0;
  double lr = 1e-3, tolerance = 0.5;
  int threads = 1, ranks = 2;
  std::uint64_t seed = 1;
  std::string data_dir, trace;
};

examples::ZeroRun train(Comm& comm, const Options& o, bool zero) {
  const int rank = comm.rank(), ranks = comm.size();
  auto [train_set, test_set] = examples::load_normalized_fashion_mnist(o.data_dir, o.limit);
  DataLoader<float> train_loader(train_set, {.batch_size = o.batch / ranks, .shuffle = true, .seed = o.seed,
                                             .rank = rank, .world_size = ranks});
  DataLoader<float> test_loader(test_set, {.batch_size = 500, .shuffle = false});
  // Memory per rank from here: the model and the strategy's buffers (measured once both exist).
  examples::RankMemory<Device, Comm> memory(comm);
  memory.start();
  // Every rank starts from rank 0's weights: both strategies broadcast them.
  auto model = lenet5<E>(1, 28, 10, o.seed);
  const auto constant = [lr = o.lr](double) { return lr; };
  examples::ZeroRun out;
  // --trace: every step, forward/backward/optimizer on the compute lane, the collectives (Zero1's
  // reduce-scatter and all-gather, DataParallel's bucket all-reduces) on the communication lane.
  const std::string trace = o.trace.empty() ? "" : examples::tagged_path(o.trace, zero ? "zero" : "dp");
  std::optional<Timeline> timeline;
  if (!trace.empty()) timeline.emplace(comm);
  Timeline* t = timeline ? &*timeline : nullptr;
  const auto finish = [&](auto& optimizer_state, const auto& results) {
    examples::StateBytes counter;
    optimizer_state.visit_state(counter);
    out.state_bytes = counter.bytes;
    out.accuracy = 100.0 * results.back().test_accuracy;
    out.train_loss = results.back().train_loss;
    for (const auto& r : results) out.seconds += r.seconds;
    if (timeline) {
      timeline->write(comm, trace);
      if (rank == 0) std::printf("timeline of every step: %s\n", trace.c_str());
    }
  };
  if (zero) {
    Zero1 zero1(model, comm, {.timeline = t});
    Adam<E> adam(zero1.shard_parameters(), {.lr = o.lr});
    out.model_bytes = memory.held().requested;  // Adam's state appears at its first step
    Zero1Optimizer optimizer(zero1, adam);
    Trainer trainer(model, optimizer, constant,
                    {.epochs = o.epochs, .verbose = rank == 0, .timeline = t, .checkpoint_group = CheckpointGroup(comm)});
    finish(adam, trainer.fit(train_loader, &test_loader));
  } else {
    DataParallel dp(model, comm);
    Adam<E> adam(dp.parameters(), {.lr = o.lr});
    out.model_bytes = memory.held().requested;
    // The Trainer drives DataParallel (parallel/strategy.hpp) and hands it the timeline, where it
    // records each bucket's all-reduce.
    Trainer trainer(model, adam, dp, constant,
                    {.epochs = o.epochs, .verbose = rank == 0, .timeline = t, .checkpoint_group = CheckpointGroup(comm)});
    finish(adam, trainer.fit(train_loader, &test_loader));
  }
  return out;
}

int run(Comm& comm, const Options& o) {
  const int rank = comm.rank(), ranks = comm.size();
  TESSERA_CHECK(o.batch % ranks == 0, ArgumentError, "--batch=", o.batch, " (the global batch) must be divisible by the ",
                ranks, " ranks");
  Cpu::set_num_threads(o.threads);
  auto probe = lenet5<E>(1, 28, 10, o.seed);
  const std::size_t params = count_parameters(named_tensors(probe));
  const std::size_t shard = (params + static_cast<std::size_t>(ranks) - 1) / static_cast<std::size_t>(ranks);
  if (rank == 0)
    std::printf("12_zero: LeNet-5 (%zu parameters) with Adam on %d rank(s), global batch %lld, %lld epoch(s)\n\n"
                "--- DataParallel: every rank holds all of Adam's state\n",
                params, ranks, static_cast<long long>(o.batch), static_cast<long long>(o.epochs));
  auto [train_set, test_set] = examples::load_normalized_fashion_mnist(o.data_dir, o.limit);
  const double sgd_apart = examples::sgd_steps_apart<E>(comm, train_set, o.batch, o.seed, kCheckSteps);
  if (rank == 0)
    std::printf("check: %lld SGD steps under DataParallel and under Zero1 end %.2g apart (largest parameter "
                "difference; tolerance 1e-5) %s\n\n",
                static_cast<long long>(kCheckSteps), sgd_apart, sgd_apart <= 1e-5 ? "ok" : "FAIL");
  const examples::ZeroRun dp = train(comm, o, false);
  if (rank == 0) std::printf("\n--- Zero1: rank r holds the state of its shard of %zu parameters\n", shard);
  const examples::ZeroRun zero = train(comm, o, true);

  const bool ok = examples::report_zero(rank == 0, ranks, params, SharedMemoryCommunicator<Comm>, dp, zero, o.tolerance);
  return ok && sgd_apart <= 1e-5 ? 0 : 1;
}

Options parse(int argc, char** argv) {
  Flags flags(argc, argv);
  Options o;
  o.epochs = flags.get("epochs", o.epochs, {.min = 1}, "passes over the training set, under each strategy");
  o.batch = flags.get("batch", o.batch, {.min = 1}, "global batch in images, split over the ranks");
  o.lr = flags.get("lr", o.lr, {.above = 0}, "Adam's learning rate, held constant");
  o.threads = flags.threads("threads", o.threads, "OpenMP threads per rank");
  o.ranks = flags.ranks("ranks", o.ranks, !SharedMemoryCommunicator<Comm>,
                        "data-parallel ranks (Zero1 shards Adam's state over them)");
  check_thread_budget(SharedMemoryCommunicator<Comm> ? o.ranks : 1, "--ranks", o.threads, "--threads");
  o.seed = static_cast<std::uint64_t>(flags.get("seed", std::int64_t{1}, "seed of the weights and the shuffling"));
  o.limit = flags.get("limit", o.limit, {.min = 0}, "training images to use (0: all 60,000)");
  o.data_dir = flags.get("data-dir", o.data_dir, "Fashion-MNIST directory (empty: the default locations)");
  o.tolerance = flags.get("tolerance", o.tolerance, {.min = 0},
                          "test-accuracy gap allowed between DataParallel and Zero1, in points");
  o.trace = flags.output_path("trace", o.trace, "Chrome trace of every step, one file per strategy (.dp, .zero)");
  flags.finish();
  return o;
}

}  // namespace

int main(int argc, char** argv) { return examples::run_checked<E>("12_zero", argc, argv, parse, run); }
