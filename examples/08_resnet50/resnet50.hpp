// Example 08's pieces that both of its sources use: the options, the Env and the model. main.cpp
// holds the command line and data parallelism; model_parallel.cpp the pipeline and tensor-parallel
// strategies (two translation units that compile in parallel; see README.md).
#pragma once

#include <cstdint>
#include <algorithm>
#include <cstdio>
#include <string>

#include "tessera/tessera.hpp"
#include "tessera/build_env.hpp"
#include "common/device_batch.hpp"
#include "common/memory.hpp"

namespace resnet50_example {

using namespace tessera;

// The one policy bundle: device, scalar and communicator. Layers read the device and scalar; the
// strategies take the communicator type from it.
using E = BuildEnv;
using Device = E::Device;
using Comm = E::Comm;
using Model = ResNet<E, Bottleneck>;

struct Options {
  std::int64_t batch = 8, steps = 5, image = 224, classes = 1000;
  int threads = 0, ranks = 1, micro_batches = 1;
  bool sync_bn = false, verify = false;
  std::string strategy = "data";
  // NHWC on the GPU, where cuDNN's tensor-core convolutions run in it; NCHW on the CPU, whose
  // kernels are planar (core/memory_format.hpp).
  MemoryFormat memory_format = Device::host_accessible ? MemoryFormat::Contiguous : MemoryFormat::ChannelsLast;
};

using Upload = examples::DeviceBatch<Device>;

inline Model make_resnet50(const Options& o) {
  Model model = resnet50<E>({.in_channels = 3, .num_classes = o.classes, .zero_init_residual = true, .seed = 1});
  model.set_memory_format(o.memory_format);
  return model;
}
inline SgdOptions sgd_options(std::int64_t global_batch) {
  return {.lr = linear_scaling_rule(0.1, global_batch), .momentum = 0.9, .weight_decay = 1e-4, .decay_norm_and_bias = false};
}

// --strategy=pipeline:P and --strategy=tensor (model_parallel.cpp): every rank sees the same batches;
// with --verify rank 0 also trains the unsplit model (for the pipeline: micro-batch by micro-batch,
// as BatchNorm sees them there) and compares each step's loss and the pipeline's gradients.
void train_pipeline(Comm& comm, const Options& o, int stages);
void train_tensor(Comm& comm, const Options& o);

// Memory per rank after the first step, formula | measured (bytes requested from the allocator;
// thread ranks: the process's average). Parameters and gradients P values each, BatchNorm's
// running statistics B, DataParallel's flat buckets P + 1 (the last carries the step's error
// flag); SGD's momentum P. Activations: measured only, per image of the batch (ResNet-50 keeps
// about 100 MB per 224x224 image for its backward).
inline void report_memory(Comm& comm, NamedTensors<E>& named, const examples::RankMemory<E::Device, Comm>::Bytes& model,
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

// The flags, checked before any rank starts; `ranks`: how many to spawn in-process (threads) for
// the strategy, 0 where a launcher's world decides.
inline Options parse_options(int argc, char** argv, int& ranks) {
  Flags flags(argc, argv);
  Options o;
  o.batch = flags.get("batch", o.batch, {.min = 1}, "images per step: per rank for data, the whole batch otherwise");
  o.steps = flags.get("steps", o.steps, {.min = 1}, "training steps; the first, a warm-up, is left out of img/s");
  o.image = flags.get("image", o.image, {.min = 1}, "height and width of the synthetic images, in pixels");
  o.classes = flags.get("classes", o.classes, {.min = 1}, "classifier outputs (and range of the synthetic labels)");
  o.threads = flags.threads("threads", o.threads, "OpenMP threads per rank");
  o.ranks = flags.get("ranks", o.ranks, {.min = 1}, "ranks of data and tensor (tensor: at least 2; pipeline:P runs P)");
  o.sync_bn = flags.get("sync-bn", o.sync_bn, "BatchNorm over the global batch's statistics (data only)");
  o.strategy = flags.get("strategy", o.strategy, "how to split: data, pipeline:P (P stages, 1 to 18) or tensor");
  o.micro_batches = flags.get("micro-batches", o.micro_batches, {.min = 1},
                              "micro-batches per step, pipeline:P only (must divide --batch)");
  o.verify = flags.get("verify", o.verify, "compare with the unsplit model trained on rank 0 (pipeline, tensor)");
  o.memory_format = parse_memory_format(
      flags.get("memory-format", std::string(to_string(o.memory_format)),
                "activations' layout: contiguous (NCHW) or channels_last (NHWC; default on the GPU)"),
      "--memory-format");
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
  // Tensor parallelism splits and gathers activations along their channels, written for NCHW.
  TESSERA_CHECK(o.strategy != "tensor" || !flags.has("memory-format") || o.memory_format == MemoryFormat::Contiguous,
                ArgumentError, "--memory-format=channels_last applies to --strategy=data and pipeline:P only");
  if (o.strategy == "tensor") o.memory_format = MemoryFormat::Contiguous;
  TESSERA_CHECK(split || !o.verify, ArgumentError, "--verify applies to --strategy=pipeline:P and ",
                "--strategy=tensor (data parallelism keeps full replicas: there is no split to check)");
  // Ranks spawned in-process (threads) for each strategy; a process backend takes its world
  // from the launcher (mpirun, tools/tessera-run, srun).
  // Under a launcher a rank count not given is 0: take what it started (pipeline:P still needs P).
  const bool launcher_decides = !SharedMemoryCommunicator<Comm> && !flags.has("ranks");
  ranks = stages != 0 ? stages : launcher_decides ? 0 : o.strategy == "tensor" ? std::max(o.ranks, 2) : o.ranks;
  // Ranks of the threads build share this process's cores (a process backend runs one rank here).
  check_thread_budget(SharedMemoryCommunicator<Comm> ? ranks : 1, split ? "ranks" : "--ranks", o.threads,
                      "--threads");
  return o;
}

}  // namespace resnet50_example
