// NCCL conformance with the unique id through tessera-run's file store (see conformance_nccl.hpp).
#include "cuda/conformance_nccl.hpp"

int main(int argc, char** argv) {
  using namespace tessera;
  return testing::run_nccl_conformance(argc, argv, "id through the file store", [] { return NcclComm::from_env(); },
                                       /*from_env=*/true);
}
