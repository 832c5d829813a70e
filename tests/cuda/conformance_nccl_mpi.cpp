// NCCL conformance with the unique id sent over MPI (see conformance_nccl.hpp).
#include "cuda/conformance_nccl.hpp"
#include "tessera/comm/mpi.hpp"

int main(int argc, char** argv) {
  using namespace tessera;
  return testing::run_nccl_conformance(argc, argv, "id over MPI", [] { return NcclComm::from(MpiComm::world()); },
                                       /*from_env=*/false);
}
