// A program outside the Tessera tree, built against an installed Tessera (CMake find_package or
// pkg-config) and in-tree by meson from this same source, so tests/consumer/test_consumer.py can
// compare their speed: LeNet-5 training steps on synthetic Fashion-MNIST-sized images, data
// parallel over the build's communicator at one rank (the consumer links the backend too).
//
//   consumer [--steps=30] [--threads=2]   prints one JSON line: {"images_per_second": ..., ...}
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <vector>

#include "tessera/tessera.hpp"
#include "tessera/build_env.hpp"

using namespace tessera;
using E = BuildEnv;  // the define pair comes from the consumer's build (CMake target or -D flags)

int main(int argc, char** argv) {
  try {
    Flags flags(argc, argv);
    const int steps = flags.get("steps", 30, {.min = 2});
    const int threads = flags.threads("threads", 2);
    flags.finish();
    Cpu::set_num_threads(threads);
    double images_per_second = 0, first_loss = 0, last_loss = 0;
    launch<E>([&](E::Comm& comm) {
      auto model = lenet5<E>(1, 28, 10, 1);
      DataParallel dp(model, comm);
      Sgd<E> sgd(dp.parameters(), {.lr = 0.05, .momentum = 0.9});
      Trainer trainer(model, sgd, ConstantLr{0.05}, {.epochs = 1, .verbose = false});
      const std::int64_t batch = 64;
      Dataset data = SyntheticImages(batch, 1, 28, 28, 10, 7);
      DataLoader<float> loader(data, {.batch_size = batch, .shuffle = false, .prefetch = false});
      Batch<float> b;
      loader.start_epoch(0);
      loader.next(b);
      first_loss = trainer.train_step(b);  // also the warm-up: caches and workspaces are made here
      std::vector<double> seconds;
      for (int i = 0; i < steps; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        last_loss = trainer.train_step(b);
        seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      std::sort(seconds.begin(), seconds.end());
      images_per_second = static_cast<double>(batch) / seconds[seconds.size() / 2];
    });
    // One batch seen over and over: the loss must fall, or the build is broken, not just slow.
    const bool learned = std::isfinite(last_loss) && last_loss < first_loss;
    // %.9g: enough digits to tell the AVX-512 kernels' result from the portable loops' (both exact
    // copies and comparisons on LeNet-5, so the two must agree to the last bit).
    std::printf("{\"backend\": \"%s\", \"images_per_second\": %.1f, \"first_loss\": %.9g, \"last_loss\": %.9g, "
                "\"gemm\": \"%s\", \"cpu_capability\": \"%s\"}\n",
                E::Comm::backend_name, images_per_second, first_loss, last_loss, cpu_gemm_kernel().c_str(),
                cpu_capability_name(cpu_capability()));
    if (!learned) std::fprintf(stderr, "consumer: the loss did not fall (%g -> %g)\n", first_loss, last_loss);
    return learned ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: %s\n", e.what());
    return 1;
  }
}
