// What example 09 (synchronous against asynchronous SGD) prints and checks after its modes ran,
// kept out of its main: the table (time to the target accuracy, final accuracy, staleness) with
// its checks, the cost per gradient beside the bytes measured on loopback, the JSON lines and the
// plot of test accuracy against wall time.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "common/png_plot.hpp"
#include "tessera/core/error.hpp"

namespace examples {

struct AsyncPoint {
  double seconds, accuracy;
};

// One mode's run, as the evaluator saw it.
struct AsyncModeResult {
  std::string mode;
  std::vector<AsyncPoint> points;
  std::int64_t gradients = 0;
  double staleness_mean = 0;
  std::int64_t staleness_max = 0;
  std::int64_t staleness_bound = -1;  // the bound SSP must respect, -1 if none
  double loopback = 0;                // bytes over this host's loopback during the sessions (evaluator)
  double peer = -1;                   // thread ranks: bytes all ranks' sends and collectives moved; -1: none
};

struct AsyncReportOptions {
  double target = 0.85, min_accuracy = 0.6;  // fractions
  int workers = 1;
  bool shared_memory = false;  // thread ranks: nothing crosses loopback (their own count, `peer`, does)
  double parameters = 0;
};

// The table, with a CHECK FAILED line for each mode below min_accuracy or past its staleness
// bound; returns how many failed.
inline int print_async_table(const std::vector<AsyncModeResult>& results, const AsyncReportOptions& o) {
  int failures = 0;
  std::printf("\n%-8s %16s %10s %10s %10s %15s %15s\n", "mode", "time to target", "final acc", "wall time", "gradients",
              "mean staleness", "max staleness");
  for (const AsyncModeResult& r : results) {
    std::string to_target = "not reached";
    for (const AsyncPoint& p : r.points)
      if (p.accuracy >= o.target) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.1f s", p.seconds);
        to_target = buf;
        break;
      }
    const AsyncPoint& last = r.points.back();
    std::printf("%-8s %16s %9.2f%% %9.1fs %10lld %15.2f %15lld\n", r.mode.c_str(), to_target.c_str(),
                100 * last.accuracy, last.seconds, static_cast<long long>(r.gradients), r.staleness_mean,
                static_cast<long long>(r.staleness_max));
    if (last.accuracy < o.min_accuracy) {
      std::printf("CHECK FAILED: %s ends at %.2f%%, below --min-accuracy %.2f%%\n", r.mode.c_str(),
                  100 * last.accuracy, 100 * o.min_accuracy);
      ++failures;
    }
    if (r.staleness_bound >= 0 && r.staleness_max > r.staleness_bound) {
      std::printf("CHECK FAILED: %s max staleness %lld exceeds (W - 1)(2s + 1) = %lld\n", r.mode.c_str(),
                  static_cast<long long>(r.staleness_max), static_cast<long long>(r.staleness_bound));
      ++failures;
    }
  }
  std::printf("(time to target: wall time, evaluation excluded, until test accuracy >= %.1f%%)\n", 100 * o.target);
  return failures;
}

// The cost model, bytes per gradient (4 bytes x P parameters): the W workers' all-reduce moves
// 2(W-1)/W x 4P per worker and step, one gradient each; a parameter server takes 4P in (the push)
// and sends 4P back (the pull) for every gradient, whatever the number of servers (each holds a
// slice). Measured: the bytes that crossed this host's loopback interface during the sessions
// (the end-of-session gathers of the parameters included) over the gradients; for thread ranks,
// the bytes their sends and collectives copied between the ranks (ThreadComm::peer_bytes).
inline void print_async_costs(const std::vector<AsyncModeResult>& results, const AsyncReportOptions& o) {
  const double g = 4.0 * o.parameters, w = o.workers;
  std::printf("\ncost per gradient: sync 2(W-1)/W x 4P = %.1f KiB; ssp and async: push 4P + pull 4P = %.1f KiB "
              "(P = %.0f)\n", 2 * (w - 1) / w * g / 1024, 2 * g / 1024, o.parameters);
  for (const AsyncModeResult& r : results) {
    if (r.mode == "hogwild" || r.gradients == 0) continue;
    const double formula = r.mode == "sync" ? 2 * (w - 1) / w * g : 2 * g;
    const double per_gradient = (o.shared_memory ? r.peer : r.loopback) / static_cast<double>(r.gradients);
    if (o.shared_memory)
      std::printf("  %-6s %.1f KiB by formula | %.1f KiB measured between the threads' buffers (%.2fx)\n",
                  r.mode.c_str(), formula / 1024, per_gradient / 1024, per_gradient / formula);
    else
      std::printf("  %-6s %.1f KiB by formula | %.1f KiB measured on loopback (%.2fx; 0 where the backend uses shared "
                  "memory)\n", r.mode.c_str(), formula / 1024, per_gradient / 1024, per_gradient / formula);
  }
}

