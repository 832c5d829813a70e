// 06_pipeline_parallel: LeNet-5 on Fashion-MNIST split into P pipeline stages, one per rank, each
// batch cut into M micro-batches, under GPipe, 1F1B, interleaved 1F1B, ZB-H1 or ZB-V (each backward
// split into input and weight halves), or torch's CSV; optionally R data-parallel replicas (hybrid):
//
//   build/examples/06_pipeline_parallel_threads --stages=2 --micro-batches=4
//   mpirun -n 2 build/examples/06_pipeline_parallel_mpi --schedule=gpipe
//   build/examples/06_pipeline_parallel_threads --stages=2 --replicas=2     4 ranks: 2 x 2
//   tools/tessera-run -n 2 build/examples/06_pipeline_parallel_nccl          one stage per GPU
//
// The idea: a Pipeline is a strategy that runs the model itself, stage by stage, so the same
// Trainer::fit drives it, alone or stacked under DataParallel: stack(dp, pipe). It checks itself
// first: on the first batch, the pipeline's loss and every stage's gradients must equal the
// unsplit model's (every rank builds the whole model from the same seed). After training it
// asserts the schedule and prints the bubble, the bytes between stages and the activation memory,
// each by formula beside the measured figure (common/pipeline_report.hpp).
#include <algorithm>
#include <cstdio>
#include <string>

#include "tessera/tessera.hpp"
#include "tessera/build_env.hpp"
#include "common/fashion_mnist_data.hpp"
#include "common/pipeline_report.hpp"

using namespace tessera;

