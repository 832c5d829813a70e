// Flags' guards: ranges, choices, lists, thread counts and output/input paths, each refused with a
// message naming the flag, the value and what is allowed, while the flags are read.
#include <catch2/catch.hpp>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <optional>
#include <fstream>
#include <string>
#include <vector>

#include "tessera/comm/launch.hpp"
#include "tessera/io/flags.hpp"
#include "support/temp_dir.hpp"

using namespace tessera;
using tessera::testing::TempDir;

namespace {

// Flags over a list of arguments (argv[0] added).
struct Args {
  std::vector<std::string> text;
  std::vector<char*> argv;
  explicit Args(std::vector<std::string> a) : text(std::move(a)) {
    text.insert(text.begin(), "prog");
    for (auto& t : text) argv.push_back(t.data());
  }
  Flags flags() { return Flags(static_cast<int>(argv.size()), argv.data()); }
};

}  // namespace

TEST_CASE("Flags ranges: values in range pass, out of range name flag, value and range", "[core][flags]") {
  Args a({"--limit=-5", "--epochs=3", "--lr=0", "--momentum=1", "--frac=0.5", "--big=1048576"});
  Flags f = a.flags();
  CHECK_THROWS_WITH(f.get("limit", std::int64_t{0}, {.min = 0}), "--limit=-5: must be >= 0");
  CHECK(f.get("epochs", std::int64_t{1}, {.min = 1}) == 3);
  CHECK(f.get("epochs", 1, {.min = 1, .max = 3}) == 3);  // inclusive ends
  CHECK_THROWS_WITH(f.get("epochs", 1, {.min = 1, .below = 3}), "--epochs=3: must be in [1, 3)");
  CHECK_THROWS_WITH(f.get("lr", 0.1, {.above = 0}), "--lr=0: must be > 0");
  CHECK_THROWS_WITH(f.get("momentum", 0.9, {.min = 0, .below = 1}), "--momentum=1: must be in [0, 1)");
  CHECK(f.get("frac", 0.0, {.min = 0, .max = 1}) == 0.5);
  CHECK_THROWS_WITH(f.get("frac", 0.0, {.above = 0.5, .max = 1}), "--frac=0.5: must be in (0.5, 1]");
  // Bounds print as the shortest text that reads back: 1048576, not 1.04858e+06.
  CHECK_THROWS_WITH(f.get("big", std::int64_t{1}, {.max = 1048575}), "--big=1048576: must be <= 1048575");
  CHECK_THROWS_WITH(f.get("big", 1, {.below = 1e-7}), "--big=1048576: must be < 1e-07");
  // An absent flag takes its fallback, which must lie in the range too (else the program is wrong).
  CHECK(f.get("absent", std::int64_t{7}, {.min = 1}) == 7);
  CHECK_THROWS_WITH(f.get("absent2", std::int64_t{0}, {.min = 1}), "--absent2 (default 0): must be >= 1");
  f.finish();
}

TEST_CASE("Flags numbers: non-finite and malformed values refused", "[core][flags]") {
  Args a({"--lr=nan", "--wd=inf", "--n=99999999999999999999", "--m=+5", "--k=5x", "--j="});
  Flags f = a.flags();
  CHECK_THROWS_WITH(f.get("lr", 0.1), "--lr=nan is not a number");
  CHECK(f.get("wd", 0.0) == std::numeric_limits<double>::infinity());  // unranged: as written
  CHECK_THROWS_WITH(f.get("wd", 0.0, {.min = 0}), "--wd=inf: must be a finite number");
  CHECK_THROWS_WITH(f.get("n", std::int64_t{0}), Catch::Contains("out of range for a 64-bit integer"));
  CHECK(f.get("m", std::int64_t{0}) == 5);
  CHECK_THROWS_WITH(f.get("k", std::int64_t{0}), "--k=5x is not an integer");
  CHECK_THROWS_WITH(f.get("j", std::int64_t{0}), "--j= is not an integer");
  CHECK_THROWS_WITH(f.get("n", 0), Catch::Contains("--n=99999999999999999999"));
}

