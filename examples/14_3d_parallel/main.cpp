// 14_3d_parallel: data x pipeline x tensor parallelism at once (Megatron-LM's "3-D"): three
// split()s of the world, one strategy stack, stack(DataParallel, Pipeline, TensorParallel), that
// Trainer::fit drives. An MLP 784-h-h-h-10 on Fashion-MNIST as two tensor-parallel blocks
// (column-parallel Linear -> ReLU -> row-parallel Linear, Megatron's MLP):
//
//   unit 0  flatten                                         (N, 1, 28, 28) -> (N, 784)
//   unit 1  block1: Linear(784, h) | ReLU | Linear(h, h)    hidden split over the T tensor ranks
//   unit 2  ReLU
//   unit 3  block2: Linear(h, h) | ReLU | Linear(h, 10)     hidden split over the T tensor ranks
//
// The units are cut into P pipeline stages, each stage's layers are split over T tensor ranks,
// and D copies of the whole pipeline train on their shards of every batch (data parallel).
// World rank = (d P + s) T + t. One source, one binary per communicator:
//
//   build/examples/14_3d_parallel_threads                   8 thread ranks: D = P = T = 2
//   mpirun -n 8 build/examples/14_3d_parallel_mpi
//   tools/tessera-run -n 4 build/examples/14_3d_parallel_gloo --data=1
//
// It checks itself in its first step: every rank's gradient slices, averaged over the replicas,
// equal the dense network's of the same seed on the whole batch (common/three_d_report.hpp, with
// the cost model of each dimension printed after training).
#include <cstdio>
#include <string>

#include "tessera/tessera.hpp"
#include "tessera/build_env.hpp"
#include "common/fashion_mnist_data.hpp"
#include "common/rank_status.hpp"
#include "common/three_d_report.hpp"

using namespace tessera;