namespace {

struct Options {
  std::int64_t epochs = 3, batch = 64, limit = 0;
  int micro_batches = 4, threads = 1, stages = 2, replicas = 1;
  bool stages_given = false;  // under a launcher, --stages not given means "as many as it started"
  double lr = 0.05;
  std::uint64_t seed = 1;
  std::string schedule = "1f1b", schedule_csv, data_dir, trace;
};

using E = BuildEnv;  // CpuThreads, CpuMpi, CpuGloo or CudaNccl: chosen by the build, nowhere else
using Device = E::Device;
using Comm = E::Comm;
constexpr std::int64_t kTracedStep = 1;  // --trace records the second step (the first fills caches)

void train(Comm& world, const Options& o, int stages) {
  const int replicas = world.size() / stages, replica = world.rank() / stages;
  // The global batch splits evenly over the replicas and each replica's share into the
  // micro-batches, or it is refused here, before the data is read: never silently rounded.
  TESSERA_CHECK(o.batch % replicas == 0 && (o.batch / replicas) % o.micro_batches == 0, ArgumentError, "--batch=",
                o.batch, " over ", replicas, " replica(s) does not split into --micro-batches=", o.micro_batches);
  Cpu::set_num_threads(o.threads);
  // Rank = replica x stages + stage: my pipeline, and the same stage in the other replicas.
  Comm pipe_comm = world.split(replica, world.rank() % stages), dp_comm = world.split(world.rank() % stages, replica);
  auto [train_set, test_set] = examples::load_normalized_fashion_mnist(o.data_dir, o.limit);
  DataLoader<float> loader(train_set, {.batch_size = o.batch / replicas, .shuffle = true, .seed = o.seed,
                                       .rank = replica, .world_size = replicas, .drop_tail = true});
  DataLoader<float> test_loader(test_set, {.batch_size = 500, .shuffle = false});
  Batch<float> first;
  loader.start_epoch(0);
  TESSERA_CHECK(loader.next(first), Error, "no training data");

  auto model = lenet5<E>(1, 28, 10, o.seed);  // every rank builds all of it; each runs its stage
  // Balance: rank 0 times each layer on one micro-batch, and the split evens out the stages' times.
  Tensor<float> sample(Shape{first.images.dim(0) / o.micro_batches, 1, 28, 28});
  std::copy_n(first.images.data(), sample.numel(), sample.data());
  const auto on_device = to_device<Device>(sample);
  // The schedule is a table of actions per rank: a built-in one, or torch's CSV (--schedule-csv).
  const auto table = o.schedule_csv.empty() ? pipeline_table(o.schedule, stages, o.micro_batches)
                                            : read_pipeline_csv(o.schedule_csv);
  Pipeline pipe(model, pipe_comm, {.micro_batches = o.micro_batches, .table = table},
                pipe_comm.rank() == 0 ? &on_device : nullptr);
  const examples::PipelineShape shape{stages, replicas, o.micro_batches, o.batch, pipe.schedule()};
  if (world.rank() == 0) examples::print_split("06_pipeline_parallel: LeNet-5", model, pipe, shape);
  examples::RankMemory<Device, Comm> memory(world);
  auto whole = lenet5<E>(1, 28, 10, o.seed);
  const auto activations = examples::check_against_unsplit(pipe, pipe_comm, memory, whole, first, world.rank() == 0);

  // Each stage's gradients are averaged over the replicas holding that stage: DataParallel hooks
  // the pipeline's last backward (B_{M-1}); with one replica it has nothing to average.
  DataParallel<E> dp(pipe.stage(), dp_comm);
  Sgd<E> sgd(dp.parameters(), {.lr = o.lr, .momentum = 0.9});
  auto strategy = stack(dp, pipe);
  examples::PipelineSteps steps;  // every step's F/B time and step time, for the bubble
  Timeline timeline(world);
  Trainer trainer(model, sgd, strategy, CosineLr{o.lr, static_cast<double>(o.epochs), 0.0},
                  {.epochs = o.epochs, .verbose = world.rank() == 0, .before_step = [&] { steps.record(pipe.last_step()); },
                   .timeline = o.trace.empty() ? nullptr : &timeline, .timeline_first_step = kTracedStep,
                   .timeline_steps = 1, .trace_path = o.trace, .checkpoint_group = CheckpointGroup(world)});
  const auto epochs = trainer.fit(loader, &test_loader);
  if (world.rank() == 0) std::printf("final test accuracy: %.2f%%\n", 100 * epochs.back().test_accuracy);

  const auto idle = steps.idle_fractions(pipe_comm, 1, steps.size() - 1);
  examples::report_pipeline<Device>(world, pipe_comm, model, pipe, shape, idle, steps.first(), activations,
                                    memory.ranks_per_process());
  if (!o.trace.empty()) examples::report_traced_step(world, pipe_comm, steps, kTracedStep, o.trace);
}

Options parse(int argc, char** argv) {
  Flags flags(argc, argv);
  Options o;
  o.epochs = flags.get("epochs", o.epochs, {.min = 1}, "passes over the training set");
  o.batch = flags.get("batch", o.batch, {.min = 1}, "global batch, split over the replicas, then into micro-batches");
  o.micro_batches = flags.get("micro-batches", o.micro_batches, {.min = 1}, "micro-batches per replica's batch (M)");
  o.schedule = flags.choice("schedule", o.schedule, {"1f1b", "gpipe", "interleaved1f1b", "zbh1", "zbv"},
                            "1F1B, GPipe, interleaved 1F1B (2 stages per rank), zero bubble H1 or V");
  o.schedule_csv = flags.get("schedule-csv", std::string(), "a schedule table in torch's CSV form, run in place of --schedule");
  o.lr = flags.get("lr", o.lr, {.above = 0}, "SGD learning rate (momentum 0.9), decayed to 0 by a cosine");
  o.threads = flags.threads("threads", o.threads, "OpenMP threads per rank");
  // the max keeps stages x replicas an int
  o.stages = flags.get("stages", o.stages, {.min = 1, .max = 4096},
                       "pipeline stages, one rank each (launcher: its ranks / replicas)");
  o.replicas = flags.get("replicas", o.replicas, {.min = 1, .max = 4096},
                         "data-parallel copies of the pipeline (ranks = replicas x stages)");
  o.stages_given = flags.has("stages");
  // Ranks of the threads build share this process's cores (a process backend runs one rank here).
  check_thread_budget(SharedMemoryCommunicator<Comm> ? std::int64_t{o.stages} * o.replicas : 1,
                      "--stages x --replicas", o.threads, "--threads");
  o.seed = static_cast<std::uint64_t>(flags.get("seed", std::int64_t{1}, "seed of initialization and shuffling"));
  o.limit = flags.get("limit", o.limit, {.min = 0}, "train on the first N images only (0: all 60,000)");
  o.data_dir = flags.get("data-dir", std::string(),
                         "directory of the IDX files (empty: TESSERA_DATA_DIR, then the default)");
  o.trace = flags.output_path("trace", o.trace, "Chrome trace of the second training step");
  flags.finish();
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    // Threads: --stages x --replicas ranks are spawned here; a process backend brings its own
    // world, every rank a stage unless --replicas says how many pipelines there are.
    launch<E>(
        [&](Comm& comm) {
          TESSERA_CHECK(comm.size() % o.replicas == 0, ArgumentError, comm.size(),
                        " ranks do not split into --replicas=", o.replicas, " pipelines of equal length");
          train(comm, o, comm.size() / o.replicas);
        },
        {.ranks = SharedMemoryCommunicator<Comm> || o.stages_given ? o.stages * o.replicas : 0});
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "06_pipeline_parallel: %s\n", e.what());
    return 1;
  }
}
