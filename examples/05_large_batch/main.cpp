// 05_large_batch: Goyal et al.'s claim, "Accurate, Large Minibatch SGD", and You et al.'s answer
// where it stops holding (LARS, "Large Batch Training of Convolutional Networks", 2017; LAMB,
// "Large Batch Optimization for Deep Learning", 2019), at small scale. The same network is
// trained on Fashion-MNIST several times; --runs picks which (default: the first three):
//
//   small     batch 256, lr 0.1 (--small-batch; lr 0.1 per 256 images)
//   nowarmup  batch B = --large-batch (default 4096), lr 0.1 x B / 256 (linear scaling rule), no warmup
//   warmup    batch B, the same lr, reached by gradual linear warmup from 0.1 over --warmup epochs
//   lars      batch B, LARS: layer-wise trust ratio eta ||w|| / (||g|| + wd ||w||), --lars-lr, --lars-eta
//   lamb      batch B, LAMB: Adam moments with the trust ratio ||w|| / ||r||, --lamb-lr, --lamb-wd
//
// then prints a table (final and best test accuracy of each, the gap to the small batch, steps and
// time) and writes test accuracy per epoch as JSON lines and as a PNG plot. The claims: with the
// linear scaling rule and gradual warmup the large batch matches the small one (Goyal); where the
// batch is so large that it does not, the layer-wise trust ratio recovers the accuracy (You).
//
// Every run is data parallel over --ranks threads (ThreadComm; default 2), so the 4096 batch is
// 2 x 2048; BatchNorm statistics are per rank, as in the paper. Every run decays its rate with the
// same cosine (or, for LARS and LAMB with --adaptive-decay=poly2, You et al.'s (1 - t/T)^2) and
// warms up from rate / k (k = B / 256) when it warms up. Biases and BatchNorm scales/shifts get no
// weight decay and, in LARS and LAMB, no trust ratio (trust 1), as in You et al.'s setup.
//
//   build/examples/05_large_batch [--epochs=16] [--warmup=5] [--ranks=2] [--threads=1]
//       [--runs=small,nowarmup,warmup,lars,lamb] [--large-batch=4096] [--small-batch=256]
//       [--lars-lr=8] [--lars-eta=0.001] [--lars-wd=5e-4] [--lamb-lr=0.05] [--lamb-wd=0.01]
//       [--adaptive-warmup=<--warmup>] [--adaptive-decay=cosine|poly2]
//       [--out=05_large_batch.jsonl] [--plot=05_large_batch.png]
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <sstream>
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

enum class Method { Sgd, Lars, Lamb };

// You et al. 2017's decay: lr(e) = base (1 - e / T)^power, 0 past T.
struct PolyLr {
  double base_lr, t_max, power;
  double operator()(double epoch) const {
    const double left = std::max(0.0, 1.0 - epoch / t_max);
    return base_lr * std::pow(left, power);
  }
};

struct Run {
  std::string key;   // the --runs name
  std::string name;  // the table's
  Method method;
  std::int64_t batch;
  double lr, warmup_epochs;
  double weight_decay;
  double eta = 0;     // LARS trust coefficient
  bool poly = false;  // (1 - e/T)^2 instead of cosine
  std::array<std::uint8_t, 3> colour{};
  const char* colour_name = "";
  std::vector<double> accuracy;  // test accuracy per epoch
  double seconds = 0;            // training (the trainer's epoch times)
  double wall = 0;               // the whole run: training, test passes, setup
  std::int64_t steps = 0;        // optimizer steps
};

const char* method_name(Method m) { return m == Method::Sgd ? "sgd" : m == Method::Lars ? "lars" : "lamb"; }

