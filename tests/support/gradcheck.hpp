// Catch2 side of the public gradient checker (tessera/testing/gradcheck.hpp): every checked tensor
// becomes one CHECK with its error in the message.
#pragma once

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "tessera/testing/gradcheck.hpp"

namespace tessera::testing {

// With TESSERA_REPORT_ERRORS set, every checked error is also printed to stderr
// ("gradcheck <what> <error>"), so the figures behind the tolerances can be collected.
inline void report_error(const char* kind, const std::string& what, double err) {
  if (std::getenv("TESSERA_REPORT_ERRORS")) std::fprintf(stderr, "%s %s %.3g\n", kind, what.c_str(), err);
}

template <class L>
void check_gradients(L& layer, T64 x, Rng& rng, double tolerance = 1e-6, double eps = 1e-6) {
  const Shape input_shape = x.shape();
  const GradCheckReport report = gradient_check(layer, std::move(x), rng, {.tolerance = tolerance, .eps = eps});
  INFO("input " << input_shape);
  REQUIRE(report.output_shape_ok);
  for (const auto& e : report.entries) {
    report_error("gradcheck", Catch::getResultCapture().getCurrentTestName() + " " + e.name, e.error);
    INFO(e.name << " relative error " << e.error << " for shape " << e.shape);
    CHECK(e.error <= tolerance);
  }
}

}  // namespace tessera::testing
