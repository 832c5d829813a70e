// Flags: a small --name=value / --name value command-line parser for the examples and benchmarks.
// Unknown flags and malformed values are errors (ArgumentError naming the flag), so a typo such as
// --epoch=3 never silently trains with the default. Everything a flag can get wrong is refused
// while the flags are read, before any data is loaded or any step is computed:
//
//   flags.get("limit", o.limit, {.min = 0})            --limit=-5: must be >= 0
//   flags.get("lr", o.lr, {.above = 0})                --lr=0: must be > 0
//   flags.get("momentum", o.momentum, {.min = 0, .below = 1})
//   flags.choice("schedule", o.schedule, {"1f1b", "gpipe"})
//   flags.list("modes", "sync,ssp", {"sync", "ssp", "async"})      comma-separated, each one checked
//   flags.threads("threads", 1)                        0 (all cores) .. max_threads()
//   flags.output_path("checkpoint", "")                its directory exists and is writable
//   flags.input_path("resume", "")                     a readable file
//   check_thread_budget(ranks, "--ranks", threads, "--threads")   ranks x threads <= max_threads()
//
// Every reader takes the flag's meaning last, as argparse's help= does:
//
//   flags.get("epochs", 5, {.min = 1}, "passes over the training set")
//
// --help: every flag read before finish() is listed there, in the order read, with its default,
// its meaning and what it must be ("--epochs=5  passes over the training set (>= 1)"), and the
// program exits 0 (as argparse does). So the list is the program's own, never out of date;
// tests/check_example_flags.py compares it with each example's README and requires a meaning.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <initializer_list>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/core/linkage.hpp"

namespace tessera {

// The interval a numeric flag must lie in; unset ends are open to infinity. `min`/`max` are
// inclusive, `above`/`below` exclusive; give at most one of each pair. Written with designated
// initializers, lower end first: {.min = 0}, {.above = 0}, {.min = 0, .max = 1}, {.above = 0, .below = 1}.
struct FlagRange {
  std::optional<double> min, above, max, below;

  // NaN lies in no range (every comparison with it is false).
  bool contains(double v) const;

  // ">= 0", "> 0", "<= 8", "in [0, 1]", "in (0, 1)".
  std::string describe() const;

  // Shortest text that reads back as x: 1048576, 0.001, 1e-07 (not 1.04858e+06).
  static std::string number(double x);
};

// Hardware threads of this machine (std::thread::hardware_concurrency(); 1 if it cannot tell).
TESSERA_LINKAGE int hardware_threads();

// The most threads one process may ask for: 4 per hardware thread. OpenMP threads beyond the cores
// only take turns on them (every parallel region then waits for the slowest, descheduled one), so
// more than the core count never speeds a step up; 4x still lets a 2-core CI machine run 4 ranks of
// 2 threads to test oversubscription. Far beyond it, libgomp runs out of stacks and crashes
// (--threads=100000 was a segfault), and every thread-rank holds its own copy of the data set.
TESSERA_LINKAGE int max_threads();

// OMP_NUM_THREADS as a thread count: its first entry ("4" or "4,2" for nested levels), or none
// when unset or empty. A value that is not a positive count is an error naming the variable.
TESSERA_LINKAGE std::optional<int> omp_num_threads();

// Refuses `ranks` ranks (threads of this process) x `threads` OpenMP threads each when the total
// exceeds max_threads(). threads <= 0 ("all cores") counts as hardware_threads().
TESSERA_LINKAGE void check_thread_budget(std::int64_t ranks, const std::string& ranks_flag, std::int64_t threads,
                                const std::string& threads_flag);

// Refuses an output path whose file could not be created later: its directory must exist and be
// writable, and the path must not be a directory. Creates nothing. Call it before any compute, so
// that a mistyped --checkpoint fails in a second, not after the training it was meant to keep.
// An empty path means "no output" and passes.
TESSERA_LINKAGE void check_writable_output(const std::string& path, const std::string& flag);

// Refuses an input path that is not a readable regular file. An empty path passes.
TESSERA_LINKAGE void check_readable_input(const std::string& path, const std::string& flag);

class Flags {
 public:
  Flags(int argc, char** argv);

