// 10_hyperparameter_search: an evolutionary search over learning rate, momentum and weight decay
// for LeNet-5 on Fashion-MNIST, spread over groups of ranks. With 4 ranks and --groups=2, two
// groups of two train two trials at a time, each data-parallel inside its group.
//
//   build/examples/10_hyperparameter_search_threads --ranks=4 --groups=2
//   mpirun -n 4 build/examples/10_hyperparameter_search_mpi --groups=2
//   tools/tessera-run -n 4 build/examples/10_hyperparameter_search_gloo --groups=2
//
// The search trains on the first --limit training images minus the last --validation, scores each
// trial by accuracy on those --validation held-out images, and logs every trial to --log (JSON
// lines; rerun with the same flags to resume after a crash). Afterwards the two groups retrain,
// with the same budget (--epochs, same data, same seed), the default configuration (plain SGD:
// lr 0.01, no momentum, no weight decay, torch.optim.SGD's usual starting point) and the best
// configuration found, and compare them on the 10,000 test images, which the search never saw.
// Prints each generation's best and median validation accuracy, plots them (--plot), and checks
// itself: the best found must beat the default on the test set, else exit 1.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "common/accuracy.hpp"
#include "common/fashion_mnist_data.hpp"
#include "common/png_plot.hpp"
#include "tessera/build_env.hpp"
#include "tessera/tessera.hpp"

using namespace tessera;

