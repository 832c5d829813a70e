// The NCCL conformance suite, compiled once for the three programs of conformance_nccl.hpp.

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "comm/conformance.hpp"
#include "cuda/conformance_nccl.hpp"
#include "cuda/device_buffers.hpp"
#include "tessera/comm/nccl.hpp"

namespace tessera::testing {
namespace {

// A second from_env in the same run meets on an id file of its own (not the first's), and rank 0
// removes each file once every rank has joined. Only meaningful where the ranks met by from_env.
void check_second_from_env(int rank, std::vector<std::string>& failures, int& checks) {
  auto second = NcclComm::from_env();
  std::int64_t value = second.rank() + 1;
  second.all_reduce(std::span<std::int64_t>(&value, 1), ReduceOp::Sum);
  const std::int64_t expected = std::int64_t{second.size()} * (second.size() + 1) / 2;
  if (value != expected)
    failures.push_back("second from_env: all_reduce gave " + std::to_string(value) + ", expected " +
                       std::to_string(expected));
  second.barrier();
  const std::string store = LaunchEnv::from_environment().store;
  if (rank == 0 && store.rfind("file://", 0) == 0)
    for (const auto& entry : std::filesystem::directory_iterator(store.substr(7)))
      if (entry.path().filename().string().find("nccl_unique_id") != std::string::npos)
        failures.push_back("from_env left its id file behind: " + entry.path().string());
  checks += 2;
}

}  // namespace

int run_nccl_conformance(int argc, char** argv, const char* bootstrap, NcclComm (*open)(), bool from_env) {
  if (Cuda::device_count() == 0) {
    std::printf("conformance_nccl: no CUDA device, skipped\n");
    return 77;
  }
  int rank = -1;
  try {
    NcclComm comm = open();
    rank = comm.rank();
    ConformanceOptions options;
    options.verbose = true;
    bool host_buffers = false;
    for (int i = 1; i < argc; ++i) {
      if (std::strcmp(argv[i], "--no-large") == 0) options.large_bytes = 0;
      host_buffers = host_buffers || std::strcmp(argv[i], "--host-buffers") == 0;
    }
    if (rank == 0) std::printf("conformance: nccl (%s), %d ranks\n", bootstrap, comm.size());
    std::vector<std::string> failures;
    int checks = 0;
    if (host_buffers) {
      Conformance<NcclComm> suite(comm, options);
      failures = suite.run();
      checks = suite.checks();
    } else {
      Conformance<NcclComm, DeviceBuffers> suite(comm, options);
      failures = suite.run();
      checks = suite.checks();
    }
    if (from_env) check_second_from_env(rank, failures, checks);
    for (const auto& f : failures) std::fprintf(stderr, "FAILED %s\n", f.c_str());
    std::printf("rank %d (GPU %d): %d checks, %zu failed\n", rank, comm.device(), checks, failures.size());
    std::fflush(stdout);
    comm.barrier();
    return failures.empty() ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    return 1;
  }
}

}  // namespace tessera::testing