  // `meaning` (last in every reader, optional) is what the flag does, for --help: "passes over the
  // training set". A flag read twice keeps the first meaning given.
  std::string get(const std::string& name, const std::string& fallback, std::string_view meaning = {});
  std::string get(const std::string& name, const char* fallback, std::string_view meaning = {});
  std::int64_t get(const std::string& name, std::int64_t fallback, std::string_view meaning = {});
  int get(const std::string& name, int fallback, std::string_view meaning = {});
  double get(const std::string& name, double fallback, std::string_view meaning = {});
  bool get(const std::string& name, bool fallback, std::string_view meaning = {});

  // Range-checked numbers: the value (given or the fallback) must lie in `range`, else
  // ArgumentError "--limit=-5: must be >= 0". A double must also be finite.
  std::int64_t get(const std::string& name, std::int64_t fallback, const FlagRange& range,
                   std::string_view meaning = {});
  int get(const std::string& name, int fallback, const FlagRange& range, std::string_view meaning = {});
  double get(const std::string& name, double fallback, const FlagRange& range, std::string_view meaning = {});

  // One of `allowed`: "--schedule=zigzag: must be one of 1f1b, gpipe".
  std::string choice(const std::string& name, const std::string& fallback, std::initializer_list<const char*> allowed,
                     std::string_view meaning = {});

  // A comma-separated list (empty items skipped), each item one of `allowed` (any text if `allowed`
  // is empty); an empty list is refused: "--runs=small,big: 'big' must be one of small, warmup".
  std::vector<std::string> list(const std::string& name, const std::string& fallback,
                                std::initializer_list<const char*> allowed = {}, std::string_view meaning = {});
  // A comma-separated list of integers, each in `range`: "--periods=1,x: 'x' is not an integer".
  std::vector<int> int_list(const std::string& name, const std::string& fallback, const FlagRange& range,
                            std::string_view meaning = {});

  // OpenMP threads: 1 .. max_threads(), or 0 for all cores, returned as hardware_threads() (the
  // same in every program: 0 was refused by some and meant all cores in others).
  // Not given on the command line, the count is OMP_NUM_THREADS when that is set (srun and
  // tools/tessera-sbatch set it from SLURM_CPUS_PER_TASK; PyTorch honours it too), else `fallback`.
  int threads(const std::string& name, int fallback, std::string_view meaning = {});

  // --ranks of a program built once per backend: how many ranks the threads build starts
  // (`threads_default` when not given). Where a launcher starts the ranks (`launcher_decides`:
  // mpirun, tessera-run, srun) the launcher's -n decides: not given, this is 0 ("whatever was
  // started"); given, launch<E> refuses it unless it agrees (it was silently ignored).
  int ranks(const std::string& name, int threads_default, bool launcher_decides, std::string_view meaning = {});

  // A path the program will write (checkpoint, trace, metrics, plot): checked now by
  // check_writable_output(); empty = none.
  std::string output_path(const std::string& name, const std::string& fallback, std::string_view meaning = {});
  // A file the program will read (a checkpoint to resume from): checked now; empty = none.
  std::string input_path(const std::string& name, const std::string& fallback, std::string_view meaning = {});

  bool has(const std::string& name) const;
  // Marks the flag as known and says whether it was given.
  bool present(const std::string& name, std::string_view meaning = {});

  // Call after reading every flag: with --help, prints every flag read (help()) and exits 0;
  // otherwise throws on flags nobody asked for.
  void finish() const;

  // "usage: prog [--flag=value ...]" and one line per flag read so far, in the order read:
  //   --epochs=5                passes over the training set (>= 1)
  //   --schedule=1f1b           micro-batch order (one of 1f1b, gpipe)
  std::string help() const;

