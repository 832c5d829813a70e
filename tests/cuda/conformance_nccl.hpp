// The communicator conformance suite over NCCL, one process per GPU: the same checks as every
// other backend (tests/comm/conformance.hpp), with the buffers in GPU memory. Three small programs
// differ only in how the ranks meet (how the NCCL unique id travels):
//   tessera-run -n 2 conformance_nccl        through tessera-run's file store (NcclComm::from_env)
//   mpirun -n 2 conformance_nccl_mpi         over MPI (NcclComm::from(MpiComm::world()))
//   tessera-run -n 2 conformance_nccl_gloo   over Gloo (NcclComm::from(GlooComm::from_env()))
//
// The meson tests run them through if_gpus.sh, which skips (exit 77) with fewer GPUs than ranks:
// NCCL refuses two ranks of one communicator on the same GPU.
//
// The suite itself is compiled once, in conformance_nccl_suite.cpp: conformance_nccl's second
// source, whose object the other two programs link (communicators/nccl/tests/meson.build). It is
// the bulk of each program's compile time (Conformance<NcclComm> on device and host buffers), and
// only the bootstrap differs, so it takes the opening function instead of being a template on it.
#pragma once

#include "tessera/comm/nccl.hpp"

namespace tessera::testing {

// open() returns the NcclComm; bootstrap names how; from_env adds the check of a second
// NcclComm::from_env in the same run. Options: --no-large (skip the large-buffer checks),
// --host-buffers (the same suite with host buffers, which NcclComm stages through the GPU: the
// path control messages such as step times take). Returns main's exit status: 0, 1 on a failed
// check or an exception, 77 without a CUDA device.
int run_nccl_conformance(int argc, char** argv, const char* bootstrap, NcclComm (*open)(), bool from_env);

}  // namespace tessera::testing
