// Comparison with PyTorch reference data (tests/data/*.safetensors, written by tools/reference/).
//
// float64: relative error (norm-wise) <= 1e-10. float32: <= 8x PyTorch's own float32 error on the
// same case plus a floor of a few float32 epsilons; the generator stores that error for tensor
// "<case>.<t>" as "<case>.torch_f32_err.<t>", where <case> ends at the last dot of the name (or at
// the first, with case_ends_at_first_dot).
#pragma once

#include <catch2/catch.hpp>
#include <string>
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

}  // namespace tessera::testing