// The learning rate as a function of the fractional epoch: warmup from lr / k (k = batch / 256,
// Goyal et al.) multiplying a cosine or polynomial decay over all epochs.
std::function<double(double)> make_schedule(const Run& run, std::int64_t epochs) {
  const double start = std::min(1.0, 256.0 / static_cast<double>(run.batch));
  const double factor = run.warmup_epochs > 0 ? start : 1.0;
  if (run.poly) return LinearWarmup<PolyLr>{PolyLr{run.lr, static_cast<double>(epochs), 2.0}, run.warmup_epochs, factor};
  return LinearWarmup<CosineLr>{CosineLr{run.lr, static_cast<double>(epochs), 0.0}, run.warmup_epochs, factor};
}

// Trains the first `stop_after` epochs (0: all) of a schedule that spans `epochs`.
void train(Run& run, const Dataset& train_set, const Dataset& test_set, std::int64_t epochs, std::int64_t stop_after,
           int ranks, int threads, std::uint64_t seed) {
  using E = CpuThreads;  // ranks are threads of this process (the runs' results meet in `run`)
  const auto t0 = std::chrono::steady_clock::now();
  launch<E>([&](E::Comm& comm) {
    Cpu::set_num_threads(threads);
    auto model = make_bn_net<E>(seed);
    DataParallel dp(model, comm);
    const auto named = dp.parameters();
    DataLoader<float> train_loader(train_set, {.batch_size = run.batch / ranks, .shuffle = true, .seed = seed,
                                               .rank = comm.rank(), .world_size = ranks});
    DataLoader<float> test_loader(test_set, {.batch_size = 1000, .shuffle = false});

    // The same loop for every optimizer; LARS and LAMB also print their last step's trust ratios
    // of the adapted weights (conv1, conv2, fc), the per-layer factor on the global rate.
    auto loop = [&](auto& optimizer) {
      Trainer trainer(model, optimizer, make_schedule(run, epochs),
                      {.epochs = epochs, .progress = 0, .verbose = false, .checkpoint_group = CheckpointGroup(comm)});
      for (std::int64_t e = 0; e < (stop_after > 0 ? std::min(stop_after, epochs) : epochs); ++e) {
        const auto r = trainer.train_epoch(train_loader, &test_loader);
        if (comm.rank() != 0) continue;
        run.accuracy.push_back(r.test_accuracy);
        run.seconds += r.seconds;
        run.steps = optimizer.steps();
        std::ostringstream trust;
        if constexpr (requires { optimizer.trust_ratios(); }) {
          trust << ", trust";
          const auto& t = optimizer.trust_ratios();
          for (std::size_t i = 0; i < t.size(); ++i)
            if (gets_weight_decay(named.parameters[i].second->kind, false)) trust << " " << t[i];
        }
        std::printf("  %-40s epoch %2lld: train loss %.4f, test accuracy %.2f%%, lr %.4g%s\n", run.name.c_str(),
                    static_cast<long long>(r.epoch), r.train_loss, 100 * r.test_accuracy, r.lr, trust.str().c_str());
        std::fflush(stdout);
      }
    };
    switch (run.method) {
      case Method::Sgd: {
        Sgd<E> opt(named, {.lr = run.lr, .momentum = 0.9, .weight_decay = run.weight_decay,
                           .decay_norm_and_bias = false});
        loop(opt);
        break;
      }
      case Method::Lars: {
        Lars<E> opt(named, {.lr = run.lr, .momentum = 0.9, .weight_decay = run.weight_decay, .eta = run.eta});
        loop(opt);
        break;
      }
      case Method::Lamb: {
        Lamb<E> opt(named, {.lr = run.lr, .weight_decay = run.weight_decay});
        loop(opt);
        break;
      }
    }
  }, {.ranks = ranks});
  run.wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string text(const char* fmt, auto... args) {
  char buf[160];
  std::snprintf(buf, sizeof buf, fmt, args...);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Flags flags(argc, argv);
    // Every flag is checked here, the output paths included, before hours of training.
    const std::int64_t epochs = flags.get("epochs", std::int64_t{16}, {.min = 1});
    const double warmup = flags.get("warmup", 5.0, {.min = 0});
    // Train only the first N epochs of the --epochs schedule (0: all): the early epochs, where
    // the large rate without warmup does its damage, in a fraction of the time.
    const std::int64_t stop_after = flags.get("stop-after", std::int64_t{0}, {.min = 0});
    // The claim checked when both large-batch SGD runs are in --runs: warmup's best test accuracy
    // is at least this many points above no warmup's (0: no check). The best, not the last: at a
    // rate this high BatchNorm's running statistics make single epochs' test accuracies jump by
    // tens of points (a warmup run at 51% fell to 8% for one epoch, at seed 2).
    const double min_warmup_gain = flags.get("min-warmup-gain", 5.0, {.min = 0});
    const int ranks = flags.get("ranks", 2, {.min = 1});
    const int threads = flags.threads("threads", 1);
    check_thread_budget(ranks, "--ranks", threads, "--threads");  // the ranks are threads of this process
    const std::uint64_t seed = static_cast<std::uint64_t>(flags.get("seed", std::int64_t{1}));
    const std::int64_t limit = flags.get("limit", std::int64_t{0}, {.min = 0});
    const std::vector<std::string> run_keys =
        flags.list("runs", "small,nowarmup,warmup", {"small", "nowarmup", "warmup", "lars", "lamb"});
    const std::int64_t small = flags.get("small-batch", std::int64_t{256}, {.min = 1});
    const std::int64_t large = flags.get("large-batch", std::int64_t{4096}, {.min = 1});
    const double lars_lr = flags.get("lars-lr", 8.0, {.above = 0});
    const double lars_eta = flags.get("lars-eta", 0.001, {.above = 0});
    const double lars_wd = flags.get("lars-wd", 5e-4, {.min = 0});
    const double lamb_lr = flags.get("lamb-lr", 0.05, {.above = 0});
    const double lamb_wd = flags.get("lamb-wd", 0.01, {.min = 0});
    const double adaptive_warmup = flags.get("adaptive-warmup", warmup, {.min = 0});
    const std::string adaptive_decay = flags.choice("adaptive-decay", "cosine", {"cosine", "poly2"});
    const std::string out = flags.output_path("out", "05_large_batch.jsonl");
    const std::string plot = flags.output_path("plot", "05_large_batch.png");
    const std::string data_dir = flags.get("data-dir", std::string());
    flags.finish();
    // Global batches split evenly over the ranks, or refused: never silently rounded.
    TESSERA_CHECK(small % ranks == 0 && large % ranks == 0, ArgumentError, "--small-batch=", small,
                  " and --large-batch=", large, " (global batches) must be multiples of --ranks=", ranks);
    const bool poly = adaptive_decay == "poly2";

    auto [train_set, test_set] = examples::load_normalized_fashion_mnist(data_dir, limit);

    const double base_lr = 0.1;  // per 256 images
    const double small_lr = linear_scaling_rule(base_lr, small), large_lr = linear_scaling_rule(base_lr, large);
    const std::string k = text("%gx batch %lld", static_cast<double>(large) / static_cast<double>(small),
                                 static_cast<long long>(large));
    // Every run there is; --runs picks and orders them (the first one is the table's reference).
    const std::vector<Run> all = {
        {"small", text("small batch %lld, lr %g", static_cast<long long>(small), small_lr), Method::Sgd, small,
         small_lr, 0, 5e-4, 0, false, {40, 90, 200}, "blue"},
        {"nowarmup", text("%s, lr %g, no warmup", k.c_str(), large_lr), Method::Sgd, large, large_lr, 0, 5e-4, 0,
         false, {210, 50, 40}, "red"},
        {"warmup", text("%s, lr %g, warmup", k.c_str(), large_lr), Method::Sgd, large, large_lr, warmup, 5e-4, 0,
         false, {40, 160, 60}, "green"},
        {"lars", text("LARS batch %lld, lr %g, eta %g", static_cast<long long>(large), lars_lr, lars_eta),
         Method::Lars, large, lars_lr, adaptive_warmup, lars_wd, lars_eta, poly, {150, 50, 190}, "purple"},
        {"lamb", text("LAMB batch %lld, lr %g, wd %g", static_cast<long long>(large), lamb_lr, lamb_wd),
         Method::Lamb, large, lamb_lr, adaptive_warmup, lamb_wd, 0, poly, {230, 140, 20}, "orange"},
    };
    std::vector<Run> runs;
    for (const auto& key : run_keys)  // each one of all's keys (flags.list checked them)
      runs.push_back(*std::find_if(all.begin(), all.end(), [&](const Run& r) { return r.key == key; }));

    std::printf("05_large_batch: %lld epochs, %d ranks x %d thread(s), %lld training images, warmup %.1f epochs "
                "(LARS/LAMB %.1f, %s decay)\n",
                static_cast<long long>(epochs), ranks, threads, static_cast<long long>(train_set.labels.size()), warmup,
                adaptive_warmup, adaptive_decay.c_str());
    double total = 0;
    for (auto& run : runs) {
      train(run, train_set, test_set, epochs, stop_after, ranks, threads, seed);
      total += run.wall;
    }

    std::printf("\n%-42s %8s %8s %9s %6s %9s %9s\n", "run", "final", "best", "vs first", "steps", "train", "wall");
    for (const auto& run : runs) {
      const double best = *std::max_element(run.accuracy.begin(), run.accuracy.end());
      std::printf("%-42s %7.2f%% %7.2f%% %+9.2f %6lld %8.1fs %8.1fs\n", run.name.c_str(), 100 * run.accuracy.back(),
                  100 * best, 100 * (run.accuracy.back() - runs[0].accuracy.back()),
                  static_cast<long long>(run.steps), run.seconds, run.wall);
    }
    std::printf("total: %.1f s (%.1f min)\n", total, total / 60);
    // Goyal et al.'s claim: at the large batch, gradual warmup beats the same rate from step one.
    const auto nowarmup = std::find_if(runs.begin(), runs.end(), [](const Run& r) { return r.key == "nowarmup"; });
    const auto with_warmup = std::find_if(runs.begin(), runs.end(), [](const Run& r) { return r.key == "warmup"; });
    bool claim_holds = true;
    if (min_warmup_gain > 0 && nowarmup != runs.end() && with_warmup != runs.end()) {
      const auto best = [](const Run& r) { return *std::max_element(r.accuracy.begin(), r.accuracy.end()); };
      const double gain = 100 * (best(*with_warmup) - best(*nowarmup));
      claim_holds = gain >= min_warmup_gain;
      std::printf("check: warmup's best test accuracy is %.2f points above no warmup's (%.2f%% against %.2f%%; at least "
                  "%.2f: --min-warmup-gain) %s\n", gain, 100 * best(*with_warmup), 100 * best(*nowarmup),
                  min_warmup_gain, claim_holds ? "ok" : "FAIL");
      if (!claim_holds)
        std::fprintf(stderr, "05_large_batch: warmup did not beat no warmup by %.2f points at these settings. The "
                     "effect needs the large rate to last: see the README for settings that show it "
                     "(--min-warmup-gain=0 turns the check off)\n", min_warmup_gain);
    }
    if (!out.empty()) {
      std::FILE* f = std::fopen(out.c_str(), "w");
      TESSERA_CHECK(f != nullptr, IoError, "05_large_batch: cannot write '", out, "'");
      for (const auto& run : runs)
        for (std::size_t e = 0; e < run.accuracy.size(); ++e)
          std::fprintf(f, "{\"run\": \"%s\", \"optimizer\": \"%s\", \"batch\": %lld, \"lr\": %g, \"warmup_epochs\": %g, "
                          "\"weight_decay\": %g, \"eta\": %g, \"decay\": \"%s\", \"epoch\": %zu, "
                          "\"test_accuracy\": %.6f}\n",
                       run.name.c_str(), method_name(run.method), static_cast<long long>(run.batch), run.lr,
                       run.warmup_epochs, run.weight_decay, run.eta, run.poly ? "poly2" : "cosine", e + 1,
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
    return claim_holds ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "05_large_batch: %s\n", e.what());
    return 1;
  }
}
