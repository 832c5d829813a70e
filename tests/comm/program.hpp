// The frame of a multi-rank test program, built once per backend from one source (tests/meson.build
// passes the backend's TESSERA_ENV pair; see tessera/build_env.hpp): opens BuildEnv's
// communicator the way launch<E> does for that backend and runs body(comm) on every rank.
//
// Exit status: the largest status any rank's body returned; 3 after a CommError (a dead, stalled or
// mismatched peer: tests/comm/fault_test.py reads the status and the "rank R: CommError: ..."
// line); 1 after any other error.
#pragma once

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>

#include "tessera/build_env.hpp"
#include "tessera/core/error.hpp"

namespace tessera::testing {

using TestEnv = BuildEnv;
using TestComm = BuildEnv::Comm;

inline const char* backend_name() { return TestComm::backend_name; }

// --ranks=N from the command line: how many ranks a backend that spawns its own (threads) starts;
// backends whose ranks a launcher started (mpirun, tessera-run) ignore it.
inline LaunchOptions launch_options(int argc, char** argv) {
  LaunchOptions options;
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], "--ranks=", 8) == 0) options.ranks = std::atoi(argv[i] + 8);
  return options;
}

template <class Body>
int run_ranks(Body body, const LaunchOptions& options = {}) {
  std::atomic<int> status{0};
  // This process's rank when it holds exactly one (mpirun, tessera-run); -1 while its communicator
  // is not open, or when the ranks are threads here (then the error text names the rank).
  std::atomic<int> my_rank{-1};
  auto raise = [&](int s) {
    int seen = status.load();
    while (s > seen && !status.compare_exchange_weak(seen, s)) {
    }
  };
  try {
    launch<TestEnv>(
        [&](TestComm& comm) {
          my_rank = comm.size() > 1 && options.ranks > 1 ? -1 : comm.rank();
          raise(body(comm));
        },
        options);
  } catch (const CommError& e) {
    std::fprintf(stderr, "rank %d: CommError: %s\n", my_rank.load(), e.what());
    std::fflush(stderr);
    return 3;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: error: %s\n", my_rank.load(), e.what());
    return 1;
  }
  return status.load();
}

}  // namespace tessera::testing
