// 10_hyperparameter_search: an evolutionary search over learning rate, momentum and weight decay
// for LeNet-5 on Fashion-MNIST, over groups of ranks: with 4 ranks and --groups=2, two groups of
// two train two trials at a time, each data-parallel inside its group.
//
//   build/examples/10_hyperparameter_search_threads --ranks=4 --groups=2
//   mpirun -n 4 build/examples/10_hyperparameter_search_mpi --groups=2
//   tools/tessera-run --elastic -n 4 build/examples/10_hyperparameter_search_gloo --groups=2   (a dead rank: README)
//
// Each trial trains with the Trainer on the first --limit images minus the last --validation and
// is scored on those; every trial is logged to --log (rerun with the same flags to resume). Then
// the default (plain SGD, lr 0.01) and the best configuration are retrained with the same budget
// and compared on the 10,000 test images, which the search never saw; the best must win, or exit
// 1 (common/search_report.hpp, with the per-generation table and --plot).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "common/fashion_mnist_data.hpp"
#include "common/rank_status.hpp"
#include "common/search_report.hpp"
#include "tessera/build_env.hpp"
#include "tessera/tessera.hpp"

using namespace tessera;

namespace {

using E = BuildEnv;  // CpuThreads, CpuMpi or CpuGloo: chosen by the build, nowhere else
using Comm = E::Comm;

struct Options {
  std::int64_t epochs = 2, batch = 64, limit = 20000, validation = 5000;
  int groups = 2, ranks = 4, threads = 1;
  EvolutionOptions evolution{.population = 8, .generations = 4, .tournament_size = 3, .crossover = 0.5,
                             .mutation = 0.3, .elitism = 1};
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
  Trainer trainer(model, sgd, dp, ConstantLr{config.at("lr")},
                  {.epochs = o.epochs, .verbose = false, .checkpoint_group = CheckpointGroup(group)});
  double acc = 0;
  for (std::int64_t epoch = 0; epoch < o.epochs; ++epoch) {
    const EpochResult r = trainer.train_epoch(loader, &eval_loader);  // the group's loss, this rank's evaluation
    acc = r.test_accuracy;  // identical replicas: every rank of the group gets the same
    report.epoch({{"epoch", static_cast<double>(r.epoch)}, {"train_loss", r.train_loss}, {eval_name, acc}});
    if (!std::isfinite(r.train_loss)) break;  // diverged: the search records the trial as such
  }
  return acc;
}

int run(Comm& world, const Options& o) {
  // --batch splits evenly over a group's ranks, or is refused before the data is read.
  TESSERA_CHECK(world.size() % o.groups == 0, ArgumentError, world.size(),
                " ranks do not form --groups=", o.groups, " groups of equal size");
  const int group_size = world.size() / o.groups;
  TESSERA_CHECK(o.batch % group_size == 0, ArgumentError, "--batch=", o.batch,
                " (each trial's global batch) must be divisible by the ", group_size, " ranks of a group (",
                world.size(), " ranks / --groups=", o.groups, ")");
  Cpu::set_num_threads(o.threads);
  const examples::FashionMnist data = examples::load_normalized_fashion_mnist(o.data_dir, o.limit);
  const auto held_out = examples::hold_out(data.train, o.validation);  // named, not bound: the lambdas capture them
  const Dataset &search_train = held_out.first, &validation = held_out.second, &test_set = data.test;
  SearchSpace space;
  space.add("lr", 1e-3, 0.5, SearchScale::Log).add("momentum", 0.0, 0.99).add("weight_decay", 1e-6, 1e-2, SearchScale::Log);
  HyperparameterSearch search(world,
                              {.groups = o.groups, .strategy = SearchStrategy::Evolution, .evolution = o.evolution,
                               .seed = o.seed, .log_path = o.log,
                               // What else decides a trial's score: a log of other settings is refused.
                               .settings = detail::cat("epochs=", o.epochs, " batch=", o.batch, " limit=", o.limit,
                                                       " validation=", o.validation, " ranks_per_trial=",
                                                       world.size() / o.groups)},
                              space);
  if (world.rank() == 0)
    std::printf("10_hyperparameter_search: LeNet-5, %d ranks as %d groups, population %d x %d generations, "
                "%lld epochs per trial on %lld images, scored on %lld held-out images\n",
                world.size(), o.groups, o.evolution.population, o.evolution.generations, static_cast<long long>(o.epochs),
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

  const std::vector<double> test_acc = examples::retrain_on_test(
      world, search, best->config, o.groups, o.seed, [&](const TrialConfig& c, Comm& group, TrialReport& report) {
        return train_trial(c, group, report, o, search_train, test_set, "test_accuracy");
      });
  if (world.rank() != 0) return 0;
  std::printf("\nsearch: %zu trials in %.1f s (log: %s)\n", records.size(), search_seconds,
              o.log.empty() ? "none" : o.log.c_str());
  return examples::report_search(search, *best, test_acc, o.epochs, o.plot);
}

Options parse(int argc, char** argv) {
  Flags flags(argc, argv);
  Options o;
  o.epochs = flags.get("epochs", o.epochs, {.min = 1}, "passes over the training images, per trial");
  o.batch = flags.get("batch", o.batch, {.min = 1}, "images per step of a trial, split over its group's ranks");
  o.limit = flags.get("limit", o.limit, {.min = 0}, "training images used, validation included (0: all 60,000)");
  o.validation = flags.get("validation", o.validation, {.min = 1},  // and below the training images: run()
                           "last training images held out to score the trials");
  o.groups = flags.get("groups", o.groups, {.min = 1}, "groups of ranks, each training one trial at a time");
  o.ranks = flags.ranks("ranks", o.ranks, !SharedMemoryCommunicator<Comm>, "ranks in all, split into the groups");
  o.threads = flags.threads("threads", o.threads, "OpenMP threads per rank");
  // Ranks of the threads build share this process's cores (a process backend runs one rank here).
  check_thread_budget(SharedMemoryCommunicator<Comm> ? o.ranks : 1, "--ranks", o.threads, "--threads");
  EvolutionOptions& e = o.evolution;
  e.population = flags.get("population", e.population, {.min = 2}, "configurations per generation");
  e.generations = flags.get("generations", e.generations, {.min = 1}, "generations of the evolutionary search");
  e.tournament_size =
      flags.get("tournament", e.tournament_size, {.min = 1}, "a parent is the best of this many random picks");
  e.elitism = flags.get("elitism", e.elitism, {.min = 0}, "best configurations carried over unchanged");
  e.crossover = flags.get("crossover", e.crossover, {.min = 0, .max = 1},  // probabilities
                          "probability that a child mixes two parents");
  e.mutation = flags.get("mutation", e.mutation, {.min = 0, .max = 1}, "per-hyperparameter mutation probability");
  o.seed = static_cast<std::uint64_t>(flags.get("seed", std::int64_t{1}, "seed of the search and its trials"));
  o.data_dir = flags.get("data-dir", std::string(), "Fashion-MNIST directory (empty: the default locations)");
  o.log = flags.output_path("log", o.log, "one JSON line per trial, also what a rerun resumes from");
  o.plot = flags.output_path("plot", o.plot, "best and median validation accuracy per generation, as a PNG");
  flags.finish();
  TESSERA_CHECK(e.elitism < e.population, ArgumentError, "--elitism=", e.elitism,
                " must be below --population=", e.population, " (the elite are carried over unchanged)");
  return o;
}

}  // namespace

int main(int argc, char** argv) { return examples::run_checked<E>("10_hyperparameter_search", argc, argv, parse, run); }
