// The main() of a self-checking example: parses its flags (parse(argc, argv) -> options with a
// `ranks` field), runs check(comm, options) on its ranks and returns rank 0's verdict as the
// exit status.
// Rank 0's, because other ranks may test the same weights with their own BatchNorm statistics
// and print nothing; a process backend's launcher (mpirun, tessera-run) fails when rank 0's
// process does. `check(comm)` returns 0 (claim holds) or 1; an exception is reported as
// "<name>: <what>" and gives 1, whether thrown while parsing or while running.
#pragma once

#include <atomic>
#include <cstdio>
#include <exception>

#include "tessera/comm/launch.hpp"

namespace examples {

template <class E, class Parse, class Check>
int run_checked(const char* name, int argc, char** argv, Parse parse, Check check) {
  try {
    const auto options = parse(argc, argv);
    std::atomic<int> status{0};
    tessera::launch<E>([&](typename E::Comm& comm) {
      const int s = check(comm, options);
      if (comm.rank() == 0) status.store(s);
    }, {.ranks = options.ranks});  // ranks: the threads build only; a process backend has its launcher's
    return status.load();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
    return 1;
  }
}

}  // namespace examples
