// launch<E>(fn, options): opens the world of the Env's communicator and runs fn(comm) on every
// rank, the one way a program starts whatever its backend:
//
//   tessera::launch<E>([&](E::Comm& comm) { train(comm); }, {.ranks = 2});
//
//   LocalComm   this process is the only rank
//   ThreadComm  spawns options.ranks threads (ranks of one process); errors on any rank stop the
//               others and are rethrown here
//   MpiComm     MPI_Init_thread (once), MPI_COMM_WORLD; finalized at exit; ranks from mpirun/srun
//   GlooComm    rendezvous through the launcher's store (TESSERA_STORE, tools/tessera-run, srun)
//   NcclComm    the unique id through the launcher's store; one GPU per rank
//
// A communicator takes part by providing `static void launch(const LaunchOptions&, Fn&&)` (for
// ranks it spawns itself) or `static C from_env(CommOptions)` (for ranks a launcher started).
#pragma once

#include <type_traits>
#include <utility>

#include "tessera/comm/options.hpp"
#include "tessera/core/error.hpp"

namespace tessera {

// options.ranks (a program's --ranks) under a launcher: 0 takes what the launcher started; any
// other count must be that (it used to be ignored, so --ranks=4 under mpirun -n 2 trained on 2).
inline void check_launched_ranks(const LaunchOptions& options, int launched, const char* backend) {
  TESSERA_CHECK(options.ranks <= 0 || options.ranks == launched, ArgumentError, "--ranks=", options.ranks, " asks for ",
                options.ranks, " ranks, but the launcher started ", launched, ": with the ", backend,
                " communicator the launcher decides (mpirun -n, tessera-run -n, srun -n); leave --ranks out or make "
                "them agree");
}

template <class E, class Fn>
void launch(Fn&& fn, const LaunchOptions& options = {}) {
  using Comm = typename E::Comm;
  if constexpr (requires { Comm::launch(options, fn); }) {
    Comm::launch(options, std::forward<Fn>(fn));
  } else {
    static_assert(requires { Comm::from_env(options.comm); },
                  "launch<E>: the Env's communicator has neither `static void launch(const LaunchOptions&, Fn&&)` "
                  "nor `static Comm from_env(CommOptions)`; add one (docs/adding-a-communicator.md)");
    auto comm = Comm::from_env(options.comm);
    check_launched_ranks(options, comm.size(), Comm::backend_name);
    fn(comm);
  }
}

}  // namespace tessera