TEST_CASE("Flags choices and lists", "[core][flags]") {
  Args a({"--schedule=zigzag", "--compression=fp16", "--runs=small,,lars", "--modes=sync,bogus", "--empty=,"});
  Flags f = a.flags();
  CHECK_THROWS_WITH(f.choice("schedule", "1f1b", {"1f1b", "gpipe"}), "--schedule=zigzag: must be one of 1f1b, gpipe");
  CHECK(f.choice("compression", "none", {"none", "fp16", "topk"}) == "fp16");
  CHECK(f.choice("absent", "none", {"none", "fp16"}) == "none");
  CHECK(f.list("runs", "small", {"small", "lars", "lamb"}) == std::vector<std::string>{"small", "lars"});
  CHECK_THROWS_WITH(f.list("modes", "sync", {"sync", "ssp"}), "--modes=sync,bogus: 'bogus' must be one of sync, ssp");
  CHECK_THROWS_WITH(f.list("empty", "x"), "--empty=,: names nothing (a comma-separated list)");
  CHECK(f.list("free", "a,b") == std::vector<std::string>{"a", "b"});  // no allowed set: any text
}

TEST_CASE("Flags threads: bounded by 4 x the hardware threads; the thread budget of ranks x threads",
          "[core][flags]") {
  const int cap = max_threads();
  REQUIRE(cap == 4 * hardware_threads());
  Args a({"--threads=100000", "--ok=" + std::to_string(cap), "--zero=0", "--neg=-1"});
  Flags f = a.flags();
  CHECK_THROWS_WITH(f.threads("threads", 1),
                    Catch::StartsWith("--threads=100000: must be <= " + std::to_string(cap) + " (4 x the "));
  CHECK(f.threads("ok", 1) == cap);
  // 0 = all cores in every program (it was refused by some and taken by others), as the real count.
  CHECK(f.threads("zero", 1) == hardware_threads());
  CHECK_THROWS_WITH(f.threads("neg", 1), Catch::StartsWith("--neg=-1: must be >= 0 (0: all cores)"));

  CHECK_NOTHROW(check_thread_budget(1, "--ranks", cap, "--threads"));
  CHECK_NOTHROW(check_thread_budget(cap, "--ranks", 1, "--threads"));
  CHECK_THROWS_WITH(check_thread_budget(2, "--ranks", cap, "--threads"),
                    Catch::StartsWith("--ranks=2 x --threads=" + std::to_string(cap) + " = " + std::to_string(2 * cap) +
                                      " threads in this process: must be <= " + std::to_string(cap)));
  // threads 0 means all cores: counted as hardware_threads() each.
  CHECK_THROWS_WITH(check_thread_budget(5, "--ranks", 0, "--threads"), Catch::Contains("--threads=0 (all cores)"));
  CHECK_NOTHROW(check_thread_budget(4, "--ranks", 0, "--threads"));
}

// OMP_NUM_THREADS set by the launcher (srun, tools/tessera-sbatch) for one case, and put back.
struct ScopedOmpNumThreads {
  std::optional<std::string> saved;
  explicit ScopedOmpNumThreads(const char* value) {
    if (const char* old = std::getenv("OMP_NUM_THREADS")) saved = old;
    if (value) ::setenv("OMP_NUM_THREADS", value, 1);
    else ::unsetenv("OMP_NUM_THREADS");
  }
  ~ScopedOmpNumThreads() {
    if (saved) ::setenv("OMP_NUM_THREADS", saved->c_str(), 1);
    else ::unsetenv("OMP_NUM_THREADS");
  }
};

TEST_CASE("Flags threads: OMP_NUM_THREADS is the default when the flag is not given", "[core][flags]") {
  Args a({"--given=2"});
  {
    ScopedOmpNumThreads omp(nullptr);
    Flags f = a.flags();
    CHECK(f.threads("threads", 1) == 1);  // unset: the program's default
  }
  {
    ScopedOmpNumThreads omp("3");
    Flags f = a.flags();
    CHECK(f.threads("threads", 1) == 3);  // set by srun from SLURM_CPUS_PER_TASK, say
    CHECK(f.threads("given", 1) == 2);    // the command line wins
  }
  {
    ScopedOmpNumThreads omp("4,2");  // nested levels: the first is this process's team
    Flags f = a.flags();
    CHECK(f.threads("threads", 1) == 4);
  }
  for (const char* bad : {"0", "two", "-1", "3x"}) {
    ScopedOmpNumThreads omp(bad);
    Flags f = a.flags();
    CHECK_THROWS_WITH(f.threads("threads", 1), "environment variable OMP_NUM_THREADS='" + std::string(bad) +
                                                   "' is not a thread count (a positive integer)");
  }
}

