// Two strategies that each own the micro-batch loop cannot stack: a step has one loop.
// expect: Tessera strategy stack: two strategies own the micro-batch loop
// expect: GradientAccumulation
// max-lines: 16
#include "tessera/tessera.hpp"

int main() {
  using namespace tessera;
  GradientAccumulation<CpuLocal> by_two(2), by_four(4);
  auto both = stack(by_two, by_four);
}
