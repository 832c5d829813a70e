// bfloat16 compute asks for float master weights: a float64 Env cannot have it.
// expect: Compute is the Scalar itself, or BFloat16 with Scalar float
#include "tessera/tessera.hpp"

int main() {
  using E = tessera::Env<tessera::Cpu, tessera::LocalComm, double, tessera::BFloat16>;
  auto model = tessera::lenet5<E>(1, 28, 10, 1);
}
