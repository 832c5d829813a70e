// Part of the library tessera_layers: DataParallel over ThreadComm (CpuThreads), which the
// programs of the meson build declare extern (parallel/data_parallel.hpp) instead of compiling it
// again in each. MpiComm's and GlooComm's are in their backends' libraries.
#include "tessera/parallel/data_parallel.hpp"

namespace tessera {
template class DataParallel<CpuThreads>;
}  // namespace tessera
