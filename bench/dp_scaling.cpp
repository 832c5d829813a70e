// Data-parallel training throughput: images/s of LeNet-5 or ResNet-20 training steps (forward,
// loss, backward, gradient all-reduce, SGD step) on synthetic 1x28x28 data, per rank batch fixed
// (weak scaling, as DDP users scale). One source, one binary per communicator:
//
//   dp_scaling_threads --ranks=1|2 ...    one rank is plain training with no DataParallel at all
//   mpirun -n 2 dp_scaling_mpi ...
//   tessera-run -n 2 dp_scaling_gloo ...
//
// Flags: --model=lenet|resnet20 --batch=64 (per rank) --steps=40 --warmup=5 --threads=1 (per rank)
// --bucket-kib=1024 --consistency-check-every=100 (DataParallel's replica checksum; 0: off, with
// TESSERA_COMM_CHECK_EVERY=0 the agreement checks' cost is measured: bench/check_overhead.py --dp).
// Prints one JSON line (rank 0): images/s over all ranks = ranks x batch x steps
// / the slowest rank's time for the timed steps, and the exposed communication per step (from
// finish() starting to wait until the last bucket is reduced: the all-reduce time backward did not
// hide plus waiting for the slower rank; the largest of the ranks' means). bench/dp_scaling.py runs
// these next to PyTorch DDP.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

#include "tessera/tessera.hpp"
#include "tessera/build_env.hpp"

using namespace tessera;

namespace {

using E = BuildEnv;  // the backend is the build's choice (bench/meson.build, one binary per backend)
using Comm = E::Comm;

struct Options {
  std::string model = "lenet";
  std::int64_t batch = 64;
  int steps = 40, warmup = 5, threads = 1, ranks = 1;
  std::int64_t bucket_kib = 1024;
  int consistency_check_every = DataParallelOptions{}.consistency_check_every;
};

struct Timing {
  double seconds = 0, exposed_seconds_per_step = 0;
};

// Runs warmup + timed steps; returns the seconds of the timed steps on this rank.
// One rank: plain training, no DataParallel at all (the baseline of the scaling efficiency).
template <class Model>
Timing run_steps(Model& model, Comm& comm, const Options& o) {
  const SyntheticImages data(o.batch * 4, 1, 28, 28, 10, 7);
  DataLoader<float> loader(data, {.batch_size = o.batch, .shuffle = false, .prefetch = false});
  Batch<float> batch;
  loader.start_epoch(0);
  loader.next(batch);
  std::optional<DataParallel<E>> dp;
  if (comm.size() > 1) dp.emplace(model, comm, DataParallelOptions{.bucket_bytes = static_cast<std::size_t>(o.bucket_kib) * 1024,
                                                         .first_bucket_bytes = std::min<std::size_t>(1u << 20, static_cast<std::size_t>(o.bucket_kib) * 1024),
                                                         .consistency_check_every = o.consistency_check_every});
  auto named = named_tensors(model);
  Sgd<E> sgd(named, {.lr = 0.01, .momentum = 0.9});
  // Several ranks: the Trainer drives DataParallel through the strategy protocol, as the examples do.
  const auto time_steps = [&](auto& trainer) {
    for (int i = 0; i < o.warmup; ++i) trainer.train_step(batch);
    comm.barrier();
    double exposed = 0;
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < o.steps; ++i) {
      trainer.train_step(batch);
      if (dp) exposed += std::chrono::duration<double>(dp->buckets().back().completed_at - dp->last_wait_began()).count();
    }
    return Timing{std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), exposed / o.steps};
  };
  if (dp) {
    Trainer trainer(model, sgd, *dp, ConstantLr{0.01}, {.verbose = false});
    return time_steps(trainer);
  }
  Trainer trainer(model, sgd, ConstantLr{0.01}, {.verbose = false});
  return time_steps(trainer);
}

Timing run(Comm& comm, const Options& o) {
  Cpu::set_num_threads(o.threads);
  if (o.model == "resnet20") {
    auto model = resnet20<E>({.in_channels = 1, .num_classes = 10});
    return run_steps(model, comm, o);
  }
  TESSERA_CHECK(o.model == "lenet", ArgumentError, "dp_scaling: --model=", o.model, " is not lenet or resnet20");
  auto model = lenet5<E>();
  return run_steps(model, comm, o);
}

void report(const char* comm, int ranks, const Options& o, double seconds, double exposed_seconds_per_step) {
  std::printf("{\"bench\": \"dp_scaling\", \"framework\": \"tessera\", \"comm\": \"%s\", \"model\": \"%s\", \"ranks\": %d, "
              "\"threads_per_rank\": %d, \"batch_per_rank\": %lld, \"steps\": %d, \"seconds\": %.6f, "
              "\"images_per_second\": %.2f, \"exposed_comm_us_per_step\": %.1f, \"gemm\": \"%s\"}\n",
              comm, o.model.c_str(), ranks, o.threads, static_cast<long long>(o.batch), o.steps, seconds,
              static_cast<double>(ranks) * static_cast<double>(o.batch) * o.steps / seconds, exposed_seconds_per_step * 1e6,
              cpu_gemm_kernel().c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Flags flags(argc, argv);
    Options o;
    o.model = flags.choice("model", o.model, {"lenet", "resnet20"});
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
          std::vector<double> worst = {timing.seconds, timing.exposed_seconds_per_step};
          comm.all_reduce(std::span<double>(worst), ReduceOp::Max);  // the slowest rank's time
          if (comm.rank() == 0) report(comm.size() > 1 ? Comm::backend_name : "none", comm.size(), o, worst[0], worst[1]);
        },
        {.ranks = o.ranks});  // --ranks: threads build only
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dp_scaling: %s\n", e.what());
    return 1;
  }
}
