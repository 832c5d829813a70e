// The training driver shared by examples 01 and 02: load Fashion-MNIST, normalize, train with SGD
// (momentum, weight decay) and a warmup + cosine schedule, report test accuracy per epoch, and
// optionally write metrics, checkpoint, and resume. With --checkpoint, SIGUSR1 or SIGTERM (a
// cluster's warning before the time limit, or the limit itself) saves the checkpoint at the next
// step and exits 75 (tessera::kExitStoppedForResume): run again with --resume to go on. Each
// example supplies its model (built for the Env it is given) and recipe. --precision=bfloat16
// trains the same model with CpuLocalBf16: float weights, bfloat16 products (tessera/core/env.hpp),
// against float32's CpuLocal.
#pragma once

#include <cstdio>
#include <exception>
#include <optional>
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
  // The example's claim: the final test accuracy this recipe reaches at least (with margin over
  // runs and CPUs). Below it, the run exits 1. It is the default of --min-accuracy when no flag
  // changes the recipe (epochs, batch, lr, weight decay, warmup, limit, precision); otherwise the
  // default is 0, no check, unless --min-accuracy states a floor for those settings.
  double min_accuracy = 0.0;
};

template <class M>
std::string model_name(const M& model) {
  if constexpr (requires { model.name(); })
    return std::string(model.name());
  else
    return "LeNet-5";
}

struct RunOptions {
  std::string data_dir, metrics, checkpoint, resume;
  std::uint64_t seed = 1;
  std::int64_t limit = 0, stop_after = 0, checkpoint_every = 0;
  int progress = -1;
  double min_accuracy = 0;
  const tessera::StopSignals* stop_signals = nullptr;  // set with a checkpoint path
};

// The final line and the --min-accuracy check (for a finished run: a run stopped early is not
// checked). Returns the exit code.
inline int report_fashion_mnist(const char* title, const Recipe& recipe, const RunOptions& o,
                                const std::vector<tessera::EpochResult>& results, double train_images) {
  if (results.empty()) return 0;
  double seconds = 0;
  for (auto& r : results) seconds += r.seconds;
  if (seconds > 0)
    std::printf("final test accuracy: %.2f%% (%lld epochs, %.1f s training, %.0f img/s)\n",
                100.0 * results.back().test_accuracy, static_cast<long long>(results.back().epoch), seconds,
                train_images * static_cast<double>(results.size()) / seconds);
  else
    std::printf("final test accuracy: %.2f%% (%lld epochs, all trained before the resume)\n",
                100.0 * results.back().test_accuracy, static_cast<long long>(results.back().epoch));
  // The claim is about a finished run: a run stopped early (--stop-after) is not checked.
  if (o.min_accuracy <= 0)
    std::printf("check: none (the recipe's floor of %.1f%% is for its own settings; --min-accuracy sets one)\n",
                100.0 * recipe.min_accuracy);
  if (o.min_accuracy > 0 && results.back().epoch == recipe.epochs) {
    const bool reached = results.back().test_accuracy >= o.min_accuracy;
    std::printf("check: final test accuracy %.2f%% %s the floor of %.2f%% (--min-accuracy)\n",
                100.0 * results.back().test_accuracy, reached ? ">=" : "is BELOW", 100.0 * o.min_accuracy);
    if (!reached) {
      std::fprintf(stderr, "error: %s reached %.2f%%, below --min-accuracy=%g: the floor is for this recipe's "
                   "settings; with fewer epochs or images pass a lower one (0: no check)\n", title,
                   100.0 * results.back().test_accuracy, o.min_accuracy);
      return 1;
    }
  }
  return 0;
}

// Trains make_model.template operator()<E>(seed) and prints the final test accuracy.
template <class E, class MakeModel>
int train_fashion_mnist(const char* title, const Recipe& recipe, const RunOptions& o, MakeModel& make_model) {
  using namespace tessera;
  auto [train, test] = examples::load_normalized_fashion_mnist(o.data_dir, o.limit);

  auto model = make_model.template operator()<E>(o.seed);
  auto named = named_tensors(model);
  std::printf("%s: %s, %zu parameters, %lld training / %lld test images, batch %lld, %lld epochs, %d threads%s\n",
              title, model_name(model).c_str(), count_parameters(named), static_cast<long long>(train.labels.size()),
              static_cast<long long>(test.labels.size()), static_cast<long long>(recipe.batch_size),
              static_cast<long long>(recipe.epochs), Cpu::num_threads(),
              E::bf16_compute ? (", bfloat16 products: " + cpu_bf16_kernel()).c_str() : "");

  Sgd<E> sgd(named, {.lr = recipe.lr, .momentum = recipe.momentum, .weight_decay = recipe.weight_decay,
                     .nesterov = recipe.nesterov, .decay_norm_and_bias = false});
  const CosineLr cosine{recipe.lr, static_cast<double>(recipe.epochs), 0.0};
  const LinearWarmup<CosineLr> schedule{cosine, recipe.warmup_epochs, 0.1};

  DataLoader<float> train_loader(train, {.batch_size = recipe.batch_size, .shuffle = true, .seed = o.seed});
  DataLoader<float> test_loader(test, {.batch_size = 500, .shuffle = false});
  Trainer trainer(model, sgd, schedule, {.epochs = recipe.epochs, .metrics_path = o.metrics,
                                         .checkpoint_path = o.checkpoint, .progress = o.progress,
                                         .checkpoint_every_steps = o.checkpoint_every, .stop_signals = o.stop_signals});
  if (!o.resume.empty()) {
    trainer.load(o.resume, train_loader);  // checks the loader position too, before "resumed" is printed
    std::printf("resumed from %s at epoch %lld, step %lld\n", o.resume.c_str(),
                static_cast<long long>(trainer.state().epoch), static_cast<long long>(trainer.state().global_step));
  }
  auto results = trainer.fit(train_loader, &test_loader, o.stop_after);
  if (trainer.stopped_by() != 0) return kExitStoppedForResume;  // the Trainer said where, and the checkpoint
  if (results.empty() && trainer.state().epoch >= recipe.epochs) {
    // Resumed from a finished run: nothing left to train, but the checks below are still owed, on
    // the model as loaded (a finished checkpoint must not pass --min-accuracy unmeasured).
    const auto [loss, accuracy] = trainer.evaluate(test_loader);
    std::printf("nothing left to train: the checkpoint finished epoch %lld of %lld; its test accuracy %.2f%%\n",
                static_cast<long long>(trainer.state().epoch), static_cast<long long>(recipe.epochs), 100.0 * accuracy);
    results.push_back({.epoch = recipe.epochs, .test_loss = loss, .test_accuracy = accuracy});
  }
  return report_fashion_mnist(title, recipe, o, results, static_cast<double>(train.labels.size()));
}

