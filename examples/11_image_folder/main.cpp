// 11_image_folder: train a ResNet from a folder of JPEG/PNG files (root/train/<class>/*,
// root/test/<class>/*), with the torchvision recipe: RandomResizedCrop + horizontal flip for
// training, Resize + CenterCrop for testing, per-channel normalization. The files are decoded on
// a pool of loader worker threads (--workers) while the model trains; each rank decodes only its
// own shard. One source, one binary per communicator:
//
//   build/idx-to-image-folder --out=/tmp/fmnist-images          Fashion-MNIST as PNG files
//   build/examples/11_image_folder_threads --image-folder=/tmp/fmnist-images --ranks=1
//   build/examples/11_image_folder_threads --image-folder=/tmp/fmnist-images --ranks=2
//   mpirun -n 2 build/examples/11_image_folder_mpi --image-folder=/tmp/fmnist-images
//
// --compare-idx trains the same model a second time from the IDX files of Fashion-MNIST, through
// the same transforms and in the same sample order (the converter names each file by its IDX
// index), and fails unless the two test accuracies are within 0.5 points: the files hold the
// data set faithfully and the pipeline reads it faithfully. With PNG files the two runs see the
// same bytes, so they agree exactly; JPEG files differ by their compression.
//
// Flags: --image-folder=DIR --epochs=3 --batch=128 (global) --lr=0.1 --warmup=0.5 --seed=1
// --threads=1 (per rank) --ranks=2 (threads build) --workers=1 (decoding threads per rank)
// --model=resnet20|resnet50 --size=28 (training and test resolution) --eval-resize=0 (shorter side
// before the test's centre crop; 0: --size) --channels=1|3 --augment=standard|none
// --crop-scale=0.35 (RandomResizedCrop's smallest area fraction) --flip=0.5 --cache (keep decoded
// images in memory) --cache-file=PATH (decoded images in PATH.train / PATH.test, memory-mapped,
// built by the first run and reused by the next) --skip-corrupt (skip unreadable files, and count them) --compare-idx
// --data-dir=DIR (the IDX files, for --compare-idx) --min-accuracy=0 (exit 1 below it, percent)
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>

#include "tessera/tessera.hpp"
#include "tessera/build_env.hpp"
#include "common/rank_status.hpp"

using namespace tessera;

