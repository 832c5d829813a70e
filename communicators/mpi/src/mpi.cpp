// The library tessera_mpi: MpiComm's non-template functions and its collectives for every
// CommScalar (TESSERA_MPI_ALL_INSTANCES), compiled once for every program of the build that uses
// the MPI backend; they see declarations only (TESSERA_COMPILED_MPI, on tessera_mpi_dep).
// tessera/comm/mpi.hpp and core/linkage.hpp explain the mode.
#define TESSERA_COMPILING_MPI 1

#include "tessera/comm/mpi.hpp"
#include "tessera/parallel/data_parallel.hpp"

namespace tessera {
TESSERA_MPI_ALL_INSTANCES()
// DataParallel over MpiComm, which the backend's programs declare extern (parallel/data_parallel.hpp).
template class DataParallel<CpuMpi>;
}  // namespace tessera
