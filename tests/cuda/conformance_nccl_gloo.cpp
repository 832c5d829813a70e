// NCCL conformance with the unique id sent over Gloo (see conformance_nccl.hpp).
#include "cuda/conformance_nccl.hpp"
#include "tessera/comm/gloo.hpp"

int main(int argc, char** argv) {
  using namespace tessera;
  return testing::run_nccl_conformance(argc, argv, "id over Gloo", [] { return NcclComm::from(GlooComm::from_env()); },
                                       /*from_env=*/false);
}
