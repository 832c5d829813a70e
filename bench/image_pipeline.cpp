// The image pipeline's speed, as JSON: bench/image_pipeline.py runs it next to torchvision's
// DataLoader on the same files.
//
//   ./image_pipeline --folder=DIR [--workers=1] [--batch=32] [--size=224] [--epochs=1] [--cache]
//       The pipeline alone: ImageFolder (JPEG/PNG decode, RandomResizedCrop(size) + flip +
//       Normalize, torchvision's training recipe) through a DataLoader with `workers` decoding
//       threads, batches of `batch` (N, 3, size, size) floats. One warm-up epoch (threads start,
//       buffers and caches settle), then `epochs` timed epochs; reports images/s.
//   ./image_pipeline --folder=DIR --train-steps=N [--workers=1] [--batch=16] [--threads=2]
//       ResNet-50 (3x224x224, classes of the folder) trained on the folder: per step, the time
//       next() waited for the loader and the time of the step itself. Reports the data-wait
//       fraction of the steps after the first (whose batch nobody could have prepared ahead), and
//       the step time next to the same steps on one batch held in memory (synthetic data, no
//       decoding at all): what decoding on the same cores costs the step even when it never waits.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "tessera/tessera.hpp"

using namespace tessera;
using E = CpuLocal;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

ImageTransform train_transform(std::int64_t size) {
  return ImageTransform::train(size).normalize({0.485f, 0.456f, 0.406f}, {0.229f, 0.224f, 0.225f});
}

int pipeline(const std::string& folder, int workers, std::int64_t batch, std::int64_t size, std::int64_t epochs,
             bool cache) {
  ImageFolder images(folder, {.transform = train_transform(size), .seed = 1, .cache = cache});
  DataLoader<float> loader(images, {.batch_size = batch, .shuffle = true, .seed = 1, .workers = workers});
  Batch<float> b;
  std::int64_t count = 0;
  const auto run_epoch = [&](std::int64_t epoch) {
    loader.start_epoch(epoch);
    while (loader.next(b)) count += b.images.dim(0);
  };
  run_epoch(0);  // warm-up
  count = 0;
  const auto start = Clock::now();
  for (std::int64_t e = 1; e <= epochs; ++e) run_epoch(e);
  const double secs = seconds_since(start);
  std::printf("{\"mode\": \"pipeline\", \"framework\": \"tessera\", \"workers\": %d, \"batch\": %lld, \"size\": %lld, "
              "\"images\": %lld, \"seconds\": %.4f, \"images_per_second\": %.2f, \"cache\": %s, \"decoders\": \"%s\"}\n",
              workers, static_cast<long long>(batch), static_cast<long long>(size), static_cast<long long>(count), secs,
              static_cast<double>(count) / secs, cache ? "true" : "false", image_decoders().c_str());
  return 0;
}

int train(const std::string& folder, int workers, std::int64_t batch, std::int64_t steps, int threads) {
  Cpu::set_num_threads(threads);
  ImageFolder images(folder, {.transform = train_transform(224), .seed = 1});
  auto model = resnet50<E>({.in_channels = 3, .num_classes = images.num_classes(), .seed = 1});
  Sgd<E> sgd(named_tensors(model), {.lr = 0.01, .momentum = 0.9, .weight_decay = 1e-4});
  Trainer trainer(model, sgd, [](double) { return 0.01; }, {.epochs = 1, .verbose = false});
  model.set_mode(Mode::Train);

  // Steps on the folder: time in next() (waiting for the workers) and in the step.
  std::vector<double> wait, step;
  {
    DataLoader<float> loader(images, {.batch_size = batch, .shuffle = true, .seed = 1, .drop_last = true,
                                      .workers = workers});
    TESSERA_CHECK(loader.batches_per_epoch() >= steps, ArgumentError, "--train-steps=", steps, " needs ",
                  steps * batch, " images; the folder has ", images.size());
    Batch<float> b;
    for (std::int64_t s = 0; s < steps; ++s) {
      const auto t0 = Clock::now();
      loader.next(b);
      wait.push_back(seconds_since(t0));
      const auto t1 = Clock::now();
      trainer.train_step(b);
      step.push_back(seconds_since(t1));
    }
  }
  // The same number of steps on one batch in memory: no loader, no decoding.
  std::vector<double> synthetic;
  {
    DataLoader<float> loader(images, {.batch_size = batch, .shuffle = true, .seed = 2, .prefetch = false});
    Batch<float> b;
    loader.next(b);
    for (std::int64_t s = 0; s < steps; ++s) {
      const auto t1 = Clock::now();
      trainer.train_step(b);
      synthetic.push_back(seconds_since(t1));
    }
  }
  double waited = 0, total = 0;
  for (std::size_t s = 1; s < wait.size(); ++s) {
    waited += wait[s];
    total += wait[s] + step[s];
  }
  const std::vector<double> steady_step(step.begin() + 1, step.end());
  const std::vector<double> steady_synthetic(synthetic.begin() + 1, synthetic.end());
  std::printf("{\"mode\": \"train\", \"model\": \"resnet50\", \"workers\": %d, \"batch\": %lld, \"threads\": %d, "
              "\"steps\": %lld, \"first_wait_seconds\": %.4f, \"data_wait_seconds\": %.4f, \"data_wait_fraction\": %.5f, "
              "\"median_step_seconds\": %.4f, \"median_step_seconds_synthetic\": %.4f, \"step_time_ratio\": %.4f}\n",
              workers, static_cast<long long>(batch), threads, static_cast<long long>(steps), wait.front(), waited,
              total > 0 ? waited / total : 0.0, median(steady_step), median(steady_synthetic),
              median(steady_step) / median(steady_synthetic));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Flags flags(argc, argv);
    const std::string folder = flags.get("folder", std::string());
    const int workers = flags.get("workers", 1, {.min = 1, .max = 64});
    const std::int64_t steps = flags.get("train-steps", std::int64_t{0}, {.min = 0});
    const std::int64_t batch = flags.get("batch", std::int64_t{steps > 0 ? 16 : 32}, {.min = 1});
    const std::int64_t size = flags.get("size", std::int64_t{224}, {.min = 8});
    const std::int64_t epochs = flags.get("epochs", std::int64_t{1}, {.min = 1});
    const bool cache = flags.get("cache", false);
    const int threads = flags.threads("threads", 2);
    flags.finish();
    TESSERA_CHECK(!folder.empty(), ArgumentError, "--folder=DIR is required (an ImageFolder root)");
    return steps > 0 ? train(folder, workers, batch, steps, threads) : pipeline(folder, workers, batch, size, epochs, cache);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "image_pipeline: %s\n", e.what());
    return 1;
  }
}
