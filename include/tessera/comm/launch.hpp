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

namespace tessera {

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
    fn(comm);
  }
}

}  // namespace tessera
