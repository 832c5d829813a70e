// The library tessera_gloo: GlooComm's non-template functions (its constructors, the rendezvous,
// split, the error translation, the stores) and its collectives for every CommScalar, compiled
// once for every program of the build that uses the Gloo backend instead of in each of them
// (gloo.hpp explains the mode). The header lists the instances; this file expands the list with
// an empty prefix, i.e. as explicit instantiation definitions.
#define TESSERA_COMPILING_GLOO 1

#include "tessera/comm/gloo.hpp"
#include "tessera/parallel/data_parallel.hpp"

namespace tessera {

TESSERA_GLOO_ALL_INSTANCES()
// DataParallel over GlooComm, which the backend's programs declare extern (parallel/data_parallel.hpp).
template class DataParallel<CpuGloo>;

}  // namespace tessera
