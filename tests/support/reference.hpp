// Comparison with PyTorch reference data (tests/data/*.safetensors, written by tools/reference/).
//
// float64: relative error (norm-wise) <= 1e-10. float32: <= 8x PyTorch's own float32 error on the
// same case plus a floor of a few float32 epsilons; the generator stores that error for tensor
// "<case>.<t>" as "<case>.torch_f32_err.<t>", where <case> ends at the last dot of the name (or at
// the first, with case_ends_at_first_dot).
#pragma once

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>
#include <type_traits>

#include "support/gradcheck.hpp"
#include "tessera/io/safetensors.hpp"

namespace tessera::testing {

struct MatchOptions {
  bool case_ends_at_first_dot = false;
  double f32_floor = 2.5e-7;
};

template <class S>
void expect_matches(const SafetensorsFile& reference, const Tensor<S>& got, const std::string& name,
                    MatchOptions options = {}) {
  const T64 want = reference.tensor<double>(name);
  INFO(name << ": got shape " << got.shape() << ", reference " << want.shape());
  REQUIRE(got.numel() == want.numel());
  T64 got64 = got.template cast<double>();
  got64.reshape(want.shape());  // a loss is () in torch and (1) here
  const double err = relative_error(got64, want);
  double tolerance = 1e-10;
  if constexpr (std::is_same_v<S, float>) {
    const auto dot = options.case_ends_at_first_dot ? name.find('.') : name.rfind('.');
    const double torch_err = reference.tensor<double>(name.substr(0, dot) + ".torch_f32_err" + name.substr(dot))[0];
    tolerance = 8 * torch_err + options.f32_floor;
  }
  report_error(std::is_same_v<S, float> ? "reference-f32" : "reference-f64", name, err);
  INFO(name << ": relative error " << err << ", tolerance " << tolerance);
  CHECK(err <= tolerance);
}

// Integer labels stored (as float64) under `name`.
inline std::vector<std::int64_t> load_labels(const SafetensorsFile& reference, const std::string& name) {
  const T64 t = reference.tensor<double>(name);
  std::vector<std::int64_t> out(static_cast<std::size_t>(t.numel()));
  for (std::int64_t i = 0; i < t.numel(); ++i) out[static_cast<std::size_t>(i)] = static_cast<std::int64_t>(t[i]);
  return out;
}

// %g, as the generators format numbers in their configuration strings.
inline std::string fmt_g(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// Central differences of a scalar loss f(z) in every element of z, against the analytic gradient,
// with the same error measure and tolerance as check_gradients.
template <class F>
void check_loss_gradient(T64 z, const T64& analytic, F&& f) {
  REQUIRE(analytic.shape() == z.shape());
  const double eps = 1e-6;
  T64 numeric(z.shape());
  for (std::int64_t i = 0; i < z.numel(); ++i) {
    const double saved = z[i];
    z[i] = saved + eps;
    const double plus = f(z);
    z[i] = saved - eps;
    const double minus = f(z);
    z[i] = saved;
    numeric[i] = (plus - minus) / (2 * eps);
  }
  const double err = relative_error(analytic, numeric);
  INFO("d loss / d input relative error " << err);
  CHECK(err <= 1e-6);
}

}  // namespace tessera::testing
