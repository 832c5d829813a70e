// Example 08: ResNet-50 (v1.5, 25,557,032 parameters at 1000 classes) training steps on synthetic
// ImageNet-shaped data. One source, one binary per backend: the build picks the Env
// (tessera::BuildEnv: CpuLocal, CpuThreads, CpuMpi, CpuGloo, CudaLocal, CudaNccl) and this file
// never names a backend; the strategy is a flag.
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
//                            batches and checks that every step's loss agrees
//
// The learning rate follows the linear scaling rule for the global batch (0.1 x batch / 256),
// momentum 0.9, weight decay 1e-4 not on BN and biases, and the last BN of every block starts at
// zero (Goyal et al.).
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <type_traits>

#include "tessera/tessera.hpp"
#include "tessera/build_env.hpp"
#include "common/device_batch.hpp"

using namespace tessera;

namespace {

struct Options {
  std::int64_t batch = 8, steps = 5, image = 224, classes = 1000;
  int threads = 0, ranks = 1, micro_batches = 1;
  bool sync_bn = false, verify = false;
  std::string strategy = "data";
};

// The one policy bundle: device, scalar and communicator. Layers read the device and scalar; the
// strategies take the communicator type from it.
using E = BuildEnv;
using Device = E::Device;
using Comm = E::Comm;
using Model = ResNet<E, Bottleneck>;

using Upload = examples::DeviceBatch<Device>;

Model make_resnet50(const Options& o) {
  return resnet50<E>({.in_channels = 3, .num_classes = o.classes, .zero_init_residual = true, .seed = 1});
}
SgdOptions sgd_options(std::int64_t global_batch) {
  return {.lr = linear_scaling_rule(0.1, global_batch), .momentum = 0.9, .weight_decay = 1e-4, .decay_norm_and_bias = false};
}

// The unsplit model, trained on rank 0 beside a model-parallel run to check it step by step.
struct Reference {
  Model model;
  NamedTensors<E> named;
  Sgd<E> sgd;
  Upload upload;
  explicit Reference(const Options& o)
      : model(make_resnet50(o)), named(named_tensors(model)), sgd(named, sgd_options(o.batch)) {}
  float step(const Batch<float>& b) {
    sgd.zero_grad();
    Model::Cache cache{};
    CrossEntropyLoss<E> loss;
    CrossEntropyLoss<E>::Cache loss_cache;
    const float l = loss.forward(model.forward(upload(b.images), cache), b.labels, loss_cache);
    model.backward(loss.backward(loss_cache), cache);
    sgd.step();
    return l;
  }
};

// Pipeline or tensor parallelism: every rank sees the same batches. step(batch) -> loss.
template <class Step>
void run_model_parallel(Comm& comm, const Options& o, const char* what, Step&& step) {
  const int rank = comm.rank();
  std::optional<Reference> reference;
  if (o.verify && rank == 0) reference.emplace(o);
  Dataset data = SyntheticImages(o.batch * 4, 3, o.image, o.image, o.classes, 7);
  DataLoader<float> loader(data, {.batch_size = o.batch, .shuffle = true, .seed = 3, .drop_last = true});
  Batch<float> b;
  double total = 0, worst = 0;
  for (std::int64_t s = 0, epoch = 0; s < o.steps; ++epoch) {
    loader.start_epoch(epoch);
    while (s < o.steps && loader.next(b)) {
      const auto t0 = std::chrono::steady_clock::now();
      const float loss = step(b);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (s > 0) total += seconds;
      if (rank == 0) {
        std::printf("step %lld: loss %.6f, %.2f s, %.1f img/s", static_cast<long long>(s + 1), loss, seconds,
                    static_cast<double>(o.batch) / seconds);
        if (reference) {
          const float expected = reference->step(b);
          worst = std::max(worst, static_cast<double>(std::abs(loss - expected)) / std::max(1.0f, std::abs(expected)));
          std::printf(" | unsplit model: loss %.6f", expected);
        }
        std::printf("\n");
        std::fflush(stdout);
      }
      ++s;
    }
  }
  if (o.steps > 1 && rank == 0)
    std::printf("steady state (%s): %.1f img/s\n", what, static_cast<double>(o.batch * (o.steps - 1)) / total);
  if (reference) {
    TESSERA_CHECK(worst < 1e-4, Error, "08_resnet50: ", what, " loss differs from the unsplit model by ", worst,
                  " (relative)");
    std::printf("verify: every step's loss equals the unsplit model's (largest relative difference %.1e)\n", worst);
  }
}

void train_pipeline(Comm& comm, const Options& o, int stages) {
  TESSERA_CHECK(comm.size() == stages, ArgumentError, "08_resnet50: --strategy=pipeline:", stages, " needs ", stages,
                " ranks, got ", comm.size());
  Cpu::set_num_threads(o.threads);
  auto model = make_resnet50(o);
  // Balanced by each unit's forward + backward time on one micro-batch, measured on rank 0.
  TESSERA_CHECK(o.batch % o.micro_batches == 0, ArgumentError, "08_resnet50: --batch=", o.batch,
                " does not split into --micro-batches=", o.micro_batches);
  Tensor<float> host_sample(Shape{o.batch / o.micro_batches, 3, o.image, o.image});
  Rng rng(11);
  for (std::int64_t k = 0; k < host_sample.numel(); ++k) host_sample.data()[k] = static_cast<float>(rng.normal());
  const auto sample = to_device<Device>(host_sample);
  Pipeline pipe(model, comm, {.micro_batches = o.micro_batches, .schedule = PipelineSchedule::OneFOneB},
                comm.rank() == 0 ? &sample : nullptr);
  Sgd<E> sgd(pipe.stage_parameters(), sgd_options(o.batch));
  // Per stage: which units, how many parameters (gathered to rank 0 for the report).
  std::array<double, 3> mine{static_cast<double>(pipe.boundaries()[comm.rank()]),
                             static_cast<double>(pipe.boundaries()[comm.rank() + 1]),
                             static_cast<double>(count_parameters(pipe.stage_parameters()))};
  std::vector<double> all(3 * static_cast<std::size_t>(comm.size()));
  comm.all_gather(std::span<const double>(mine), std::span<double>(all));
  if (comm.rank() == 0) {
    std::printf("%s, pipeline over %d stages, batch %lld in %d micro-batch(es), 1F1B, %lldx%lld, %d threads per rank\n",
                model.name().c_str(), stages, static_cast<long long>(o.batch), o.micro_batches,
                static_cast<long long>(o.image), static_cast<long long>(o.image), Cpu::num_threads());
    for (int s = 0; s < stages; ++s)
      std::printf("  stage %d: %s .. %s, %.0f parameters\n", s, model.unit_name(static_cast<std::size_t>(all[3 * s])).c_str(),
                  model.unit_name(static_cast<std::size_t>(all[3 * s + 1]) - 1).c_str(), all[3 * s + 2]);
  }
  Upload upload;
  run_model_parallel(comm, o, "pipeline", [&](const Batch<float>& b) {
    sgd.zero_grad();
    const float loss = pipe.train_step(upload(b.images), b.labels);
    sgd.step();
    return loss;
  });
}

void train_tensor(Comm& comm, const Options& o) {
  Cpu::set_num_threads(o.threads);
  std::optional<TensorParallelResNet<E>> model;
  {
    auto dense = make_resnet50(o);  // split, then dropped: each rank keeps 1/p of the blocks and head
    model.emplace(dense, comm);
  }
  auto named = named_tensors(*model);
  Sgd<E> sgd(named, sgd_options(o.batch));
  if (comm.rank() == 0)
    std::printf("%s: %zu parameters on each rank (of 25.6 M in the unsplit model), batch %lld, %lldx%lld, %d threads per rank\n",
                model->name().c_str(), count_parameters(named), static_cast<long long>(o.batch),
                static_cast<long long>(o.image), static_cast<long long>(o.image), Cpu::num_threads());
  typename TensorParallelResNet<E>::Cache cache{};
  CrossEntropyLoss<E> loss;
  CrossEntropyLoss<E>::Cache loss_cache;
  Upload upload;
  run_model_parallel(comm, o, "tensor", [&](const Batch<float>& b) {
    sgd.zero_grad();
    const float l = loss.forward(model->forward(upload(b.images), cache), b.labels, loss_cache);
    model->backward(loss.backward(loss_cache), cache);
    sgd.step();
    return l;
  });
}

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
  auto model = make_resnet50(o);
  if (parallel && o.sync_bn) convert_sync_batch_norm(model, comm);
  std::optional<DataParallel<E>> dp;
  if (parallel) dp.emplace(model, comm);
  auto named = named_tensors(model);
  if (rank == 0)
    std::printf("%s: %zu parameters, %d rank(s) x batch %lld, %lldx%lld, %d threads per rank%s\n", model.name().c_str(),
                count_parameters(named), ranks, static_cast<long long>(o.batch), static_cast<long long>(o.image),
                static_cast<long long>(o.image), Cpu::num_threads(),
                parallel ? (o.sync_bn ? ", DataParallel + SyncBatchNorm" : ", DataParallel") : "");

