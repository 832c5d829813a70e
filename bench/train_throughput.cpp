// Training-step throughput (images/s) of Tessera models on synthetic data, as JSON.
//
//   ./train_throughput [--models=mlp,lenet,resnet20,resnet50_b8,resnet50_b32] [--threads=2]
//                      [--steps=N] [--warmup=2] [--warmup-seconds=0.5] [--precision=float32|bfloat16]
//                      [--loader]
//
// --precision=bfloat16 trains with CpuLocalBf16: float weights, bfloat16 products (core/env.hpp).
// --models=gpt (not among the defaults): a small GPT, windows/s in place of images/s (measure_gpt).
// --loader: each timed step also takes its batch from the DataLoader (TokenLoader for the GPT), as
// Trainer::fit does; without it every step trains on one batch, as bench/torch_throughput.py does.
//
// Each model: `warmup` steps (caches and workspaces settle; at least 1), and more until
// `warmup-seconds` have passed since its first step, then `steps` timed steps; reports the median
// step time, images/s, and the heap allocations made during the timed steps, counted by
// interposing malloc (so Eigen's and OpenMP's allocations count too, not just operator new).
// The seconds are for the small models, whose 50 timed steps otherwise lie in a process's first
// tenth of a second, where Linux may still run both OpenMP threads of a 2-core machine on one core
// (it separates them later), and some starts' medians measured that instead of training (bench/README.md,
// "On the AMD EPYC Zen 5, 2026-12-08"). bench/torch_throughput.py warms up by the same rule.
// Never a timed test: bench/compare_pytorch.py runs this next to PyTorch and prints the ratio.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "tessera/tessera.hpp"

#include "alloc_counter.hpp"

using namespace tessera;

struct Result {
  std::string model;
  std::int64_t batch, image;
  double median_step_s, images_per_second;
  long first_step_allocations, allocations;
  int steps;
};

// One model's run: next_batch() fills b (the first batch before anything; with --loader before
// every step too), then the first step (counted, untimed), the rest of the warm-up (at least
// `warmup.steps` steps and `warmup.seconds` since the first began, at most kMaxWarmupSteps), and the
// timed steps, whose heap allocations are counted.
constexpr int kMaxWarmupSteps = 100000;

struct Warmup {
  int steps;       // at least 1: the first step is never timed
  double seconds;  // and at least this long since the first step began
};

template <class T, class NextBatch>
Result run_steps(const std::string& label, T& trainer, Batch<float>& b, const NextBatch& next_batch,
                 std::int64_t batch, std::int64_t image, Warmup warmup, int steps, bool from_loader) {
  next_batch();
  const auto start = std::chrono::steady_clock::now();
  const auto warming = [&](int done) {
    return done < warmup.steps ||
           (done < kMaxWarmupSteps &&
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < warmup.seconds);
  };
  // The first step is counted too: it must allocate (caches, workspaces, optimizer state), which
  // shows the counter works; the timed steps after warm-up must not.
  g_allocations = 0;
  g_counting = true;
  trainer.train_step(b);
  g_counting = false;
  const long first_step_allocations = g_allocations.load();
  for (int i = 1; warming(i); ++i) {
    if (from_loader) next_batch();
    trainer.train_step(b);
  }
  std::vector<double> times;
  g_allocations = 0;
  for (int i = 0; i < steps; ++i) {
    g_counting = true;
    const auto t0 = std::chrono::steady_clock::now();
    if (from_loader) next_batch();
    trainer.train_step(b);
    const auto t1 = std::chrono::steady_clock::now();
    g_counting = false;
    times.push_back(std::chrono::duration<double>(t1 - t0).count());
  }
  std::sort(times.begin(), times.end());
  const double median = times[times.size() / 2];
  return {label, batch, image, median, static_cast<double>(batch) / median, first_step_allocations, g_allocations.load(),
          steps};
}

template <class E, class Model>
Result measure(const std::string& label, Model& model, std::int64_t batch, std::int64_t channels, std::int64_t image,
               std::int64_t classes, Warmup warmup, int steps, bool from_loader) {
  auto named = named_tensors(model);
  Sgd<E> sgd(named, {.lr = 0.01, .momentum = 0.9, .weight_decay = 1e-4});
  Trainer trainer(model, sgd, ConstantLr{0.01}, {.epochs = 1, .verbose = false});
  Dataset data = SyntheticImages(batch, channels, image, image, classes, 11);
  DataLoader<float> loader(data, {.batch_size = batch, .shuffle = false, .prefetch = false});
  Batch<float> b;
  std::int64_t epoch = 0;
  // --loader: each step takes its batch from the loader first, as Trainer::fit does (the dataset
  // is one batch, so each step starts an epoch); else every step trains on the first batch.
  const auto next_batch = [&] {
    loader.start_epoch(epoch++);
    loader.next(b);
  };
  return run_steps(label, trainer, b, next_batch, batch, image, warmup, steps, from_loader);
}

