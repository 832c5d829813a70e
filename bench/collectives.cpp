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
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#if defined(TESSERA_BENCH_MPI)
#include "tessera/comm/mpi.hpp"
#elif defined(TESSERA_BENCH_GLOO)
#include <gloo/reduce_scatter.h>

#include "tessera/comm/gloo.hpp"
#else
#include <omp.h>

#include "tessera/comm/threads.hpp"
#endif

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::size_t min_bytes = 4u << 10;
  std::size_t max_bytes = 256u << 20;
  int rounds = 5;               // alternating Tessera / raw rounds per size; medians reported
  double round_seconds = 0.05;  // each round repeats the op at least this long (and >= 2 times)
  std::vector<int> thread_ranks = {2, 4};
  std::vector<std::string> ops = {"all_reduce", "all_gather", "reduce_scatter", "broadcast"};
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (a == "--max-bytes") o.max_bytes = std::strtoull(next().c_str(), nullptr, 10);
    else if (a == "--min-bytes") o.min_bytes = std::strtoull(next().c_str(), nullptr, 10);
    else if (a == "--rounds") o.rounds = std::atoi(next().c_str());
    else if (a == "--round-seconds") o.round_seconds = std::atof(next().c_str());
    else if (a == "--ops") {
      o.ops.clear();
      const std::string list = next();
      for (std::size_t p = 0; p < list.size();) {
        const auto comma = list.find(',', p);
        o.ops.push_back(list.substr(p, comma == std::string::npos ? std::string::npos : comma - p));
        p = comma == std::string::npos ? list.size() : comma + 1;
      }
    }
    else if (a == "--ranks") {
      o.thread_ranks.clear();
      const std::string list = next();
      for (std::size_t p = 0; p < list.size();) {
        o.thread_ranks.push_back(std::atoi(list.c_str() + p));
        const auto comma = list.find(',', p);
        p = comma == std::string::npos ? list.size() : comma + 1;
      }
    } else {
      std::fprintf(stderr, "usage: %s [--min-bytes B] [--max-bytes B] [--rounds R] [--round-seconds S] [--ranks 2,4] [--ops a,b]\n",
                   argv[0]);
      std::exit(2);
    }
  }
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

}  // namespace

#if defined(TESSERA_BENCH_MPI)

int main(int argc, char** argv) {
  using namespace tessera;
  const Options o = parse(argc, argv);
  auto comm = MpiComm::world();
  const int rank = comm.rank(), n = comm.size();
  if (rank == 0) header();
  auto barrier = [] { MPI_Barrier(MPI_COMM_WORLD); };
  auto max_over = [](double t) {
    MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return t;
  };
  auto impls_for = [&](const std::string& op) {
    std::vector<Impl> impls = {tessera_impl(comm, op)};
    if (op == "all_reduce")
      impls.push_back({"raw MPI_Allreduce", [](Buffers& b, std::size_t) {
                         MPI_Allreduce(MPI_IN_PLACE, b.a.data(), static_cast<int>(b.a.size()), MPI_FLOAT, MPI_SUM,
                                       MPI_COMM_WORLD);
                       }});
    else if (op == "all_gather")
      impls.push_back({"raw MPI_Allgather", [](Buffers& b, std::size_t) {
                         MPI_Allgather(b.a.data(), static_cast<int>(b.a.size()), MPI_FLOAT, b.b.data(),
                                       static_cast<int>(b.a.size()), MPI_FLOAT, MPI_COMM_WORLD);
                       }});
    else if (op == "reduce_scatter")
      impls.push_back({"raw MPI_Reduce_scatter_block", [](Buffers& b, std::size_t) {
                         MPI_Reduce_scatter_block(b.a.data(), b.b.data(), static_cast<int>(b.b.size()), MPI_FLOAT,
                                                  MPI_SUM, MPI_COMM_WORLD);
                       }});
    else
      impls.push_back({"raw MPI_Bcast", [n](Buffers& b, std::size_t) {
                         MPI_Bcast(b.a.data(), static_cast<int>(b.a.size()), MPI_FLOAT, n - 1, MPI_COMM_WORLD);
                       }});
    return impls;
  };
  run_all("mpi", rank, n, o, impls_for, barrier, max_over);
  return 0;
}

#elif defined(TESSERA_BENCH_GLOO)

