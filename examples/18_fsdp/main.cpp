// 18_fsdp: ZeRO-2 and ZeRO-3 (FullyShardedDataParallel; Rajbhandari et al. 2020, PyTorch FSDP)
// against DataParallel, on the same ranks, data and seed: an MLP 784-1024xL-10 (L = --layers; 12:
// 12.4 M parameters in 13 units) trained with AdamW on Fashion-MNIST. One source, one binary per
// communicator:
//
//   build/examples/18_fsdp_threads --ranks=4
//   mpirun -n 4 build/examples/18_fsdp_mpi
//   tools/tessera-run -n 4 build/examples/18_fsdp_gloo
//
// It trains --steps steps three times (DataParallel, stage 2, stage 3) and prints for each the
// memory per rank measured by the allocator next to its formula (the peak while building, what
// stays once built, AdamW's state, the peak while training) and the elements each rank sends per
// step. It checks, exiting 1 when one fails:
// the three end at the same loss (float32 rounding apart), every kept and state figure within 5% of
// its formula, and from 4 ranks on ZeRO-3's training peak at most 0.35x DataParallel's
// (common/fsdp_report.hpp). --trace writes stage 3's timeline: each unit's all_gather on the
// communication lane beside the unit before it computing. --help lists the flags.
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "tessera/tessera.hpp"
#include "tessera/build_env.hpp"
#include "common/fashion_mnist_data.hpp"
#include "common/fsdp_report.hpp"
#include "common/memory.hpp"
#include "common/rank_status.hpp"

using namespace tessera;

namespace {

using E = BuildEnv;  // CpuThreads, CpuMpi or CpuGloo: chosen by the build, nowhere else
using Comm = E::Comm;
using Device = E::Device;

struct Options {
  std::int64_t batch = 64, limit = 8192;
  int steps = 20, layers = 12, threads = 1, ranks = 4;
  double lr = 1e-3;
  std::uint64_t seed = 1;
  std::string data_dir, trace;
};

// `stage` 0: DataParallel; 2 or 3: FullyShardedDataParallel. Memory from the model's construction on.
examples::FsdpRun train(Comm& comm, const Options& o, const Dataset& train_set, int stage) {
  DataLoader<float> loader(train_set, {.batch_size = o.batch / comm.size(), .shuffle = true, .seed = o.seed,
                                       .rank = comm.rank(), .world_size = comm.size()});
  examples::RankMemory<Device, Comm> memory(comm);
  memory.start();
  auto model = Mlp<E>(784, std::vector<std::int64_t>(static_cast<std::size_t>(o.layers), 1024), 10, o.seed);
  examples::FsdpRun out;
  std::optional<Timeline> timeline;
  if (!o.trace.empty() && stage == 3) timeline.emplace(comm);
  double before_update = 0;
  TrainOptions options{.verbose = false};
  options.before_step = [&] { before_update = memory.held().requested; };  // every rank, at the same point
  options.timeline = timeline ? &*timeline : nullptr;
  const auto run_steps = [&](auto& trainer) {
    out.built = memory.peak().requested;
    memory.restart_peak();
    Batch<float> batch;
    loader.start_epoch(0);
    for (int s = 0; s < o.steps && loader.next(batch); ++s) {
      out.loss = trainer.train_step(batch);
      if (s == 0) out.state = memory.held().requested - before_update;  // what the first update allocated
    }
    out.peak = memory.peak().requested;
  };
  if (stage == 0) {
    DataParallel dp(model, comm);
    AdamW<E> adamw(dp.parameters(), {.lr = o.lr});
    out.kept = memory.held().requested;
    Trainer trainer(model, adamw, dp, ConstantLr{o.lr}, options);
    run_steps(trainer);
  } else {
    FullyShardedDataParallel fsdp(model, comm, {.stage = stage});
    AdamW<E> adamw(fsdp.shard_parameters(), {.lr = o.lr});
    out.kept = memory.held().requested;
    FullyShardedOptimizer optimizer(fsdp, adamw);
    Trainer trainer(model, optimizer, fsdp, ConstantLr{o.lr}, options);
    run_steps(trainer);
    out.collective_elements = fsdp.last_step().gathered_elements + fsdp.last_step().reduce_scattered_elements;
  }
  if (timeline) {
    timeline->write(comm, o.trace);
    if (comm.rank() == 0) std::printf("timeline of ZeRO-3's steps: %s\n", o.trace.c_str());
  }
  return out;
}

int run(Comm& comm, const Options& o) {
  const int rank = comm.rank(), ranks = comm.size();
  TESSERA_CHECK(o.batch % ranks == 0, ArgumentError, "--batch=", o.batch, " (the global batch) must be divisible by the ",
                ranks, " ranks");
  Cpu::set_num_threads(o.threads);
  const std::int64_t parameters = 784 * 1024 + 1024 + (o.layers - 1) * (1024 * 1024 + 1024) + 1024 * 10 + 10;
  if (rank == 0)
    std::printf("18_fsdp: MLP 784-1024x%d-10 (%lld parameters, %d units) with AdamW on %d rank(s), global batch %lld, "
                "%d steps under each of DataParallel, ZeRO-2 and ZeRO-3\n",
                o.layers, static_cast<long long>(parameters), o.layers + 1, ranks, static_cast<long long>(o.batch), o.steps);
  auto [train_set, test_set] = examples::load_normalized_fashion_mnist(o.data_dir, o.limit);
  examples::FsdpRun runs[3];
  const int stages[3] = {0, 2, 3};
  for (int k = 0; k < 3; ++k) runs[k] = train(comm, o, train_set, stages[k]);
  return examples::report_fsdp(rank == 0, ranks, parameters, runs, 1e-3) ? 0 : 1;
}

Options parse(int argc, char** argv) {
  Flags flags(argc, argv);
  Options o;
  o.steps = flags.get("steps", o.steps, {.min = 1}, "training steps under each strategy");
  o.layers = flags.get("layers", o.layers, {.min = 1, .max = 64}, "hidden layers of 1024 (the units ZeRO-3 gathers one by one)");
  o.batch = flags.get("batch", o.batch, {.min = 1}, "global batch in images, split over the ranks");
  o.lr = flags.get("lr", o.lr, {.above = 0}, "AdamW's learning rate, held constant");
  o.threads = flags.threads("threads", o.threads, "OpenMP threads per rank");
  o.ranks = flags.ranks("ranks", o.ranks, !SharedMemoryCommunicator<Comm>, "data-parallel ranks (the shards)");
  check_thread_budget(SharedMemoryCommunicator<Comm> ? o.ranks : 1, "--ranks", o.threads, "--threads");
  o.seed = static_cast<std::uint64_t>(flags.get("seed", std::int64_t{1}, "seed of the weights and the shuffling"));
  o.limit = flags.get("limit", o.limit, {.min = 0}, "training images to use (0: all 60,000)");
  o.data_dir = flags.get("data-dir", o.data_dir, "Fashion-MNIST directory (empty: the default locations)");
  o.trace = flags.output_path("trace", o.trace, "Chrome trace of ZeRO-3's steps");
  flags.finish();
  return o;
}

}  // namespace

int main(int argc, char** argv) { return examples::run_checked<E>("18_fsdp", argc, argv, parse, run); }
