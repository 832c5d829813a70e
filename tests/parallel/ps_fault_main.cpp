// A parameter server whose worker is killed (tests/comm/fault_test.py, scenario "ps"): rank 0
// serves asynchronously, ranks 1 and 2 push and pull in a long loop. After every rank printed
// "rank R ready pid P", the test kills rank 1; the server must stop with a CommError that names
// rank 1 instead of waiting for it forever.
#include <unistd.h>

#include <cstdio>

#include "comm/program.hpp"
#include "tessera/models/mlp.hpp"
#include "tessera/optim/sgd.hpp"
#include "tessera/parallel/parameter_server.hpp"

int main() {
  using namespace tessera;
  using E = Env<Cpu, testing::TestComm, float>;
  return testing::run_ranks([&](testing::TestComm& comm) {
    Mlp<E> model(16, {32}, 4, 3);
    ParameterServer ps(model, comm, {.staleness_bound = ParameterServerOptions::kAsynchronous});
    auto ready = [&] {
      std::printf("rank %d ready pid %d\n", comm.rank(), static_cast<int>(getpid()));
      std::fflush(stdout);
    };
    if (ps.is_server()) {
      Sgd<E> sgd(ps.server_parameters(), {.lr = 0.01});
      ready();
      ps.serve(sgd);  // never ends on its own: the workers loop until killed
      return 0;
    }
    ps.pull();
    ready();
    for (long step = 0; step < 100000000; ++step) ps.push_pull();  // bounded, far beyond the test
    ps.done();
    return 0;
  });
}
