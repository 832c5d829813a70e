// 12_zero: ZeRO stage 1 (Rajbhandari et al., 2020) against plain data parallelism, on the same
// ranks, the same data and the same seed: LeNet-5 on Fashion-MNIST with Adam, whose state (two
// moments per parameter) is twice the model. One source, one binary per communicator:
//
//   build/examples/12_zero_threads --ranks=2
//   mpirun -n 2 build/examples/12_zero_mpi
//   tools/tessera-run -n 2 build/examples/12_zero_gloo
//
// Each run trains twice: DataParallel + Adam (every rank holds all of Adam's state), then Zero1 +
// Adam (rank r holds the state of its 1/N shard of the flattened parameters only). It prints the
// memory per rank by formula and as measured, the communication per step by formula, and checks
// its claims: Zero1 applies the same update as DataParallel (8 SGD steps under each, every
// parameter within 1e-5), the same training with Adam (final test accuracies within --tolerance
// points, losses printed) and the optimizer state divided by N. Exit status 1 when a check fails.
//
// Flags: --epochs=1 --batch=64 (global) --lr=0.001 --threads=1 (per rank) --ranks=2 (threads
// build) --seed=1 --limit=N (first N training images) --data-dir=DIR --tolerance=0.5 (points)
// --trace=trace.json (every step of both runs as Chrome traces: trace.dp.json, trace.zero.json)
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

using namespace tessera;

