// Example 08: ResNet-50 (v1.5, 25,557,032 parameters at 1000 classes) training steps on synthetic
// ImageNet-shaped data. One set of sources, one binary per backend: the build picks the Env
// (tessera::BuildEnv: CpuLocal, CpuThreads, CpuMpi, CpuGloo, CudaLocal, CudaNccl) and no source
// names a backend; the strategy is a flag. This file: the flags and data parallelism;
// model_parallel.cpp: pipeline and tensor parallelism; resnet50.hpp: the model both train.
//
//   ./08_resnet50_local [--batch=8] ...               one CPU process (CpuLocal)
//   ./08_resnet50_threads [--batch=8] [--steps=5] [--image=224] [--classes=1000] [--threads=N]
//                 [--ranks=1]  (>1: data parallel over that many ranks, threads of this process)
//   mpirun -n 2 ./08_resnet50_mpi ...                 data parallel over MPI
//   tools/tessera-run -n 2 ./08_resnet50_gloo ...     data parallel over Gloo
//   ./08_resnet50_cuda ...                            one GPU (CudaLocal)
//   tools/tessera-run -n 2 ./08_resnet50_nccl ...     one process per GPU over NCCL (CudaNccl)
//   [--sync-bn] synchronizes BatchNorm statistics across ranks (default: per rank, as Goyal et al.)
//
//   --strategy=data          (default) every rank a replica, --batch per rank
//   --strategy=pipeline:P    the 18 units (stem, 16 bottlenecks, head) split into P stages, one per
//                            rank, --micro-batches=M (default 1), 1F1B; --batch is the whole batch
//   --strategy=tensor        every bottleneck and the classifier split over the ranks (Megatron
//                            style channel/column parallelism); --batch is the whole batch
//   --verify                 (pipeline, tensor) rank 0 also trains the unsplit model on the same
//                            batches and checks that every step's loss agrees (pipeline: and the
//                            last step's gradients). With M > 1 the unsplit model runs the M
//                            micro-batches one by one, as BatchNorm sees them in the pipeline
//
// The learning rate follows the linear scaling rule for the global batch (0.1 x batch / 256),
// momentum 0.9, weight decay 1e-4 not on BN and biases, and the last BN of every block starts at
// zero (Goyal et al.).
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>

#include "08_resnet50/resnet50.hpp"
#include "common/memory.hpp"

using namespace resnet50_example;

