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
// (common/image_folder_check.hpp). --help lists every flag; README.md explains them.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>

#include "tessera/tessera.hpp"
#include "tessera/build_env.hpp"
#include "11_image_folder/options.hpp"
#include "common/image_folder_check.hpp"
#include "common/rank_status.hpp"

using namespace tessera;

namespace {

using image_folder_example::Options;
using E = BuildEnv;  // CpuThreads, CpuMpi, CpuGloo or CudaNccl: chosen by the build, nowhere else
using Comm = E::Comm;

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
  if (rank == 0)
    std::printf("11_image_folder: %s from %s, %lld x %lld, %d rank(s) x batch %lld, %d decoding worker(s) per rank, %s\n",
                o.model.c_str(), examples::describe(train_set, test_set).c_str(), static_cast<long long>(o.size),
                static_cast<long long>(o.size), ranks, static_cast<long long>(o.batch / ranks), o.workers,
                o.augment == "standard" ? "RandomResizedCrop + flip" : "no augmentation");
  // --compare-idx's data is read and matched to the folder before the first training, so that a
  // wrong --data-dir or folder fails in seconds, not after a whole training run.
  std::optional<examples::IdxTwin> twin;
  if (o.compare_idx) twin.emplace(train_set, test_set, t.train, t.test, o.seed, o.data_dir, o.channels, o.size);
  const RunResult folder = train(comm, o, train_set, test_set, "image folder");
  if (rank == 0) examples::print_skipped(train_set, test_set);
  const bool high_enough = folder.accuracy >= o.min_accuracy;
  if (rank == 0 && !high_enough)
    std::printf("FAIL: test accuracy %.2f%% is below --min-accuracy=%.2f%%\n", folder.accuracy, o.min_accuracy);
  if (!o.compare_idx) return high_enough ? 0 : 1;
  const RunResult idx = train(comm, o, *twin->train, *twin->test, "IDX files");
  const double difference = std::abs(folder.accuracy - idx.accuracy);
  if (rank == 0)
    std::printf("image folder %.2f%% vs IDX %.2f%%: %.2f points apart (must be <= 0.5): %s\n", folder.accuracy,
                idx.accuracy, difference, difference <= 0.5 ? "ok" : "FAIL");
  return high_enough && difference <= 0.5 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  return examples::run_checked<E>("11_image_folder", argc, argv, image_folder_example::parse, run);
}
