// Collective benchmark in the style of nccl-tests: all_reduce, all_gather, reduce_scatter and
// broadcast of float32 from 4 KiB to 256 MiB, with time, algbw and busbw, and in the same run the
// raw library call for the same sizes, alternating Tessera and raw rounds so that machine noise
// hits both alike.
//
// One source, one binary per backend (tests/meson.build style macros):
//   collectives_threads [--ranks 2,4]      ThreadComm; raw = none, a STREAM triad is measured
//                                          instead (memory bandwidth is the shared-memory bound)
//   mpirun -n N collectives_mpi            MpiComm vs MPI_Allreduce / MPI_Allgather /
//                                          MPI_Reduce_scatter_block / MPI_Bcast
//   tessera-run -n N collectives_gloo      GlooComm vs gloo::allreduce (ring and bcube),
//                                          gloo::allgather, gloo::ReduceScatterHalvingDoubling,
//                                          gloo::broadcast
//
// Sizes follow nccl-tests: "bytes" is the all_reduce/broadcast buffer, the all_gather output and
// the reduce_scatter input. algbw = bytes / time; busbw = algbw x 2(n-1)/n for all_reduce,
// x (n-1)/n for all_gather and reduce_scatter, x 1 for broadcast: the per-link traffic of the
// optimal algorithm, comparable across rank counts. Time per operation is the slowest rank's.
// Output: one JSON object per line on stdout (rank 0), a table on stderr.
//
// This header is the driver every backend shares; each collectives_<backend>.cpp holds the
// backend's main and its raw-library baseline (MPI_Allreduce, gloo::allreduce; STREAM for threads).
#pragma once
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <span>
#include <vector>

#include "tessera/comm/communicator.hpp"
#include "tessera/io/flags.hpp"

