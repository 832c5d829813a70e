// ResNet-50 inference throughput (images/s) and the peak memory of one ResNet-50 training step, as JSON.
//
//   ./inference_throughput [--batches=1,8] [--threads=2] [--steps=N] [--warmup=3] [--mode=inference|eval]
//   ./inference_throughput --memory [--batch=32] [--threads=2]
//
// Inference: resnet50 (3x224x224, 1000 classes) in Mode::Inference (BatchNorm normalizes with its
// running statistics, as torch's model.eval(); forward only, as torch.inference_mode(), so each
// convolution finishes its output with the BatchNorm, ReLU and residual add after it while the
// output is in cache), or with --mode=eval in Mode::Eval (the same numbers, layer by layer). No
// backward, no optimizer. Per batch size:
// `warmup` forwards (workspaces and caches settle; at least 1), then `steps` timed forwards; reports
// the median forward time, images/s, and the heap allocations made during the timed forwards,
// counted by interposing malloc as train_throughput.cpp does.
//
// --memory: one training step (SGD with momentum, as train_throughput) in this fresh process. Reports
// the process's peak resident set (VmHWM, /proc/self/status) at start, after model + optimizer +
// batch creation (the baseline) and after the step, the step's growth over the baseline, and the
// CPU caching allocator's own peak of bytes in use (its blocks are powers of two, so this counts the
// rounded sizes; scratch buffers and the model's parameters go through it too, Eigen's and OpenMP's
// internal mallocs do not). bench/compare_inference.py runs both modes next to PyTorch.
// Never a timed test.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "tessera/tessera.hpp"

#include "alloc_counter.hpp"
#include "proc_status.hpp"

using namespace tessera;
using E = CpuLocal;

