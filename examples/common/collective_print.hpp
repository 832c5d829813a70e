// Printing and checking a collective's result in example 03: every rank's values gathered to
// rank 0, which prints one line each (output from several processes would interleave otherwise),
// and a check that every rank makes of its own result, the failures summed to rank 0.
#pragma once

#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "tessera/comm/communicator.hpp"

namespace examples {

inline int failures = 0;  // counted on rank 0 (threads: only rank 0 writes it)

// Gathers every rank's `values` (same length on all) to all ranks; rank 0 prints one line each.
template <class Comm>
void print_all(Comm& comm, const char* label, const std::vector<float>& values) {
  std::vector<float> all(values.size() * static_cast<std::size_t>(comm.size()));
  comm.all_gather(std::span<const float>(values), std::span<float>(all));
  if (comm.rank() != 0) return;
  std::printf("  %-7s", label);
  for (int r = 0; r < comm.size(); ++r) {
    std::printf(" rank %d: [", r);
    for (std::size_t i = 0; i < values.size(); ++i) std::printf(i ? " %g" : "%g", all[r * values.size() + i]);
    std::printf("]");
  }
  std::printf("\n");
}

// Every rank checks its own result; the failures are summed so rank 0 can report them all.
template <class Comm>
void verify(Comm& comm, const char* what, bool ok) {
  std::vector<std::int32_t> bad = {ok ? 0 : 1};
  comm.all_reduce(std::span<std::int32_t>(bad), tessera::ReduceOp::Sum);
  if (comm.rank() == 0) {
    std::printf("  %s %s\n\n", bad[0] == 0 ? "ok:" : "WRONG on", bad[0] == 0 ? what : (std::to_string(bad[0]) + " rank(s): " + what).c_str());
    failures += bad[0];
  }
}

}  // namespace examples
