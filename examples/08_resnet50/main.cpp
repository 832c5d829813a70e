// Example 08: ResNet-50 (v1.5, 25,557,032 parameters at 1000 classes) training steps on synthetic
// ImageNet-shaped data. One set of sources, one binary per backend: the build picks the Env
// (tessera::BuildEnv: CpuLocal, CpuThreads, CpuMpi, CpuGloo, CudaLocal, CudaNccl) and no source
// names a backend; the strategy is a flag. This file: data parallelism; model_parallel.cpp:
// pipeline and tensor parallelism; resnet50.hpp: the model both train, the flags, the memory report.
//
//   ./08_resnet50_threads --batch=8 --steps=5 --ranks=1   one process; --ranks=2: data parallel, 2 threads
//   mpirun -n 2 ./08_resnet50_mpi ...                     data parallel over MPI (Gloo, NCCL alike)
//   ./08_resnet50_threads --strategy=pipeline:2 --verify  the 18 units in 2 stages, checked against one rank
//   ./08_resnet50_threads --strategy=tensor --verify      every bottleneck split over the ranks (Megatron style)
//
// The learning rate follows the linear scaling rule for the global batch (0.1 x batch / 256),
// momentum 0.9, weight decay 1e-4 not on BN and biases, and the last BN of every block starts at
// zero (Goyal et al.). --help lists every flag; README.md explains them.
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
    std::printf("%s: %zu parameters, %d rank(s) x batch %lld, %lldx%lld %s, %d threads per rank%s\n", model.name().c_str(),
                count_parameters(named), ranks, static_cast<long long>(o.batch), static_cast<long long>(o.image),
                static_cast<long long>(o.image), to_string(o.memory_format), Cpu::num_threads(),
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
    int ranks = 0;
    const Options o = parse_options(argc, argv, ranks);
    const bool split = o.strategy != "data";
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
