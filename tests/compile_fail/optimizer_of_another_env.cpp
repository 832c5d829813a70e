// An optimizer of one Env handed the parameters of a model of another.
// expect: these parts were built for different Envs
// expect: Sgd
#include "tessera/tessera.hpp"

int main() {
  using namespace tessera;
  auto model = lenet5<CpuLocal>(1, 28, 10, 1);
  Sgd<CpuThreads> sgd(named_tensors(model), {.lr = 0.1});
}
