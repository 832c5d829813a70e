// gradient_check: the float64 gradient check every layer passes, public so that a user's own
// layer gets the same check (no test framework needed; after dlib's test_layer and PyTorch's
// torch.autograd.gradcheck).
//
//   ChannelScale<tessera::CpuLocal64> layer(3);
//   tessera::Rng rng(1);
//   auto report = tessera::testing::gradient_check(layer, tessera::testing::random_tensor({2, 3, 4, 4}, rng), rng);
//   if (!report.passed()) std::cerr << report.describe();
//
// What is compared: the analytic dL/dx and dL/dtheta from backward against central differences of
// L(x, theta) = sum(forward(x) * g), g a fixed random upstream gradient. Error per tensor:
//   ||analytic - numeric||_2 / max(||analytic||_2, ||numeric||_2, 1e-12)
// Central differences with eps = 1e-6 in float64 are accurate to ~1e-9 on smooth layers, so the
// default tolerance 1e-6 catches any real bug without failing on rounding. Layers with kinks
// (ReLU, max-pool) need inputs away from them: a difference straddling a kink is not a gradient.
//
// Cost: 2 * (numel(x) + numel(theta)) forward passes, so keep shapes small.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "tessera/core/concepts.hpp"
#include "tessera/core/parameter.hpp"
#include "tessera/core/random.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/device/cpu.hpp"

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

inline double relative_error(const T64& analytic, const T64& numeric) {
  double diff = 0, na = 0, nn = 0;
  for (std::int64_t i = 0; i < analytic.numel(); ++i) {
    diff += (analytic[i] - numeric[i]) * (analytic[i] - numeric[i]);
    na += analytic[i] * analytic[i];
    nn += numeric[i] * numeric[i];
  }
  return std::sqrt(diff) / std::max({std::sqrt(na), std::sqrt(nn), 1e-12});
}

struct GradCheckOptions {
  double tolerance = 1e-6;  // largest relative error accepted per tensor
  double eps = 1e-6;        // central-difference step
};

// One checked tensor: "dx" for the input, "d<name>" for a parameter (its visit name).
struct GradCheckEntry {
  std::string name;
  Shape shape;
  double error = 0;
};

struct GradCheckReport {
  std::vector<GradCheckEntry> entries;
  double tolerance = 0;
  bool output_shape_ok = true;  // backward returned a gradient of x's shape

  bool passed() const {
    return output_shape_ok &&
           std::all_of(entries.begin(), entries.end(), [&](const GradCheckEntry& e) { return e.error <= tolerance; });
  }
  // One line per tensor, failures marked, e.g. "dweight (4, 3) relative error 2.1e-03 > 1e-06  FAILED".
  std::string describe() const {
    std::ostringstream out;
    if (!output_shape_ok) out << "backward returned dL/dx of another shape than x  FAILED\n";
    for (const auto& e : entries) {
      out << e.name << " " << e.shape << " relative error " << e.error;
      if (e.error > tolerance) out << " > " << tolerance << "  FAILED";
      out << "\n";
    }
    return out.str();
  }
};

namespace detail {
// sum(forward(x) * g) on a fresh cache, so no state leaks between evaluations.
template <class L>
double gradcheck_objective(L& layer, const T64& x, const T64& g) {
  typename L::Cache cache{};
  const T64& y = layer.forward(x, cache);
  return dot(y, g);
}

// Central differences of the objective with respect to every element of t (x or a parameter's
// value), restoring each element afterwards.
template <class L>
T64 numeric_gradient(L& layer, T64& t, const T64& x, const T64& g, double eps) {
  T64 numeric(t.shape());
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    const double saved = t[i];
    t[i] = saved + eps;
    const double plus = gradcheck_objective(layer, x, g);
    t[i] = saved - eps;
    const double minus = gradcheck_objective(layer, x, g);
    t[i] = saved;
    numeric[i] = (plus - minus) / (2 * eps);
  }
  return numeric;
}
}  // namespace detail

// Checks dL/dx and the gradient of every parameter the layer visits. The layer must be built for
// a float64 CPU Env (CpuLocal64, CpuThreads64, ...): float32 differences are too coarse to tell a
// bug from rounding.
template <class L>
GradCheckReport gradient_check(L& layer, T64 x, Rng& rng, GradCheckOptions options = {}) {
  static_assert(check_layer<L>());
  using E = typename L::Env;
  static_assert(std::is_same_v<typename E::Scalar, double> && std::is_same_v<typename E::Device, Cpu>,
                "gradient_check: build the layer with a float64 CPU Env (e.g. CpuLocal64); float32 central "
                "differences cannot tell a wrong gradient from rounding");
  GradCheckReport report;
  report.tolerance = options.tolerance;
  typename L::Cache cache{};
  const T64 y = layer.forward(x, cache);
  const T64 g = random_tensor(y.shape(), rng);
  auto named = named_tensors(layer);
  for (auto& [name, p] : named.parameters) p->grad.zero();
  const T64 dx = layer.backward(g, cache);
  if (dx.shape() != x.shape()) {
    report.output_shape_ok = false;
    return report;
  }
  T64 numeric_x = detail::numeric_gradient(layer, x, x, g, options.eps);
  report.entries.push_back({"dx", x.shape(), relative_error(dx, numeric_x)});
  for (auto& [name, p] : named.parameters) {
    const T64 analytic = p->grad;
    const T64 numeric = detail::numeric_gradient(layer, p->value, x, g, options.eps);
    report.entries.push_back({"d" + name, p->value.shape(), relative_error(analytic, numeric)});
  }
  return report;
}

}  // namespace tessera::testing
