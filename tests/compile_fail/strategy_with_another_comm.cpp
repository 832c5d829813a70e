// A model built for the local Env wrapped by DataParallel over a ThreadComm: the Env picks the
// backend, so the communicator must be the Env's.
// expect: the communicator passed here is not the Env's Comm type
// expect: DataParallel
#include "tessera/tessera.hpp"

int main() {
  using namespace tessera;
  launch<CpuThreads>([](ThreadComm& comm) {
    auto model = lenet5<CpuLocal>(1, 28, 10, 1);
    DataParallel dp(model, comm);
  }, {.ranks = 2});
}
