// Data-parallel training throughput: images/s of LeNet-5 or ResNet-20 training steps (forward,
// loss, backward, gradient all-reduce, SGD step) on synthetic 1x28x28 data, per rank batch fixed
// (weak scaling, as DDP users scale). One source, one binary per communicator:
//
//   dp_scaling_threads --ranks=1|2 ...    one rank is plain training with no DataParallel at all
//   mpirun -n 2 dp_scaling_mpi ...
//   tessera-run -n 2 dp_scaling_gloo ...
//
// Flags: --model=lenet|resnet20|mlp (784-1024xL-10, L = --layers=12) --batch=64 (per rank) --steps=40 --warmup=5 --threads=1 (per rank)
// --bucket-kib=1024 --consistency-check-every=100 (DataParallel's replica checksum; 0: off, with
// TESSERA_COMM_CHECK_EVERY=0 the agreement checks' cost is measured: bench/check_overhead.py --dp)
// --strategy=dp|fsdp2|fsdp3 (DataParallel, or FullyShardedDataParallel at stage 2 or 3; a sharded
// strategy wraps one rank too; with --optimizer=adamw and --model=resnet20 or mlp, the combinations
// measured, so that the benchmark compiles no others) --optimizer=sgd|adamw (SGD with momentum: one
// state tensor per parameter; AdamW: two).
// Memory (the allocator's requested bytes, as a formula of tensor sizes predicts them; per rank: the
// process's over --ranks for the threads build, whose ranks share one allocator): what the model and
// the strategy keep after construction ("parameters and gradients", DataParallel's bucket copy
// included), what the first optimizer step allocates (its state), and the timed steps' peak above
// that, and the timed steps' peak above what was in use before the model was built (the whole
// cost of training this model); the first two next to their formulas for Ψ parameters over N ranks:
//   dp:    3 Ψ b (values, gradients, buckets)   state K Ψ b
//   fsdp2: Ψ b + 2 Ψ b / N                       state K Ψ b / N
//   fsdp3: 2 Ψ b / N                             state K Ψ b / N
// Prints one JSON line (rank 0): images/s over all ranks = ranks x batch x steps
// / the slowest rank's time for the timed steps, and the exposed communication per step (from
// finish() starting to wait until the last bucket is reduced: the all-reduce time backward did not
// hide plus waiting for the slower rank; the largest of the ranks' means). bench/dp_scaling.py runs
// these next to PyTorch DDP.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <type_traits>

#include "tessera/tessera.hpp"
#include "tessera/build_env.hpp"

using namespace tessera;

