// Fuzz target: Flags (include/tessera/io/flags.hpp). The input is split at NUL bytes into argv[1..]
// and read the way the examples read their flags: integers, doubles and booleans with ranges,
// a choice, a list, thread counts, paths, then finish() (or, with --help, the help text, since
// finish() would exit). Expected: values or ArgumentError.
// Every value returned must lie in the range it was asked for (a value outside is a bug too).
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/io/flags.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<std::string> args{"prog"};
  std::string cur;
  for (std::size_t i = 0; i < size; ++i) {
    if (data[i] == 0) {
      args.push_back(cur);
      cur.clear();
    } else {
      cur += static_cast<char>(data[i]);
    }
  }
  if (!cur.empty()) args.push_back(cur);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  try {
    tessera::Flags flags(static_cast<int>(args.size()), argv.data());
    // Each getter on its own: one bad flag must not hide how the others are read.
    auto each = [](auto&& read) {
      try {
        read();
      } catch (const tessera::ArgumentError&) {
      }
    };
    each([&] {
      const int v = flags.get("epochs", 3, {.min = 1});
      if (v < 1) __builtin_trap();
    });
    each([&] {
      const std::int64_t v = flags.get("limit", std::int64_t{0}, {.min = 0});
      if (v < 0) __builtin_trap();
    });
    each([&] {
      const double v = flags.get("lr", 0.1, {.above = 0});
      if (!(v > 0) || !std::isfinite(v)) __builtin_trap();
    });
    each([&] {
      const double v = flags.get("momentum", 0.9, {.min = 0, .below = 1});
      if (!(v >= 0 && v < 1)) __builtin_trap();
    });
    each([&] { (void)flags.get("seed", std::int64_t{1}); });
    each([&] { (void)flags.get("timeout", 30.0); });
    each([&] { (void)flags.get("verbose", false); });
    each([&] { (void)flags.get("name", "default"); });
    each([&] { (void)flags.choice("schedule", "1f1b", {"1f1b", "gpipe"}); });
    each([&] { (void)flags.list("modes", "sync,ssp", {"sync", "ssp", "async"}); });
    each([&] { (void)flags.list("runs", "small"); });
    each([&] {
      const int v = flags.threads("threads", 1);
      if (v < 1 || v > tessera::max_threads()) __builtin_trap();
    });
    each([&] {
      const int v = flags.threads("omp", 0);  // 0: all cores, returned as the count
      if (v < 1 || v > tessera::max_threads()) __builtin_trap();
    });
    each([&] { tessera::check_thread_budget(flags.get("ranks", 2, {.min = 1}), "--ranks", 1, "--threads"); });
    each([&] { (void)flags.output_path("checkpoint", ""); });
    each([&] { (void)flags.input_path("resume", ""); });
    // With --help, finish() prints the list and exits 0 (as argparse does): check the list instead.
    if (flags.has("help")) {
      const std::string text = flags.help();
      if (text.rfind("usage: prog ", 0) != 0 || text.find("\n  --epochs=3") == std::string::npos) __builtin_trap();
      return 0;
    }
    flags.finish();
  } catch (const tessera::ArgumentError&) {
  }
  return 0;
}
