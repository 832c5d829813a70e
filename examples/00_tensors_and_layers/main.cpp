// Example 00: tensors, layers, forward and backward by hand, and a check that backward is right.
//
// Builds a two-layer network, runs one forward and one backward pass, prints each shape, and
// compares one analytic gradient entry with a central difference. Exits 1 if they disagree.
#include <cmath>
#include <cstdio>

#include "tessera/tessera.hpp"

using namespace tessera;
using E = CpuLocal64;  // float64, so the finite difference below is accurate

int main() {
  Rng rng(42);
  // A Sequential is a flat tuple of layers; its Cache holds one micro-batch's activations.
  Sequential net{Linear<E>(4, 8, rng), ReLU<E>(), Linear<E>(8, 3, rng)};
  Sequential<Linear<E>, ReLU<E>, Linear<E>>::Cache cache;

  Tensor<double> x({2, 4});  // (N=2, features=4)
  for (auto& v : x) v = rng.normal();
  const Tensor<double>& y = net.forward(x, cache);  // (2, 3)
  std::printf("x %s -> y %s\n", x.shape().str().c_str(), y.shape().str().c_str());

  // L = sum(y), so dL/dy is all ones; backward accumulates dL/dW into each parameter's grad.
  Tensor<double> dy(y.shape(), 1.0);
  const Tensor<double>& dx = net.backward(dy, cache);  // (2, 4)
  std::printf("dL/dx %s\n", dx.shape().str().c_str());

  auto named = named_tensors(net);
  for (auto& [name, p] : named.parameters) std::printf("  %-10s %s\n", name.c_str(), p->value.shape().str().c_str());

  // Check dL/dW[0] of the first layer against (L(W + h) - L(W - h)) / 2h.
  auto& w = named.parameters[0].second->value;
  const double analytic = named.parameters[0].second->grad[0];
  auto loss = [&] {
    Sequential<Linear<E>, ReLU<E>, Linear<E>>::Cache c;
    const auto& out = net.forward(x, c);
    double s = 0;
    for (double v : out) s += v;
    return s;
  };
  const double h = 1e-6, saved = w[0];
  w[0] = saved + h;
  const double plus = loss();
  w[0] = saved - h;
  const double minus = loss();
  w[0] = saved;
  const double numeric = (plus - minus) / (2 * h);
  std::printf("dL/dW[0]: analytic %.10f, central difference %.10f\n", analytic, numeric);

  // A wrong shape is an error that names the layer and both shapes.
  try {
    Tensor<double> bad({2, 5});
    net.forward(bad, cache);
  } catch (const ShapeError& e) {
    std::printf("as expected: %s\n", e.what());
  }
  const bool ok = std::abs(analytic - numeric) <= 1e-6 * std::max(1.0, std::abs(analytic));
  std::printf("%s\n", ok ? "gradient check passed" : "gradient check FAILED");
  return ok ? 0 : 1;
}