namespace {

using E = BuildEnv;  // the backend is the build's choice (bench/meson.build, one binary per backend)
using Comm = E::Comm;

struct Options {
  std::string model = "lenet", strategy = "dp", optimizer = "sgd";
  std::int64_t batch = 64;
  int steps = 40, warmup = 5, threads = 1, ranks = 1, layers = 12;
  std::int64_t bucket_kib = 1024;
  int consistency_check_every = DataParallelOptions{}.consistency_check_every;
};

struct Timing {
  double seconds = 0, exposed_seconds_per_step = 0;
  // Requested bytes on this rank (the process's over its ranks for threads), and the formulas.
  double kept_bytes = 0, state_bytes = 0, step_peak_bytes = 0, peak_bytes = 0, kept_formula = 0, state_formula = 0;
  std::int64_t parameters = 0;
};

// The allocator's requested bytes in use, per rank of this process.
double requested_in_use(const Comm& comm) {
  const int sharing = SharedMemoryCommunicator<Comm> ? comm.size() : 1;
  return static_cast<double>(Cpu::allocator().stats().requested_bytes_in_use) / sharing;
}

// Runs warmup + timed steps; returns the seconds of the timed steps on this rank and the memory.
// One rank under --strategy=dp: plain training, no DataParallel at all (the baseline of the scaling
// efficiency). `before_model`: requested bytes before the model was built.
template <bool kShardable, class Model>
Timing run_steps(Model& model, Comm& comm, const Options& o, double before_model) {
  TESSERA_CHECK(o.strategy == "dp" || (kShardable && o.optimizer == "adamw"), ArgumentError, "dp_scaling: --strategy=",
                o.strategy, " runs with --optimizer=adamw and --model=resnet20 or mlp");
  const SyntheticImages data(o.batch * 4, 1, 28, 28, 10, 7);
  DataLoader<float> loader(data, {.batch_size = o.batch, .shuffle = false, .prefetch = false});
  Batch<float> batch;
  loader.start_epoch(0);
  loader.next(batch);
  Timing timing;
  std::optional<DataParallel<E>> dp;
  std::optional<FullyShardedDataParallel<Model>> fsdp;
  if (o.strategy == "dp" && comm.size() > 1)
    dp.emplace(model, comm, DataParallelOptions{.bucket_bytes = static_cast<std::size_t>(o.bucket_kib) * 1024,
                                                .first_bucket_bytes = std::min<std::size_t>(1u << 20, static_cast<std::size_t>(o.bucket_kib) * 1024),
                                                .consistency_check_every = o.consistency_check_every});
  if constexpr (kShardable)
    if (o.strategy != "dp") fsdp.emplace(model, comm, FullyShardedOptions{.stage = o.strategy == "fsdp2" ? 2 : 3});
  auto named = named_tensors(model);
  const NamedTensors<E>& trained = fsdp ? fsdp->shard_parameters() : named;
  if (fsdp) timing.parameters = fsdp->model_elements();  // stage 3 has released the model's tensors
  else
    for (auto& [name, p] : named.parameters) timing.parameters += p->value.numel();
  comm.barrier();  // threads share one allocator: every rank's model built and sharded first
  timing.kept_bytes = requested_in_use(comm) - before_model;
  const double psi = static_cast<double>(timing.parameters) * sizeof(float), n = comm.size();
  const int k = o.optimizer == "adamw" ? 2 : 1;
  timing.kept_formula = o.strategy == "dp" ? (comm.size() > 1 ? 3 : 2) * psi : o.strategy == "fsdp2" ? psi + 2 * psi / n : 2 * psi / n;
  timing.state_formula = o.strategy == "dp" ? k * psi : k * psi / n;
  // Drives the Trainer: the first step measures the optimizer's state (what its step() allocates:
  // TrainOptions::before_step runs just before it), then warmup and timed steps.
  const auto time_steps = [&](auto& trainer, double& before_update) {
    trainer.train_step(batch);
    comm.barrier();
    timing.state_bytes = requested_in_use(comm) - before_update;
    for (int i = 1; i < o.warmup; ++i) trainer.train_step(batch);
    comm.barrier();
    const double steady = requested_in_use(comm);
    Cpu::allocator().reset_peak();
    double exposed = 0;
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < o.steps; ++i) {
      trainer.train_step(batch);
      if (dp) exposed += std::chrono::duration<double>(dp->buckets().back().completed_at - dp->last_wait_began()).count();
    }
    timing.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    timing.exposed_seconds_per_step = exposed / o.steps;
    const int sharing = SharedMemoryCommunicator<Comm> ? comm.size() : 1;
    const double peak = static_cast<double>(Cpu::allocator().stats().peak_requested_bytes_in_use) / sharing;
    timing.step_peak_bytes = peak - steady;
    timing.peak_bytes = peak - before_model;
  };
  // One optimizer type per run; the other is built on no parameters (nothing allocated).
  const auto train = [&](auto& optimizer) {
    double before_update = 0;
    TrainOptions options{.verbose = false};
    options.before_step = [&] {  // every rank, at the same point of the step
      comm.barrier();
      before_update = requested_in_use(comm);
      comm.barrier();
    };
    if constexpr (kShardable && std::is_same_v<std::remove_cvref_t<decltype(optimizer)>, AdamW<E>>) {
      if (fsdp) {
        FullyShardedOptimizer sharded(*fsdp, optimizer);
        Trainer trainer(model, sharded, *fsdp, ConstantLr{0.01}, options);
        time_steps(trainer, before_update);
        return;
      }
    }
    if (dp) {
      Trainer trainer(model, optimizer, *dp, ConstantLr{0.01}, options);
      time_steps(trainer, before_update);
    } else {
      Trainer trainer(model, optimizer, ConstantLr{0.01}, options);
      time_steps(trainer, before_update);
    }
  };
  if (o.optimizer == "adamw") {
    AdamW<E> adamw(trained, {.lr = 0.01});
    train(adamw);
  } else {
    Sgd<E> sgd(trained, {.lr = 0.01, .momentum = 0.9});
    train(sgd);
  }
  return timing;
}