  Sgd<E> sgd(named, sgd_options(o.batch * ranks));
  Dataset data = SyntheticImages(o.batch * ranks * 4, 3, o.image, o.image, o.classes, 7);
  DataLoader<float> loader(data, {.batch_size = o.batch, .shuffle = true, .seed = 3, .drop_last = true,
                                  .rank = rank, .world_size = ranks});
  // No before_step hook: sgd.step() finishes DataParallel's all-reduce itself.
  Trainer trainer(model, sgd, ConstantLr{sgd.lr()}, {.epochs = 1, .verbose = false});

  Batch<float> b;
  double total = 0;
  for (std::int64_t step = 0, epoch = 0; step < o.steps; ++epoch) {
    loader.start_epoch(epoch);
    while (step < o.steps && loader.next(b)) {
      const auto t0 = std::chrono::steady_clock::now();
      const float loss = trainer.train_step(b);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (step > 0) total += s;  // the first step warms up caches and workspaces
      if (rank == 0)
        std::printf("step %lld: loss %.4f (rank 0), %.2f s, %.1f img/s\n", static_cast<long long>(step + 1), loss, s,
                    static_cast<double>(o.batch * ranks) / s);
      ++step;
    }
  }
  if (o.steps > 1 && rank == 0)
    std::printf("steady state: %.1f img/s\n", static_cast<double>(o.batch * ranks * (o.steps - 1)) / total);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Flags flags(argc, argv);
    Options o;
    o.batch = flags.get("batch", o.batch);
    o.steps = flags.get("steps", o.steps);
    o.image = flags.get("image", o.image);
    o.classes = flags.get("classes", o.classes);
    o.threads = flags.get("threads", o.threads);
    o.ranks = flags.get("ranks", o.ranks);
    o.sync_bn = flags.get("sync-bn", o.sync_bn);
    o.strategy = flags.get("strategy", o.strategy);
    o.micro_batches = flags.get("micro-batches", o.micro_batches);
    o.verify = flags.get("verify", o.verify);
    flags.finish();
    const bool split = o.strategy != "data";
    TESSERA_CHECK(!split || o.strategy == "tensor" ||
                      (o.strategy.rfind("pipeline:", 0) == 0 && o.strategy.size() > 9 &&
                       o.strategy.find_first_not_of("0123456789", 9) == std::string::npos),
                  ArgumentError, "--strategy=", o.strategy, " is not data, pipeline:P or tensor");
    TESSERA_CHECK(!split || !o.sync_bn, ArgumentError, "--sync-bn applies to --strategy=data only");
    // Ranks spawned in-process (threads) for each strategy; a process backend takes its world
    // from the launcher (mpirun, tools/tessera-run, srun).
    const int ranks = !split                ? o.ranks
                      : o.strategy == "tensor" ? std::max(o.ranks, 2)
                                               : std::stoi(o.strategy.substr(9));
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