namespace {

struct InferenceResult {
  std::int64_t batch;
  int steps;
  double median_forward_s, images_per_second;
  long first_forward_allocations, allocations;
  bool finite;
};

InferenceResult measure_inference(ResNet<E, Bottleneck>& net, std::int64_t batch, int warmup, int steps) {
  using T = Tensor<float, Cpu>;
  T x({batch, 3, 224, 224});
  Rng rng(11);
  uniform_(x, -1.0, 1.0, rng);
  ResNet<E, Bottleneck>::Cache cache;
  g_allocations = 0;
  g_counting = true;
  net.forward(x, cache);
  g_counting = false;
  const long first = g_allocations.load();
  for (int i = 1; i < warmup; ++i) net.forward(x, cache);
  std::vector<double> times;
  g_allocations = 0;
  const T* out = nullptr;
  for (int i = 0; i < steps; ++i) {
    g_counting = true;
    const auto t0 = std::chrono::steady_clock::now();
    out = &net.forward(x, cache);
    const auto t1 = std::chrono::steady_clock::now();
    g_counting = false;
    times.push_back(std::chrono::duration<double>(t1 - t0).count());
  }
  bool finite = true;  // random weights with eval BN: the logits must still be numbers (no inf/NaN paths timed)
  for (std::int64_t i = 0; i < out->numel(); ++i) finite = finite && std::isfinite(out->data()[i]);
  std::sort(times.begin(), times.end());
  const double median = times[times.size() / 2];
  return {batch, steps, median, static_cast<double>(batch) / median, first, g_allocations.load(), finite};
}

int run_memory(std::int64_t batch, int threads) {
  const long long hwm_start = proc_status_bytes("VmHWM");
  auto net = resnet50<E>({.in_channels = 3, .num_classes = 1000, .seed = 1});
  auto named = named_tensors(net);
  Sgd<E> sgd(named, {.lr = 0.01, .momentum = 0.9, .weight_decay = 1e-4});
  Trainer trainer(net, sgd, ConstantLr{0.01}, {.epochs = 1, .verbose = false});
  Dataset data = SyntheticImages(batch, 3, 224, 224, 1000, 11);
  DataLoader<float> loader(data, {.batch_size = batch, .shuffle = false, .prefetch = false});
  Batch<float> b;
  loader.start_epoch(0);
  loader.next(b);
  const long long hwm_baseline = proc_status_bytes("VmHWM");
  const long long rss_baseline = proc_status_bytes("VmRSS");
  Cpu::allocator().reset_peak();
  const AllocatorStats before = Cpu::allocator().stats();
  const auto t0 = std::chrono::steady_clock::now();
  const float loss = trainer.train_step(b);
  const auto t1 = std::chrono::steady_clock::now();
  const AllocatorStats after = Cpu::allocator().stats();
  const long long hwm_after = proc_status_bytes("VmHWM");
  std::fprintf(stderr,
               "resnet50 b%lld training step: VmHWM %.1f MiB (baseline after model+optimizer+batch %.1f MiB, growth "
               "%.1f MiB); allocator peak %.1f MiB (in use before the step %.1f MiB)\n",
               static_cast<long long>(batch), hwm_after / 1048576.0, hwm_baseline / 1048576.0,
               (hwm_after - hwm_baseline) / 1048576.0, after.peak_bytes_in_use / 1048576.0,
               before.bytes_in_use / 1048576.0);
  std::printf("{\"framework\": \"tessera\", \"mode\": \"memory\", \"threads\": %d, \"model\": \"resnet50\", "
              "\"batch\": %lld, \"image\": 224, \"step_s\": %.4f, \"loss\": %.6f, "
              "\"vmhwm_start_bytes\": %lld, \"vmhwm_baseline_bytes\": %lld, \"vmrss_baseline_bytes\": %lld, "
              "\"vmhwm_after_step_bytes\": %lld, \"vmhwm_step_growth_bytes\": %lld, "
              "\"allocator_in_use_before_step_bytes\": %zu, \"allocator_peak_bytes\": %zu, "
              "\"allocator_step_growth_bytes\": %zu, \"allocator_system_allocations_in_step\": %zu}\n",
              threads, static_cast<long long>(batch), std::chrono::duration<double>(t1 - t0).count(),
              static_cast<double>(loss), hwm_start, hwm_baseline, rss_baseline, hwm_after, hwm_after - hwm_baseline,
              before.bytes_in_use, after.peak_bytes_in_use, after.peak_bytes_in_use - before.bytes_in_use,
              after.system_allocations - before.system_allocations);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Flags flags(argc, argv);
    const bool memory = flags.get("memory", false);
    const std::string batches_flag = flags.get("batches", "1,8");
    const std::int64_t memory_batch = flags.get("batch", std::int64_t{32}, {.min = 2});
    const int threads = flags.threads("threads", 2);
    const int steps_flag = flags.get("steps", 0, {.min = 0});  // 0: by batch size (20 at b1, 10 at b8)
    const int warmup = flags.get("warmup", 3, {.min = 1});     // the first forward is never timed
    // inference (default): Mode::Inference, forward only, convolutions fused with the eval
    // BatchNorm, ReLU and residual add after them; eval: Mode::Eval, every layer on its own.
    const std::string mode_flag = flags.get("mode", std::string("inference"));
    flags.finish();
    if (mode_flag != "inference" && mode_flag != "eval")
      throw ArgumentError("--mode=" + mode_flag + ": expected inference or eval");
    const Mode mode = mode_flag == "eval" ? Mode::Eval : Mode::Inference;
    Cpu::set_num_threads(threads);
    if (memory) return run_memory(memory_batch, threads);

    std::vector<std::int64_t> batches;
    for (std::size_t pos = 0; pos <= batches_flag.size();) {
      const std::size_t comma = std::min(batches_flag.find(',', pos), batches_flag.size());
      const std::string item = batches_flag.substr(pos, comma - pos);
      const long long v = std::atoll(item.c_str());
      if (v <= 0 || std::to_string(v) != item)
        throw ArgumentError("--batches=" + batches_flag + ": '" + item + "' is not a positive integer");
      batches.push_back(v);
      pos = comma + 1;
    }

    auto net = resnet50<E>({.in_channels = 3, .num_classes = 1000, .seed = 1});
    net.set_mode(mode);
    std::vector<InferenceResult> results;
    for (const std::int64_t batch : batches) {
      const int steps = steps_flag > 0 ? steps_flag : (batch < 8 ? 20 : 10);
      results.push_back(measure_inference(net, batch, warmup, steps));
      Cpu::allocator().release_cached();  // the next batch size starts from a clean host heap
      const auto& r = results.back();
      std::fprintf(stderr, "resnet50 %s batch %3lld  %8.1f img/s  median forward %.4f s  allocations: first %ld, timed %ld%s\n",
                   mode_flag.c_str(), static_cast<long long>(r.batch), r.images_per_second, r.median_forward_s,
                   r.first_forward_allocations, r.allocations, r.finite ? "" : "  NON-FINITE LOGITS");
    }
    std::printf("{\"framework\": \"tessera\", \"mode\": \"inference\", \"tessera_mode\": \"%s\", \"threads\": %d, "
                "\"gemm\": \"%s\", \"idle_spin_ms\": %d, \"results\": [",
                mode_flag.c_str(), threads, cpu_gemm_kernel().c_str(), Cpu::idle_spin_ms());
    for (std::size_t i = 0; i < results.size(); ++i) {
      const auto& r = results[i];
      std::printf("%s{\"model\": \"resnet50\", \"batch\": %lld, \"image\": 224, \"steps\": %d, \"median_forward_s\": %.6f, "
                  "\"images_per_second\": %.2f, \"allocations_first_forward\": %ld, \"allocations_in_timed_forwards\": %ld, "
                  "\"logits_finite\": %s}",
                  i ? ", " : "", static_cast<long long>(r.batch), r.steps, r.median_forward_s, r.images_per_second,
                  r.first_forward_allocations, r.allocations, r.finite ? "true" : "false");
    }
    std::printf("]}\n");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
