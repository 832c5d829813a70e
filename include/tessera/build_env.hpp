// BuildEnv: the Env a program was built for. One source becomes one binary per backend because
// the build passes one define pair, consumed here and nowhere else:
//
//   -DTESSERA_ENV=tessera::CpuMpi -DTESSERA_ENV_HEADER='"tessera/comm/mpi.hpp"'
//
// (meson.build's backend list sets them for every example, test and benchmark built per backend).
// Without them the program is built for CpuThreads: ranks are threads of one process.
//
//   using E = tessera::BuildEnv;
//   tessera::launch<E>([&](E::Comm& comm) { ... }, {.ranks = flags_ranks});
#pragma once

#if defined(TESSERA_ENV) != defined(TESSERA_ENV_HEADER)
#error "tessera/build_env.hpp: define both TESSERA_ENV and TESSERA_ENV_HEADER, or neither"
#endif

#if defined(TESSERA_ENV)
#include TESSERA_ENV_HEADER
#else
#include "tessera/comm/threads.hpp"
#define TESSERA_ENV ::tessera::CpuThreads
#endif
#include "tessera/comm/launch.hpp"

namespace tessera {
using BuildEnv = TESSERA_ENV;
}  // namespace tessera
