// Picks the communicator a multi-process test program is built for (one binary per backend,
// chosen by a macro from tests/meson.build) and opens it from the launcher's environment.
#pragma once

#if defined(TESSERA_TEST_MPI)
#include "tessera/comm/mpi.hpp"
namespace tessera::testing {
using BackendComm = MpiComm;
inline const char* backend_name() { return "mpi"; }
inline MpiComm open_backend() { return MpiComm::world(); }
}  // namespace tessera::testing
#elif defined(TESSERA_TEST_GLOO)
#include "tessera/comm/gloo.hpp"
namespace tessera::testing {
using BackendComm = GlooComm;
inline const char* backend_name() { return "gloo"; }
inline GlooComm open_backend() { return GlooComm::from_env(); }
}  // namespace tessera::testing
#elif defined(TESSERA_TEST_NCCL)
#include "tessera/comm/nccl.hpp"
namespace tessera::testing {
using BackendComm = NcclComm;
inline const char* backend_name() { return "nccl"; }
inline NcclComm open_backend() { return NcclComm::from_env(); }
}  // namespace tessera::testing
#else
#error "define TESSERA_TEST_MPI, TESSERA_TEST_GLOO or TESSERA_TEST_NCCL"
#endif