// The table and the costs; returns the failed checks.
inline int report_async(const std::vector<AsyncModeResult>& results, const AsyncReportOptions& o) {
  const int failures = print_async_table(results, o);
  print_async_costs(results, o);
  return failures;
}

// Every evaluation of every mode as one JSON line (empty path: none).
inline void write_async_jsonl(const std::string& path, const std::vector<AsyncModeResult>& results, std::int64_t evals,
                              int straggler_ms, int workers) {
  if (path.empty()) return;
  std::FILE* f = std::fopen(path.c_str(), "w");
  TESSERA_CHECK(f != nullptr, tessera::IoError, "09_async_sgd: cannot write '", path, "'");
  for (const AsyncModeResult& r : results)
    for (std::size_t i = 0; i < r.points.size(); ++i)
      std::fprintf(f, "{\"mode\": \"%s\", \"epoch\": %.4f, \"seconds\": %.3f, \"test_accuracy\": %.6f, "
                      "\"straggler_ms\": %d, \"workers\": %d, \"staleness_mean\": %.4f, \"staleness_max\": %lld}\n",
                   r.mode.c_str(), static_cast<double>(i + 1) / static_cast<double>(evals), r.points[i].seconds,
                   r.points[i].accuracy, straggler_ms, workers, r.staleness_mean, static_cast<long long>(r.staleness_max));
  TESSERA_CHECK(std::fclose(f) == 0, tessera::IoError, "09_async_sgd: cannot write '", path, "'");
}

// Test accuracy against wall time, one line per mode from chance (10%) at 0 s (empty path: none).
inline void plot_async(const std::string& path, const std::vector<AsyncModeResult>& results) {
  if (path.empty() || results.empty()) return;
  const std::array<std::array<std::uint8_t, 3>, 4> colours = {{{40, 90, 200}, {40, 160, 60}, {210, 50, 40}, {150, 60, 170}}};
  const char* colour_names[] = {"blue", "green", "red", "purple"};
  std::vector<Series> series;
  double x_max = 0, low = 1;
  for (std::size_t i = 0; i < results.size(); ++i) {
    Series s{results[i].mode, colours[i % 4], {}, {0.0}};
    s.y.push_back(0.1);  // chance, at time 0
    for (const AsyncPoint& p : results[i].points) {
      s.x.push_back(p.seconds);
      s.y.push_back(p.accuracy);
      x_max = std::max(x_max, p.seconds);
      low = std::min(low, p.accuracy);
    }
    series.push_back(s);
  }
  const double y_min = std::floor(std::min(low, 0.5) * 10) / 10;
  plot_xy_png(path, series, x_max, y_min, 1.0, "wall time (s)", "test accuracy");
  std::printf("\nplot: %s (test accuracy against wall time; x: 0..%.0f s, y: %.0f%%..100%%, grid every 10%%)\n",
              path.c_str(), x_max, 100 * y_min);
  for (std::size_t i = 0; i < results.size(); ++i) std::printf("  %-6s %s\n", colour_names[i % 4], results[i].mode.c_str());
}

}  // namespace examples
