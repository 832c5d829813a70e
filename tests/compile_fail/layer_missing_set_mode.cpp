// A user's layer without set_mode, put in a Sequential: one sentence naming the member, the
// layer type on the line above it, and nothing else.
// expect: Tessera Layer: missing `void set_mode(Mode)`
// expect: Swish
// max-lines: 8
#include "tessera/tessera.hpp"

template <class E>
struct Swish : tessera::ParameterFree {
  using Env = E;
  using Tensor = tessera::Tensor<typename E::Scalar, typename E::Device>;
  struct Cache {
    Tensor y;
  };
  const Tensor& forward(const Tensor& x, Cache& c) { return c.y = x, c.y; }
  const Tensor& backward(const Tensor& dy, Cache& c) { return c.y = dy, c.y; }
};

int main() {
  using namespace tessera;
  Rng rng(1);
  Sequential model(Linear<CpuLocal>(4, 4, rng), Swish<CpuLocal>{});
  decltype(model)::Cache cache;
  model.forward(Tensor<float, Cpu>({2, 4}, 1.0f), cache);
  model.set_mode(Mode::Eval);
}
