// 05_large_batch: Goyal et al.'s claim, "Accurate, Large Minibatch SGD", at small scale. The same
// network is trained on Fashion-MNIST three times:
//
//   small batch   256, lr 0.1
//   16x batch    4096, lr 1.6 (linear scaling rule: 0.1 x 4096 / 256), no warmup
//   16x + warmup 4096, lr 1.6, reached by gradual linear warmup from 0.1 over --warmup epochs
//
// then prints a table (final and best test accuracy of each) and writes test accuracy per epoch
// as JSON lines and as a PNG plot. The claim: with the linear scaling rule and gradual warmup, the
// large batch matches the small one; without warmup, the large early steps hurt.
//
// Every run is data parallel over --ranks threads (ThreadComm; default 2), so the 4096 batch is
// 2 x 2048; BatchNorm statistics are per rank, as in the paper. Same cosine decay in every run.
//
//   build/examples/05_large_batch [--epochs=16] [--warmup=5] [--ranks=2] [--threads=1]
//                                 [--out=05_large_batch.jsonl] [--plot=05_large_batch.png]
#include <cstdio>
#include <string>
#include <vector>

#include "common/png_plot.hpp"
#include "tessera/tessera.hpp"
#include "common/fashion_mnist_data.hpp"

using namespace tessera;