namespace {

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

// Counts the bytes of an optimizer's state tensors (visit_state: the checkpoint's view of it).
struct StateBytes {
  std::size_t bytes = 0;
  template <class T>
  void buffer(const std::string&, T& t) {
    bytes += static_cast<std::size_t>(t.numel()) * sizeof(typename T::Scalar);
  }
  void integer(const std::string&, std::int64_t&) {}
};

struct Outcome {
  double accuracy = 0, train_loss = 0, seconds = 0;
  std::size_t state_bytes = 0;  // this rank's optimizer state
  double model_bytes = 0;       // parameters, gradients and the strategy's buffers (allocator, requested)
};

Outcome train(Comm& comm, const Options& o, bool zero) {
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
  Outcome out;
  // --trace: every step, forward/backward/optimizer on the compute lane, the collectives (Zero1's
  // reduce-scatter and all-gather, DataParallel's bucket all-reduces) on the communication lane.
  const std::string trace = o.trace.empty() ? "" : examples::tagged_path(o.trace, zero ? "zero" : "dp");
  std::optional<Timeline> timeline;
  if (!trace.empty()) timeline.emplace(comm);
  Timeline* t = timeline ? &*timeline : nullptr;
  const auto finish = [&](auto& optimizer_state, const auto& results) {
    StateBytes counter;
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

// What an accuracy comparison cannot check: that Zero1 applies the averaged gradient. Adam divides
// by the gradient's own scale, so a gradient off by a constant factor (a sum over ranks instead of
// the average) would train the same under it; SGD's update is linear in the gradient. So both
// strategies take kCheckSteps SGD steps from the same weights on the same batches, and every
// parameter must agree (to float32 summation order). Returns the largest difference.
constexpr std::int64_t kCheckSteps = 8;
double sgd_steps_apart(Comm& comm, const Options& o) {
  auto [train_set, test_set] = examples::load_normalized_fashion_mnist(o.data_dir, o.limit);
  std::vector<float> weights[2];
  for (const bool zero : {false, true}) {
    DataLoader<float> loader(train_set, {.batch_size = o.batch / comm.size(), .shuffle = true, .seed = o.seed,
                                         .rank = comm.rank(), .world_size = comm.size()});
    auto model = lenet5<E>(1, 28, 10, o.seed);
    const TrainOptions quiet{.verbose = false, .checkpoint_group = CheckpointGroup(comm), .stop_after_steps = kCheckSteps};
    const auto lr = [](double) { return 0.05; };
    if (zero) {
      Zero1 zero1(model, comm);
      Sgd<E> sgd(zero1.shard_parameters(), {.lr = 0.05});
      Zero1Optimizer optimizer(zero1, sgd);
      Trainer(model, optimizer, lr, quiet).fit(loader);
    } else {
      DataParallel dp(model, comm);
      Sgd<E> sgd(dp.parameters(), {.lr = 0.05});
      Trainer(model, sgd, dp, lr, quiet).fit(loader);
    }
    for (auto& [name, p] : named_tensors(model).parameters)
      weights[zero].insert(weights[zero].end(), p->value.data(), p->value.data() + p->value.numel());
  }
  double apart = 0;
  for (std::size_t i = 0; i < weights[0].size(); ++i) apart = std::max(apart, std::abs(double{weights[0][i]} - weights[1][i]));
  return apart;
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
  const double sgd_apart = sgd_steps_apart(comm, o);
  if (rank == 0)
    std::printf("check: %lld SGD steps under DataParallel and under Zero1 end %.2g apart (largest parameter "
                "difference; tolerance 1e-5) %s\n\n",
                static_cast<long long>(kCheckSteps), sgd_apart, sgd_apart <= 1e-5 ? "ok" : "FAIL");
  const Outcome dp = train(comm, o, false);
  if (rank == 0) std::printf("\n--- Zero1: rank r holds the state of its shard of %zu parameters\n", shard);
  const Outcome zero = train(comm, o, true);

  // Formulas (float32, 4 bytes): parameters P and gradients P on every rank under both; Adam's
  // two moments 2P under DataParallel, 2 ceil(P/N) under Zero1. Per step a ring all-reduce moves
  // 2 (N-1)/N x 4P bytes per rank; Zero1's reduce-scatter + all-gather of the padded N ceil(P/N)
  // elements move (N-1)/N x 4 N ceil(P/N) each, the same up to the padding.
  const double mib = 1024.0 * 1024.0, n = ranks;
  const double weights = 4.0 * static_cast<double>(params);
  const double dp_state = 2 * weights, zero_state = 2 * 4.0 * static_cast<double>(shard);
  const double dp_comm = 2 * (n - 1) / n * weights, zero_comm = 2 * (n - 1) / n * 4.0 * n * static_cast<double>(shard);
  // The model and the strategy's buffers: parameters and gradients P each under both; DataParallel's
  // flat buckets P + 1 (the last carries the step's error flag, so one all-reduce tells every rank
  // that some rank failed); Zero1's flat buffer N ceil(P/N) (gradients to reduce-scatter, then gathered
  // values), its shard buffer ceil(P/N), and the shard's own parameter pieces for the optimizer
  // (values and gradients: 2 x the real elements of the shard; rank 0's, or the average over
  // thread ranks, P/N). Zero1 saves 2P - 2P/N of Adam's state and spends about 3P/N on its
  // buffers: less memory in all from N = 3.
  const double own = SharedMemoryCommunicator<Comm> ? static_cast<double>(params) / n
                                                     : static_cast<double>(std::min(shard, params));
  const double dp_model = 3 * weights + 4;
  const double zero_model = 4.0 * (2.0 * static_cast<double>(params) + (n + 1) * static_cast<double>(shard) + 2 * own);
  bool ok = true;
  if (rank == 0) {
    std::printf("\n%-34s %14s %14s\n", "per rank", "DataParallel", "Zero1");
    std::printf("%-34s %11.3f MiB %11.3f MiB\n", "model + buffers, formula", dp_model / mib, zero_model / mib);
    std::printf("%-34s %11.3f MiB %11.3f MiB\n", "model + buffers, measured", dp.model_bytes / mib, zero.model_bytes / mib);
    std::printf("%-34s %11.3f MiB %11.3f MiB\n", "Adam state, formula", dp_state / mib, zero_state / mib);
    std::printf("%-34s %11.3f MiB %11.3f MiB\n", "Adam state, measured", static_cast<double>(dp.state_bytes) / mib,
                static_cast<double>(zero.state_bytes) / mib);
    std::printf("%-34s %11.3f MiB %11.3f MiB\n", "total, measured",
                (dp.model_bytes + static_cast<double>(dp.state_bytes)) / mib,
                (zero.model_bytes + static_cast<double>(zero.state_bytes)) / mib);
    std::printf("%-34s %11.3f MiB %11.3f MiB\n", "communication per step (formula)", dp_comm / mib, zero_comm / mib);
    std::printf("%-34s %14.4f %14.4f\n", "final train loss", dp.train_loss, zero.train_loss);
    std::printf("%-34s %13.2f%% %13.2f%%\n", "final test accuracy", dp.accuracy, zero.accuracy);
    std::printf("%-34s %12.1f s %12.1f s\n", "training time", dp.seconds, zero.seconds);
  }
  // The claim: the optimizer state shrinks N-fold (exactly the formula) and training is the same.
  const bool memory_ok = static_cast<double>(dp.state_bytes) == dp_state && static_cast<double>(zero.state_bytes) == zero_state &&
                         std::abs(dp.model_bytes - dp_model) < 1 && std::abs(zero.model_bytes - zero_model) < 1;
  const double apart = std::abs(dp.accuracy - zero.accuracy);
  ok = memory_ok && apart <= o.tolerance && sgd_apart <= 1e-5;
  if (rank == 0)
    std::printf("\ncheck: Adam state %.2fx smaller (formula %.2fx: N = %d, up to padding), memory = formulas %s; test "
                "accuracies %.2f points "
                "apart (tolerance %.2f) %s\n",
                static_cast<double>(dp.state_bytes) / static_cast<double>(zero.state_bytes), dp_state / zero_state, ranks,
                memory_ok ? "ok" : "FAIL: measured differs from the formula", apart, o.tolerance,
                apart <= o.tolerance ? "ok" : "FAIL");
  return ok ? 0 : 1;
}

Options parse(int argc, char** argv) {
  Flags flags(argc, argv);
  Options o;
  o.epochs = flags.get("epochs", o.epochs, {.min = 1});
  o.batch = flags.get("batch", o.batch, {.min = 1});
  o.lr = flags.get("lr", o.lr, {.above = 0});
  o.threads = flags.threads("threads", o.threads);
  o.ranks = flags.ranks("ranks", o.ranks, !SharedMemoryCommunicator<Comm>);
  check_thread_budget(SharedMemoryCommunicator<Comm> ? o.ranks : 1, "--ranks", o.threads, "--threads");
  o.seed = static_cast<std::uint64_t>(flags.get("seed", std::int64_t{1}));
  o.limit = flags.get("limit", o.limit, {.min = 0});
  o.data_dir = flags.get("data-dir", o.data_dir);
  o.tolerance = flags.get("tolerance", o.tolerance, {.min = 0});
  o.trace = flags.output_path("trace", o.trace);
  flags.finish();
  return o;
}

}  // namespace

int main(int argc, char** argv) { return examples::run_checked<E>("12_zero", argc, argv, parse, run); }