Timing run(Comm& comm, const Options& o) {
  Cpu::set_num_threads(o.threads);
  comm.barrier();
  const double before_model = requested_in_use(comm);
  if (o.model == "resnet20") {
    auto model = resnet20<E>({.in_channels = 1, .num_classes = 10});
    return run_steps<true>(model, comm, o, before_model);
  }
  if (o.model == "mlp") {  // 784-1024xL-10: 12.3 M parameters in 13 units at L = 12 (memory, not speed)
    auto model = Mlp<E>(784, std::vector<std::int64_t>(static_cast<std::size_t>(o.layers), 1024), 10, 7);
    return run_steps<true>(model, comm, o, before_model);
  }
  auto model = lenet5<E>();
  return run_steps<false>(model, comm, o, before_model);
}

// `worst`: the largest over ranks of the seconds, the exposed communication and the four memory figures.
void report(const char* comm, int ranks, const Options& o, const std::vector<double>& worst, const Timing& t) {
  std::printf("{\"bench\": \"dp_scaling\", \"framework\": \"tessera\", \"comm\": \"%s\", \"model\": \"%s\", "
              "\"strategy\": \"%s\", \"optimizer\": \"%s\", \"ranks\": %d, "
              "\"threads_per_rank\": %d, \"batch_per_rank\": %lld, \"steps\": %d, \"seconds\": %.6f, "
              "\"images_per_second\": %.2f, \"exposed_comm_us_per_step\": %.1f, \"parameters\": %lld, "
              "\"memory_bytes_per_rank\": {\"kept\": %.0f, \"kept_formula\": %.0f, \"optimizer_state\": %.0f, "
              "\"optimizer_state_formula\": %.0f, \"step_peak_above_steady\": %.0f, \"peak\": %.0f}, \"gemm\": \"%s\"}\n",
              comm, o.model.c_str(), o.strategy.c_str(), o.optimizer.c_str(), ranks, o.threads,
              static_cast<long long>(o.batch), o.steps, worst[0],
              static_cast<double>(ranks) * static_cast<double>(o.batch) * o.steps / worst[0], worst[1] * 1e6,
              static_cast<long long>(t.parameters), worst[2], t.kept_formula, worst[3], t.state_formula, worst[4],
              worst[5], cpu_gemm_kernel().c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Flags flags(argc, argv);
    Options o;
    o.model = flags.choice("model", o.model, {"lenet", "resnet20", "mlp"});
    o.strategy = flags.choice("strategy", o.strategy, {"dp", "fsdp2", "fsdp3"});
    o.layers = flags.get("layers", o.layers, {.min = 1, .max = 64});  // --model=mlp's hidden layers
    o.optimizer = flags.choice("optimizer", o.optimizer, {"sgd", "adamw"});
    o.batch = flags.get("batch", o.batch, {.min = 1});  // per rank
    o.steps = flags.get("steps", o.steps, {.min = 1});
    o.warmup = flags.get("warmup", o.warmup, {.min = 0});
    o.threads = flags.threads("threads", o.threads);
    o.ranks = flags.ranks("ranks", o.ranks, !SharedMemoryCommunicator<Comm>);
    // Ranks of the threads build share this process's cores (a process backend runs one rank here).
    check_thread_budget(SharedMemoryCommunicator<Comm> ? o.ranks : 1, "--ranks", o.threads, "--threads");
    o.bucket_kib = flags.get("bucket-kib", o.bucket_kib, {.min = 1, .max = 1 << 20});  // 1 KiB .. 1 GiB
    o.consistency_check_every = flags.get("consistency-check-every", o.consistency_check_every, {.min = 0});
    flags.finish();
    launch<E>(
        [&](Comm& comm) {
          const Timing timing = run(comm, o);
          std::vector<double> worst = {timing.seconds, timing.exposed_seconds_per_step, timing.kept_bytes,
                                       timing.state_bytes, timing.step_peak_bytes, timing.peak_bytes};
          comm.all_reduce(std::span<double>(worst), ReduceOp::Max);  // the slowest rank's time, the most memory
          if (comm.rank() == 0) report(comm.size() > 1 ? Comm::backend_name : "none", comm.size(), o, worst, timing);
        },
        {.ranks = o.ranks});  // --ranks: threads build only
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dp_scaling: %s\n", e.what());
    return 1;
  }
}