namespace {

// LeNet-shaped with BatchNorm after each convolution (large learning rates need it, as in ResNets).
template <class E>
using BnNet = Sequential<Conv2d<E>, BatchNorm2d<E>, ReLU<E>, MaxPool2d<E>, Conv2d<E>, BatchNorm2d<E>, ReLU<E>,
                         MaxPool2d<E>, Flatten<E>, Linear<E>>;

template <class E>
BnNet<E> make_bn_net(std::uint64_t seed) {
  Rng rng(seed);
  BnNet<E> net{Conv2d<E>(1, 16, 5, rng, 1, 2), BatchNorm2d<E>(16), ReLU<E>(), MaxPool2d<E>(2, 2, 0),
               Conv2d<E>(16, 32, 5, rng), BatchNorm2d<E>(32), ReLU<E>(), MaxPool2d<E>(2, 2, 0), Flatten<E>(),
               Linear<E>(32 * 5 * 5, 10, rng)};
  net.set_needs_input_grad(false);
  return net;
}

struct Run {
  std::string name;
  std::int64_t batch;
  double lr, warmup_epochs;
  std::array<std::uint8_t, 3> colour;
  const char* colour_name;
  std::vector<double> accuracy;  // test accuracy per epoch
  double seconds = 0;
};

void train(Run& run, const Dataset& train_set, const Dataset& test_set, std::int64_t epochs, int ranks, int threads,
           std::uint64_t seed) {
  using E = CpuThreads;  // ranks are threads of this process (the runs' results meet in `run`)
  launch<E>([&](E::Comm& comm) {
    Cpu::set_num_threads(threads);
    auto model = make_bn_net<E>(seed);
    DataParallel dp(model, comm);
    Sgd<E> sgd(dp.parameters(), {.lr = run.lr, .momentum = 0.9, .weight_decay = 5e-4, .decay_norm_and_bias = false});
    const CosineLr cosine{run.lr, static_cast<double>(epochs), 0.0};
    // Goyal et al.: start at lr / k (k = batch / 256) and rise linearly to lr over the warmup.
    const double start = std::min(1.0, 256.0 / static_cast<double>(run.batch));
    const LinearWarmup<CosineLr> schedule{cosine, run.warmup_epochs, run.warmup_epochs > 0 ? start : 1.0};
    DataLoader<float> train_loader(train_set, {.batch_size = run.batch / ranks, .shuffle = true, .seed = seed,
                                               .rank = comm.rank(), .world_size = ranks});
    DataLoader<float> test_loader(test_set, {.batch_size = 1000, .shuffle = false});
    Trainer trainer(model, sgd, schedule, {.epochs = epochs, .progress = 0, .verbose = false});
    for (std::int64_t e = 0; e < epochs; ++e) {
      const auto r = trainer.train_epoch(train_loader, &test_loader);
      if (comm.rank() == 0) {
        run.accuracy.push_back(r.test_accuracy);
        run.seconds += r.seconds;
        std::printf("  %-34s epoch %2lld: train loss %.4f, test accuracy %.2f%%, lr %.3f\n", run.name.c_str(),
                    static_cast<long long>(r.epoch), r.train_loss, 100 * r.test_accuracy, r.lr);
        std::fflush(stdout);
      }
    }
  }, {.ranks = ranks});
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Flags flags(argc, argv);
    const std::int64_t epochs = flags.get("epochs", std::int64_t{16});
    const double warmup = flags.get("warmup", 5.0);
    const int ranks = flags.get("ranks", 2);
    const int threads = flags.get("threads", 1);
    const std::uint64_t seed = static_cast<std::uint64_t>(flags.get("seed", std::int64_t{1}));
    const std::int64_t limit = flags.get("limit", std::int64_t{0});
    const std::string out = flags.get("out", std::string("05_large_batch.jsonl"));
    const std::string plot = flags.get("plot", std::string("05_large_batch.png"));
    const std::string data_dir = flags.get("data-dir", std::string());
    flags.finish();

    auto [train_set, test_set] = examples::load_normalized_fashion_mnist(data_dir, limit);

    const double base_lr = 0.1;  // per 256 images
    std::vector<Run> runs = {
        {"small batch 256, lr 0.1", 256, base_lr, 0, {40, 90, 200}, "blue"},
        {"16x batch 4096, lr 1.6, no warmup", 4096, linear_scaling_rule(base_lr, 4096), 0, {210, 50, 40}, "red"},
        {"16x batch 4096, lr 1.6, warmup", 4096, linear_scaling_rule(base_lr, 4096), warmup, {40, 160, 60}, "green"},
    };
    std::printf("05_large_batch: %lld epochs, %d ranks x %d thread(s), %lld training images, warmup %.1f epochs\n",
                static_cast<long long>(epochs), ranks, threads, static_cast<long long>(train_set.labels.size()), warmup);
    for (auto& run : runs) train(run, train_set, test_set, epochs, ranks, threads, seed);

    std::printf("\n%-36s %8s %8s %8s %10s\n", "run", "final", "best", "vs small", "time");
    for (const auto& run : runs) {
      const double best = *std::max_element(run.accuracy.begin(), run.accuracy.end());
      std::printf("%-36s %7.2f%% %7.2f%% %+7.2f %9.1fs\n", run.name.c_str(), 100 * run.accuracy.back(), 100 * best,
                  100 * (run.accuracy.back() - runs[0].accuracy.back()), run.seconds);
    }
    if (!out.empty()) {
      std::FILE* f = std::fopen(out.c_str(), "w");
      TESSERA_CHECK(f != nullptr, IoError, "05_large_batch: cannot write '", out, "'");
      for (const auto& run : runs)
        for (std::size_t e = 0; e < run.accuracy.size(); ++e)
          std::fprintf(f, "{\"run\": \"%s\", \"batch\": %lld, \"lr\": %g, \"warmup_epochs\": %g, \"epoch\": %zu, "
                          "\"test_accuracy\": %.6f}\n",
                       run.name.c_str(), static_cast<long long>(run.batch), run.lr, run.warmup_epochs, e + 1,
                       run.accuracy[e]);
      std::fclose(f);
    }
    if (!plot.empty()) {
      std::vector<examples::Series> series;
      double low = 1.0;
      for (const auto& run : runs) {
        series.push_back({run.name, run.colour, run.accuracy});
        low = std::min(low, *std::min_element(run.accuracy.begin(), run.accuracy.end()));
      }
      const double y_min = std::floor(low * 10) / 10, y_max = 1.0;
      examples::plot_png(plot, series, y_min, y_max);
      std::printf("\nplot: %s (test accuracy per epoch; x: epochs 1..%lld, y: %.0f%%..%.0f%%, grid every %.0f%%)\n",
                  plot.c_str(), static_cast<long long>(epochs), 100 * y_min, 100 * y_max, 10 * (y_max - y_min));
      for (const auto& run : runs) std::printf("  %-6s %s\n", run.colour_name, run.name.c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "05_large_batch: %s\n", e.what());
    return 1;
  }
}
