// A type used as a communicator that lacks the collectives.
// expect: communicator: needs void barrier()
#include "tessera/comm/communicator.hpp"

struct HalfDoneComm {
  int rank() const { return 0; }
  int size() const { return 1; }
};
static_assert(tessera::check_communicator<HalfDoneComm>());

int main() {}
