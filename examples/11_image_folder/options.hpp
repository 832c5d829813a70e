// Example 11's flags: every one read and checked here, before any image is decoded.
#pragma once

#include <cstdint>
#include <string>

#include "tessera/build_env.hpp"
#include "tessera/tessera.hpp"

namespace image_folder_example {

using namespace tessera;

struct Options {
  std::string image_folder, model = "resnet20", augment = "standard", data_dir, cache_file;
  std::int64_t epochs = 3, batch = 128, size = 28, eval_resize = 0, channels = 1;
  double lr = 0.1, warmup = 0.5, crop_scale = 0.35, flip = 0.5, min_accuracy = 0;
  int threads = 1, ranks = 2, workers = 1;
  std::uint64_t seed = 1;
  bool cache = false, skip_corrupt = false, compare_idx = false;
};

inline Options parse(int argc, char** argv) {
  Flags flags(argc, argv);
  Options o;
  o.image_folder = flags.get("image-folder", o.image_folder, "directory holding train/ and test/ (required)");
  o.epochs = flags.get("epochs", o.epochs, {.min = 1}, "passes over the training set");
  o.batch = flags.get("batch", o.batch, {.min = 1}, "global batch in images, split over the ranks");
  o.lr = flags.get("lr", o.lr, {.above = 0}, "SGD learning rate after the warmup, then cosine decay to 0");
  o.warmup = flags.get("warmup", o.warmup, {.min = 0}, "epochs of linear learning-rate warmup");
  o.seed = static_cast<std::uint64_t>(
      flags.get("seed", std::int64_t{1}, "seed of the weights, sample order, crops and flips"));
  o.threads = flags.threads("threads", o.threads, "OpenMP threads per rank for the model");
  o.ranks = flags.ranks("ranks", o.ranks, !SharedMemoryCommunicator<BuildEnv::Comm>, "data-parallel ranks");
  check_thread_budget(SharedMemoryCommunicator<BuildEnv::Comm> ? o.ranks : 1, "--ranks", o.threads, "--threads");
  o.workers = flags.get("workers", o.workers, {.min = 1, .max = 64}, "decoding threads per rank (num_workers)");
  o.model = flags.choice("model", o.model, {"resnet20", "resnet50"}, "network to train");
  o.size = flags.get("size", o.size, {.min = 8, .max = 4096}, "training and test resolution in pixels");
  o.eval_resize = flags.get("eval-resize", o.eval_resize, {.min = 0, .max = 8192},
                            "test images' shorter side before the centre crop (0: --size)");
  o.channels = flags.get("channels", o.channels, {.min = 1, .max = 3}, "decoded image channels: 1 grey, 3 RGB");
  o.augment = flags.choice("augment", o.augment, {"standard", "none"},
                           "training transform: random crop and flip, or the test's");
  o.crop_scale = flags.get("crop-scale", o.crop_scale, {.above = 0, .max = 1},
                           "smallest area fraction of a random resized crop");
  o.flip = flags.get("flip", o.flip, {.min = 0, .max = 1}, "probability of a horizontal flip");
  o.cache = flags.get("cache", o.cache, "keep decoded images in memory after their first read");
  o.cache_file = flags.output_path("cache-file", o.cache_file,
                                   "memory-mapped decoded images in PATH.train and PATH.test");
  o.skip_corrupt = flags.get("skip-corrupt", o.skip_corrupt, "replace an unreadable file by the next readable one");
  o.compare_idx = flags.get("compare-idx", o.compare_idx, "train again from the IDX files and compare");
  o.data_dir = flags.get("data-dir", o.data_dir, "IDX files for --compare-idx (empty: the default locations)");
  o.min_accuracy = flags.get("min-accuracy", o.min_accuracy, {.min = 0, .max = 100},
                             "test accuracy in percent to reach, else exit 1 (0: no check)");
  flags.finish();
  TESSERA_CHECK(!o.image_folder.empty(), ArgumentError,
                "--image-folder=DIR is required (DIR/train/<class>/*.png|jpg and DIR/test/...); make one from "
                "Fashion-MNIST with build/idx-to-image-folder --out=DIR");
  TESSERA_CHECK(o.channels != 2, ArgumentError, "--channels=2: use 1 (grey) or 3 (RGB)");
  return o;
}

}  // namespace image_folder_example
