// What example 10 (hyper-parameter search) does after the search, kept out of its main: the
// default and the best configuration retrained on the held-out test set, and the chief's summary
// (each generation's best and median, the comparison, the plot) with the check.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/png_plot.hpp"
#include "tessera/tessera.hpp"

namespace examples {

// The training set without its last `validation` images, and those images: the search scores its
// trials on data it never trains on (and never on the test set).
inline std::pair<tessera::Dataset, tessera::Dataset> hold_out(const tessera::Dataset& train, std::int64_t validation) {
  const std::int64_t n = train.size();
  TESSERA_CHECK(validation > 0 && validation < n, tessera::ArgumentError, "10_hyperparameter_search: --validation=",
                validation, " must be between 1 and the ", n, " training images minus one");
  return {tessera::subset(train, 0, n - validation), tessera::subset(train, n - validation, n)};
}

// Same budget, held-out test set: group 0 retrains the default, the last group the best found.
// Returns {default's, best's} test accuracy on every rank.
template <class Comm, class Search, class TrainTrial>
std::vector<double> retrain_on_test(Comm& world, Search& search, const tessera::TrialConfig& best, int groups,
                                    std::uint64_t seed, TrainTrial train_trial) {
  using namespace tessera;
  const TrialConfig default_config = {{"lr", 0.01}, {"momentum", 0.0}, {"weight_decay", 0.0}};
  const int g = search.group_index();
  std::vector<double> test_acc(2, 0.0);
  // A retired group means a dead rank: the world cannot reduce any more, so the coordinator's
  // group (group 0, world rank 0 prints) retrains both on its own, if it is whole.
  const bool degraded = search.any_group_retired();
  if (degraded && (g != 0 || search.group_retired())) return test_acc;
  for (int which = 0; which < 2; ++which) {
    if (!degraded && ((which == 0 && g != 0) || (which == 1 && g != groups - 1))) continue;
    TrialReport report;
    report.seed = seed;
    const double acc = train_trial(which == 0 ? default_config : best, search.group(), report);
    if (search.group().rank() == 0) test_acc[static_cast<std::size_t>(which)] = acc;
  }
  if (!degraded) world.all_reduce(std::span<double>(test_acc), ReduceOp::Max);
  return test_acc;
}

// The chief's summary: each generation's best and median, the best configuration found, both
// retrained on the held-out test set, and the plot. Returns 1 unless the best beats the default.
template <class Search>
int report_search(Search& search, const tessera::TrialRecord& best, const std::vector<double>& test_acc,
                  std::int64_t epochs, const std::string& plot) {
  std::printf("\n%-12s %14s %14s %10s\n", "generation", "best val acc", "median val acc", "failed");
  std::vector<double> bests, medians;
  for (const auto& gen : search.generations()) {
    int failed = 0;
    for (const auto& t : gen.trials) failed += t.failed;
    bests.push_back(gen.best());
    medians.push_back(gen.median());
    std::printf("%-12lld %13.2f%% %13.2f%% %10d\n", static_cast<long long>(gen.index + 1), 100 * gen.best(),
                100 * gen.median(), failed);
  }
  std::printf("best found: lr %.4g, momentum %.3f, weight_decay %.3g (trial %lld, val accuracy %.2f%%)\n",
              best.config.at("lr"), best.config.at("momentum"), best.config.at("weight_decay"),
              static_cast<long long>(best.id), 100 * best.score);
  std::printf("\nsame budget (%lld epochs), held-out test set:\n", static_cast<long long>(epochs));
  std::printf("  default (lr 0.01, momentum 0, weight_decay 0)  %.2f%%\n", 100 * test_acc[0]);
  std::printf("  best found                                     %.2f%%  (%+.2f points)\n", 100 * test_acc[1],
              100 * (test_acc[1] - test_acc[0]));
  if (!plot.empty()) {
    double low = 1;
    for (double m : medians)
      if (std::isfinite(m)) low = std::min(low, m);
    const double y_min = std::floor(std::min(low, 0.5) * 10) / 10;
    examples::plot_png(plot, {{"best", {210, 50, 40}, bests}, {"median", {40, 90, 200}, medians}}, y_min, 1.0,
                       "generation", "validation accuracy");
    std::printf("\nplot: %s (validation accuracy per generation; x: generations 1..%zu, y: %.0f%%..100%%; red best, "
                "blue median)\n", plot.c_str(), bests.size(), 100 * y_min);
  }
  if (!(test_acc[1] > test_acc[0])) {
    std::printf("CHECK FAILED: the best configuration found does not beat the default on the test set\n");
    return 1;
  }
  return 0;
}

}  // namespace examples
