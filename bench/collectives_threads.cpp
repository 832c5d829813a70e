// Collectives over ThreadComm, bracketed by the STREAM triad (bench/collectives.hpp has the driver).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "tessera/comm/threads.hpp"
#include "collectives.hpp"

using namespace collectives_bench;
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
