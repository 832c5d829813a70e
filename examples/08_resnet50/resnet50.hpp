// Example 08's pieces that both of its sources use: the options, the Env and the model. main.cpp
// holds the command line and data parallelism; model_parallel.cpp the pipeline and tensor-parallel
// strategies (two translation units that compile in parallel; see README.md).
#pragma once

#include <cstdint>
#include <string>

#include "tessera/tessera.hpp"
#include "tessera/build_env.hpp"
#include "common/device_batch.hpp"

namespace resnet50_example {

using namespace tessera;

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

inline Model make_resnet50(const Options& o) {
  return resnet50<E>({.in_channels = 3, .num_classes = o.classes, .zero_init_residual = true, .seed = 1});
}
inline SgdOptions sgd_options(std::int64_t global_batch) {
  return {.lr = linear_scaling_rule(0.1, global_batch), .momentum = 0.9, .weight_decay = 1e-4, .decay_norm_and_bias = false};
}

// --strategy=pipeline:P and --strategy=tensor (model_parallel.cpp): every rank sees the same batches;
// with --verify rank 0 also trains the unsplit model (for the pipeline: micro-batch by micro-batch,
// as BatchNorm sees them there) and compares each step's loss and the pipeline's gradients.
void train_pipeline(Comm& comm, const Options& o, int stages);
void train_tensor(Comm& comm, const Options& o);

}  // namespace resnet50_example