namespace collectives_bench {

using Clock = std::chrono::steady_clock;

struct Options {
  std::size_t min_bytes = 4u << 10;
  std::size_t max_bytes = 256u << 20;
  int rounds = 5;               // alternating Tessera / raw rounds per size; medians reported
  double round_seconds = 0.05;  // each round repeats the op at least this long (and >= 2 times)
  std::vector<int> thread_ranks = {2, 4};
  std::vector<std::string> ops = {"all_reduce", "all_gather", "reduce_scatter", "broadcast"};
};

// --name=value or --name value (tessera::Flags); every value is checked before anything runs,
// and a bad one ends the program with its message and status 2 (the mains catch nothing).
Options parse_flags(int argc, char** argv);
Options parse(int argc, char** argv) {
  try {
    return parse_flags(argc, argv);
  } catch (const tessera::ArgumentError& e) {
    std::fprintf(stderr, "%s: %s\nusage: %s [--min-bytes B] [--max-bytes B] [--rounds R] [--round-seconds S] "
                 "[--ranks 2,4] [--ops a,b]\n", argv[0], e.what(), argv[0]);
    std::exit(2);
  }
}

Options parse_flags(int argc, char** argv) {
  tessera::Flags flags(argc, argv);
  Options o;
  // Sizes go min, 4 min, 16 min, ... up to max: at least one float, at most 16 GiB per buffer.
  const tessera::FlagRange bytes{.min = 4, .max = static_cast<double>(std::int64_t{1} << 34)};
  o.min_bytes = static_cast<std::size_t>(flags.get("min-bytes", static_cast<std::int64_t>(o.min_bytes), bytes));
  o.max_bytes = static_cast<std::size_t>(flags.get("max-bytes", static_cast<std::int64_t>(o.max_bytes), bytes));
  TESSERA_CHECK(o.min_bytes <= o.max_bytes, tessera::ArgumentError, "--min-bytes=", o.min_bytes,
                " is above --max-bytes=", o.max_bytes);
  o.rounds = flags.get("rounds", o.rounds, {.min = 1});
  o.round_seconds = flags.get("round-seconds", o.round_seconds, {.above = 0, .max = 3600});
  // An unknown name would otherwise be timed as a broadcast (tessera_impl's last case).
  o.ops = flags.list("ops", "all_reduce,all_gather,reduce_scatter,broadcast",
                     {"all_reduce", "all_gather", "reduce_scatter", "broadcast"});
  // --ranks: the threads build's rank counts, each bounded like threads (1 .. max_threads()).
  o.thread_ranks.clear();
  for (const std::string& item : flags.list("ranks", "2,4")) {
    int n = 0;
    const auto r = std::from_chars(item.data(), item.data() + item.size(), n);
    TESSERA_CHECK(r.ec == std::errc() && r.ptr == item.data() + item.size() && n >= 1 && n <= tessera::max_threads(),
                  tessera::ArgumentError, "--ranks: '", item, "' must be a rank count in [1, ", tessera::max_threads(),
                  "] (4 x the ", tessera::hardware_threads(), " hardware threads of this machine)");
    o.thread_ranks.push_back(n);
  }
  flags.finish();
  return o;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

double bus_factor(const std::string& op, int n) {
  if (op == "all_reduce") return 2.0 * (n - 1) / n;
  if (op == "broadcast") return 1.0;
  return static_cast<double>(n - 1) / n;  // all_gather, reduce_scatter
}

// What one rank needs to run an op of a given size: buffers sized per nccl-tests' convention.
struct Buffers {
  std::vector<float> a, b;
};

// One implementation of one op ("tessera" or "raw..."), to be timed.
struct Impl {
  std::string name;
  std::function<void(Buffers&, std::size_t count)> run;  // count = elements of "bytes"
};

void prepare(Buffers& buf, const std::string& op, std::size_t count, int n) {
  // Zeros: sums stay zero, so repeated in-place reductions never reach inf or denormals.
  const std::size_t shard = count / static_cast<std::size_t>(n);
  if (op == "all_reduce" || op == "broadcast") buf.a.assign(count, 0.0f), buf.b.clear();
  else if (op == "all_gather") buf.a.assign(shard, 0.0f), buf.b.assign(shard * n, 0.0f);
  else buf.a.assign(shard * n, 0.0f), buf.b.assign(shard, 0.0f);  // reduce_scatter
}

// Times `impl` on this rank for one round: repeat until round_seconds has passed (decided
// collectively: rank 0's decision is broadcast via `agree`), return seconds per op.
template <class Barrier, class MaxOver>
double time_round(const Impl& impl, Buffers& buf, std::size_t count, const Options& o, Barrier&& barrier,
                  MaxOver&& max_over) {
  impl.run(buf, count);  // warm-up (first touch, connection setup, caches)
  barrier();
  int iterations = 0;
  const auto start = Clock::now();
  double elapsed = 0;
  // Each rank runs the same number of iterations: the count doubles until rank 0's clock (taken
  // collectively through max_over) says the round is long enough.
  int batch = 1;
  for (;;) {
    for (int i = 0; i < batch; ++i) impl.run(buf, count);
    iterations += batch;
    elapsed = max_over(std::chrono::duration<double>(Clock::now() - start).count());
    if (elapsed >= o.round_seconds && iterations >= 2) break;
    batch *= 2;
  }
  return elapsed / iterations;
}

struct Row {
  std::string comm, impl, op;
  int ranks;
  std::size_t bytes;
  double seconds;
};

void emit(const Row& r) {
  const double algbw = r.bytes / r.seconds / 1e9;
  const double busbw = algbw * bus_factor(r.op, r.ranks);
  std::printf(
      "{\"bench\": \"collectives\", \"comm\": \"%s\", \"impl\": \"%s\", \"op\": \"%s\", \"ranks\": %d, \"bytes\": %zu, "
      "\"time_us\": %.2f, \"algbw_GBps\": %.4f, \"busbw_GBps\": %.4f}\n",
      r.comm.c_str(), r.impl.c_str(), r.op.c_str(), r.ranks, r.bytes, r.seconds * 1e6, algbw, busbw);
  std::fflush(stdout);
  std::fprintf(stderr, "%-8s %-6s %-15s %3d %11zu %12.1f %9.3f %9.3f  %s\n", r.comm.c_str(), "", r.op.c_str(), r.ranks,
               r.bytes, r.seconds * 1e6, algbw, busbw, r.impl.c_str());
}

void header() {
  std::fprintf(stderr, "%-8s %-6s %-15s %3s %11s %12s %9s %9s  %s\n", "comm", "", "op", "n", "bytes", "time_us",
               "algbw", "busbw", "impl");
}

// Runs every op and size over the implementations, alternating them round by round.
template <class Barrier, class MaxOver>
void run_all(const std::string& comm_name, int rank, int n, const Options& o,
             const std::function<std::vector<Impl>(const std::string& op)>& impls_for, Barrier&& barrier,
             MaxOver&& max_over) {
  for (const std::string& op : o.ops) {
    const auto impls = impls_for(op);
    for (std::size_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= 4) {
      const std::size_t count = bytes / sizeof(float);
      Buffers buf;
      prepare(buf, op, count, n);
      std::vector<std::vector<double>> times(impls.size());
      // Round r starts with implementation r mod k, so none always runs first (or after the same one).
      for (int round = 0; round < o.rounds; ++round)
        for (std::size_t j = 0; j < impls.size(); ++j) {
          const std::size_t k = (j + static_cast<std::size_t>(round)) % impls.size();
          times[k].push_back(time_round(impls[k], buf, count, o, barrier, max_over));
        }
      if (rank == 0)
        for (std::size_t k = 0; k < impls.size(); ++k) emit({comm_name, impls[k].name, op, n, bytes, median(times[k])});
    }
  }
}

template <class Comm>
Impl tessera_impl(Comm& comm, const std::string& op) {
  if (op == "all_reduce")
    return {"tessera", [&comm](Buffers& b, std::size_t) { comm.all_reduce(std::span<float>(b.a), tessera::ReduceOp::Sum); }};
  if (op == "all_gather")
    return {"tessera", [&comm](Buffers& b, std::size_t) {
              comm.all_gather(std::span<const float>(b.a), std::span<float>(b.b));
            }};
  if (op == "reduce_scatter")
    return {"tessera", [&comm](Buffers& b, std::size_t) {
              comm.reduce_scatter(std::span<const float>(b.a), std::span<float>(b.b), tessera::ReduceOp::Sum);
            }};
  return {"tessera", [&comm](Buffers& b, std::size_t) { comm.broadcast(std::span<float>(b.a), comm.size() - 1); }};
}

}  // namespace collectives_bench