int main(int argc, char** argv) {
  using namespace tessera;
  const Options o = parse(argc, argv);
  auto comm = GlooComm::from_env();
  const int rank = comm.rank(), n = comm.size();
  const auto context = comm.native();
  if (rank == 0) header();
  // Raw calls get tags from a range the communicator never reaches in this run.
  std::uint32_t raw_tag = 0x40000000u;
  auto barrier = [&] {
    gloo::BarrierOptions opts(context);
    opts.setTag(raw_tag++);
    gloo::barrier(opts);
  };
  auto max_over = [&](double t) {
    gloo::AllreduceOptions opts(context);
    opts.setOutput(&t, 1);
    opts.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::max<double>));
    opts.setTag(raw_tag++);
    gloo::allreduce(opts);
    return t;
  };
  auto raw_allreduce = [&](gloo::AllreduceOptions::Algorithm algorithm) {
    return [&, algorithm](Buffers& b, std::size_t) {
      gloo::AllreduceOptions opts(context);
      opts.setOutput(b.a.data(), b.a.size());
      opts.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
      opts.setAlgorithm(algorithm);
      opts.setTag(raw_tag++);
      gloo::allreduce(opts);
    };
  };
  // The old-style halving-doubling reduce-scatter is built once per size (as it is meant to be
  // used) and then run; rebuilding it when the buffer changes.
  std::unique_ptr<gloo::ReduceScatterHalvingDoubling<float>> rs;
  const float* rs_for = nullptr;
  std::vector<float> rs_work;
  auto impls_for = [&](const std::string& op) {
    std::vector<Impl> impls = {tessera_impl(comm, op)};
    if (op == "all_reduce") {
      impls.push_back({"raw gloo::allreduce ring", raw_allreduce(gloo::AllreduceOptions::Algorithm::RING)});
      impls.push_back({"raw gloo::allreduce bcube", raw_allreduce(gloo::AllreduceOptions::Algorithm::BCUBE)});
    } else if (op == "all_gather") {
      impls.push_back({"raw gloo::allgather", [&](Buffers& b, std::size_t) {
                         gloo::AllgatherOptions opts(context);
                         opts.setInput(b.a.data(), b.a.size());
                         opts.setOutput(b.b.data(), b.b.size());
                         opts.setTag(raw_tag++);
                         gloo::allgather(opts);
                       }});
    } else if (op == "reduce_scatter") {
      impls.push_back({"raw gloo::ReduceScatterHalvingDoubling", [&](Buffers& b, std::size_t) {
                         // In place on a work copy of the input, like the algorithm requires.
                         if (rs_for != b.a.data()) {
                           rs_work = b.a;
                           std::vector<int> counts(static_cast<std::size_t>(n), static_cast<int>(b.b.size()));
                           rs = std::make_unique<gloo::ReduceScatterHalvingDoubling<float>>(
                               context, std::vector<float*>{rs_work.data()}, static_cast<int>(rs_work.size()), counts);
                           rs_for = b.a.data();
                         }
                         rs->run();
                       }});
    } else {
      impls.push_back({"raw gloo::broadcast", [&, n](Buffers& b, std::size_t) {
                         gloo::BroadcastOptions opts(context);
                         opts.setOutput(b.a.data(), b.a.size());
                         opts.setRoot(n - 1);
                         opts.setTag(raw_tag++);
                         gloo::broadcast(opts);
                       }});
    }
    return impls;
  };
  run_all("gloo", rank, n, o, impls_for, barrier, max_over);
  return 0;
}

#else

// STREAM triad a[i] = b[i] + s c[i] over arrays far larger than the caches, with `threads`
// OpenMP threads; bytes counted as STREAM does (3 x 8 per element; no write-allocate).
double stream_triad_GBps(int threads) {
  const std::size_t n = std::size_t(1) << 25;  // 32 Mi doubles = 256 MiB per array
  std::vector<double> a(n), b(n), c(n);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (std::size_t i = 0; i < n; ++i) a[i] = 0, b[i] = 1, c[i] = 2;  // first touch by the same threads
  std::vector<double> rates;
  for (int rep = 0; rep < 7; ++rep) {
    const auto start = Clock::now();
#pragma omp parallel for num_threads(threads) schedule(static)
    for (std::size_t i = 0; i < n; ++i) a[i] = b[i] + 3.0 * c[i];
    const double s = std::chrono::duration<double>(Clock::now() - start).count();
    rates.push_back(3.0 * sizeof(double) * n / s / 1e9);
  }
  return *std::max_element(rates.begin(), rates.end());  // STREAM reports the best
}

int main(int argc, char** argv) {
  using namespace tessera;
  const Options o = parse(argc, argv);
  header();
  for (int threads : {1, 2}) {
    const double triad = stream_triad_GBps(threads);
    std::printf("{\"bench\": \"stream_triad\", \"threads\": %d, \"GBps\": %.3f}\n", threads, triad);
    std::fprintf(stderr, "STREAM triad, %d thread(s): %.2f GB/s\n", threads, triad);
  }
  for (int n : o.thread_ranks) {
    ThreadWorld world(n);
    world.run([&](ThreadComm& comm) {
      auto barrier = [&] { comm.barrier(); };
      auto max_over = [&](double t) {
        comm.all_reduce(std::span<double>(&t, 1), ReduceOp::Max);
        return t;
      };
      auto impls_for = [&](const std::string& op) { return std::vector<Impl>{tessera_impl(comm, op)}; };
      run_all("threads", comm.rank(), n, o, impls_for, barrier, max_over);
    });
  }
  // The triad again at the end: the machine is shared, so bracket the run.
  const double triad = stream_triad_GBps(2);
  std::printf("{\"bench\": \"stream_triad\", \"threads\": 2, \"GBps\": %.3f, \"when\": \"after\"}\n", triad);
  std::fprintf(stderr, "STREAM triad, 2 threads, after: %.2f GB/s\n", triad);
  return 0;
}

#endif