TEST_CASE("Flags output paths: directory must exist and be writable; nothing created", "[core][flags]") {
  TempDir tmp;
  const std::string ok = (tmp.path / "ck.safetensors").string();
  const std::string missing = (tmp.path / "no-such-dir" / "ck.safetensors").string();
  Args a({"--checkpoint=" + ok, "--trace=" + missing, "--metrics=" + tmp.path.string(), "--plot="});
  Flags f = a.flags();
  CHECK(f.output_path("checkpoint", "") == ok);
  CHECK_FALSE(std::filesystem::exists(ok));  // checked, not created
  CHECK_THROWS_WITH(f.output_path("trace", ""),
                    "--trace=" + missing + ": directory '" + (tmp.path / "no-such-dir").string() +
                        "' does not exist (create it first)");
  CHECK_FALSE(std::filesystem::exists(tmp.path / "no-such-dir"));
  CHECK_THROWS_WITH(f.output_path("metrics", ""), Catch::EndsWith(": is a directory, not a file name"));
  CHECK(f.output_path("plot", "x.png").empty());  // given empty: no output, nothing to check
  CHECK(f.output_path("absent", "").empty());
  // A relative name is checked against the current directory.
  CHECK_NOTHROW(check_writable_output("relative-name.json", "--out"));

  // A file as the "directory".
  { std::ofstream(tmp.path / "file") << "x"; }
  CHECK_THROWS_WITH(check_writable_output((tmp.path / "file" / "x.json").string(), "--out"),
                    Catch::EndsWith("' is not a directory"));
  // A read-only directory (root ignores permission bits, so only where they apply).
  std::filesystem::create_directory(tmp.path / "ro");
  std::filesystem::permissions(tmp.path / "ro", std::filesystem::perms::owner_read | std::filesystem::perms::owner_exec);
  if (::geteuid() != 0)
    CHECK_THROWS_WITH(check_writable_output((tmp.path / "ro" / "x.json").string(), "--out"),
                      Catch::EndsWith("' is not writable"));
  std::filesystem::permissions(tmp.path / "ro", std::filesystem::perms::owner_all);
}

TEST_CASE("Flags input paths: a readable regular file", "[core][flags]") {
  TempDir tmp;
  { std::ofstream(tmp.path / "ck") << "x"; }
  Args a({"--resume=" + (tmp.path / "ck").string(), "--other=" + (tmp.path / "none").string(),
          "--dir=" + tmp.path.string()});
  Flags f = a.flags();
  CHECK(f.input_path("resume", "") == (tmp.path / "ck").string());
  CHECK_THROWS_WITH(f.input_path("other", ""), Catch::EndsWith("none: no such file"));
  CHECK_THROWS_WITH(f.input_path("dir", ""), Catch::EndsWith(": not a regular file"));
  CHECK(f.input_path("absent", "").empty());
}

// A bare --checkpoint once became the path "true" (a converter's bare --out wrote 70,000 files into
// ./true/); a bare flag is an on/off flag's true and every other kind's error, naming the flag.
TEST_CASE("Flags: a value-taking flag given without a value is refused by name", "[core][flags]") {
  Args a({"--checkpoint", "--resume", "--epochs", "--lr", "--name", "--compression", "--runs", "--verbose", "--plot="});
  Flags f = a.flags();
  CHECK_THROWS_WITH(f.output_path("checkpoint", ""),
                    "--checkpoint was given without a value: write --checkpoint=VALUE (only an on/off flag may be given bare)");
  CHECK_FALSE(std::filesystem::exists("true"));
  CHECK_THROWS_WITH(f.input_path("resume", ""), Catch::StartsWith("--resume was given without a value"));
  CHECK_THROWS_WITH(f.get("epochs", 5), Catch::StartsWith("--epochs was given without a value: write --epochs=N"));
  CHECK_THROWS_WITH(f.get("lr", 0.1), Catch::StartsWith("--lr was given without a value: write --lr=X"));
  CHECK_THROWS_WITH(f.get("name", std::string("x")), Catch::StartsWith("--name was given without a value"));
  CHECK_THROWS_WITH(f.choice("compression", "none", {"none", "fp16"}), Catch::StartsWith("--compression was given"));
  CHECK_THROWS_WITH(f.list("runs", "a", {}), Catch::StartsWith("--runs was given without a value"));
  CHECK(f.get("verbose", false));          // an on/off flag: bare is true
  CHECK(f.output_path("plot", "x.png").empty());  // given empty on purpose: still "none"
  // "--out true" (an explicit value) stays a value.
  Args b({"--out", "true"});
  Flags g = b.flags();
  CHECK(g.get("out", std::string()) == "true");
}

