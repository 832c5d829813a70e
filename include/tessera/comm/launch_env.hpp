// LaunchEnv: who am I and how many are we, read from what the launcher set.
//
// Looked up in this order (the first launcher whose rank variable is present wins):
//   tessera-run / by hand: TESSERA_RANK, TESSERA_WORLD_SIZE, TESSERA_LOCAL_RANK, TESSERA_STORE
//   Open MPI mpirun:       OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK
//   Slurm srun:            SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID
// Open MPI comes before Slurm because an mpirun inside an sbatch allocation passes the
// allocation's SLURM_PROCID (its own daemon's) to every rank; only the OMPI_ values are per rank.
// With none of them set, the process is rank 0 of 1. The store address (used by Gloo and for
// NCCL's id exchange) always comes from TESSERA_STORE.
#pragma once

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <optional>
#include <string>

#include "tessera/core/error.hpp"
#include "tessera/core/linkage.hpp"  // non-template functions: defined at the end (inline) or once in tessera_kernels

namespace tessera {

struct LaunchEnv {
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  std::string store;          // e.g. "file:///shared/run42" or "redis://10.0.0.1:6379"; may be empty
  std::string source = "default (no launcher variables set)";  // which variables were read

  static LaunchEnv from_environment();

 private:
  static std::optional<int> read_int(const char* name);
};

// A program whose ranks all live in this one process (LocalComm, ThreadComm) that a launcher
// started as several processes (srun -n 2, an sbatch job of 2 nodes, mpirun -n 2, tessera-run
// -n 2): each process would train alone on the same data and all would write the same
// checkpoint. Refused before anything runs. SLURM_STEP_NUM_TASKS, not SLURM_NTASKS: inside an
// sbatch script (no srun) the latter is the allocation's, yet the script is one process.
void check_one_process(const char* backend);

#if TESSERA_HEADER_DEFINITIONS

TESSERA_LINKAGE LaunchEnv LaunchEnv::from_environment() {
  LaunchEnv env;
  if (const char* store = std::getenv("TESSERA_STORE")) env.store = store;
  struct Scheme {
    const char* rank;
    const char* size;
    const char* local_rank;
    const char* name;
  };
  const Scheme schemes[] = {
      {"TESSERA_RANK", "TESSERA_WORLD_SIZE", "TESSERA_LOCAL_RANK", "tessera-run (TESSERA_RANK)"},
      {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "Open MPI (OMPI_COMM_WORLD_RANK)"},
      {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "Slurm (SLURM_PROCID)"},
  };
  for (const Scheme& s : schemes) {
    const auto rank = read_int(s.rank);
    if (!rank) continue;
    const auto size = read_int(s.size);
    TESSERA_CHECK(size.has_value(), ArgumentError, s.rank, " is set but ", s.size,
                  " is not: set both (the world size is needed to rendezvous)");
    TESSERA_CHECK(*size >= 1 && *rank >= 0 && *rank < *size, ArgumentError, s.rank, "=", *rank, " and ", s.size,
                  "=", *size, " are inconsistent: need 0 <= rank < size");
    env.rank = *rank;
    env.size = *size;
    env.local_rank = read_int(s.local_rank).value_or(*rank);
    env.source = s.name;
    return env;
  }
  return env;
}

TESSERA_LINKAGE std::optional<int> LaunchEnv::read_int(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long value = std::strtol(text, &end, 10);
  TESSERA_CHECK(end != text && *end == '\0' && errno == 0 && value >= INT_MIN && value <= INT_MAX,
                ArgumentError, "environment variable ", name, "='", text, "' is not an integer");
  return static_cast<int>(value);
}

TESSERA_LINKAGE void check_one_process(const char* backend) {
  for (const char* var : {"TESSERA_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS"}) {
    const char* text = std::getenv(var);
    if (text == nullptr || *text == '\0') continue;
    const long processes = std::strtol(text, nullptr, 10);
    TESSERA_CHECK(processes <= 1, ArgumentError, "this program's ranks all run in one process (the ", backend,
                  " communicator), but the launcher started ", processes, " processes (", var, "=", text,
                  "): each would train alone on the same data and write the same checkpoint. Start one process "
                  "(srun -n 1, mpirun -n 1, tessera-sbatch -N 1 --backend threads; the threads build's --ranks sets "
                  "its ranks), or run the program built for a multi-process backend (_mpi, _gloo)");
  }
}

#endif  // TESSERA_HEADER_DEFINITIONS

}  // namespace tessera
