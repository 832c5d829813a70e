// The conformance suite as a multi-process program: every rank runs it, prints its failures, and
// exits non-zero if it had any. Built once per backend (tests/meson.build) and launched under
// mpirun or tessera-run.
#include <cstdio>
#include <cstring>

#include "comm/conformance.hpp"
#include "comm/program.hpp"

// Whether c spins while it waits for a peer: only a communicator that can (GlooComm) says so.
template <class C>
bool busy_polls(const C& c) {
  if constexpr (requires { c.busy_polls(); }) return c.busy_polls();
  else return false;
}

int main(int argc, char** argv) {
  using namespace tessera;
  testing::ConformanceOptions options;
  options.verbose = true;
  bool expect_busy_poll = false;  // --expect-busy-poll: the run must exercise GlooComm's spinning waits
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--no-large") == 0) options.large_bytes = 0;
    if (std::strcmp(argv[i], "--expect-busy-poll") == 0) expect_busy_poll = true;
  }
  return testing::run_ranks([&](testing::TestComm& comm) {
    if (comm.rank() == 0) std::printf("conformance: %s, %d ranks\n", testing::backend_name(), comm.size());
    testing::Conformance<testing::TestComm> suite(comm, options);
    auto failures = suite.run();
    if (expect_busy_poll) {
      if (!busy_polls(comm)) failures.push_back("--expect-busy-poll: this communicator did not busy-poll its waits");
    }
    for (const auto& f : failures) std::fprintf(stderr, "FAILED %s\n", f.c_str());
    std::printf("rank %d: %d checks, %zu failed\n", comm.rank(), suite.checks(), failures.size());
    std::fflush(stdout);
    comm.barrier();  // nobody tears the connections down while a peer still finishes
    return failures.empty() ? 0 : 1;
  }, testing::launch_options(argc, argv));
}
