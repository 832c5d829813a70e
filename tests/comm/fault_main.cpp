// Failure scenarios for tests/comm/fault_test.py, one program per backend.
//
//   fault_program allreduce   loop over 64 MiB all_reduces (the test kills a rank meanwhile)
//   fault_program barrier     loop over barriers (likewise)
//   fault_program mismatch    rank 0 reduces 10 floats, the others 11 (the first call: checked)
//   fault_program mismatch-dtype | mismatch-op | mismatch-root | mismatch-kind
//                             rank 0 differs from the others in the element type, the reduce op,
//                             the broadcast root, or the collective (broadcast vs all_reduce)
//   fault_program mismatch-late-op | mismatch-late-count
//                             100 matching all_reduces, then rank 0 reduces with max (or 10
//                             floats) where the others sum (or 11): a call the sampled check
//                             skips, found at the next checked call
//   fault_program stall       40 matching all_reduces (past the checked first calls), then rank 1
//                             sleeps instead of joining the next one
//   fault_program join        rendezvous and one barrier (the test starts fewer ranks than the size)
//   fault_program throw       one all_reduce, then rank 1 fails with an ordinary error (a corrupt
//                             image, not a communication error) while the others go on reducing
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
  const bool mismatch = mode.rfind("mismatch", 0) == 0;
  if (mode != "allreduce" && mode != "barrier" && mode != "mismatch" && mode != "mismatch-dtype" &&
      mode != "mismatch-op" && mode != "mismatch-root" && mode != "mismatch-kind" && mode != "mismatch-late-op" &&
      mode != "mismatch-late-count" && mode != "stall" && mode != "join" && mode != "throw") {
    std::fprintf(stderr,
                 "usage: %s allreduce|barrier|mismatch[-dtype|-op|-root|-kind|-late-op|-late-count]|stall|join|throw\n",
                 argv[0]);
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
    } else if (mismatch) {
      ready();
      const bool odd = rank == 0;  // rank 0 is the odd one out
      std::vector<float> g(11, 1.0f);
      std::vector<double> d(11, 1.0);
      if (mode.rfind("mismatch-late", 0) == 0)
        for (int i = 0; i < 100; ++i) comm.all_reduce(std::span<float>(g), ReduceOp::Sum);
      if (mode == "mismatch" || mode == "mismatch-late-count") {
        comm.all_reduce(std::span<float>(g.data(), odd ? 10 : 11), ReduceOp::Sum);
      } else if (mode == "mismatch-dtype") {
        if (odd) comm.all_reduce(std::span<double>(d), ReduceOp::Sum);
        else comm.all_reduce(std::span<float>(g), ReduceOp::Sum);
      } else if (mode == "mismatch-op" || mode == "mismatch-late-op") {
        comm.all_reduce(std::span<float>(g), odd ? ReduceOp::Max : ReduceOp::Sum);
      } else if (mode == "mismatch-root") {
        comm.broadcast(std::span<float>(g), odd ? 0 : 1);
      } else {  // mismatch-kind
        if (odd) comm.broadcast(std::span<float>(g), 0);
        else comm.all_reduce(std::span<float>(g), ReduceOp::Sum);
      }
      // A mismatch the check skipped is found at the next checked call (at most 16 later).
      for (int i = 0; i < 32; ++i) comm.all_reduce(std::span<float>(g), ReduceOp::Sum);
      std::printf("rank %d: all_reduce returned despite the mismatch\n", rank);
    } else if (mode == "stall") {
      comm.barrier();
      std::vector<float> g(1000, 1.0f);
      for (int i = 0; i < 40; ++i) comm.all_reduce(std::span<float>(g), ReduceOp::Sum);
      ready();
      if (rank == 1) std::this_thread::sleep_for(std::chrono::hours(1));
      comm.all_reduce(std::span<float>(g), ReduceOp::Sum);
    } else if (mode == "throw") {
      std::vector<float> g(1000, 1.0f);
      comm.all_reduce(std::span<float>(g), ReduceOp::Sum);
      ready();
      if (rank == 1) throw IoError("shard1/img_7.png: not a PNG file (a corrupt image: the test's ordinary error)");
      for (;;) comm.all_reduce(std::span<float>(g), ReduceOp::Sum);
    } else {  // join
      comm.barrier();
      ready();
    }
    return 0;
  });
}
