// The library tessera_layers: the layers, losses and models of the one-process CPU Envs (CpuLocal,
// CpuLocal64, CpuLocalBf16), compiled once for every program of the build. A layer of any other
// Env is the LocalEnv one under its own Env name (comm/local_env.hpp), so these instances serve
// every backend; the programs declare them extern (TESSERA_LOCAL_EXTERN). Compiled like a program
// (TESSERA_COMPILED_KERNELS: the kernels and the non-template functions are tessera_kernels'), at
// the project's optimization level.
#include "local_layers.hpp"

namespace tessera {
TESSERA_LOCAL_LAYER_LIST(TESSERA_LOCAL_CPU_INSTANCES)
}  // namespace tessera
