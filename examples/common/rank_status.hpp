// Runs a self-checking example on its ranks and returns rank 0's verdict as the exit status.
// Rank 0's, because other ranks may test the same weights with their own BatchNorm statistics
// and print nothing; a process backend's launcher (mpirun, tessera-run) fails when rank 0's
// process does. `check(comm)` returns 0 (claim holds) or 1; an exception is reported as
// "<name>: <what>" and gives 1.
#pragma once

#include <atomic>
#include <cstdio>
#include <exception>

#include "tessera/comm/launch.hpp"

namespace examples {

template <class E, class Check>
int run_checked(const char* name, int ranks, Check check) {
  try {
    std::atomic<int> status{0};
    tessera::launch<E>([&](typename E::Comm& comm) {
      const int s = check(comm);
      if (comm.rank() == 0) status.store(s);
    }, {.ranks = ranks});  // ranks: the threads build only; a process backend has its launcher's
    return status.load();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
    return 1;
  }
}

}  // namespace examples
