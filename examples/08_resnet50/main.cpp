// Example 08: ResNet-50 (v1.5, 25,557,032 parameters at 1000 classes) training steps on synthetic
// ImageNet-shaped data. The same source will build for every backend as later issues add them;
// here it is the CpuLocal variant.
//   ./08_resnet50 [--batch=8] [--steps=5] [--image=224] [--classes=1000] [--threads=N]
#include <chrono>
#include <cstdio>

#include "tessera/tessera.hpp"

using namespace tessera;

int main(int argc, char** argv) {
  try {
    Flags flags(argc, argv);
    const std::int64_t batch = flags.get("batch", std::int64_t{8});
    const std::int64_t steps = flags.get("steps", std::int64_t{5});
    const std::int64_t image = flags.get("image", std::int64_t{224});
    const std::int64_t classes = flags.get("classes", std::int64_t{1000});
    const int threads = flags.get("threads", 0);
    flags.finish();
    Cpu::set_num_threads(threads);

    using E = CpuLocal;
    auto model = resnet50<E>({.in_channels = 3, .num_classes = classes, .zero_init_residual = true, .seed = 1});
    auto named = named_tensors<float, Cpu>(model);
    std::printf("%s: %zu parameters, batch %lld, %lldx%lld, %d threads\n", model.name().c_str(),
                count_parameters(named), static_cast<long long>(batch), static_cast<long long>(image),
                static_cast<long long>(image), Cpu::num_threads());

    // Goyal et al.: lr = 0.1 x batch / 256, momentum 0.9, weight decay 1e-4 (not on BN and biases).
    Sgd<E> sgd(named, {.lr = linear_scaling_rule(0.1, batch), .momentum = 0.9, .weight_decay = 1e-4,
                       .decay_norm_and_bias = false});
    Dataset data = SyntheticImages(batch * 4, 3, image, image, classes, 7);
    DataLoader<float> loader(data, {.batch_size = batch, .shuffle = true, .seed = 3, .drop_last = true});
    Trainer trainer(model, sgd, ConstantLr{sgd.lr()}, {.epochs = 1, .verbose = false});

    Batch<float> b;
    double total = 0;
    for (std::int64_t step = 0, epoch = 0; step < steps; ++epoch) {
      loader.start_epoch(epoch);
      while (step < steps && loader.next(b)) {
        const auto t0 = std::chrono::steady_clock::now();
        const float loss = trainer.train_step(b);
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (step > 0) total += s;  // the first step warms up caches and workspaces
        std::printf("step %lld: loss %.4f, %.2f s, %.1f img/s\n", static_cast<long long>(step + 1), loss, s,
                    static_cast<double>(batch) / s);
        ++step;
      }
    }
    if (steps > 1)
      std::printf("steady state: %.1f img/s\n", static_cast<double>(batch * (steps - 1)) / total);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
