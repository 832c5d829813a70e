// A layer that owns a parameter but never exposes it: it would train without ever being updated,
// saved or all-reduced, so it does not compile.
// expect: Tessera Layer: missing `template <class V> void visit(V& v, const std::string& prefix)`
// expect: Scale
// max-lines: 8
#include "tessera/tessera.hpp"

template <class E>
struct Scale {
  using Env = E;
  using Tensor = tessera::Tensor<typename E::Scalar, typename E::Device>;
  struct Cache {
    Tensor y;
  };
  tessera::Parameter<typename E::Scalar, typename E::Device> gain{{1}};
  const Tensor& forward(const Tensor& x, Cache& c) { return c.y = x, c.y; }
  const Tensor& backward(const Tensor& dy, Cache& c) { return c.y = dy, c.y; }
  void set_mode(tessera::Mode) {}
};

int main() {
  using namespace tessera;
  Rng rng(1);
  Sequential model(Linear<CpuLocal>(4, 4, rng), Scale<CpuLocal>{});
  auto params = named_tensors(model);
  Sgd<CpuLocal> sgd(params, {.lr = 0.1});
}
