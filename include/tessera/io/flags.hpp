// Flags: a small --name=value / --name value command-line parser for the examples and benchmarks.
// Unknown flags and malformed values are errors (ArgumentError naming the flag), so a typo such as
// --epoch=3 never silently trains with the default.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>

#include "tessera/core/error.hpp"

namespace tessera {

class Flags {
 public:
  Flags(int argc, char** argv) {
    for (int i = 1; i < argc; ++i) {
      std::string arg = argv[i];
      TESSERA_CHECK(arg.rfind("--", 0) == 0, ArgumentError, "unexpected argument '", arg, "' (flags look like --name=value)");
      arg = arg.substr(2);
      const auto eq = arg.find('=');
      if (eq != std::string::npos) {
        values_[arg.substr(0, eq)] = arg.substr(eq + 1);
      } else if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
        values_[arg] = argv[++i];
      } else {
        values_[arg] = "true";  // a bare --flag is a boolean
      }
    }
  }

  std::string get(const std::string& name, const std::string& fallback) {
    known_.insert(name);
    auto it = values_.find(name);
    return it == values_.end() ? fallback : it->second;
  }
  std::string get(const std::string& name, const char* fallback) { return get(name, std::string(fallback)); }
  std::int64_t get(const std::string& name, std::int64_t fallback) {
    if (!present(name)) return fallback;
    const std::string v = get(name, std::string());
    try {
      std::size_t used = 0;
      const long long x = std::stoll(v, &used);
      if (used == v.size()) return x;
    } catch (const std::exception&) {
    }
    throw ArgumentError(detail::cat("--", name, "=", v, " is not an integer"));
  }
  int get(const std::string& name, int fallback) {
    const std::int64_t v = get(name, static_cast<std::int64_t>(fallback));
    TESSERA_CHECK(v >= INT32_MIN && v <= INT32_MAX, ArgumentError, "--", name, "=", v, " is out of range");
    return static_cast<int>(v);
  }
  double get(const std::string& name, double fallback) {
    if (!present(name)) return fallback;  // no round trip through text: 1e-7 stays 1e-7
    const std::string v = get(name, std::string());
    try {
      std::size_t used = 0;
      const double x = std::stod(v, &used);
      if (used == v.size()) return x;
    } catch (const std::exception&) {
    }
    throw ArgumentError(detail::cat("--", name, "=", v, " is not a number"));
  }
  bool get(const std::string& name, bool fallback) {
    if (!present(name)) return fallback;
    const std::string v = get(name, std::string());
    if (v == "true" || v == "1" || v == "yes") return true;
    if (v == "false" || v == "0" || v == "no") return false;
    throw ArgumentError(detail::cat("--", name, "=", v, " is not a boolean (true/false)"));
  }
  bool has(const std::string& name) const { return values_.count(name) != 0; }
  // Marks the flag as known and says whether it was given.
  bool present(const std::string& name) {
    known_.insert(name);
    return has(name);
  }

  // Call after reading every flag: throws on flags nobody asked for.
  void finish() const {
    for (auto& [name, value] : values_)
      TESSERA_CHECK(known_.count(name), ArgumentError, "unknown flag --", name, " (known: ", known_list(), ")");
  }

 private:
  std::string known_list() const {
    std::string s;
    for (auto& k : known_) s += (s.empty() ? "--" : ", --") + k;
    return s;
  }
  std::map<std::string, std::string> values_;
  std::set<std::string> known_;
};

}  // namespace tessera