 private:
  // "--limit=-5" for a given value, "--limit (default 5)" for the fallback (a program's own bug).
  std::string where(const std::string& name, const std::string& text) const;
  void check(const std::string& name, double v, const std::string& text, const FlagRange& range) const;
  static std::string join(std::initializer_list<const char*> items);
  std::string known_list() const;
  // Registers a flag for help(): its default as text and what it must be (kept when not given, so
  // that a typed overload's inner calls do not erase what the outer one says).
  void note(const std::string& name, const std::string& fallback, const std::string& constraint = "",
            std::string_view meaning = {});
  struct Doc {
    std::string fallback, constraint, meaning;
  };
  std::string program_ = "program";
  // A value-taking flag given bare: refused by name, where it was taken for "true" before (a bare
  // --checkpoint wrote into a directory named "true").
  void check_not_bare(const std::string& name, const char* what) const;
  std::map<std::string, std::string> values_;
  std::set<std::string> bare_;  // flags given as a bare --name: a boolean's true, any other flag's error
  std::set<std::string> known_;
  std::vector<std::string> order_;
  std::map<std::string, Doc> docs_;
};

#if TESSERA_HEADER_DEFINITIONS

TESSERA_LINKAGE int hardware_threads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

TESSERA_LINKAGE int max_threads() { return 4 * hardware_threads(); }

TESSERA_LINKAGE std::optional<int> omp_num_threads() {
  const char* text = std::getenv("OMP_NUM_THREADS");
  if (text == nullptr || *text == '\0') return std::nullopt;
  const std::string value(text);
  const std::string first = value.substr(0, value.find(','));
  int count = 0;
  const auto [end, error] = std::from_chars(first.data(), first.data() + first.size(), count);
  TESSERA_CHECK(error == std::errc() && end == first.data() + first.size() && count >= 1, ArgumentError,
                "environment variable OMP_NUM_THREADS='", value, "' is not a thread count (a positive integer)");
  return count;
}

TESSERA_LINKAGE void check_thread_budget(std::int64_t ranks, const std::string& ranks_flag, std::int64_t threads,
                                const std::string& threads_flag) {
  const std::int64_t per_rank = threads > 0 ? threads : hardware_threads();
  const std::int64_t total = ranks * per_rank;
  TESSERA_CHECK(total <= max_threads(), ArgumentError, ranks_flag, "=", ranks, " x ", threads_flag, "=", threads,
                threads > 0 ? "" : " (all cores)", " = ", total, " threads in this process: must be <= ", max_threads(),
                " (4 x the ", hardware_threads(), " hardware threads of this machine)");
}

TESSERA_LINKAGE void check_writable_output(const std::string& path, const std::string& flag) {
  namespace fs = std::filesystem;
  if (path.empty()) return;
  std::error_code ec;
  const fs::path p(path);
  TESSERA_CHECK(!fs::is_directory(p, ec), ArgumentError, flag, "=", path, ": is a directory, not a file name");
  const fs::path dir = p.parent_path().empty() ? fs::path(".") : p.parent_path();
  TESSERA_CHECK(fs::exists(dir, ec), ArgumentError, flag, "=", path, ": directory '", dir.string(),
                "' does not exist (create it first)");
  TESSERA_CHECK(fs::is_directory(dir, ec), ArgumentError, flag, "=", path, ": '", dir.string(), "' is not a directory");
  // W_OK | X_OK: create an entry in it (access() also says EROFS for a read-only file system).
  TESSERA_CHECK(::access(dir.c_str(), W_OK | X_OK) == 0, ArgumentError, flag, "=", path, ": directory '",
                dir.string(), "' is not writable");
  if (fs::exists(p, ec))
    TESSERA_CHECK(::access(p.c_str(), W_OK) == 0, ArgumentError, flag, "=", path,
                  ": the file exists and is not writable");
}

TESSERA_LINKAGE void check_readable_input(const std::string& path, const std::string& flag) {
  namespace fs = std::filesystem;
  if (path.empty()) return;
  std::error_code ec;
  TESSERA_CHECK(fs::exists(path, ec), ArgumentError, flag, "=", path, ": no such file");
  TESSERA_CHECK(fs::is_regular_file(path, ec), ArgumentError, flag, "=", path, ": not a regular file");
  TESSERA_CHECK(::access(path.c_str(), R_OK) == 0, ArgumentError, flag, "=", path, ": not readable");
}

TESSERA_LINKAGE bool FlagRange::contains(double v) const {
  if (min && !(v >= *min)) return false;
  if (above && !(v > *above)) return false;
  if (max && !(v <= *max)) return false;
  if (below && !(v < *below)) return false;
  return !std::isnan(v);
}

TESSERA_LINKAGE std::string FlagRange::describe() const {
  const bool low = min || above, high = max || below;
  if (low && high)
    return "in " + std::string(min ? "[" : "(") + number(min ? *min : *above) + ", " + number(max ? *max : *below) +
           (max ? "]" : ")");
  if (low) return (min ? ">= " : "> ") + number(min ? *min : *above);
  if (high) return (max ? "<= " : "< ") + number(max ? *max : *below);
  return "a number";
}

TESSERA_LINKAGE std::string FlagRange::number(double x) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, x);
  return std::string(buf, r.ptr);
}

