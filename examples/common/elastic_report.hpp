// What example 19 (elastic data parallelism) prints and checks around its training, kept out of
// its main: the cost model of a membership change, and the end of the run (every member's
// parameters bit-identical, the final accuracy, each change with its times).
#pragma once

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <span>
#include <vector>

#include "common/data_parallel_report.hpp"
#include "tessera/tessera.hpp"
#include "tessera/train/elastic.hpp"

namespace examples {

// What a membership change costs, from the model's size: the heal broadcasts parameters and
// optimizer state (SGD momentum: as many values again), from one member or, with ZeRO-1's shards,
// shard by shard from the members holding them.
inline void print_elastic_cost_model(std::int64_t parameters, double timeout, bool sharded) {
  std::printf("cost of a change: detection (a dead process: its connections reset, ~1 ms; a stopped one: the "
              "timeout, %.0f s) + check-in through the store + a new Gloo mesh + the heal, %.2f MB broadcast %s "
              "(%lld parameters and as many momentum values)\n", timeout,
              2.0 * static_cast<double>(parameters) * sizeof(float) / 1e6,
              sharded ? "shard by shard from the members holding them" : "from one member",
              static_cast<long long>(parameters));
}

// The self-check at the end: every member's parameters bit-identical (one all_gather of a
// checksum), then rank 0 prints the final line and each change. Throws if they differ, or if the
// accuracy is below min_accuracy (> 0).
template <class Group, class Model>
void report_elastic_end(Group& group, Model& model, const std::vector<tessera::EpochResult>& results,
                        const std::vector<tessera::ElasticEvent>& events, double min_accuracy) {
  auto& comm = group.comm();
  const auto mine = static_cast<std::int64_t>(parameter_checksum(model));
  std::vector<std::int64_t> all(static_cast<std::size_t>(comm.size()));
  comm.all_gather(std::span<const std::int64_t>(&mine, 1), std::span<std::int64_t>(all));
  for (const auto other : all)
    TESSERA_CHECK(other == mine, tessera::Error, "19_elastic: the members' parameters differ at the end");
  const double accuracy = results.empty() ? 0.0 : results.back().test_accuracy;
  if (comm.rank() == 0) {
    std::printf("final: %d ranks (generation %lld, %zu change(s)), test accuracy %.2f%%, replicas identical "
                "(%016" PRIx64 ")\n", comm.size(), static_cast<long long>(group.generation()), group.history().size(),
                100 * accuracy, static_cast<std::uint64_t>(mine));
    for (const auto& e : events)
      std::printf("change: generation %lld at step %lld, %d -> %d ranks, membership %.3f s, heal %.3f s\n",
                  static_cast<long long>(e.change.generation), static_cast<long long>(e.healed_step),
                  e.change.size_before, e.change.size_after, e.change.seconds, e.heal_seconds);
  }
  TESSERA_CHECK(min_accuracy <= 0 || results.empty() || accuracy >= min_accuracy, tessera::Error, "19_elastic: test "
                "accuracy ", accuracy, " is below --min-accuracy=", min_accuracy);
}

}  // namespace examples