namespace {

using E = BuildEnv;  // CpuThreads, CpuMpi or CpuGloo: chosen by the build, nowhere else
using Comm = E::Comm;
using Block = TensorParallelMlp<E>;
using Model = Sequential<Flatten<E>, Block, ReLU<E>, Block>;

struct Options {
  std::int64_t epochs = 1, batch = 64, hidden = 256, limit = 0;
  int data = 2, stages = 2, tensor = 2, micro_batches = 2, threads = 1;
  double lr = 0.05;
  std::uint64_t seed = 1;
  std::string data_dir, trace;
  int ranks = 8;  // data x stages x tensor for the threads build to launch; 0 under a launcher (run() checks its -n)
};

// The blocks draw their dense weights from one Rng in order (block1's two layers, then block2's),
// as the dense reference does, so the split network equals the dense one.
Model build_model(const Options& o, Comm& tensor_group) {
  Rng rng(o.seed);
  Block block1(784, o.hidden, o.hidden, rng, tensor_group);
  Block block2(o.hidden, o.hidden, 10, rng, tensor_group);
  Model model(Flatten<E>{}, std::move(block1), ReLU<E>{}, std::move(block2));
  model.set_names({"flatten", "block1", "relu", "block2"});
  model.set_needs_input_grad(false);              // the images need no gradient: no copy in flatten,
  model.layer<1>().set_needs_input_grad(false);   // and no backward all-reduce in block1
  return model;
}

int run(Comm& world, const Options& o) {
  const int D = o.data, P = o.stages, T = o.tensor;
  TESSERA_CHECK(world.size() == D * P * T, ArgumentError, "14_3d_parallel: ", world.size(), " ranks are not --data=", D,
                " x --stages=", P, " x --tensor=", T, " = ", D * P * T);
  TESSERA_CHECK(o.hidden % T == 0, ArgumentError, "--hidden=", o.hidden, " does not split over --tensor=", T, " ranks");
  TESSERA_CHECK(o.batch % D == 0 && (o.batch / D) % o.micro_batches == 0, ArgumentError, "--batch=", o.batch,
                " does not split over --data=", D, " replicas and then --micro-batches=", o.micro_batches);
  Cpu::set_num_threads(o.threads);
  const int rank = world.rank(), t = rank % T, s = (rank / T) % P, d = rank / (T * P);
  // Three groups from one world: my layer slices' partners (same d, s), my pipeline (same d, t:
  // one rank per stage) and my replicas (same s, t: one rank per copy).
  Comm tensor_group = world.split(d * P + s, t), pipe_group = world.split(d * T + t, s),
       data_group = world.split(s * T + t, d);
  auto [train_set, test_set] = examples::load_normalized_fashion_mnist(o.data_dir, o.limit);
  // Replica d reads shard d of every global batch; only whole batches (they split into micro-batches).
  DataLoader<float> loader(train_set, {.batch_size = o.batch / D, .shuffle = true, .seed = o.seed, .drop_last = true,
                                       .rank = d, .world_size = D, .drop_tail = true});
  DataLoader<float> test_loader(test_set, {.batch_size = 500, .shuffle = false});

  Model model = build_model(o, tensor_group);
  Pipeline pipe(model, pipe_group, {.micro_batches = o.micro_batches});  // of the 4 units, 2 hold parameters
  DataParallel<E> dp(pipe.stage(), data_group);
  TensorParallel<E> tensor(tensor_group, model.layer<1>(), model.layer<3>());
  Sgd<E> sgd(dp.parameters(), {.lr = o.lr, .momentum = 0.9});
  auto strategy = stack(dp, pipe, tensor);
  if (rank == 0) {
    std::printf("14_3d_parallel: MLP 784-%lld-%lld-%lld-10 on %d ranks = %d data x %d pipeline x %d tensor; global batch "
                "%lld = %d x %d micro-batches of %lld\n  %s\n", static_cast<long long>(o.hidden),
                static_cast<long long>(o.hidden), static_cast<long long>(o.hidden), world.size(), D, P, T,
                static_cast<long long>(o.batch), D, o.micro_batches, static_cast<long long>(o.batch / D / o.micro_batches),
                strategy.name().c_str());
    for (int k = 0; k < P; ++k)
      std::printf("  stage %d: units %s..%s, each Linear's hidden units split over %d tensor rank(s)\n", k,
                  model.unit_name(pipe.boundaries()[k]).c_str(), model.unit_name(pipe.boundaries()[k + 1] - 1).c_str(), T);
  }

  // The reference: the first global batch through the dense network, on every rank.
  examples::DenseMlp<E> dense(o.hidden, o.seed);
  const float dense_loss = dense.first_batch(train_set, o.batch, o.seed);
  // The check runs inside the first step, between the replicas' gradient average and the update.
  bool first_step = true;
  const auto check_first_step = [&] {
    TESSERA_CHECK(!first_step || examples::check_against_dense(world, pipe.stage_parameters(), dense, dense_loss, t),
                  Error, "the 3-D network's gradients differ from the dense network's on the first batch");
    first_step = false;
  };
  Timeline timeline(world);  // --trace: the second step, every rank's pipeline, tensor and data spans
  Trainer trainer(model, sgd, strategy, CosineLr{o.lr, static_cast<double>(o.epochs), 0.0},
                  {.epochs = o.epochs, .verbose = rank == 0, .before_step = check_first_step,
                   .timeline = o.trace.empty() ? nullptr : &timeline, .timeline_first_step = 1, .timeline_steps = 1,
                   .trace_path = o.trace, .checkpoint_group = CheckpointGroup(world)});
  const auto epochs = trainer.fit(loader, &test_loader);
  if (rank == 0) std::printf("final test accuracy: %.2f%%\n", 100 * epochs.back().test_accuracy);
  if (!o.trace.empty() && rank == 0) std::printf("timeline of one step: %s\n", o.trace.c_str());
  examples::print_3d_costs(world, pipe, D, P, T, o.batch, o.hidden, o.micro_batches);
  return 0;
}

Options parse(int argc, char** argv) {
  Flags flags(argc, argv);
  Options o;
  o.epochs = flags.get("epochs", o.epochs, {.min = 1}, "passes over the training set");
  o.batch = flags.get("batch", o.batch, {.min = 1}, "global batch in images, split over replicas, then micro-batches");
  o.hidden = flags.get("hidden", o.hidden, {.min = 1}, "hidden width h of the MLP, split over the tensor ranks");
  o.data = flags.get("data", o.data, {.min = 1, .max = 4096}, "D: data-parallel replicas of the pipeline");
  o.stages = flags.get("stages", o.stages, {.min = 1, .max = 2},  // 2 of the 4 units hold parameters
                       "P: pipeline stages (a stage needs a unit with parameters)");
  o.tensor = flags.get("tensor", o.tensor, {.min = 1, .max = 4096}, "T: tensor-parallel ranks per stage");
  o.micro_batches = flags.get("micro-batches", o.micro_batches, {.min = 1}, "micro-batches per replica's batch");
  o.lr = flags.get("lr", o.lr, {.above = 0}, "SGD learning rate (momentum 0.9), cosine decay to 0");
  o.threads = flags.threads("threads", o.threads, "OpenMP threads per rank");
  o.seed = static_cast<std::uint64_t>(flags.get("seed", std::int64_t{1}, "seed of the weights and the shuffling"));
  o.limit = flags.get("limit", o.limit, {.min = 0}, "training images to use (0: all 60,000)");
  o.data_dir = flags.get("data-dir", o.data_dir, "Fashion-MNIST directory (empty: the default locations)");
  o.trace = flags.output_path("trace", o.trace, "Chrome trace of the second training step, every rank");
  // Under a launcher its -n decides, and run() names --data x --stages x --tensor when they differ.
  o.ranks = SharedMemoryCommunicator<Comm> ? o.data * o.stages * o.tensor : 0;
  check_thread_budget(SharedMemoryCommunicator<Comm> ? o.ranks : 1, "--data x --stages x --tensor", o.threads,
                      "--threads");
  flags.finish();
  return o;
}

}  // namespace

int main(int argc, char** argv) { return examples::run_checked<E>("14_3d_parallel", argc, argv, parse, run); }
