// Elastic resume, on any communicator: a data-parallel run (DataParallel + SGD with momentum, or
// Zero1 + Adam, whose optimizer state is sharded, or FullyShardedDataParallel + AdamW, with its
// sharded or one-file checkpoints) of a small MLP in float64 with a global batch of 16 (24 to
// resume at 3 ranks), stopped in the middle of epoch 2 with a checkpoint, and resumed at another
// world size.
// Keeping the global batch, the resumed run must end where an uninterrupted run ends, up to
// floating-point summation order. Collective: every rank calls elastic_run.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "tessera/comm/threads.hpp"
#include "tessera/core/env.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/data/synthetic.hpp"
#include "tessera/layers/activation.hpp"
#include "tessera/layers/flatten.hpp"
#include "tessera/layers/linear.hpp"
#include "tessera/layers/sequential.hpp"
#include "tessera/optim/adam.hpp"
#include "tessera/optim/schedule.hpp"
#include "tessera/optim/sgd.hpp"
#include "tessera/parallel/data_parallel.hpp"
#include "tessera/parallel/fully_sharded.hpp"
#include "tessera/parallel/zero.hpp"
#include "tessera/train/checkpoint.hpp"
#include "tessera/train/trainer.hpp"

namespace tessera::testing {

// FullyShardedDataParallel stage 3 and stage 2, with AdamW, and DataParallel with the same AdamW
// (which resumes from the one file a sharded checkpoint consolidates into).
enum class ElasticStrategy { DataParallelSgd, Zero1Adam, Fsdp3AdamW, Fsdp2AdamW, DataParallelAdamW };

inline const char* to_string(ElasticStrategy s) {
  switch (s) {
    case ElasticStrategy::DataParallelSgd: return "dp+sgd";
    case ElasticStrategy::Zero1Adam: return "zero1+adam";
    case ElasticStrategy::Fsdp3AdamW: return "fsdp3+adamw";
    case ElasticStrategy::Fsdp2AdamW: return "fsdp2+adamw";
    case ElasticStrategy::DataParallelAdamW: return "dp+adamw";
  }
  return "?";
}

struct ElasticCase {
  ElasticStrategy strategy = ElasticStrategy::DataParallelSgd;
  std::int64_t global_batch = 16;        // 96 samples: 6 steps per epoch at every world size
  std::int64_t epochs = 3;
  std::int64_t stop_after_steps = 0;     // > 0: stop there (mid-epoch) with a checkpoint
  std::string checkpoint, resume;        // save to / resume from
  std::int64_t per_rank_batch = 0;       // > 0: this instead of global_batch / world size (a refusal test)
  bool consolidated = false;             // FSDP: one-file checkpoints instead of a directory of shards
};

struct ElasticResult {
  std::vector<double> losses;  // per completed epoch: the global batch's mean (averaged over ranks)
  std::vector<double> params;  // every parameter, flattened (rank 0's; every rank checks it equals rank 0's)
  std::int64_t global_step = 0, epoch = 0;
  bool ranks_identical = true;
};

inline const Dataset& elastic_data() {
  static const Dataset d = SyntheticImages(96, 1, 10, 10, 4, 5);
  return d;
}

// The model: 100 inputs, 32 hidden, 4 classes, weights from `seed`.
template <class E>
using ElasticNet = Sequential<Flatten<E>, Linear<E>, ReLU<E>, Linear<E>>;
template <class E>
ElasticNet<E> elastic_model(std::uint64_t seed) {
  Rng rng(seed);
  return ElasticNet<E>{Flatten<E>(), Linear<E>(100, 32, rng), ReLU<E>(), Linear<E>(32, 4, rng)};
}

// A fresh directory under the system's temporary one, unique to this process.
inline std::filesystem::path elastic_temp_dir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() / (name + "_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return dir;
}

template <class S, class Comm>
ElasticResult elastic_run(Comm& comm, const ElasticCase& c) {
  using E = Env<Cpu, Comm, S>;
  const int rank = comm.rank(), ranks = comm.size();
  // Ranks start from different weights on purpose: the strategies broadcast rank 0's, and a
  // resume loads the same file everywhere.
  auto model = elastic_model<E>(4 + static_cast<std::uint64_t>(rank));
  const std::int64_t batch = c.per_rank_batch > 0 ? c.per_rank_batch : c.global_batch / ranks;
  DataLoader<S> loader(elastic_data(), {.batch_size = batch, .seed = 1, .rank = rank, .world_size = ranks});
  const TrainOptions options{.epochs = c.epochs,
                             .checkpoint_path = c.checkpoint,
                             .verbose = false,
                             .checkpoint_group = CheckpointGroup(comm),
                             .stop_after_steps = c.stop_after_steps};
  const CosineLr schedule{0.05, static_cast<double>(c.epochs), 0.0};
  ElasticResult out;
  auto train = [&](auto& trainer) {
    if (!c.resume.empty()) trainer.load(c.resume, loader);
    for (const auto& r : trainer.fit(loader)) {
      double loss = r.train_loss;
      comm.all_reduce(std::span<double>(&loss, 1), ReduceOp::Avg);
      out.losses.push_back(loss);
    }
    out.global_step = trainer.state().global_step;
    out.epoch = trainer.state().epoch;
  };
  if (c.strategy == ElasticStrategy::DataParallelSgd) {
    DataParallel dp(model, comm);
    Sgd<E> sgd(dp.parameters(), {.lr = 0.05, .momentum = 0.9, .weight_decay = 5e-4});
    Trainer trainer(model, sgd, schedule, options);
    train(trainer);
  } else if (c.strategy == ElasticStrategy::Fsdp3AdamW || c.strategy == ElasticStrategy::Fsdp2AdamW) {
    FullyShardedDataParallel fsdp(model, comm,
                                  {.stage = c.strategy == ElasticStrategy::Fsdp3AdamW ? 3 : 2,
                                   .sharded_checkpoints = !c.consolidated});
    AdamW<E> adamw(fsdp.shard_parameters(), {.lr = 1e-2, .weight_decay = 1e-2});
    FullyShardedOptimizer optimizer(fsdp, adamw);
    Trainer trainer(model, optimizer, fsdp, [](double) { return 1e-2; }, options);
    train(trainer);
    fsdp.gather_full();  // the parameters into the model, to be read below
  } else if (c.strategy == ElasticStrategy::DataParallelAdamW) {
    DataParallel dp(model, comm);
    AdamW<E> adamw(dp.parameters(), {.lr = 1e-2, .weight_decay = 1e-2});
    Trainer trainer(model, adamw, [](double) { return 1e-2; }, options);
    train(trainer);
  } else {
    Zero1 zero(model, comm);
    Adam<E> adam(zero.shard_parameters(), {.lr = 1e-2, .weight_decay = 1e-4});
    Zero1Optimizer optimizer(zero, adam);
    Trainer trainer(model, optimizer, [](double) { return 1e-2; }, options);
    train(trainer);
  }
  for (auto& [name, p] : named_tensors(model).parameters)
    for (std::int64_t k = 0; k < p->value.numel(); ++k) out.params.push_back(static_cast<double>(p->value.data()[k]));
  std::vector<double> first = out.params;
  comm.broadcast(std::span<double>(first), 0);
  out.ranks_identical = first == out.params;
  int identical = out.ranks_identical ? 1 : 0;
  comm.all_reduce(std::span<int>(&identical, 1), ReduceOp::Min);
  out.ranks_identical = identical == 1;
  return out;
}

// elastic_run on `ranks` thread ranks; rank 0's result.
inline ElasticResult elastic_run_threads(int ranks, const ElasticCase& c) {
  ElasticResult out;
  ThreadWorld world(ranks);
  world.run([&](ThreadComm& comm) {
    ElasticResult mine = elastic_run<double>(comm, c);
    if (comm.rank() == 0) out = std::move(mine);
  });
  return out;
}

// Largest |a - b| over the parameters (infinity when the sizes differ).
inline double max_difference(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return INFINITY;
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return worst;
}

}  // namespace tessera::testing
