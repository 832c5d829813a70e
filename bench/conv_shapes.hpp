// The convolutions of the benchmarked networks, each distinct shape once with how often the network
// has it: bf16_conv (bfloat16 against float32) and conv_layers (against PyTorch) time them layer by layer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tessera/tessera.hpp"

struct ConvShape {
  std::int64_t in, out, size, kernel, stride, pad, count;  // channels in and out, input H = W, k, s, p, layers
};

// ResNet-50 (torchvision's v1.5: stride on the 3x3) at 224x224, each distinct convolution once.
inline const std::vector<ConvShape> kResNet50 = {
    {3, 64, 224, 7, 2, 3, 1},     {64, 64, 56, 1, 1, 0, 1},     {64, 64, 56, 3, 1, 1, 3},
    {64, 256, 56, 1, 1, 0, 4},    {256, 64, 56, 1, 1, 0, 2},    {256, 128, 56, 1, 1, 0, 1},
    {128, 128, 56, 3, 2, 1, 1},   {128, 512, 28, 1, 1, 0, 4},   {256, 512, 56, 1, 2, 0, 1},
    {512, 128, 28, 1, 1, 0, 3},   {128, 128, 28, 3, 1, 1, 3},   {512, 256, 28, 1, 1, 0, 1},
    {256, 256, 28, 3, 2, 1, 1},   {256, 1024, 14, 1, 1, 0, 6},  {512, 1024, 28, 1, 2, 0, 1},
    {1024, 256, 14, 1, 1, 0, 5},  {256, 256, 14, 3, 1, 1, 5},   {1024, 512, 14, 1, 1, 0, 1},
    {512, 512, 14, 3, 2, 1, 1},   {512, 2048, 7, 1, 1, 0, 3},   {1024, 2048, 14, 1, 2, 0, 1},
    {2048, 512, 7, 1, 1, 0, 2},   {512, 512, 7, 3, 1, 1, 2},
};
// ResNet-20 on Fashion-MNIST (models/resnet.hpp: 1 channel in, 1x1 projection shortcuts).
inline const std::vector<ConvShape> kResNet20 = {
    {1, 16, 28, 3, 1, 1, 1},  {16, 16, 28, 3, 1, 1, 6}, {16, 32, 28, 3, 2, 1, 1}, {16, 32, 28, 1, 2, 0, 1},
    {32, 32, 14, 3, 1, 1, 5}, {32, 64, 14, 3, 2, 1, 1}, {32, 64, 14, 1, 2, 0, 1}, {64, 64, 7, 3, 1, 1, 5},
};
// LeNet-5 on Fashion-MNIST (models/lenet.hpp).
inline const std::vector<ConvShape> kLeNet = {{1, 6, 28, 5, 1, 2, 1}, {6, 16, 14, 5, 1, 0, 1}};

// The flags both programs take: --model (resnet50 at 224x224, batch 8 by default; resnet20 or lenet
// at 28x28, batch 64), --batch (0: the model's), --threads, --runs. Sets the threads.
struct ConvBenchSetup {
  std::string model;
  std::int64_t batch;
  int threads, runs;
  const std::vector<ConvShape>& shapes;
};
inline ConvBenchSetup conv_bench_setup(int argc, char** argv) {
  tessera::Flags flags(argc, argv);
  const std::string model = flags.choice("model", "resnet50", {"resnet50", "resnet20", "lenet"});
  std::int64_t batch = flags.get("batch", 0, {.min = 0});
  const int threads = flags.threads("threads", 2);
  const int runs = flags.get("runs", 7, {.min = 1});
  flags.finish();
  if (batch == 0) batch = model == "resnet50" ? 8 : 64;
  tessera::Cpu::set_num_threads(threads);
  return {model, batch, threads, runs, model == "resnet50" ? kResNet50 : model == "resnet20" ? kResNet20 : kLeNet};
}
