// Fuzz target: LaunchEnv::from_environment (include/tessera/comm/launch_env.hpp), which every
// communicator's from_env() uses to read rank, world size, local rank and the rendezvous store
// from what a launcher (tools/tessera-run, mpirun, srun) put in the environment. The input is
// split at NUL bytes into the values of the ten variables below, in order; a missing field leaves
// its variable unset. Expected: a LaunchEnv with 0 <= rank < size and the store as given, or an
// ArgumentError. Anything else (a crash, another exception, an inconsistent result) is a bug.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "tessera/comm/launch_env.hpp"

namespace {

constexpr const char* kVariables[] = {
    "TESSERA_RANK", "TESSERA_WORLD_SIZE", "TESSERA_LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "TESSERA_STORE"};
constexpr std::size_t kCount = sizeof kVariables / sizeof kVariables[0];

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<std::string> values(1);
  for (std::size_t i = 0; i < size && values.size() <= kCount; ++i) {
    if (data[i] == 0)
      values.emplace_back();
    else
      values.back() += static_cast<char>(data[i]);
  }
  if (values.size() > kCount) values.resize(kCount);
  for (std::size_t v = 0; v < kCount; ++v) {
    if (v < values.size())
      ::setenv(kVariables[v], values[v].c_str(), 1);
    else
      ::unsetenv(kVariables[v]);
  }
  const std::string store = values.size() == kCount ? values.back() : "";
  try {
    const tessera::LaunchEnv env = tessera::LaunchEnv::from_environment();
    if (env.size < 1 || env.rank < 0 || env.rank >= env.size || env.store != store) {
      std::fprintf(stderr, "LaunchEnv: rank %d of %d, store '%s' (expected '%s')\n", env.rank, env.size,
                   env.store.c_str(), store.c_str());
      std::abort();
    }
  } catch (const tessera::ArgumentError&) {
  }
  return 0;
}
