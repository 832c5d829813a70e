// NCCL moves GPU memory only: an Env pairing it with the CPU device is refused.
// expect: NcclComm moves GPU memory only
// expect: CudaNccl
#include "tessera/comm/nccl.hpp"
#include "tessera/models/lenet.hpp"

int main() {
  using E = tessera::Env<tessera::Cpu, tessera::NcclComm, float>;
  auto model = tessera::lenet5<E>(1, 28, 10, 1);
}
