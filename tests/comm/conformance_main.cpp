// The conformance suite as a multi-process program: every rank runs it, prints its failures, and
// exits non-zero if it had any. Built once per backend (tests/meson.build) and launched under
// mpirun or tessera-run.
#include <cstdio>
#include <cstring>

#include "comm/conformance.hpp"
#include "comm/program.hpp"

int main(int argc, char** argv) {
  using namespace tessera;
  testing::ConformanceOptions options;
  options.verbose = true;
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--no-large") == 0) options.large_bytes = 0;
  return testing::run_ranks([&](testing::TestComm& comm) {
    if (comm.rank() == 0) std::printf("conformance: %s, %d ranks\n", testing::backend_name(), comm.size());
    testing::Conformance<testing::TestComm> suite(comm, options);
    const auto failures = suite.run();
    for (const auto& f : failures) std::fprintf(stderr, "FAILED %s\n", f.c_str());
    std::printf("rank %d: %d checks, %zu failed\n", comm.rank(), suite.checks(), failures.size());
    std::fflush(stdout);
    comm.barrier();  // nobody tears the connections down while a peer still finishes
    return failures.empty() ? 0 : 1;
  }, testing::launch_options(argc, argv));
}