TESSERA_LINKAGE Flags::Flags(int argc, char** argv) {
  if (argc > 0) {
    program_ = argv[0];
    program_ = program_.substr(program_.find_last_of('/') + 1);
  }
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
      bare_.insert(arg);
    }
  }
}

TESSERA_LINKAGE void Flags::check_not_bare(const std::string& name, const char* what) const {
  TESSERA_CHECK(!bare_.count(name), ArgumentError, "--", name, " was given without a value: write --", name, "=",
                what, " (only an on/off flag may be given bare)");
}

TESSERA_LINKAGE std::string Flags::get(const std::string& name, const std::string& fallback, std::string_view meaning) {
  note(name, fallback, "", meaning);
  check_not_bare(name, "VALUE");
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

TESSERA_LINKAGE std::string Flags::get(const std::string& name, const char* fallback, std::string_view meaning) {
  return get(name, std::string(fallback), meaning);
}

TESSERA_LINKAGE std::int64_t Flags::get(const std::string& name, std::int64_t fallback, std::string_view meaning) {
  note(name, std::to_string(fallback), "", meaning);
  if (!present(name)) return fallback;
  check_not_bare(name, "N");
  const std::string v = values_.at(name);
  std::int64_t x = 0;
  const std::size_t skip = v.size() > 1 && v[0] == '+' ? 1 : 0;  // "+5" reads as 5, as std::stoll does
  const auto r = std::from_chars(v.data() + skip, v.data() + v.size(), x);
  if (r.ec == std::errc::result_out_of_range)
    throw ArgumentError(detail::cat("--", name, "=", v, " is out of range for a 64-bit integer"));
  if (r.ec != std::errc() || r.ptr != v.data() + v.size() || v.empty())
    throw ArgumentError(detail::cat("--", name, "=", v, " is not an integer"));
  return x;
}

TESSERA_LINKAGE int Flags::get(const std::string& name, int fallback, std::string_view meaning) {
  const std::int64_t v = get(name, static_cast<std::int64_t>(fallback), meaning);
  TESSERA_CHECK(v >= INT32_MIN && v <= INT32_MAX, ArgumentError, "--", name, "=", v, " is out of range");
  return static_cast<int>(v);
}

TESSERA_LINKAGE double Flags::get(const std::string& name, double fallback, std::string_view meaning) {
  note(name, FlagRange::number(fallback), "", meaning);
  if (!present(name)) return fallback;  // no round trip through text: 1e-7 stays 1e-7
  check_not_bare(name, "X");
  const std::string v = values_.at(name);
  try {
    std::size_t used = 0;
    const double x = std::stod(v, &used);
    if (used == v.size() && !std::isnan(x)) return x;  // "nan" parses, but is no value of any flag
  } catch (const std::exception&) {
  }
  throw ArgumentError(detail::cat("--", name, "=", v, " is not a number"));
}

TESSERA_LINKAGE bool Flags::get(const std::string& name, bool fallback, std::string_view meaning) {
  note(name, fallback ? "true" : "false", "true or false; a bare --" + name + " is true", meaning);
  if (!present(name)) return fallback;
  const std::string v = values_.at(name);
  if (v == "true" || v == "1" || v == "yes") return true;
  if (v == "false" || v == "0" || v == "no") return false;
  throw ArgumentError(detail::cat("--", name, "=", v, " is not a boolean (true/false)"));
}

TESSERA_LINKAGE std::int64_t Flags::get(const std::string& name, std::int64_t fallback, const FlagRange& range,
                                        std::string_view meaning) {
  const std::int64_t v = get(name, fallback, meaning);
  note(name, std::to_string(fallback), range.describe());
  check(name, static_cast<double>(v), std::to_string(v), range);
  return v;
}

TESSERA_LINKAGE int Flags::get(const std::string& name, int fallback, const FlagRange& range, std::string_view meaning) {
  const int v = get(name, fallback, meaning);
  note(name, std::to_string(fallback), range.describe());
  check(name, v, std::to_string(v), range);
  return v;
}

TESSERA_LINKAGE double Flags::get(const std::string& name, double fallback, const FlagRange& range,
                                  std::string_view meaning) {
  const double v = get(name, fallback, meaning);
  note(name, FlagRange::number(fallback), range.describe());
  const std::string text = has(name) ? values_.at(name) : FlagRange::number(v);
  TESSERA_CHECK(std::isfinite(v), ArgumentError, where(name, text), ": must be a finite number");
  check(name, v, text, range);
  return v;
}

TESSERA_LINKAGE std::string Flags::choice(const std::string& name, const std::string& fallback,
                                          std::initializer_list<const char*> allowed, std::string_view meaning) {
  const std::string v = get(name, fallback, meaning);
  note(name, fallback, "one of " + join(allowed));
  for (const char* a : allowed)
    if (v == a) return v;
  throw ArgumentError(detail::cat(where(name, v), ": must be one of ", join(allowed)));
}

TESSERA_LINKAGE std::vector<std::string> Flags::list(const std::string& name, const std::string& fallback,
                                std::initializer_list<const char*> allowed, std::string_view meaning) {
  const std::string v = get(name, fallback, meaning);
  note(name, fallback, allowed.size() ? "comma-separated, each one of " + join(allowed) : "comma-separated");
  std::vector<std::string> items;
  for (std::size_t p = 0; p <= v.size();) {
    const auto comma = std::min(v.find(',', p), v.size());
    if (comma > p) items.push_back(v.substr(p, comma - p));
    p = comma + 1;
  }
  TESSERA_CHECK(!items.empty(), ArgumentError, where(name, v), ": names nothing (a comma-separated list)");
  for (const auto& item : items) {
    bool ok = allowed.size() == 0;
    for (const char* a : allowed) ok = ok || item == a;
    TESSERA_CHECK(ok, ArgumentError, where(name, v), ": '", item, "' must be one of ", join(allowed));
  }
  return items;
}

TESSERA_LINKAGE std::vector<int> Flags::int_list(const std::string& name, const std::string& fallback,
                                                 const FlagRange& range, std::string_view meaning) {
  const std::vector<std::string> items = list(name, fallback, {}, meaning);
  note(name, fallback, "comma-separated integers, each " + range.describe());
  const std::string v = get(name, fallback);
  std::vector<int> out;
  for (const auto& item : items) {
    int k = 0;
    const auto [end, error] = std::from_chars(item.data(), item.data() + item.size(), k);
    TESSERA_CHECK(error == std::errc() && end == item.data() + item.size(), ArgumentError, where(name, v), ": '", item,
                  "' is not an integer");
    TESSERA_CHECK(range.contains(k), ArgumentError, where(name, v), ": '", item, "' must be ", range.describe());
    out.push_back(k);
  }
  return out;
}

TESSERA_LINKAGE int Flags::threads(const std::string& name, int fallback, std::string_view meaning) {
  const int given = get(name, omp_num_threads().value_or(fallback), meaning);
  note(name, std::to_string(fallback),
       "1 to " + std::to_string(max_threads()) + ", or 0 for all " + std::to_string(hardware_threads()) +
           " cores; OMP_NUM_THREADS when not given");
  TESSERA_CHECK(given >= 0, ArgumentError, where(name, std::to_string(given)), ": must be >= 0 (0: all cores)");
  const int v = given == 0 ? hardware_threads() : given;
  TESSERA_CHECK(v <= max_threads(), ArgumentError, where(name, std::to_string(v)), ": must be <= ", max_threads(),
                " (4 x the ", hardware_threads(), " hardware threads of this machine: more threads than cores only ",
                "take turns on them)");
  return v;
}

TESSERA_LINKAGE int Flags::ranks(const std::string& name, int threads_default, bool launcher_decides,
                                 std::string_view meaning) {
  const int v = get(name, threads_default, {.min = 1}, meaning);
  note(name, std::to_string(threads_default),
       launcher_decides ? ">= 1; the launcher's -n when not given (a given one must agree with it)" : ">= 1");
  return launcher_decides && !has(name) ? 0 : v;
}

TESSERA_LINKAGE std::string Flags::output_path(const std::string& name, const std::string& fallback,
                                               std::string_view meaning) {
  const std::string v = get(name, fallback, meaning);
  note(name, fallback, "a file to write (empty: none)");
  check_writable_output(v, "--" + name);
  return v;
}

TESSERA_LINKAGE std::string Flags::input_path(const std::string& name, const std::string& fallback,
                                              std::string_view meaning) {
  const std::string v = get(name, fallback, meaning);
  note(name, fallback, "a file to read (empty: none)");
  check_readable_input(v, "--" + name);
  return v;
}

TESSERA_LINKAGE bool Flags::has(const std::string& name) const { return values_.count(name) != 0; }

TESSERA_LINKAGE bool Flags::present(const std::string& name, std::string_view meaning) {
  if (known_.insert(name).second) order_.push_back(name);
  if (!meaning.empty() && docs_[name].meaning.empty()) docs_[name].meaning = meaning;
  return has(name);
}

TESSERA_LINKAGE void Flags::finish() const {
  if (values_.count("help") && !known_.count("help")) {
    std::fputs(help().c_str(), stdout);
    std::fflush(stdout);
    std::exit(0);
  }
  for (auto& [name, value] : values_)
    TESSERA_CHECK(known_.count(name), ArgumentError, "unknown flag --", name, " (known: ", known_list(), ")");
}

TESSERA_LINKAGE std::string Flags::help() const {
  std::string out = "usage: " + program_ + " [--flag=value ...]\n";
  for (const auto& name : order_) {
    const auto it = docs_.find(name);
    std::string line = "  --" + name + "=" + (it != docs_.end() ? it->second.fallback : "");
    const std::string meaning = it != docs_.end() ? it->second.meaning : "";
    const std::string constraint = it != docs_.end() ? it->second.constraint : "";
    const std::string text = meaning.empty() ? constraint : constraint.empty() ? meaning : meaning + " (" + constraint + ")";
    if (!text.empty()) line += std::string(line.size() < 28 ? 28 - line.size() : 1, ' ') + text;
    out += line + "\n";
  }
  return out + "  --help                    this list\n";
}

TESSERA_LINKAGE std::string Flags::where(const std::string& name, const std::string& text) const {
  return has(name) ? "--" + name + "=" + text : "--" + name + " (default " + text + ")";
}

TESSERA_LINKAGE void Flags::check(const std::string& name, double v, const std::string& text, const FlagRange& range) const {
  TESSERA_CHECK(range.contains(v), ArgumentError, where(name, text), ": must be ", range.describe());
}

TESSERA_LINKAGE std::string Flags::join(std::initializer_list<const char*> items) {
  std::string s;
  for (const char* i : items) s += (s.empty() ? "" : ", ") + std::string(i);
  return s;
}

TESSERA_LINKAGE std::string Flags::known_list() const {
  std::string s;
  for (auto& k : known_) s += (s.empty() ? "--" : ", --") + k;
  return s;
}

TESSERA_LINKAGE void Flags::note(const std::string& name, const std::string& fallback, const std::string& constraint,
                                std::string_view meaning) {
  if (known_.insert(name).second) order_.push_back(name);
  auto& doc = docs_[name];
  doc.fallback = fallback;
  if (!constraint.empty()) doc.constraint = constraint;
  if (!meaning.empty() && doc.meaning.empty()) doc.meaning = meaning;
}

#endif  // TESSERA_HEADER_DEFINITIONS

}  // namespace tessera
