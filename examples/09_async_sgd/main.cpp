// 09_async_sgd: synchronous data parallelism against stale-synchronous and fully asynchronous
// parameter-server SGD (and lock-free Hogwild in the threads build), with one worker slowed on
// purpose. LeNet-5 on Fashion-MNIST; every mode processes the same number of batches in total.
//
//   build/examples/09_async_sgd_threads --ranks=4 --straggler-ms=20      ranks are threads
//   mpirun -n 4 build/examples/09_async_sgd_mpi --straggler-ms=20        ranks are MPI processes
//   tools/tessera-run -n 4 build/examples/09_async_sgd_gloo --straggler-ms=20
//
// Ranks [0, --servers) hold the parameters in the parameter-server modes (and idle in the others);
// the remaining W ranks are workers, each with its own shard of the training set and a batch of
// --batch images. The last worker sleeps --straggler-ms after every batch.
//
//   sync      DataParallel over the W workers: every step waits for the straggler.
//   ssp       ParameterServer, staleness bound --staleness: a worker may run that many steps ahead
//             of the slowest, then waits.
//   async     ParameterServer without a bound: nobody waits; the fast workers take more batches,
//             and the straggler's gradients arrive computed on old parameters (their staleness).
//   hogwild   threads build only: every worker writes into one shared copy without locks.
//
// Each epoch's worth of batches (training images / batch) is split into --evals sessions; after
// each, the parameters are gathered and rank `servers` measures test accuracy (outside the clock).
// Prints a table (wall time to --target accuracy, final accuracy, mean and max staleness), writes
// the points as JSON lines (--out) and plots accuracy against wall time (--plot). Checks itself:
// every mode must reach --min-accuracy and SSP must stay within its bound, else exit 1.
// --trace=trace.json records each mode's first session: trace.sync.json, trace.ssp.json, ...
// The four training loops are in modes.hpp (Runner: sync, parameter_server, hogwild); the table,
// the costs and the plot in common/async_report.hpp. This file compares them.
//
// Learning rates: sync steps with --lr on the mean of W gradients; the parameter server applies
// each gradient scaled by 1/W with the same --lr, so W arrivals move the parameters about as far as
// one synchronous step. Its momentum is lower (--ps-momentum 0.6 against --momentum 0.9): a stale
// gradient already carries the past updates, and asynchrony acts as extra momentum (Mitliagkas et
// al., "Asynchrony begets momentum", 2016); at 0.9 async fell back to chance in 2 of 12 short runs,
// at 0.6 none of 12 did (README, "Learning rates"). Hogwild is plain SGD with --hogwild-lr per gradient:
// lr / (1 - momentum) / W would match the others' long-run step, but without momentum's averaging
// that step (0.25 for 2 workers) diverges on LeNet; 0.05 is plain SGD's usual rate for it.
#include <cstdio>
#include <string>
#include <vector>

#include "09_async_sgd/modes.hpp"
#include "common/fashion_mnist_data.hpp"

using namespace async_example;

namespace {

int run(Comm& comm, const Options& o, HogwildStore<float>& store) {
  Cpu::set_num_threads(o.threads);
  const int workers = comm.size() - o.servers;
  TESSERA_CHECK(o.servers >= 1 && workers >= 1, ArgumentError, "09_async_sgd: --servers=", o.servers,
                " must leave at least one worker among ", comm.size(), " ranks");
  auto [train_set, test_set] = examples::load_normalized_fashion_mnist(o.data_dir, o.limit);
  DataLoader<float> test_loader(test_set, {.batch_size = 1000, .shuffle = false});
  const bool is_worker = comm.rank() >= o.servers, is_evaluator = comm.rank() == o.servers;
  const std::int64_t batches_per_epoch = static_cast<std::int64_t>(train_set.labels.size()) / o.batch;
  const std::int64_t session_budget = std::max<std::int64_t>(batches_per_epoch / o.evals, workers);
  Runner runner{comm, o, train_set, test_loader, store, workers, is_worker, is_evaluator, session_budget};
  if (is_evaluator)
    std::printf("09_async_sgd: LeNet-5, %d server(s) + %d workers x batch %lld, %lld epochs (%lld batches each), "
                "worker %d sleeps %d ms per batch, SSP bound %d\n",
                o.servers, workers, static_cast<long long>(o.batch), static_cast<long long>(o.epochs),
                static_cast<long long>(session_budget * o.evals), workers - 1, o.straggler_ms, o.staleness);

  std::vector<ModeResult> results;
  for (const std::string& mode : o.modes) {  // checked by parse(): each one of the four
    if (mode == "sync") {
      results.push_back(runner.sync());
    } else if (mode == "ssp") {
      results.push_back(runner.parameter_server("ssp", o.staleness));
    } else if (mode == "async") {
      results.push_back(runner.parameter_server("async", ParameterServerOptions::kAsynchronous));
    } else if (mode == "hogwild") {
      if (!SharedMemoryCommunicator<Comm>) {
        if (is_evaluator) std::printf("  [hogwild] skipped: needs ranks that share one process (threads build)\n");
        continue;
      }
      results.push_back(runner.hogwild());
    } else {
      throw ArgumentError("09_async_sgd: --modes: unknown mode '" + mode + "' (sync, ssp, async, hogwild)");
    }
  }
  if (!is_evaluator) return 0;

  auto probe = lenet5<E>(1, 28, 10, o.seed);
  const double parameters = static_cast<double>(count_parameters(named_tensors(probe)));
  const int failures = examples::report_async(results, {.target = o.target, .min_accuracy = o.min_accuracy,
                                                         .workers = workers, .shared_memory = SharedMemoryCommunicator<Comm>,
                                                         .parameters = parameters});
  examples::write_async_jsonl(o.out, results, o.evals, o.straggler_ms, workers);
  examples::plot_async(o.plot, results);
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    HogwildStore<float> store;  // shared by the ranks of this process (the threads build's Hogwild row)
    int status = 0;
    launch<E>([&](Comm& comm) {
      const int s = run(comm, o, store);
      if (s != 0) status = s;
    }, {.ranks = o.ranks});
    return status;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "09_async_sgd: %s\n", e.what());
    return 1;
  }
}
