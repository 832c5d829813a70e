// An Env whose first argument is not a device.
// expect: the first argument is not a device
#include "tessera/tessera.hpp"

int main() {
  using E = tessera::Env<int, tessera::LocalComm, float>;
  auto model = tessera::lenet5<E>(1, 28, 10, 1);
}
