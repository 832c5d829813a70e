// The conformance suite as a multi-process program: every rank runs it, prints its failures, and
// exits non-zero if it had any. Launched by tests/meson.build under mpirun or tessera-run.
#include <cstdio>
#include <cstring>
#include <exception>

#include "comm/backend.hpp"
#include "comm/conformance.hpp"

int main(int argc, char** argv) {
  using namespace tessera;
  int rank = -1;
  try {
    auto comm = testing::open_backend();
    rank = comm.rank();
    testing::ConformanceOptions options;
    options.verbose = true;
    for (int i = 1; i < argc; ++i)
      if (std::strcmp(argv[i], "--no-large") == 0) options.large_bytes = 0;
    if (rank == 0) std::printf("conformance: %s, %d ranks\n", testing::backend_name(), comm.size());
    testing::Conformance<testing::BackendComm> suite(comm, options);
    const auto failures = suite.run();
    for (const auto& f : failures) std::fprintf(stderr, "FAILED %s\n", f.c_str());
    std::printf("rank %d: %d checks, %zu failed\n", rank, suite.checks(), failures.size());
    std::fflush(stdout);
    comm.barrier();  // nobody tears the connections down while a peer still finishes
    return failures.empty() ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    return 1;
  }
}