namespace {

// The strategy named by --strategy, on this communicator.
void train_split(Comm& comm, const Options& o) {
  if (o.strategy == "tensor") return train_tensor(comm, o);
  const int stages = std::stoi(o.strategy.substr(std::string("pipeline:").size()));
  train_pipeline(comm, o, stages);
}

// Memory per rank after the first step, formula | measured (bytes requested from the allocator;
// thread ranks: the process's average). Parameters and gradients P values each, BatchNorm's
// running statistics B, DataParallel's flat buckets P + 1 (the last carries the step's error
// flag); SGD's momentum P. Activations: measured only, per image of the batch (ResNet-50 keeps
// about 100 MB per 224x224 image for its backward).
void report_memory(Comm& comm, NamedTensors<E>& named, const examples::RankMemory<E::Device, Comm>::Bytes& model,
                   const examples::RankMemory<E::Device, Comm>::Bytes& step_peak, double momentum, bool parallel,
                   std::int64_t batch) {
  if (comm.rank() != 0) return;
  std::int64_t buffers = 0;
  for (auto& [name, t] : named.buffers) buffers += t->numel();
  const double p = static_cast<double>(count_parameters(named)), mib = 1024.0 * 1024.0;
  const double formula = 4 * (2 * p + static_cast<double>(buffers) + (parallel ? p + 1 : 0));
  std::printf("memory per rank: parameters + gradients + BatchNorm buffers%s = 4 x (2 x %.0f + %lld%s) B = %.1f MiB | "
              "%.1f MiB measured (%.2fx; %.1f MiB in blocks)\n", parallel ? " + buckets" : "", p,
              static_cast<long long>(buffers), parallel ? " + P + 1" : "", formula / mib, model.requested / mib,
              model.requested / formula, model.blocks / mib);
  std::printf("memory per rank: momentum = 4 x %.0f B = %.1f MiB | %.1f MiB measured (%.2fx)\n", p, 4 * p / mib,
              momentum / mib, momentum / (4 * p));
  std::printf("memory per rank: the first step's peak above the model (activations, their gradients, workspaces) | "
              "%.1f MiB measured = %.1f MiB per image of the batch (%.1f MiB in blocks)\n", step_peak.requested / mib,
              step_peak.requested / mib / static_cast<double>(batch), step_peak.blocks / mib);
}

// Data parallelism over every rank of comm (one rank: plain training, no DataParallel).
void train(Comm& comm, const Options& o) {
  const int rank = comm.rank(), ranks = comm.size();
  const bool parallel = ranks > 1;
  Cpu::set_num_threads(o.threads);
  examples::RankMemory<E::Device, Comm> memory(comm);  // per rank, from the model on
  memory.start();
  auto model = make_resnet50(o);
  if (parallel && o.sync_bn) convert_sync_batch_norm(model, comm);
  std::optional<DataParallel<E>> dp;
  if (parallel) dp.emplace(model, comm);
  auto named = named_tensors(model);
  const auto model_bytes = memory.held();  // parameters, gradients, BatchNorm buffers, buckets
  if (rank == 0)
    std::printf("%s: %zu parameters, %d rank(s) x batch %lld, %lldx%lld, %d threads per rank%s\n", model.name().c_str(),
                count_parameters(named), ranks, static_cast<long long>(o.batch), static_cast<long long>(o.image),
                static_cast<long long>(o.image), Cpu::num_threads(),
                parallel ? (o.sync_bn ? ", DataParallel + SyncBatchNorm" : ", DataParallel") : "");

  Sgd<E> sgd(named, sgd_options(o.batch * ranks));
  Dataset data = SyntheticImages(o.batch * ranks * 4, 3, o.image, o.image, o.classes, 7);
  DataLoader<float> loader(data, {.batch_size = o.batch, .shuffle = true, .seed = 3, .drop_last = true,
                                  .rank = rank, .world_size = ranks});
  // The first step's memory, from its start: after backward, the peak (activations, their
  // gradients, workspaces) and what stays; after the optimizer step, the momentum it created.
  // Otherwise no hook: sgd.step() finishes DataParallel's all-reduce itself.
  examples::RankMemory<E::Device, Comm>::Bytes step_peak, after_backward;
  bool first_step = true;
  const auto measure = [&] {
    if (!first_step) return;
    if (dp) dp->finish();  // the buckets' all-reduce before the measurement's barriers
    step_peak = memory.peak();
    after_backward = memory.held();
  };
  Trainer trainer(model, sgd, ConstantLr{sgd.lr()}, {.epochs = 1, .verbose = false, .before_step = measure});

  Batch<float> b;
  double total = 0;
  for (std::int64_t step = 0, epoch = 0; step < o.steps; ++epoch) {
    loader.start_epoch(epoch);
    while (step < o.steps && loader.next(b)) {
      const auto t0 = std::chrono::steady_clock::now();
      // The loss of the global batch: the mean of the ranks' shard losses (equal shards), one
      // scalar all-reduce after the step (outside the timed part).
      if (first_step) memory.start();
      std::array<double, 1> loss{trainer.train_step(b)};
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double momentum = first_step ? memory.held().requested - after_backward.requested : 0;
      if (step > 0) total += s;  // the first step warms up caches and workspaces
      if (ranks > 1) comm.all_reduce(std::span<double>(loss), ReduceOp::Avg);
      if (rank == 0)
        std::printf("step %lld: loss %.4f (%s), %.2f s, %.1f img/s (all ranks)\n", static_cast<long long>(step + 1),
                    loss[0], ranks > 1 ? "mean over the ranks" : "one rank", s, static_cast<double>(o.batch * ranks) / s);
      if (first_step) report_memory(comm, named, model_bytes, step_peak, momentum, parallel, o.batch);
      first_step = false;
      ++step;
    }
  }
  if (o.steps > 1 && rank == 0)
    std::printf("steady state: %.1f img/s (all ranks)\n", static_cast<double>(o.batch * ranks * (o.steps - 1)) / total);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Flags flags(argc, argv);
    Options o;
    o.batch = flags.get("batch", o.batch, {.min = 1});  // per rank (data), the whole batch (pipeline, tensor)
    o.steps = flags.get("steps", o.steps, {.min = 1});
    o.image = flags.get("image", o.image, {.min = 1});
    o.classes = flags.get("classes", o.classes, {.min = 1});
    o.threads = flags.threads("threads", o.threads);
    o.ranks = flags.get("ranks", o.ranks, {.min = 1});
    o.sync_bn = flags.get("sync-bn", o.sync_bn);
    o.strategy = flags.get("strategy", o.strategy);
    o.micro_batches = flags.get("micro-batches", o.micro_batches, {.min = 1});
    o.verify = flags.get("verify", o.verify);
    flags.finish();
    const bool split = o.strategy != "data";
    TESSERA_CHECK(!split || o.strategy == "tensor" ||
                      (o.strategy.rfind("pipeline:", 0) == 0 && o.strategy.size() > 9 && o.strategy.size() <= 11 &&
                       o.strategy.find_first_not_of("0123456789", 9) == std::string::npos),
                  ArgumentError, "--strategy=", o.strategy, " is not data, pipeline:P or tensor");
    // ResNet-50's 18 units (stem, 16 bottlenecks, head) give at most 18 stages.
    const int stages = o.strategy.rfind("pipeline:", 0) == 0 ? std::stoi(o.strategy.substr(9)) : 0;
    TESSERA_CHECK(o.strategy.rfind("pipeline:", 0) != 0 || (stages >= 1 && stages <= 18), ArgumentError,
                  "--strategy=", o.strategy, ": P must be in [1, 18] (ResNet-50 has 18 units)");
    TESSERA_CHECK(stages == 0 || o.batch % o.micro_batches == 0, ArgumentError, "--batch=", o.batch,
                  " does not split into --micro-batches=", o.micro_batches);
    TESSERA_CHECK(!split || !o.sync_bn, ArgumentError, "--sync-bn applies to --strategy=data only");
    // Flags that another strategy would silently ignore are refused, like a mistyped flag.
    TESSERA_CHECK(stages != 0 || o.micro_batches == 1, ArgumentError, "--micro-batches applies to ",
                  "--strategy=pipeline:P only (--strategy=", o.strategy, ")");
    TESSERA_CHECK(stages == 0 || !flags.has("ranks") || o.ranks == stages, ArgumentError, "--ranks=", o.ranks,
                  " with --strategy=", o.strategy, ": a pipeline runs one rank per stage (", stages, ")");
    TESSERA_CHECK(split || !o.verify, ArgumentError, "--verify applies to --strategy=pipeline:P and ",
                  "--strategy=tensor (data parallelism keeps full replicas: there is no split to check)");
    // Ranks spawned in-process (threads) for each strategy; a process backend takes its world
    // from the launcher (mpirun, tools/tessera-run, srun).
    // Under a launcher a rank count not given is 0: take what it started (pipeline:P still needs P).
    const bool launcher_decides = !SharedMemoryCommunicator<Comm> && !flags.has("ranks");
    const int ranks = stages != 0            ? stages
                      : launcher_decides       ? 0
                      : o.strategy == "tensor" ? std::max(o.ranks, 2)
                                               : o.ranks;
    // Ranks of the threads build share this process's cores (a process backend runs one rank here).
    check_thread_budget(SharedMemoryCommunicator<Comm> ? ranks : 1, split ? "ranks" : "--ranks", o.threads,
                        "--threads");
    launch<E>(
        [&](Comm& comm) {
          if (split) train_split(comm, o);
          else train(comm, o);
        },
        {.ranks = ranks});
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