// --ranks under a launcher (mpirun, tessera-run) used to be ignored: now 0 when not given, and a
// given one is passed on for launch<E> to compare with what the launcher started.
TEST_CASE("Flags ranks: the threads build's count, or what a launcher started", "[core][flags]") {
  Args given({"--ranks=3"});
  Flags g = given.flags();
  CHECK(g.ranks("ranks", 2, false) == 3);
  CHECK(g.ranks("ranks", 2, true) == 3);
  Args absent({});
  Flags a = absent.flags();
  CHECK(a.ranks("ranks", 2, false) == 2);  // threads: the program's default
  CHECK(a.ranks("ranks", 2, true) == 0);   // a launcher's ranks: whatever it started
  Args zero({"--ranks=0"});
  Flags z = zero.flags();
  CHECK_THROWS_WITH(z.ranks("ranks", 2, true), Catch::StartsWith("--ranks=0: must be >= 1"));
  CHECK_NOTHROW(check_launched_ranks({.ranks = 0}, 4, "mpi"));
  CHECK_NOTHROW(check_launched_ranks({.ranks = 4}, 4, "mpi"));
  CHECK_THROWS_WITH(check_launched_ranks({.ranks = 3}, 2, "mpi"),
                    "--ranks=3 asks for 3 ranks, but the launcher started 2: with the mpi communicator the launcher "
                    "decides (mpirun -n, tessera-run -n, srun -n); leave --ranks out or make them agree");
}

TEST_CASE("Flags help: every flag read, in order, with its default and what it must be", "[core][flags]") {
  Args a({"--epochs=3"});
  Flags f = a.flags();
  f.get("epochs", std::int64_t{5}, {.min = 1});
  f.get("lr", 0.05, {.above = 0});
  f.choice("schedule", "1f1b", {"1f1b", "gpipe"});
  f.get("verify", false);
  f.get("data-dir", std::string());
  const std::string help = f.help();
  // The default, not the value given: help describes the program, not this command line.
  CHECK_THAT(help, Catch::Contains("  --epochs=5                >= 1\n"));
  CHECK_THAT(help, Catch::Contains("  --lr=0.05                 > 0\n"));
  CHECK_THAT(help, Catch::Contains("  --schedule=1f1b           one of 1f1b, gpipe\n"));
  CHECK_THAT(help, Catch::Contains("  --verify=false            true or false; a bare --verify is true\n"));
  CHECK_THAT(help, Catch::Contains("  --data-dir=\n"));
  CHECK(help.find("--epochs") < help.find("--lr"));
  CHECK(help.find("--lr") < help.find("--schedule"));
  CHECK(help.rfind("usage: ", 0) == 0);
  // Without --help, finish() returns (it exits 0 only when --help was given).
  f.finish();
}

TEST_CASE("Flags help: a flag's meaning, given last to any reader, leads its line", "[core][flags]") {
  Args a({"--lr=0.1", "--modes=sync"});
  Flags f = a.flags();
  f.get("epochs", 5, {.min = 1}, "passes over the training set");
  f.get("lr", 0.05, {.above = 0}, "learning rate");
  f.choice("schedule", "1f1b", {"1f1b", "gpipe"}, "micro-batch order");
  f.list("modes", "sync,async", {"sync", "async"}, "modes to run");
  f.int_list("periods", "1,8", {.min = 1}, "steps between averages");
  f.get("name", "run", "a label");
  f.threads("threads", 1, "OpenMP threads");
  f.get("lr", 0.05, {.above = 0}, "another meaning");  // a second read keeps the first meaning
  const std::string help = f.help();
  CHECK_THAT(help, Catch::Contains("  --epochs=5                passes over the training set (>= 1)\n"));
  // The default, not the value given (a given double once replaced it with the empty text).
  CHECK_THAT(help, Catch::Contains("  --lr=0.05                 learning rate (> 0)\n"));
  CHECK_THAT(help, Catch::Contains("  --schedule=1f1b           micro-batch order (one of 1f1b, gpipe)\n"));
  CHECK_THAT(help, Catch::Contains("  --modes=sync,async        modes to run (comma-separated, each one of sync, async)\n"));
  CHECK_THAT(help, Catch::Contains("  --periods=1,8             steps between averages (comma-separated integers, each >= 1)\n"));
  CHECK_THAT(help, Catch::Contains("  --name=run                a label\n"));
  CHECK_THAT(help, Catch::Contains("  --threads=1               OpenMP threads (1 to "));
  CHECK(help.find("another meaning") == std::string::npos);
  f.finish();
}