// Reads flags over the recipe's defaults, trains, returns the process exit code.
template <class MakeModel>
int run_fashion_mnist(int argc, char** argv, const char* title, Recipe recipe, MakeModel make_model) {
  using namespace tessera;
  try {
    // Every flag is checked here, paths included, before any data is read or step computed.
    Flags flags(argc, argv);
    recipe.epochs = flags.get("epochs", recipe.epochs, {.min = 1}, "passes over the training set");
    recipe.batch_size = flags.get("batch", recipe.batch_size, {.min = 1}, "images per SGD step");
    recipe.lr = flags.get("lr", recipe.lr, {.above = 0}, "SGD learning rate after warmup, decayed to 0 by a cosine");
    recipe.weight_decay = flags.get("weight-decay", recipe.weight_decay, {.min = 0},
                                    "SGD weight decay (not on biases or BatchNorm)");
    recipe.warmup_epochs = flags.get("warmup", recipe.warmup_epochs, {.min = 0},
                                     "epochs of linear warmup from a tenth of the learning rate");
    RunOptions o;
    o.data_dir = flags.get("data-dir", std::string(),
                           "directory of the IDX files (empty: TESSERA_DATA_DIR, then the default)");
    const int threads = flags.threads("threads", 0, "OpenMP threads");
    o.seed = static_cast<std::uint64_t>(flags.get("seed", std::int64_t{1}, "seed of initialization and shuffling"));
    o.metrics = flags.output_path("metrics", "", "one JSON line per epoch: loss, accuracy, img/s, learning rate");
    o.checkpoint = flags.output_path("checkpoint", "",
                                     "safetensors checkpoint, saved after every epoch and on SIGUSR1/SIGTERM");
    o.checkpoint_every = flags.get("checkpoint-every", std::int64_t{0}, {.min = 0},
                                   "also save the checkpoint every N steps (0: after each epoch only)");
    o.resume = flags.input_path("resume", "", "checkpoint to continue from, exactly where it stopped");
    o.limit = flags.get("limit", std::int64_t{0}, {.min = 0}, "train on the first N images only (0: all 60,000)");
    o.progress = flags.get("progress", -1, {.min = -1, .max = 1},
                           "progress display: -1 a bar on a terminal, else lines; 0 lines; 1 a bar");
    o.stop_after = flags.get("stop-after", std::int64_t{0}, {.min = 0},
                             "stop after N epochs of the schedule, to resume later (0: run all)");
    const std::string precision = flags.choice("precision", "float32", {"float32", "bfloat16"},
                                               "number type of the products (bfloat16: weights and sums stay float32)");
    // The recipe's floor holds for the recipe's settings; a run that changes them states its own.
    bool recipe_settings = true;
    for (const char* setting : {"epochs", "batch", "lr", "weight-decay", "warmup", "limit", "precision"})
      recipe_settings = recipe_settings && !flags.has(setting);
    o.min_accuracy = flags.get("min-accuracy", recipe_settings ? recipe.min_accuracy : 0.0, {.min = 0, .max = 1},
                               "final test accuracy to reach, else exit 1 (0: no check)");
    flags.finish();
    TESSERA_CHECK(o.checkpoint_every == 0 || !o.checkpoint.empty(), ArgumentError, "--checkpoint-every=",
                  o.checkpoint_every, " needs --checkpoint=PATH (the file to save to)");
    // With a checkpoint to save, a stop signal saves it at the next step instead of killing the run.
    std::optional<StopSignals> stop_signals;
    if (!o.checkpoint.empty()) o.stop_signals = &stop_signals.emplace();

    Cpu::set_num_threads(threads);
    if (precision == "bfloat16") return train_fashion_mnist<CpuLocalBf16>(title, recipe, o, make_model);
    return train_fashion_mnist<CpuLocal>(title, recipe, o, make_model);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

}  // namespace examples
