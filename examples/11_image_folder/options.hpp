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
  o.image_folder = flags.get("image-folder", o.image_folder);
  o.epochs = flags.get("epochs", o.epochs, {.min = 1});
  o.batch = flags.get("batch", o.batch, {.min = 1});
  o.lr = flags.get("lr", o.lr, {.above = 0});
  o.warmup = flags.get("warmup", o.warmup, {.min = 0});
  o.seed = static_cast<std::uint64_t>(flags.get("seed", std::int64_t{1}));
  o.threads = flags.threads("threads", o.threads);
  o.ranks = flags.ranks("ranks", o.ranks, !SharedMemoryCommunicator<BuildEnv::Comm>);
  check_thread_budget(SharedMemoryCommunicator<BuildEnv::Comm> ? o.ranks : 1, "--ranks", o.threads, "--threads");
  o.workers = flags.get("workers", o.workers, {.min = 1, .max = 64});
  o.model = flags.choice("model", o.model, {"resnet20", "resnet50"});
  o.size = flags.get("size", o.size, {.min = 8, .max = 4096});
  o.eval_resize = flags.get("eval-resize", o.eval_resize, {.min = 0, .max = 8192});
  o.channels = flags.get("channels", o.channels, {.min = 1, .max = 3});
  o.augment = flags.choice("augment", o.augment, {"standard", "none"});
  o.crop_scale = flags.get("crop-scale", o.crop_scale, {.above = 0, .max = 1});
  o.flip = flags.get("flip", o.flip, {.min = 0, .max = 1});
  o.cache = flags.get("cache", o.cache);
  o.cache_file = flags.output_path("cache-file", o.cache_file);
  o.skip_corrupt = flags.get("skip-corrupt", o.skip_corrupt);
  o.compare_idx = flags.get("compare-idx", o.compare_idx);
  o.data_dir = flags.get("data-dir", o.data_dir);
  o.min_accuracy = flags.get("min-accuracy", o.min_accuracy, {.min = 0, .max = 100});
  flags.finish();
  TESSERA_CHECK(!o.image_folder.empty(), ArgumentError,
                "--image-folder=DIR is required (DIR/train/<class>/*.png|jpg and DIR/test/...); make one from "
                "Fashion-MNIST with build/idx-to-image-folder --out=DIR");
  TESSERA_CHECK(o.channels != 2, ArgumentError, "--channels=2: use 1 (grey) or 3 (RGB)");
  return o;
}

}  // namespace image_folder_example
