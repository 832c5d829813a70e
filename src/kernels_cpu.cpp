// The library tessera_kernels: the float and double instances of the heavy CPU kernels, compiled
// once for every program of the build (kernels/cpu/compiled.hpp explains the mode). Each kernel
// header lists its instances; this file only expands the lists with an empty prefix, i.e. as
// explicit instantiation definitions.
#define TESSERA_COMPILING_KERNELS 1

#include "tessera/kernels/cpu/batch_norm.hpp"
#include "tessera/kernels/cpu/conv2d.hpp"
#include "tessera/kernels/cpu/gemm.hpp"
#include "tessera/kernels/cpu/pool.hpp"

namespace tessera {

#define TESSERA_DEFINE_INSTANCES(LIST) LIST(, float) LIST(, double)
TESSERA_DEFINE_INSTANCES(TESSERA_CPU_GEMM_INSTANCES)
TESSERA_DEFINE_INSTANCES(TESSERA_CPU_CONV2D_INSTANCES)
TESSERA_DEFINE_INSTANCES(TESSERA_CPU_BATCH_NORM_INSTANCES)
TESSERA_DEFINE_INSTANCES(TESSERA_CPU_POOL_INSTANCES)

}  // namespace tessera
