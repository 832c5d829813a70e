// all_reduce bandwidth between ranks on separate hosts, for tests/net/netns_test.py: the ranks sit
// in network namespaces joined by a bridge, one link limited with tc's token bucket, and the test
// compares the measured bus bandwidth with the limit. One program per backend (tests/meson.build).
//
//   bandwidth_program [--bytes B] [--seconds S] [--max-iterations K]
//
// After one warm-up call, times all_reduce(sum) of B bytes of float32 (default 4 MiB) until S
// seconds (default 2) or K calls (default 50) have passed, each call started together (barrier) and
// timed as the slowest rank's (max over ranks). Rank 0 prints one JSON line:
//   {"bench": "netns_all_reduce", "backend": ..., "ranks": n, "bytes": B, "iterations": k,
//    "median_s": ..., "algbw_MBps": B / median, "busbw_MBps": algbw x 2(n-1)/n}
// busbw is each rank's traffic per second in each direction for a bandwidth-optimal all_reduce
// (the nccl-tests convention), so on a bottleneck link it approaches the link's rate.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "comm/program.hpp"

int main(int argc, char** argv) {
  using namespace tessera;
  std::size_t bytes = 4u << 20;
  double seconds = 2.0;
  int max_iterations = 50;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--bytes") == 0) bytes = std::strtoull(argv[i + 1], nullptr, 10);
    else if (std::strcmp(argv[i], "--seconds") == 0) seconds = std::atof(argv[i + 1]);
    else if (std::strcmp(argv[i], "--max-iterations") == 0) max_iterations = std::atoi(argv[i + 1]);
    else bytes = 0;  // unknown flag: usage below
  }
  if (argc % 2 == 0 || bytes < sizeof(float) || seconds <= 0 || max_iterations < 1) {
    std::fprintf(stderr, "usage: %s [--bytes B >= 4] [--seconds S > 0] [--max-iterations K >= 1]\n", argv[0]);
    return 2;
  }
  return testing::run_ranks([&](testing::TestComm& comm) {
    using Clock = std::chrono::steady_clock;
    const int n = comm.size();
    std::vector<float> data(bytes / sizeof(float), 1.0f);
    comm.all_reduce(std::span<float>(data), ReduceOp::Sum);  // warm-up: connections, page faults
    std::vector<double> times;
    const auto end = Clock::now() + std::chrono::duration<double>(seconds);
    // Every rank must make the same number of calls: rank 0 decides whether to go on.
    for (int go = 1; go;) {
      comm.barrier();
      const auto t0 = Clock::now();
      comm.all_reduce(std::span<float>(data), ReduceOp::Sum);
      double t[1] = {std::chrono::duration<double>(Clock::now() - t0).count()};
      comm.all_reduce(std::span<double>(t), ReduceOp::Max);
      times.push_back(t[0]);
      int more[1] = {comm.rank() != 0 || (Clock::now() < end && static_cast<int>(times.size()) < max_iterations)};
      comm.broadcast(std::span<int>(more), 0);
      go = more[0];
    }
    std::sort(times.begin(), times.end());
    const double median = times[times.size() / 2];
    const double algbw = static_cast<double>(data.size() * sizeof(float)) / median / 1e6;
    const double busbw = algbw * 2.0 * (n - 1) / n;
    if (comm.rank() == 0)
      std::printf("{\"bench\": \"netns_all_reduce\", \"backend\": \"%s\", \"ranks\": %d, \"bytes\": %zu, "
                  "\"iterations\": %zu, \"median_s\": %.6f, \"min_s\": %.6f, \"max_s\": %.6f, \"algbw_MBps\": %.3f, "
                  "\"busbw_MBps\": %.3f}\n",
                  testing::backend_name(), n, data.size() * sizeof(float), times.size(), median, times.front(),
                  times.back(), algbw, busbw);
    std::fflush(stdout);
    comm.barrier();
    return 0;
  });
}
