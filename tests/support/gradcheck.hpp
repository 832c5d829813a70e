// Generic float64 gradient check for any Layer (after dlib's test_layer): the analytic dL/dx and
// dL/dtheta from backward must match central differences of L(x, theta) = sum(y * g), where g is a
// fixed random upstream gradient.
//
// Error measure: ||analytic - numeric||_2 / max(||analytic||_2, ||numeric||_2, 1e-12), per tensor;
// central differences with eps = 1e-6 are accurate to ~1e-9 here, so a tolerance of 1e-6 catches
// any real bug while never failing on rounding.
#pragma once

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "tessera/core/parameter.hpp"
#include "tessera/core/random.hpp"
#include "tessera/core/tensor.hpp"

namespace tessera::testing {

using T64 = Tensor<double>;

inline T64 random_tensor(const Shape& shape, Rng& rng, double scale = 1.0) {
  T64 t(shape);
  for (auto& v : t) v = rng.normal(0.0, scale);
  return t;
}

inline void normal_fill(T64& t, Rng& rng, double scale = 1.0) {
  for (auto& v : t) v = rng.normal(0.0, scale);
}

inline double dot(const T64& a, const T64& b) {
  double s = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) s += a[i] * b[i];
  return s;
}

// With TESSERA_REPORT_ERRORS set, every checked error is also printed to stderr
// ("gradcheck <what> <error>"), so the figures behind the tolerances can be collected.
inline void report_error(const char* kind, const std::string& what, double err) {
  if (std::getenv("TESSERA_REPORT_ERRORS")) std::fprintf(stderr, "%s %s %.3g\n", kind, what.c_str(), err);
}

inline double relative_error(const T64& analytic, const T64& numeric) {
  double diff = 0, na = 0, nn = 0;
  for (std::int64_t i = 0; i < analytic.numel(); ++i) {
    diff += (analytic[i] - numeric[i]) * (analytic[i] - numeric[i]);
    na += analytic[i] * analytic[i];
    nn += numeric[i] * numeric[i];
  }
  return std::sqrt(diff) / std::max({std::sqrt(na), std::sqrt(nn), 1e-12});
}

template <class L>
NamedTensors<CpuLocal64> layer_tensors(L& layer) {
  NamedTensors<CpuLocal64> named;
  if constexpr (requires { layer.visit(named, std::string()); }) layer.visit(named, "");
  return named;
}

// Returns sum(forward(x) * g) on a fresh cache (so no state leaks between evaluations).
template <class L>
double objective(L& layer, const T64& x, const T64& g) {
  typename L::Cache cache{};
  const T64& y = layer.forward(x, cache);
  return dot(y, g);
}

// Checks every element of x and of every parameter. Keep shapes small: cost is
// 2 * (numel(x) + numel(theta)) forward passes.
template <class L>
void check_gradients(L& layer, T64 x, Rng& rng, double tolerance = 1e-6, double eps = 1e-6) {
  typename L::Cache cache{};
  const T64 y = layer.forward(x, cache);
  const T64 g = random_tensor(y.shape(), rng);
  auto named = layer_tensors(layer);
  for (auto& [name, p] : named.parameters) p->grad.zero();
  const T64 dx = layer.backward(g, cache);
  REQUIRE(dx.shape() == x.shape());

  T64 numeric(x.shape());
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    const double saved = x[i];
    x[i] = saved + eps;
    const double plus = objective(layer, x, g);
    x[i] = saved - eps;
    const double minus = objective(layer, x, g);
    x[i] = saved;
    numeric[i] = (plus - minus) / (2 * eps);
  }
  const double err_x = relative_error(dx, numeric);
  report_error("gradcheck", Catch::getResultCapture().getCurrentTestName() + " dx", err_x);
  INFO("dL/dx relative error " << err_x << " for input " << x.shape());
  CHECK(err_x <= tolerance);

  for (auto& [name, p] : named.parameters) {
    T64 analytic = p->grad;
    T64 num(p->value.shape());
    for (std::int64_t i = 0; i < p->value.numel(); ++i) {
      const double saved = p->value[i];
      p->value[i] = saved + eps;
      const double plus = objective(layer, x, g);
      p->value[i] = saved - eps;
      const double minus = objective(layer, x, g);
      p->value[i] = saved;
      num[i] = (plus - minus) / (2 * eps);
    }
    const double err = relative_error(analytic, num);
    report_error("gradcheck", Catch::getResultCapture().getCurrentTestName() + " d" + name, err);
    INFO("dL/d" << name << " relative error " << err << " for parameter shape " << p->value.shape());
    CHECK(err <= tolerance);
  }
}

}  // namespace tessera::testing
