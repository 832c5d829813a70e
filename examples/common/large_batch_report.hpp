// What example 05 (large-batch training) prints and checks after its runs, kept out of its main:
// the table of final and best accuracies, Goyal et al.'s warmup claim, the per-epoch JSON lines
// and the PNG plot of test accuracy.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "common/png_plot.hpp"
#include "tessera/tessera.hpp"

namespace examples {

enum class LargeBatchMethod { Sgd, Lars, Lamb };

inline const char* method_name(LargeBatchMethod m) {
  return m == LargeBatchMethod::Sgd ? "sgd" : m == LargeBatchMethod::Lars ? "lars" : "lamb";
}

// One training run of example 05: its settings, then what it measured.
struct LargeBatchRun {
  std::string key;   // the --runs name
  std::string name;  // the table's
  LargeBatchMethod method;
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

// printf into a std::string (a line of the table, a run's name).
inline std::string text(const char* fmt, auto... args) {
  char buf[160];
  std::snprintf(buf, sizeof buf, fmt, args...);
  return buf;
}

struct LargeBatchSettings {
  std::int64_t epochs, stop_after, limit, small, large;
  double warmup, min_warmup_gain, adaptive_warmup;
  int ranks, threads;
  std::uint64_t seed;
  std::vector<LargeBatchRun> runs;  // --runs, in its order (the first one is the table's reference)
  std::string decay, out, plot, data_dir;
};

// The optimizer settings of the LARS and LAMB runs.
struct LargeBatchAdaptive {
  double lars_lr, lars_eta, lars_wd, lamb_lr, lamb_wd;
};

// The runs named by `keys` (checked by flags.list), in their order, with the settings of `s`.
inline std::vector<LargeBatchRun> large_batch_runs(const LargeBatchSettings& s, const std::vector<std::string>& keys,
                                                   const LargeBatchAdaptive& a) {
  using Method = LargeBatchMethod;
  using Run = LargeBatchRun;
  using tessera::linear_scaling_rule;
  const bool poly = s.decay == "poly2";
  // 0.1 per 256 images
  const double small_lr = linear_scaling_rule(0.1, s.small), large_lr = linear_scaling_rule(0.1, s.large);
  const std::string k = text("%gx batch %lld", static_cast<double>(s.large) / static_cast<double>(s.small),
                             static_cast<long long>(s.large));
  const std::vector<Run> all = {
      {"small", text("small batch %lld, lr %g", static_cast<long long>(s.small), small_lr), Method::Sgd, s.small,
       small_lr, 0, 5e-4, 0, false, {40, 90, 200}, "blue"},
      {"nowarmup", text("%s, lr %g, no warmup", k.c_str(), large_lr), Method::Sgd, s.large, large_lr, 0, 5e-4, 0,
       false, {210, 50, 40}, "red"},
      {"warmup", text("%s, lr %g, warmup", k.c_str(), large_lr), Method::Sgd, s.large, large_lr, s.warmup, 5e-4, 0,
       false, {40, 160, 60}, "green"},
      {"lars", text("LARS batch %lld, lr %g, eta %g", static_cast<long long>(s.large), a.lars_lr, a.lars_eta),
       Method::Lars, s.large, a.lars_lr, s.adaptive_warmup, a.lars_wd, a.lars_eta, poly, {150, 50, 190}, "purple"},
      {"lamb", text("LAMB batch %lld, lr %g, wd %g", static_cast<long long>(s.large), a.lamb_lr, a.lamb_wd),
       Method::Lamb, s.large, a.lamb_lr, s.adaptive_warmup, a.lamb_wd, 0, poly, {230, 140, 20}, "orange"},
  };
  std::vector<Run> runs;
  for (const auto& key : keys)  // each one of all's keys
    runs.push_back(*std::find_if(all.begin(), all.end(), [&](const Run& r) { return r.key == key; }));
  return runs;
}

// Example 05's flags, every one checked here (the output paths included) before hours of
// training, and the runs they select.
inline LargeBatchSettings parse_large_batch(int argc, char** argv) {
  using namespace tessera;
  Flags flags(argc, argv);
  LargeBatchSettings s;
  s.epochs = flags.get("epochs", std::int64_t{16}, {.min = 1}, "epochs of every run's learning-rate schedule");
  s.warmup = flags.get("warmup", 5.0, {.min = 0}, "epochs of linear warmup of the warmup run");
  // Only the first N epochs of the --epochs schedule (0: all): where the large rate without
  // warmup does its damage, in a fraction of the time.
  s.stop_after = flags.get("stop-after", std::int64_t{0}, {.min = 0},
                           "train only the first N epochs of the schedule (0: all)");
  s.min_warmup_gain = flags.get("min-warmup-gain", 5.0, {.min = 0},
                                "best-accuracy points warmup must gain over no warmup (0: no check)");
  s.ranks = flags.get("ranks", 2, {.min = 1}, "data-parallel ranks of every run, threads of this process");
  s.threads = flags.threads("threads", 1, "OpenMP threads per rank");
  check_thread_budget(s.ranks, "--ranks", s.threads, "--threads");  // the ranks are threads of this process
  s.seed = static_cast<std::uint64_t>(flags.get("seed", std::int64_t{1}, "seed of initialization and shuffling"));
  s.limit = flags.get("limit", std::int64_t{0}, {.min = 0}, "train on the first N images only (0: all 60,000)");
  const auto keys = flags.list("runs", "small,nowarmup,warmup", {"small", "nowarmup", "warmup", "lars", "lamb"},
                               "runs to train, in order; the first is the table's reference");
  s.small = flags.get("small-batch", std::int64_t{256}, {.min = 1},
                      "global batch of the small run (lr 0.1 x batch / 256)");
  s.large = flags.get("large-batch", std::int64_t{4096}, {.min = 1},
                      "global batch of the large runs (SGD's lr 0.1 x batch / 256)");
  LargeBatchAdaptive a;
  a.lars_lr = flags.get("lars-lr", 8.0, {.above = 0}, "learning rate of the LARS run");
  a.lars_eta = flags.get("lars-eta", 0.001, {.above = 0}, "trust coefficient of the LARS run");
  a.lars_wd = flags.get("lars-wd", 5e-4, {.min = 0}, "weight decay of the LARS run");
  a.lamb_lr = flags.get("lamb-lr", 0.05, {.above = 0}, "learning rate of the LAMB run");
  a.lamb_wd = flags.get("lamb-wd", 0.01, {.min = 0}, "weight decay of the LAMB run");
  s.adaptive_warmup = flags.get("adaptive-warmup", s.warmup, {.min = 0},
                                "warmup epochs of the LARS and LAMB runs (default: --warmup)");
  s.decay = flags.choice("adaptive-decay", "cosine", {"cosine", "poly2"},
                         "learning-rate decay of the LARS and LAMB runs (poly2: (1 - e/T)^2)");
  s.out = flags.output_path("out", "05_large_batch.jsonl", "test accuracy per epoch of every run, as JSON lines");
  s.plot = flags.output_path("plot", "05_large_batch.png", "test accuracy per epoch of every run, drawn as a PNG");
  s.data_dir = flags.get("data-dir", std::string(),
                         "directory of the IDX files (empty: TESSERA_DATA_DIR, then the default)");
  flags.finish();
  // Global batches split evenly over the ranks, or refused: never silently rounded.
  TESSERA_CHECK(s.small % s.ranks == 0 && s.large % s.ranks == 0, ArgumentError, "--small-batch=", s.small,
                " and --large-batch=", s.large, " (global batches) must be multiples of --ranks=", s.ranks);
  s.runs = large_batch_runs(s, keys, a);
  return s;
}

// The table, then the claim (when both large-batch SGD runs ran and min_warmup_gain > 0): at the
// large batch, gradual warmup's best test accuracy beats no warmup's by at least min_warmup_gain
// points. The best, not the last: at a rate this high BatchNorm's running statistics make single
// epochs' test accuracies jump by tens of points. Returns whether the claim holds.
inline bool report_large_batch(const std::vector<LargeBatchRun>& runs, double min_warmup_gain) {
  const auto best = [](const LargeBatchRun& r) { return *std::max_element(r.accuracy.begin(), r.accuracy.end()); };
  std::printf("\n%-42s %8s %8s %9s %6s %9s %9s\n", "run", "final", "best", "vs first", "steps", "train", "wall");
  double total = 0;
  for (const auto& run : runs) {
    std::printf("%-42s %7.2f%% %7.2f%% %+9.2f %6lld %8.1fs %8.1fs\n", run.name.c_str(), 100 * run.accuracy.back(),
                100 * best(run), 100 * (run.accuracy.back() - runs[0].accuracy.back()), static_cast<long long>(run.steps),
                run.seconds, run.wall);
    total += run.wall;
  }
  std::printf("total: %.1f s (%.1f min)\n", total, total / 60);
  const auto find = [&](const char* key) {
    return std::find_if(runs.begin(), runs.end(), [&](const LargeBatchRun& r) { return r.key == key; });
  };
  const auto nowarmup = find("nowarmup"), with_warmup = find("warmup");
  if (min_warmup_gain <= 0 || nowarmup == runs.end() || with_warmup == runs.end()) return true;
  const double gain = 100 * (best(*with_warmup) - best(*nowarmup));
  const bool holds = gain >= min_warmup_gain;
  std::printf("check: warmup's best test accuracy is %.2f points above no warmup's (%.2f%% against %.2f%%; at least "
              "%.2f: --min-warmup-gain) %s\n", gain, 100 * best(*with_warmup), 100 * best(*nowarmup), min_warmup_gain,
              holds ? "ok" : "FAIL");
  if (!holds)
    std::fprintf(stderr, "05_large_batch: warmup did not beat no warmup by %.2f points at these settings. The effect "
                 "needs the large rate to last: see the README for settings that show it (--min-warmup-gain=0 turns "
                 "the check off)\n", min_warmup_gain);
  return holds;
}

// Test accuracy per epoch of every run, one JSON line each (empty path: none).
inline void write_large_batch_jsonl(const std::string& path, const std::vector<LargeBatchRun>& runs) {
  if (path.empty()) return;
  std::FILE* f = std::fopen(path.c_str(), "w");
  TESSERA_CHECK(f != nullptr, tessera::IoError, "05_large_batch: cannot write '", path, "'");
  for (const auto& run : runs)
    for (std::size_t e = 0; e < run.accuracy.size(); ++e)
      std::fprintf(f, "{\"run\": \"%s\", \"optimizer\": \"%s\", \"batch\": %lld, \"lr\": %g, \"warmup_epochs\": %g, "
                      "\"weight_decay\": %g, \"eta\": %g, \"decay\": \"%s\", \"epoch\": %zu, \"test_accuracy\": %.6f}\n",
                   run.name.c_str(), method_name(run.method), static_cast<long long>(run.batch), run.lr,
                   run.warmup_epochs, run.weight_decay, run.eta, run.poly ? "poly2" : "cosine", e + 1, run.accuracy[e]);
  TESSERA_CHECK(std::fclose(f) == 0, tessera::IoError, "05_large_batch: cannot write '", path, "'");
}

// Test accuracy per epoch of every run as one PNG (empty path: none), with its legend printed.
inline void plot_large_batch(const std::string& path, const std::vector<LargeBatchRun>& runs, std::int64_t epochs) {
  if (path.empty()) return;
  std::vector<Series> series;
  double low = 1.0;
  for (const auto& run : runs) {
    series.push_back({run.name, run.colour, run.accuracy});
    low = std::min(low, *std::min_element(run.accuracy.begin(), run.accuracy.end()));
  }
  const double y_min = std::floor(low * 10) / 10, y_max = 1.0;
  plot_png(path, series, y_min, y_max, "epoch", "test accuracy");
  std::printf("\nplot: %s (test accuracy per epoch; x: epochs 1..%lld, y: %.0f%%..%.0f%%, grid every %.0f%%)\n",
              path.c_str(), static_cast<long long>(epochs), 100 * y_min, 100 * y_max, 10 * (y_max - y_min));
  for (const auto& run : runs) std::printf("  %-6s %s\n", run.colour_name, run.name.c_str());
}

}  // namespace examples