namespace {

using E = BuildEnv;  // CpuThreads, CpuMpi, CpuGloo or CudaNccl: chosen by the build, nowhere else
using Comm = E::Comm;

struct Options {
  std::string image_folder, model = "resnet20", augment = "standard", data_dir, cache_file;
  std::int64_t epochs = 3, batch = 128, size = 28, eval_resize = 0, channels = 1;
  double lr = 0.1, warmup = 0.5, crop_scale = 0.35, flip = 0.5, min_accuracy = 0;
  int threads = 1, ranks = 2, workers = 1;
  std::uint64_t seed = 1;
  bool cache = false, skip_corrupt = false, compare_idx = false;
};

struct Transforms {
  ImageTransform train, test;
};

Transforms make_transforms(const Options& o) {
  // Fashion-MNIST's statistics for grey images, ImageNet's for RGB (torchvision's usual values).
  const std::vector<float> mean = o.channels == 1 ? std::vector<float>{kFashionMnistMean}
                                                  : std::vector<float>{0.485f, 0.456f, 0.406f};
  const std::vector<float> std = o.channels == 1 ? std::vector<float>{kFashionMnistStd}
                                                 : std::vector<float>{0.229f, 0.224f, 0.225f};
  Transforms t;
  t.test = ImageTransform::eval(o.eval_resize > 0 ? o.eval_resize : o.size, o.size);
  t.train = o.augment == "standard" ? ImageTransform::train(o.size, {o.crop_scale, 1.0}, {3.0 / 4.0, 4.0 / 3.0}, o.flip)
                                    : t.test;
  for (ImageTransform* x : {&t.train, &t.test}) {
    x->channels = o.channels;
    x->normalize(mean, std);
  }
  return t;
}

struct RunResult {
  double accuracy = 0, seconds = 0, images_per_second = 0, data_wait = 0;
};

// Trains a fresh model (same seed every time) on `train_set`, tests on `test_set`.
RunResult train(Comm& comm, const Options& o, const SampleSource& train_set, const SampleSource& test_set,
                const char* label) {
  const int rank = comm.rank(), ranks = comm.size();
  const ResNetOptions ro{.in_channels = o.channels, .num_classes = train_set.num_classes(),
                         .seed = o.seed + static_cast<std::uint64_t>(rank)};  // DataParallel broadcasts rank 0's
  auto run = [&](auto model) {
    DataParallel dp(model, comm);
    Sgd<E> sgd(dp.parameters(), {.lr = o.lr, .momentum = 0.9, .weight_decay = 5e-4, .decay_norm_and_bias = false});
    const LinearWarmup<CosineLr> schedule{CosineLr{o.lr, static_cast<double>(o.epochs), 0.0}, o.warmup, 0.1};
    // Each rank's loader decodes its own shard (samples r, r + N, ... of the shared permutation).
    DataLoader<float> train_loader(train_set, {.batch_size = o.batch / ranks, .shuffle = true, .seed = o.seed,
                                               .rank = rank, .world_size = ranks, .workers = o.workers});
    DataLoader<float> test_loader(test_set, {.batch_size = 250, .shuffle = false, .workers = o.workers});
    // checkpoint_group: the epoch lines give the loss and images/s of all ranks.
    Trainer trainer(model, sgd, schedule, {.epochs = o.epochs, .verbose = rank == 0, .checkpoint_group = CheckpointGroup(comm)});
    const auto results = trainer.fit(train_loader, &test_loader);
    RunResult r;
    for (const auto& e : results) {
      r.seconds += e.seconds;
      r.data_wait += e.data_wait_seconds;
    }
    r.accuracy = 100.0 * results.back().test_accuracy;
    r.images_per_second = static_cast<double>(train_set.size() * o.epochs) / r.seconds;  // all ranks together
    if (rank == 0)
      std::printf("%s: final test accuracy %.2f%% (%d rank(s), %.1f s, %.0f img/s over all ranks, rank 0 waited "
                  "%.1f%% of its step time for data)\n",
                  label, r.accuracy, ranks, r.seconds, r.images_per_second, 100.0 * r.data_wait / r.seconds);
    return r;
  };
  if (o.model == "resnet50") return run(resnet50<E>(ro));
  return run(resnet20<E>(ro));
}

// The IDX training or test set in the folder's sample order: the converter named each file by its
// IDX index, so sample k of both is the same image.
Dataset idx_in_folder_order(const ImageFolder& folder, const Dataset& idx) {
  Dataset ordered;
  ordered.name = idx.name + " in " + folder.root() + "'s order";
  ordered.num_classes = idx.num_classes;
  const std::int64_t per = idx.sample_numel();
  ordered.images.resize({folder.size(), idx.channels(), idx.height(), idx.width()});
  for (std::int64_t k = 0; k < folder.size(); ++k) {
    const std::string& path = folder.samples()[static_cast<std::size_t>(k)].path;
    const std::string stem = std::filesystem::path(path).stem().string();
    std::int64_t i = -1;
    const auto [end, error] = std::from_chars(stem.data(), stem.data() + stem.size(), i);
    TESSERA_CHECK(error == std::errc() && end == stem.data() + stem.size() && i >= 0 && i < idx.size(), ArgumentError,
                  "--compare-idx: ", path, " is not named by an IDX sample index (as idx-to-image-folder names them)");
    TESSERA_CHECK(idx.labels[static_cast<std::size_t>(i)] == folder.samples()[static_cast<std::size_t>(k)].label,
                  ArgumentError, "--compare-idx: ", path, " is in class ", folder.samples()[static_cast<std::size_t>(k)].label,
                  " but IDX sample ", i, " has label ", idx.labels[static_cast<std::size_t>(i)]);
    std::copy_n(idx.images.data() + i * per, per, ordered.images.data() + k * per);
    ordered.labels.push_back(idx.labels[static_cast<std::size_t>(i)]);
  }
  return ordered;
}

int run(Comm& comm, const Options& o) {
  namespace fs = std::filesystem;
  const int rank = comm.rank(), ranks = comm.size();
  TESSERA_CHECK(o.batch % ranks == 0, ArgumentError, "--batch=", o.batch, " (the global batch) must be divisible by the ",
                ranks, " ranks");
  Cpu::set_num_threads(o.threads);
  const fs::path root(o.image_folder);
  for (const char* split : {"train", "test"}) {
    TESSERA_CHECK(fs::is_directory(root / split), IoError, "--image-folder=", o.image_folder, ": no ", split,
                  "/ directory in it. Make one from Fashion-MNIST with: idx-to-image-folder --out=", o.image_folder,
                  " (built as build/idx-to-image-folder)");
  }
  const Transforms t = make_transforms(o);
  // --cache-file=PATH: PATH.train and PATH.test (each rank maps the same files; the first builds them).
  const std::string train_cache = o.cache_file.empty() ? "" : o.cache_file + ".train";
  const std::string test_cache = o.cache_file.empty() ? "" : o.cache_file + ".test";
  ImageFolder train_set((root / "train").string(), {.transform = t.train, .seed = o.seed, .skip_corrupt = o.skip_corrupt,
                                                    .cache = o.cache, .cache_file = train_cache});
  ImageFolder test_set((root / "test").string(),
                       {.transform = t.test, .skip_corrupt = o.skip_corrupt, .cache = o.cache, .cache_file = test_cache});
  TESSERA_CHECK(train_set.classes() == test_set.classes(), ArgumentError, "--image-folder=", o.image_folder,
                ": train/ has ", train_set.num_classes(), " classes and test/ ", test_set.num_classes(),
                "; they must be the same names");
  if (rank == 0) {
    std::printf("11_image_folder: %s, %lld training / %lld test images in %lld classes from %s; %s at %lldx%lld, "
                "%d rank(s) x batch %lld, %d decoding worker(s) per rank, %lld epochs; decoders: %s\n",
                o.model.c_str(), static_cast<long long>(train_set.size()), static_cast<long long>(test_set.size()),
                static_cast<long long>(train_set.num_classes()), o.image_folder.c_str(),
                o.augment == "standard" ? "RandomResizedCrop + flip" : "no augmentation", static_cast<long long>(o.size),
                static_cast<long long>(o.size), ranks, static_cast<long long>(o.batch / ranks), o.workers,
                static_cast<long long>(o.epochs), image_decoders().c_str());
  }
  // --compare-idx's data is read and matched to the folder before the first training, so that a
  // wrong --data-dir or folder fails in seconds, not after a whole training run.
  Dataset idx_train, idx_test;
  if (o.compare_idx) {
    TESSERA_CHECK(o.channels == 1 && o.size == 28, ArgumentError,
                  "--compare-idx compares with Fashion-MNIST's 28x28 grey images: use --channels=1 --size=28");
    idx_train = idx_in_folder_order(train_set, load_fashion_mnist(Split::Train, o.data_dir));
    idx_test = idx_in_folder_order(test_set, load_fashion_mnist(Split::Test, o.data_dir));
  }
  const RunResult folder = train(comm, o, train_set, test_set, "image folder");
  if (rank == 0 && (train_set.skipped_count() || test_set.skipped_count())) {
    std::printf("skipped %zu unreadable training and %zu test files (--skip-corrupt); the first: %s\n",
                train_set.skipped_count(), test_set.skipped_count(),
                (train_set.skipped_count() ? train_set.skipped() : test_set.skipped()).front().path.c_str());
  }
  int status = 0;
  if (folder.accuracy < o.min_accuracy) {
    if (rank == 0) std::printf("FAIL: test accuracy %.2f%% is below --min-accuracy=%.2f%%\n", folder.accuracy, o.min_accuracy);
    status = 1;
  }
  if (o.compare_idx) {
    const ImageArray idx_train_set(idx_train, t.train, o.seed), idx_test_set(idx_test, t.test, 0);
    const RunResult idx = train(comm, o, idx_train_set, idx_test_set, "IDX files");
    const double difference = std::abs(folder.accuracy - idx.accuracy);
    if (rank == 0)
      std::printf("image folder %.2f%% vs IDX %.2f%%: %.2f points apart (must be <= 0.5): %s\n", folder.accuracy,
                  idx.accuracy, difference, difference <= 0.5 ? "ok" : "FAIL");
    if (difference > 0.5) status = 1;
  }
  return status;
}

Options parse(int argc, char** argv) {
  Flags flags(argc, argv);
  Options o;
  o.image_folder = flags.get("image-folder", o.image_folder);
  o.epochs = flags.get("epochs", o.epochs, {.min = 1});
  o.batch = flags.get("batch", o.batch, {.min = 1});
  o.lr = flags.get("lr", o.lr, {.above = 0});
  o.warmup = flags.get("warmup", o.warmup, {.min = 0});
  o.seed = static_cast<std::uint64_t>(flags.get("seed", std::int64_t{1}));
  o.threads = flags.threads("threads", o.threads);
  o.ranks = flags.ranks("ranks", o.ranks, !SharedMemoryCommunicator<Comm>);
  check_thread_budget(SharedMemoryCommunicator<Comm> ? o.ranks : 1, "--ranks", o.threads, "--threads");
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

}  // namespace

int main(int argc, char** argv) { return examples::run_checked<E>("11_image_folder", argc, argv, parse, run); }
