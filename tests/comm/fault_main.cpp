// Failure scenarios for tests/comm/fault_test.py, one program per backend.
//
//   fault_program allreduce   loop over 64 MiB all_reduces (the test kills a rank meanwhile)
//   fault_program barrier     loop over barriers (likewise)
//   fault_program mismatch    rank 0 reduces 10 floats, the others 11 (run with TESSERA_COMM_DEBUG=1)
//   fault_program stall       rank 1 sleeps instead of joining an all_reduce
//   fault_program join        rendezvous and one barrier (the test starts fewer ranks than the size)
//
// Each rank prints "rank R ready pid P" after its first operation; a CommError is printed as
// "rank R: CommError: <text>" on stderr and exits with status 3.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "comm/program.hpp"

int main(int argc, char** argv) {
  using namespace tessera;
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "allreduce" && mode != "barrier" && mode != "mismatch" && mode != "stall" && mode != "join") {
    std::fprintf(stderr, "usage: %s allreduce|barrier|mismatch|stall|join\n", argv[0]);
    return 2;
  }
  return testing::run_ranks([&](testing::TestComm& comm) {
    const int rank = comm.rank();
    auto ready = [&] {
      std::printf("rank %d ready pid %d\n", rank, static_cast<int>(getpid()));
      std::fflush(stdout);
    };
    if (mode == "allreduce") {
      std::vector<float> g(16u << 20, 1.0f);
      comm.all_reduce(std::span<float>(g), ReduceOp::Sum);
      ready();
      for (;;) comm.all_reduce(std::span<float>(g), ReduceOp::Avg);
    } else if (mode == "barrier") {
      comm.barrier();
      ready();
      for (;;) comm.barrier();
    } else if (mode == "mismatch") {
      ready();
      std::vector<float> g(rank == 0 ? 10 : 11, 1.0f);
      comm.all_reduce(std::span<float>(g), ReduceOp::Sum);
      std::printf("rank %d: all_reduce returned despite the mismatch\n", rank);
    } else if (mode == "stall") {
      comm.barrier();
      ready();
      if (rank == 1) std::this_thread::sleep_for(std::chrono::hours(1));
      std::vector<float> g(1000, 1.0f);
      comm.all_reduce(std::span<float>(g), ReduceOp::Sum);
    } else {  // join
      comm.barrier();
      ready();
    }
    return 0;
  });
}