// A small GPT (2 blocks of 4 heads, width 128, windows of 64 byte tokens, batch 8): token and
// position embeddings, LayerNorm, fused causal attention, the GELU MLP, cross-entropy over 256
// tokens and AdamW, through the Trainer as examples/15_gpt trains it; a fixed pseudo-random byte
// stream for tokens. Not one of compare_pytorch.py's models: here for the steady step's
// allocations (tests/bench/check_steady_allocations.py). "image" is the window length.
template <class E>
Result measure_gpt(Warmup warmup, int steps, bool from_loader) {
  const GPTConfig config{.block_size = 64, .vocab_size = 256, .n_layer = 2, .n_head = 4, .n_embd = 128};
  const std::int64_t batch = 8;
  Rng rng(1);
  GPT<E> model(config, rng);
  AdamW<E> adamw(named_tensors(model), {.lr = 1e-3, .weight_decay = 0.1, .decay_norm_and_bias = false});
  Trainer trainer(model, adamw, ConstantLr{1e-3}, {.epochs = 1, .verbose = false});
  std::vector<std::uint16_t> tokens(1 << 14);
  std::uint64_t state = 11;
  for (auto& t : tokens) t = static_cast<std::uint16_t>((state = state * 6364136223846793005ULL + 1442695040888963407ULL) >> 56);
  TokenLoader<float> loader(TokenSpan{tokens.data(), static_cast<std::int64_t>(tokens.size())}, config.block_size,
                            {.batch_size = batch, .shuffle = false});
  Batch<float> b;
  std::int64_t epoch = 0;
  loader.start_epoch(epoch++);
  const auto next_batch = [&] {  // the next windows, a new epoch once the stream's are used up
    if (!loader.next(b)) {
      loader.start_epoch(epoch++);
      loader.next(b);
    }
  };
  return run_steps("gpt", trainer, b, next_batch, batch, config.block_size, warmup, steps, from_loader);
}

template <class E>
Result measure_model(const std::string& m, Warmup warmup, int steps_flag, bool from_loader) {
  auto steps = [&](int fallback) { return steps_flag > 0 ? steps_flag : fallback; };
  if (m == "mlp") {
    Mlp<E> net(784, {512, 256}, 10, 1);
    return measure<E>(m, net, 128, 1, 28, 10, warmup, steps(50), from_loader);
  }
  if (m == "lenet") {
    auto net = lenet5<E>(1, 28, 10, 1);
    return measure<E>(m, net, 64, 1, 28, 10, warmup, steps(50), from_loader);
  }
  if (m == "resnet20") {
    auto net = resnet20<E>({.in_channels = 1, .num_classes = 10, .seed = 1});
    return measure<E>(m, net, 64, 1, 28, 10, warmup, steps(10), from_loader);
  }
  if (m == "resnet50_b8" || m == "resnet50_b32") {
    auto net = resnet50<E>({.in_channels = 3, .num_classes = 1000, .seed = 1});
    const std::int64_t batch = m == "resnet50_b8" ? 8 : 32;
    return measure<E>(m, net, batch, 3, 224, 1000, Warmup{std::min(warmup.steps, 2), warmup.seconds}, steps(3), from_loader);
  }
  if (m == "gpt") return measure_gpt<E>(warmup, steps(20), from_loader);
  throw ArgumentError("unknown model '" + m + "' (mlp, lenet, resnet20, resnet50_b8, resnet50_b32, gpt)");
}

int main(int argc, char** argv) {
  try {
    Flags flags(argc, argv);
    const std::vector<std::string> models = flags.list("models", "mlp,lenet,resnet20,resnet50_b8,resnet50_b32",
                                                       {"mlp", "lenet", "resnet20", "resnet50_b8", "resnet50_b32", "gpt"});
    const int threads = flags.threads("threads", 2);
    const int steps_flag = flags.get("steps", 0, {.min = 0});  // 0: each model's own count
    const Warmup warmup{flags.get("warmup", 2, {.min = 1}),  // the first step is never timed
                        flags.get("warmup-seconds", 0.5, {.min = 0.0})};
    const std::string precision = flags.choice("precision", "float32", {"float32", "bfloat16"});
    const bool bf16 = precision == "bfloat16";
    const bool from_loader = flags.get("loader", false);  // each step's batch from the DataLoader
    flags.finish();
    Cpu::set_num_threads(threads);

    std::vector<Result> results;
    for (const std::string& m : models) {
      results.push_back(bf16 ? measure_model<CpuLocalBf16>(m, warmup, steps_flag, from_loader)
                             : measure_model<CpuLocal>(m, warmup, steps_flag, from_loader));
      Cpu::allocator().release_cached();  // the next model starts from a clean host heap
      const auto& r = results.back();
      std::fprintf(stderr, "%-13s batch %3lld  %8.1f img/s  median step %.4f s  allocations: first step %ld, timed %ld\n", r.model.c_str(),
                   static_cast<long long>(r.batch), r.images_per_second, r.median_step_s, r.first_step_allocations, r.allocations);
    }
    std::printf("{\"framework\": \"tessera\", \"threads\": %d, \"loader\": %s, \"gemm\": \"%s\", \"precision\": \"%s\", "
                "\"bf16_kernel\": \"%s\", \"bf16_conv\": \"%s\", \"idle_spin_ms\": %d, \"results\": [",
                threads, from_loader ? "true" : "false", cpu_gemm_kernel().c_str(), precision.c_str(), bf16 ? cpu_bf16_kernel().c_str() : "",
                bf16 ? cpu_bf16_conv_kernel().c_str() : "", Cpu::idle_spin_ms());
    for (std::size_t i = 0; i < results.size(); ++i) {
      const auto& r = results[i];
      std::printf("%s{\"model\": \"%s\", \"batch\": %lld, \"image\": %lld, \"steps\": %d, \"median_step_s\": %.6f, "
                  "\"images_per_second\": %.2f, \"allocations_first_step\": %ld, \"allocations_in_timed_steps\": %ld}",
                  i ? ", " : "", r.model.c_str(), static_cast<long long>(r.batch), static_cast<long long>(r.image),
                  r.steps, r.median_step_s, r.images_per_second, r.first_step_allocations, r.allocations);
    }
    std::printf("]}\n");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
