// Elastic groups: a data-parallel group that loses a rank (killed, stopped past the timeout, cut
// off) or gains one (a replacement) between two steps, without restarting the processes that stay
// (torchft's per-step quorum, where TorchElastic stops and restarts every worker).
//
// A backend that can do it provides a group type (GlooElasticGroup over Gloo's rendezvous store,
// ThreadElasticGroup over a hub in memory)
// and names it with ElasticGroupFor<Comm>. The group holds the communicator of its current
// generation and changes it in two ways:
//
//   g.reform(cause)      after a collective threw CommError: the survivors check in through the
//                        store, agree on the new membership (the first surviving member in the old
//                        order decides; the others follow the store), and connect a new
//                        communicator at generation + 1; a member that is dead, or that does not
//                        check in within ElasticOptions::settle, is left out
//   g.growth_due(step)   at a step boundary: whether replacements wait and the members agreed to
//   g.grow(step)         admit them at this step (the same on every member), then admit them
//   g.finished(step)     (optional) the training ended: a replacement still waiting for admission
//                        stops with a CommError that says so, instead of waiting out its timeout
//
// train/elastic.hpp's ElasticTrainer drives a group: it rebuilds the strategy and loader at each
// generation and heals the state from a healthy member (a replacement gets everything from it).
//
// Groups exist for Gloo (gloo_elastic.hpp), for threads (threads_elastic.hpp: a rank that dies is a
// thread whose function threw; the process's own death ends them all) and for NCCL
// (nccl_elastic.hpp: a Gloo group agrees, each generation gets a new NcclComm; compiled, not yet
// run after a failure on GPUs). Open MPI without ULFM ends the job when a process dies (mpirun),
// so MpiComm has none.
#pragma once

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tessera {

struct ElasticOptions {
  // Fewer members than this after a failure: the group gives up (CommError), as a job must when
  // too few replicas remain to hold the global batch in memory or to finish in time.
  int min_size = 1;
  // Membership changes allowed in one run (failures and growths together): bounds a run whose
  // members keep failing.
  int max_changes = 64;
  // After a failure, how long each survivor waits, from its own check-in, for the others; a
  // member that neither checks in nor is seen dead (a process of this host that is gone, or a host
  // that refuses a connection to its status server) within it is left out: it is stopped, hung or
  // cut off. 0: twice the communicator's timeout (a survivor notices a stopped peer only when a
  // collective times out, and may wait out one more already running on its worker thread).
  std::chrono::milliseconds settle{0};
  // Every this many steps (c) the group looks in the store for replacements waiting to join; they
  // join 2c steps later. A replacement waits the comm timeout for a sign of the group (a new
  // generation, or its growth scheduled), then three timeouts more for those 2c steps.
  int join_check_every = 1;
};

// One change of membership, as every member records it.
struct MembershipChange {
  std::int64_t generation = 0;  // the new generation
  std::int64_t step = 0;        // optimizer steps taken when it happened (the heal's agreed step)
  int size_before = 0, size_after = 0;
  std::vector<std::string> left, joined;  // member ids ("<slot>.<incarnation>")
  std::string cause;                      // the error that started it, or "replacement(s) joined"
  double seconds = 0;                     // from the failure (or the growth step) to the new communicator

  // The change from members `before` to `after` (ids in rank order); seconds left to the caller.
  static MembershipChange between(std::int64_t generation, std::int64_t step, const std::vector<std::string>& before,
                                  const std::vector<std::string>& after, std::string cause) {
    MembershipChange c;
    c.generation = generation;
    c.step = step;
    c.size_before = static_cast<int>(before.size());
    c.size_after = static_cast<int>(after.size());
    const auto in = [](const std::vector<std::string>& ids, const std::string& id) {
      return std::find(ids.begin(), ids.end(), id) != ids.end();
    };
    for (const auto& m : before)
      if (!in(after, m)) c.left.push_back(m);
    for (const auto& m : after)
      if (!in(before, m)) c.joined.push_back(m);
    c.cause = std::move(cause);
    return c;
  }
};

// The elastic group of communicator type C (a backend specializes it: `using type = ...`).
template <class C>
struct ElasticGroupFor {};
template <class C>
using ElasticGroupOf = typename ElasticGroupFor<C>::type;

template <class G>
concept ElasticGroup = requires(G& g, const G& cg, const std::string& cause, std::int64_t step) {
  typename G::Comm;
  { g.comm() } -> std::same_as<typename G::Comm&>;
  g.reform(cause);
  { g.growth_due(step) } -> std::same_as<bool>;
  g.grow(step);
  { cg.generation() } -> std::convertible_to<std::int64_t>;
  { cg.joined_late() } -> std::convertible_to<bool>;
  { cg.member() } -> std::convertible_to<std::string>;
  { cg.history() } -> std::convertible_to<const std::vector<MembershipChange>&>;
};

}  // namespace tessera
