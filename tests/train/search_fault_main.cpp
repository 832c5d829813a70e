// A HyperparameterSearch for tests/train/search_fault_test.py: 4 ranks as 2 groups, an
// evolutionary search (population 4, 3 generations: 12 records, 10 trained) whose synthetic trials run 30
// steps of a group all_reduce (as data parallelism does) 20 ms apart, so that a rank can be
// killed while one runs.
//
//   search_fault_<backend> LOG MARKERS [--diverge=G]
//
// LOG: the search's JSON-lines log (fresh each run). MARKERS: a directory where every rank
// writes, when it starts a trial, the file "group<g>.trial<k>.rank<r>" (k: the group's k-th
// trial, from 1) holding its process id, which the test waits for before it kills that rank.
// --diverge=G: the first trial group G runs reports a NaN loss (the same trial, trial 1 for
// G = 1, in every run: round 0 hands trial g to group g), the reference a killed rank's run must
// equal. Prints "best trial <id> score <score>" on rank 0 and "rank <r> done: <n> records,
// group retired: yes|no" on every rank that finishes; exit status as tests/comm/program.hpp's.
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/program.hpp"
#include "tessera/train/search.hpp"

int main(int argc, char** argv) {
  using namespace tessera;
  if (argc < 3 || (argc == 4 && std::strncmp(argv[3], "--diverge=", 10) != 0) || argc > 4) {
    std::fprintf(stderr, "usage: %s LOG MARKERS [--diverge=G]\n", argv[0]);
    return 2;
  }
  const std::string log = argv[1], markers = argv[2];
  const int diverge = argc == 4 ? std::atoi(argv[3] + 10) : -1;
  return testing::run_ranks([&](testing::TestComm& world) {
    SearchSpace space;
    space.add("lr", 1e-4, 1.0, SearchScale::Log).add("momentum", 0.0, 0.99);
    HyperparameterSearch search(world,
                                {.groups = 2, .strategy = SearchStrategy::Evolution,
                                 .evolution = {.population = 4, .generations = 3, .tournament_size = 2, .elitism = 1},
                                 .seed = 7, .log_path = log},  // rank 0 writes it
                                space);
    int started = 0;  // trials this rank's group has started
    const auto records = search.run([&](const TrialConfig& c, testing::TestComm& group, TrialReport& report) {
      ++started;
      const std::string marker = markers + "/group" + std::to_string(search.group_index()) + ".trial" +
                                 std::to_string(started) + ".rank" + std::to_string(world.rank());
      std::ofstream(marker) << getpid() << "\n";
      // Peak at lr = 0.01, momentum = 0.9; every rank of the group adds the same share.
      const double a = std::log10(c.at("lr")) + 2.0, b = c.at("momentum") - 0.9;
      std::vector<double> score = {0.0};
      for (int step = 0; step < 30; ++step) {
        score[0] = (1.0 - a * a - 4 * b * b) / group.size();
        group.all_reduce(std::span<double>(score), ReduceOp::Sum);
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      const bool nan = search.group_index() == diverge && started == 1;
      report.epoch({{"loss", nan ? std::nan("") : 1.0 - score[0]}});
      return score[0];
    });
    if (world.rank() == 0) {
      const TrialRecord* best = search.best();
      std::printf("best trial %lld score %.17g\n", best ? static_cast<long long>(best->id) : -1LL,
                  best ? best->score : std::nan(""));
    }
    std::printf("rank %d done: %zu records, group retired: %s\n", world.rank(), records.size(),
                search.group_retired() ? "yes" : "no");
    std::fflush(stdout);
    return 0;
  });
}
