// JsonRecord / MetricsWriter: every line a JSON object that a JSON parser accepts, whatever the
// strings hold (a run name with a tab, a path with a quote).
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>

#include "tessera/train/metrics.hpp"

using namespace tessera;

TEST_CASE("JsonRecord escapes quotes, backslashes and control characters", "[train][metrics]") {
  JsonRecord r;
  r.add("name", std::string("a\"b\\c\td\ne")).add("step", 3).add("loss", 0.5);
  CHECK(r.str() == R"({"name": "a\"b\\c\u0009d\u000ae", "step": 3, "loss": 0.5})");
  JsonRecord k;
  k.add("we\"ird", 1);
  CHECK(k.str() == R"({"we\"ird": 1})");
}

TEST_CASE("JsonRecord writes non-finite numbers as null", "[train][metrics]") {
  JsonRecord r;
  r.add("loss", std::numeric_limits<double>::quiet_NaN()).add("inf", std::numeric_limits<double>::infinity());
  CHECK(r.str() == R"({"loss": null, "inf": null})");
}

TEST_CASE("MetricsWriter appends one line per record and names a path it cannot open", "[train][metrics]") {
  const auto dir = std::filesystem::temp_directory_path() / "tessera_test_metrics";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const auto path = (dir / "m.jsonl").string();
  {
    MetricsWriter w(path);
    w.write(JsonRecord().add("epoch", 1));
    w.write(JsonRecord().add("epoch", 2));
  }
  std::ifstream in(path);
  std::string a, b, c;
  std::getline(in, a);
  std::getline(in, b);
  CHECK(a == R"({"epoch": 1})");
  CHECK(b == R"({"epoch": 2})");
  CHECK_FALSE(std::getline(in, c));
  CHECK_THROWS_WITH(MetricsWriter((dir / "missing" / "m.jsonl").string()), Catch::Contains("missing"));
  std::filesystem::remove_all(dir);
}