namespace {

using E = BuildEnv;  // CpuThreads, CpuMpi or CpuGloo: chosen by the build, nowhere else
using Comm = E::Comm;

struct Options {
  std::int64_t epochs = 2, batch = 64, limit = 20000, validation = 5000;
  int groups = 2, ranks = 4, threads = 1, population = 8, generations = 4, tournament = 3, elitism = 1;
  double crossover = 0.5, mutation = 0.3;
  std::uint64_t seed = 1;
  std::string data_dir, log = "10_hyperparameter_search.jsonl", plot = "10_hyperparameter_search.png";
};

// Trains LeNet-5 with `config` data-parallel over `group` for o.epochs; reports per-epoch training
// loss and `eval_set` accuracy; returns the final accuracy. Every rank of the group returns the same.
double train_trial(const TrialConfig& config, Comm& group, TrialReport& report, const Options& o,
                   const Dataset& train_set, const Dataset& eval_set, const char* eval_name) {
  auto model = lenet5<E>(1, 28, 10, report.seed);
  DataParallel dp(model, group);
  Sgd<E> sgd(dp.parameters(), {.lr = config.at("lr"), .momentum = config.at("momentum"),
                               .weight_decay = config.at("weight_decay"), .decay_norm_and_bias = false});
  const std::int64_t per_rank = o.batch / group.size();  // run() refused a batch the group cannot split
  DataLoader<float> loader(train_set, {.batch_size = per_rank, .shuffle = true, .seed = report.seed,
                                       .drop_last = true, .rank = group.rank(), .world_size = group.size()});
  DataLoader<float> eval_loader(eval_set, {.batch_size = 1000, .shuffle = false});
  CrossEntropyLoss<E> loss;
  typename LeNet5<E>::Cache cache;
  typename CrossEntropyLoss<E>::Cache loss_cache;
  Batch<float> batch;
  double acc = 0;
  for (std::int64_t epoch = 0; epoch < o.epochs; ++epoch) {
    loader.start_epoch(epoch);
    double loss_sum = 0;
    std::int64_t steps = 0;
    while (loader.next(batch)) {
      sgd.zero_grad();
      const double l = loss.forward(model.forward(batch.images, cache), batch.labels, loss_cache);
      model.backward(loss.backward(loss_cache), cache);
      sgd.step();
      loss_sum += l;  // a NaN here stays in the mean: the search records the trial as diverged
      ++steps;
    }
    std::vector<double> mean_loss = {loss_sum / static_cast<double>(std::max<std::int64_t>(steps, 1))};
    group.all_reduce(std::span<double>(mean_loss), ReduceOp::Avg);
    acc = examples::accuracy(model, eval_loader);  // identical replicas: every rank gets the same
    report.epoch({{"epoch", static_cast<double>(epoch + 1)}, {"train_loss", mean_loss[0]}, {eval_name, acc}});
    if (!std::isfinite(mean_loss[0])) break;  // the same on every rank of the group (all-reduced)
  }
  return acc;
}

int run(Comm& world, const Options& o) {
  // Every group trains with --batch split evenly over its ranks, or the run is refused here, before
  // the data is read: never silently rounded (64 over 3 ranks is not 21 each).
  TESSERA_CHECK(world.size() % o.groups == 0, ArgumentError, world.size(),
                " ranks do not form --groups=", o.groups, " groups of equal size");
  const int group_size = world.size() / o.groups;
  TESSERA_CHECK(o.batch % group_size == 0, ArgumentError, "--batch=", o.batch,
                " (each trial's global batch) must be divisible by the ", group_size, " ranks of a group (",
                world.size(), " ranks / --groups=", o.groups, ")");
  Cpu::set_num_threads(o.threads);
  auto [full_train, test_set] = examples::load_normalized_fashion_mnist(o.data_dir, o.limit);
  const std::int64_t n = static_cast<std::int64_t>(full_train.labels.size());
  TESSERA_CHECK(o.validation > 0 && o.validation < n, ArgumentError, "10_hyperparameter_search: --validation=",
                o.validation, " must be between 1 and the ", n, " training images minus one");
  const Dataset search_train = subset(full_train, 0, n - o.validation);
  const Dataset validation = subset(full_train, n - o.validation, n);
  const bool chief = world.rank() == 0;

  SearchSpace space;
  space.add("lr", 1e-3, 0.5, SearchScale::Log).add("momentum", 0.0, 0.99).add("weight_decay", 1e-6, 1e-2, SearchScale::Log);
  HyperparameterSearch search(world,
                              {.groups = o.groups, .strategy = SearchStrategy::Evolution,
                               .evolution = {.population = o.population, .generations = o.generations,
                                             .tournament_size = o.tournament, .crossover = o.crossover,
                                             .mutation = o.mutation, .elitism = o.elitism},
                               .seed = o.seed, .log_path = o.log,
                               // What else decides a trial's score: a log of other settings is refused.
                               .settings = detail::cat("epochs=", o.epochs, " batch=", o.batch, " limit=", o.limit,
                                                       " validation=", o.validation, " ranks_per_trial=",
                                                       world.size() / o.groups)},
                              space);
  if (chief)
    std::printf("10_hyperparameter_search: LeNet-5, %d ranks as %d groups, population %d x %d generations, "
                "%lld epochs per trial on %lld images, scored on %lld held-out images\n",
                world.size(), o.groups, o.population, o.generations, static_cast<long long>(o.epochs),
                static_cast<long long>(search_train.labels.size()), static_cast<long long>(o.validation));
  const auto start = std::chrono::steady_clock::now();
  const auto records = search.run([&](const TrialConfig& c, Comm& group, TrialReport& report) {
    const double acc = train_trial(c, group, report, o, search_train, validation, "val_accuracy");
    if (group.rank() == 0)
      std::printf("  trial (group %d)  lr %.4g  momentum %.3f  weight_decay %.3g  ->  val accuracy %.2f%%\n",
                  search.group_index(), c.at("lr"), c.at("momentum"), c.at("weight_decay"), 100 * acc);
    return acc;
  });
  const double search_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const TrialRecord* best = search.best();
  TESSERA_CHECK(best != nullptr, Error, "10_hyperparameter_search: every trial failed");

  // Same budget, held-out test set: group 0 retrains the default, the last group the best found.
  const TrialConfig default_config = {{"lr", 0.01}, {"momentum", 0.0}, {"weight_decay", 0.0}};
  const int g = search.group_index();
  std::vector<double> test_acc(2, 0.0);
  for (int which = 0; which < 2; ++which) {
    if ((which == 0 && g != 0) || (which == 1 && g != o.groups - 1)) continue;
    TrialReport report;
    report.seed = o.seed;
    const double acc = train_trial(which == 0 ? default_config : best->config, search.group(), report, o,
                                   search_train, test_set, "test_accuracy");
    if (search.group().rank() == 0) test_acc[static_cast<std::size_t>(which)] = acc;
  }
  world.all_reduce(std::span<double>(test_acc), ReduceOp::Max);
  if (!chief) return 0;

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
  std::printf("\nsearch: %zu trials in %.1f s (log: %s)\n", records.size(), search_seconds,
              o.log.empty() ? "none" : o.log.c_str());
  std::printf("best found: lr %.4g, momentum %.3f, weight_decay %.3g (trial %lld, val accuracy %.2f%%)\n",
              best->config.at("lr"), best->config.at("momentum"), best->config.at("weight_decay"),
              static_cast<long long>(best->id), 100 * best->score);
  std::printf("\nsame budget (%lld epochs), held-out test set:\n", static_cast<long long>(o.epochs));
  std::printf("  default (lr 0.01, momentum 0, weight_decay 0)  %.2f%%\n", 100 * test_acc[0]);
  std::printf("  best found                                     %.2f%%  (%+.2f points)\n", 100 * test_acc[1],
              100 * (test_acc[1] - test_acc[0]));
  if (!o.plot.empty()) {
    double low = 1;
    for (double m : medians)
      if (std::isfinite(m)) low = std::min(low, m);
    const double y_min = std::floor(std::min(low, 0.5) * 10) / 10;
    examples::plot_png(o.plot, {{"best", {210, 50, 40}, bests}, {"median", {40, 90, 200}, medians}}, y_min, 1.0);
    std::printf("\nplot: %s (validation accuracy per generation; x: generations 1..%zu, y: %.0f%%..100%%; red best, "
                "blue median)\n",
                o.plot.c_str(), bests.size(), 100 * y_min);
  }
  if (!(test_acc[1] > test_acc[0])) {
    std::printf("CHECK FAILED: the best configuration found does not beat the default on the test set\n");
    return 1;
  }
  return 0;
}

Options parse(int argc, char** argv) {
  Flags flags(argc, argv);
  Options o;
  o.epochs = flags.get("epochs", o.epochs, {.min = 1});
  o.batch = flags.get("batch", o.batch, {.min = 1});  // per trial, split over the ranks of its group
  o.limit = flags.get("limit", o.limit, {.min = 0});
  o.validation = flags.get("validation", o.validation, {.min = 1});  // and below the training images: run()
  o.groups = flags.get("groups", o.groups, {.min = 1});
  o.ranks = flags.ranks("ranks", o.ranks, !SharedMemoryCommunicator<Comm>);
  o.threads = flags.threads("threads", o.threads);
  // Ranks of the threads build share this process's cores (a process backend runs one rank here).
  check_thread_budget(SharedMemoryCommunicator<Comm> ? o.ranks : 1, "--ranks", o.threads, "--threads");
  o.population = flags.get("population", o.population, {.min = 2});
  o.generations = flags.get("generations", o.generations, {.min = 1});
  o.tournament = flags.get("tournament", o.tournament, {.min = 1});
  o.elitism = flags.get("elitism", o.elitism, {.min = 0});
  o.crossover = flags.get("crossover", o.crossover, {.min = 0, .max = 1});  // probabilities
  o.mutation = flags.get("mutation", o.mutation, {.min = 0, .max = 1});
  o.seed = static_cast<std::uint64_t>(flags.get("seed", std::int64_t{1}));
  o.data_dir = flags.get("data-dir", std::string());
  o.log = flags.output_path("log", o.log);
  o.plot = flags.output_path("plot", o.plot);
  flags.finish();
  TESSERA_CHECK(o.elitism < o.population, ArgumentError, "--elitism=", o.elitism,
                " must be below --population=", o.population, " (the elite are carried over unchanged)");
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    int status = 0;
    launch<E>([&](Comm& comm) {
      const int s = run(comm, o);
      if (s != 0) status = s;
    }, {.ranks = o.ranks});
    return status;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "10_hyperparameter_search: %s\n", e.what());
    return 1;
  }
}
