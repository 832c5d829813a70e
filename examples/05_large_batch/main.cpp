// 05_large_batch: Goyal et al.'s claim, "Accurate, Large Minibatch SGD", and You et al.'s answer
// where it stops holding (LARS, 2017; LAMB, 2019), at small scale: the same network trained on
// Fashion-MNIST several times, --runs picks which (default: the first three):
//
//   small     batch 256, lr 0.1 (--small-batch; lr 0.1 per 256 images)
//   nowarmup  batch B = --large-batch (default 4096), lr 0.1 x B / 256 (linear scaling rule), no warmup
//   warmup    batch B, the same lr, reached by gradual linear warmup from 0.1 over --warmup epochs
//   lars      batch B, LARS: layer-wise trust ratio eta ||w|| / (||g|| + wd ||w||), --lars-lr, --lars-eta
//   lamb      batch B, LAMB: Adam moments with the trust ratio ||w|| / ||r||, --lamb-lr, --lamb-wd
//
// The claims: with the linear scaling rule and gradual warmup the large batch matches the small
// one (Goyal); where the batch is so large that it does not, the layer-wise trust ratio recovers
// the accuracy (You). Every run is data parallel over --ranks threads (the 4096 batch is 2 x 2048;
// BatchNorm statistics per rank, as in the paper). The table, the check, the JSON lines and the
// plot are in common/large_batch_report.hpp. --help lists every flag.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "tessera/tessera.hpp"
#include "common/fashion_mnist_data.hpp"
#include "common/large_batch_report.hpp"

using namespace tessera;

namespace {

// LeNet-shaped with BatchNorm after each convolution (large learning rates need it, as in ResNets).
template <class E>
auto make_bn_net(std::uint64_t seed) {
  Rng rng(seed);
  Sequential<Conv2d<E>, BatchNorm2d<E>, ReLU<E>, MaxPool2d<E>, Conv2d<E>, BatchNorm2d<E>, ReLU<E>, MaxPool2d<E>,
             Flatten<E>, Linear<E>>
      net{Conv2d<E>(1, 16, 5, rng, 1, 2), BatchNorm2d<E>(16), ReLU<E>(), MaxPool2d<E>(2, 2, 0), Conv2d<E>(16, 32, 5, rng),
          BatchNorm2d<E>(32), ReLU<E>(), MaxPool2d<E>(2, 2, 0), Flatten<E>(), Linear<E>(32 * 5 * 5, 10, rng)};
  net.set_needs_input_grad(false);
  return net;
}

using Method = examples::LargeBatchMethod;
using Run = examples::LargeBatchRun;

// You et al. 2017's decay: lr(e) = base (1 - e / T)^power, 0 past T.
struct PolyLr {
  double base_lr, t_max, power;
  double operator()(double epoch) const {
    const double left = std::max(0.0, 1.0 - epoch / t_max);
    return base_lr * std::pow(left, power);
  }
};

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

}  // namespace

int main(int argc, char** argv) {
  try {
    examples::LargeBatchSettings s = examples::parse_large_batch(argc, argv);
    auto [train_set, test_set] = examples::load_normalized_fashion_mnist(s.data_dir, s.limit);
    std::printf("05_large_batch: %lld epochs, %d ranks x %d thread(s), %lld training images, warmup %.1f epochs "
                "(LARS/LAMB %.1f, %s decay)\n", static_cast<long long>(s.epochs), s.ranks, s.threads,
                static_cast<long long>(train_set.labels.size()), s.warmup, s.adaptive_warmup, s.decay.c_str());
    for (auto& run : s.runs) train(run, train_set, test_set, s.epochs, s.stop_after, s.ranks, s.threads, s.seed);
    const bool claim_holds = examples::report_large_batch(s.runs, s.min_warmup_gain);
    examples::write_large_batch_jsonl(s.out, s.runs);
    examples::plot_large_batch(s.plot, s.runs, s.epochs);
    return claim_holds ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "05_large_batch: %s\n", e.what());
    return 1;
  }
}
