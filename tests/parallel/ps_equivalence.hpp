// ParameterServer checks that run on any communicator with point-to-point (threads in the Catch
// tests, MPI and Gloo in tests/parallel/dp_main.cpp). Collective: every rank calls them; they
// return failures as text. Needs at least 2 ranks (one server, one worker).
#pragma once

#include <cmath>
#include <string>
#include <vector>

#include "parallel/dp_equivalence.hpp"
#include "tessera/optim/sgd.hpp"
#include "tessera/parallel/parameter_server.hpp"

namespace tessera::testing {

struct PsCase {
  int num_servers = 1;
  int per_worker_batch = 6;
  int steps = 3;
  int staleness_bound = 0;
  double tolerance = 1e-12;
};

// Every rank's final parameters after `steps` parameter-server steps, or the failures.
template <class S, class Comm>
std::vector<std::string> ps_train(Comm& comm, const PsCase& c, const DpData<S>& data, const SgdOptions& options,
                                  StalenessStats* staleness_out, std::vector<S>* final_values) {
  using E = Env<Cpu, Comm, S>;
  const int r = comm.rank();
  // Ranks other than 0 start from other weights: the constructor's broadcast must replace them.
  auto model = MakeLenet::make<E>(r == 0 ? 7 : 100 + static_cast<std::uint64_t>(r));
  ParameterServer ps(model, comm, {.num_servers = c.num_servers, .staleness_bound = c.staleness_bound});
  const std::int64_t b = c.per_worker_batch, global = b * ps.num_workers();
  if (ps.is_server()) {
    Sgd<E> sgd(ps.server_parameters(), options);
    const ServeResult result = ps.serve(sgd);
    if (result.gradients != static_cast<std::int64_t>(c.steps) * ps.num_workers())
      return {"server " + std::to_string(r) + " received " + std::to_string(result.gradients) + " gradients, expected " +
              std::to_string(c.steps * ps.num_workers())};
  } else {
    auto params = named_tensors(model);
    ps.pull();
    for (int step = 0; step < c.steps; ++step) {
      for (auto& [name, p] : params.parameters) p->grad.zero();
      forward_backward<S>(model, data, step * global + ps.worker_index() * b, b);
      ps.push_pull();
    }
    ps.done();
  }
  ps.gather_parameters();
  if (staleness_out) *staleness_out = ps.gather_staleness();
  if (final_values) {
    final_values->clear();
    for (auto& [name, p] : named_tensors(model).parameters)
      final_values->insert(final_values->end(), p->value.data(), p->value.data() + p->value.numel());
  }
  return {};
}

// With staleness bound 0 the parameter server is synchronous SGD: equal to one process training
// on the global batch (W workers x per_worker_batch), momentum and weight decay included.
template <class S, class Comm>
std::vector<std::string> ps_equivalence(Comm& comm, const PsCase& c) {
  using Reference = Env<Cpu, LocalComm, S>;
  const int workers = comm.size() - c.num_servers;
  const std::int64_t global = static_cast<std::int64_t>(c.per_worker_batch) * workers;
  const DpData<S> data(global * c.steps);
  const SgdOptions options{.lr = 0.05, .momentum = 0.9, .weight_decay = 5e-4};

  auto reference = MakeLenet::make<Reference>(7);
  auto reference_params = named_tensors(reference);
  Sgd<Reference> reference_sgd(reference_params, options);
  for (int step = 0; step < c.steps; ++step) {
    reference_sgd.zero_grad();
    forward_backward<S>(reference, data, step * global, global);
    reference_sgd.step();
  }
  std::vector<S> want;
  for (auto& [name, p] : reference_params.parameters)
    want.insert(want.end(), p->value.data(), p->value.data() + p->value.numel());

  std::vector<S> got;
  StalenessStats staleness;
  std::vector<std::string> failures = ps_train<S>(comm, c, data, options, &staleness, &got);
  const std::string who = "rank " + std::to_string(comm.rank()) + ": ";
  double worst = 0;
  for (std::size_t k = 0; k < want.size() && k < got.size(); ++k)
    worst = std::max(worst, std::abs(static_cast<double>(got[k]) - static_cast<double>(want[k])) /
                                std::max(1.0, std::abs(static_cast<double>(want[k]))));
  if (got.size() != want.size() || !(worst <= c.tolerance))
    failures.push_back(who + "parameters differ from one process by " + std::to_string(worst) + " (relative)");
  if (staleness.applied != static_cast<std::int64_t>(c.steps) * workers || staleness.max != 0)
    failures.push_back(who + "synchronous mode recorded " + std::to_string(staleness.applied) +
                       " gradients with max staleness " + std::to_string(staleness.max));
  return failures;
}

// Under a staleness bound s >= 1 every gradient is recorded, and none is staler than the bound
// allows: between a worker's read and its next push, each other worker pushes at most 2s + 1
// times, so staleness <= (W - 1)(2s + 1).
template <class S, class Comm>
std::vector<std::string> ps_staleness_bound(Comm& comm, PsCase c) {
  const int workers = comm.size() - c.num_servers;
  const DpData<S> data(static_cast<std::int64_t>(c.per_worker_batch) * workers * c.steps);
  StalenessStats staleness;
  std::vector<std::string> failures =
      ps_train<S>(comm, c, data, SgdOptions{.lr = 0.02, .momentum = 0.9}, &staleness, nullptr);
  const std::int64_t bound = c.staleness_bound == ParameterServerOptions::kAsynchronous
                                 ? std::numeric_limits<std::int64_t>::max()
                                 : static_cast<std::int64_t>(workers - 1) * (2 * c.staleness_bound + 1);
  if (staleness.applied != static_cast<std::int64_t>(c.steps) * workers || staleness.max > bound)
    failures.push_back("rank " + std::to_string(comm.rank()) + ": recorded " + std::to_string(staleness.applied) +
                       " gradients (expected " + std::to_string(c.steps * workers) + "), max staleness " +
                       std::to_string(staleness.max) + " (bound " + std::to_string(bound) + ")");
  return failures;
}

}  // namespace tessera::testing
