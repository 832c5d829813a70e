// The training driver shared by examples 01 and 02: load Fashion-MNIST, normalize, train with SGD
// (momentum, weight decay) and a warmup + cosine schedule, report test accuracy per epoch, and
// optionally write metrics, checkpoint, and resume. Each example supplies its model and recipe.
#pragma once

#include <cstdio>
#include <exception>
#include <string>

#include "tessera/tessera.hpp"
#include "fashion_mnist_data.hpp"

namespace examples {

struct Recipe {
  std::int64_t epochs = 5;
  std::int64_t batch_size = 64;
  double lr = 0.05;
  double momentum = 0.9;
  double weight_decay = 5e-4;
  double warmup_epochs = 0.0;
  bool nesterov = false;
};

template <class M>
std::string model_name(const M& model) {
  if constexpr (requires { model.name(); })
    return std::string(model.name());
  else
    return "LeNet-5";
}

// Reads flags over the recipe's defaults, trains, returns the process exit code.
template <class MakeModel>
int run_fashion_mnist(int argc, char** argv, const char* title, Recipe recipe, MakeModel make_model) {
  using namespace tessera;
  try {
    // Every flag is checked here, paths included, before any data is read or step computed.
    Flags flags(argc, argv);
    recipe.epochs = flags.get("epochs", recipe.epochs, {.min = 1});
    recipe.batch_size = flags.get("batch", recipe.batch_size, {.min = 1});
    recipe.lr = flags.get("lr", recipe.lr, {.above = 0});
    recipe.weight_decay = flags.get("weight-decay", recipe.weight_decay, {.min = 0});
    recipe.warmup_epochs = flags.get("warmup", recipe.warmup_epochs, {.min = 0});
    const std::string data_dir = flags.get("data-dir", std::string());
    const int threads = flags.threads("threads", 0, /*zero_is_all_cores=*/true);
    const std::uint64_t seed = static_cast<std::uint64_t>(flags.get("seed", std::int64_t{1}));
    const std::string metrics = flags.output_path("metrics", "");
    const std::string checkpoint = flags.output_path("checkpoint", "");
    const std::string resume = flags.input_path("resume", "");
    // use only the first N training images (0: all)
    const std::int64_t limit = flags.get("limit", std::int64_t{0}, {.min = 0});
    const int progress = flags.get("progress", -1, {.min = -1, .max = 1});  // -1 detect terminal, 0 lines, 1 bar
    // stop after this many epochs (0: run all), e.g. to test resume
    const std::int64_t stop_after = flags.get("stop-after", std::int64_t{0}, {.min = 0});
    flags.finish();

    Cpu::set_num_threads(threads);
    auto [train, test] = examples::load_normalized_fashion_mnist(data_dir, limit);

    auto model = make_model(seed);
    auto named = named_tensors(model);
    std::printf("%s: %s, %zu parameters, %lld training / %lld test images, batch %lld, %lld epochs, %d threads\n",
                title, model_name(model).c_str(), count_parameters(named), static_cast<long long>(train.labels.size()),
                static_cast<long long>(test.labels.size()), static_cast<long long>(recipe.batch_size),
                static_cast<long long>(recipe.epochs), Cpu::num_threads());

    Sgd<CpuLocal> sgd(named, {.lr = recipe.lr, .momentum = recipe.momentum, .weight_decay = recipe.weight_decay,
                              .nesterov = recipe.nesterov, .decay_norm_and_bias = false});
    const CosineLr cosine{recipe.lr, static_cast<double>(recipe.epochs), 0.0};
    const LinearWarmup<CosineLr> schedule{cosine, recipe.warmup_epochs, 0.1};

    DataLoader<float> train_loader(train, {.batch_size = recipe.batch_size, .shuffle = true, .seed = seed});
    DataLoader<float> test_loader(test, {.batch_size = 500, .shuffle = false});
    Trainer trainer(model, sgd, schedule, {.epochs = recipe.epochs, .metrics_path = metrics,
                                           .checkpoint_path = checkpoint, .progress = progress});
    if (!resume.empty()) {
      trainer.load(resume, train_loader);  // checks the loader position too, before "resumed" is printed
      std::printf("resumed from %s at epoch %lld, step %lld\n", resume.c_str(),
                  static_cast<long long>(trainer.state().epoch), static_cast<long long>(trainer.state().global_step));
    }
    const auto results = trainer.fit(train_loader, &test_loader, stop_after);
    if (!results.empty()) {
      double seconds = 0;
      for (auto& r : results) seconds += r.seconds;
      std::printf("final test accuracy: %.2f%% (%lld epochs, %.1f s training, %.0f img/s)\n",
                  100.0 * results.back().test_accuracy, static_cast<long long>(results.back().epoch), seconds,
                  static_cast<double>(train.labels.size()) * static_cast<double>(results.size()) / seconds);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

}  // namespace examples
