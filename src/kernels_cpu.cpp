// The library tessera_kernels: the float and double instances of the heavy CPU kernels, and the
// non-template functions of the headers listed below, compiled once for every program of the
// build (kernels/cpu/compiled.hpp and core/linkage.hpp explain the mode). Each kernel header lists
// its instances; this file only expands the lists with an empty prefix, i.e. as explicit
// instantiation definitions. The other headers define their functions here as ordinary ones.
#define TESSERA_COMPILING_KERNELS 1

#include "tessera/comm/reduce.hpp"
#include "tessera/kernels/cpu/attention.hpp"
#include "tessera/kernels/cpu/batch_norm.hpp"
#include "tessera/kernels/cpu/conv2d.hpp"
#include "tessera/kernels/cpu/elementwise.hpp"
#include "tessera/kernels/cpu/embedding.hpp"
#include "tessera/kernels/cpu/gemm.hpp"
#include "tessera/kernels/cpu/loss.hpp"
#include "tessera/kernels/cpu/norm.hpp"
#include "tessera/kernels/cpu/optim.hpp"
#include "tessera/kernels/cpu/pool.hpp"
#include "tessera/kernels/cpu/softmax.hpp"

// Non-template code (core/linkage.hpp): defined here, declared everywhere else.
#include "tessera/comm/async_worker.hpp"
#include "tessera/comm/call_check.hpp"
#include "tessera/comm/communicator.hpp"
#include "tessera/comm/core.hpp"
#include "tessera/comm/launch_env.hpp"
#include "tessera/comm/monitor.hpp"
#include "tessera/comm/threads.hpp"
#include "tessera/core/allocator.hpp"
#include "tessera/core/random.hpp"
#include "tessera/core/shape.hpp"
#include "tessera/data/dataset.hpp"
#include "tessera/data/fashion_mnist.hpp"
#include "tessera/data/idx.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/data/text.hpp"
#include "tessera/io/flags.hpp"
#include "tessera/io/json.hpp"
#include "tessera/io/safetensors.hpp"
#include "tessera/kernels/conv2d_geometry.hpp"
#include "tessera/kernels/cpu/onednn.hpp"
#include "tessera/kernels/cpu/onednn_conv.hpp"
#include "tessera/kernels/cpu/onednn_gemm.hpp"
#include "tessera/layers/pool.hpp"
#include "tessera/parallel/agreement.hpp"
#include "tessera/parallel/pipeline_schedule.hpp"
#include "tessera/train/checkpoint.hpp"
#include "tessera/train/sharded_checkpoint.hpp"
#include "tessera/train/metrics.hpp"
#include "tessera/train/preemption.hpp"
#include "tessera/train/timeline.hpp"

namespace tessera {

#define TESSERA_DEFINE_INSTANCES(LIST) LIST(, float) LIST(, double)
TESSERA_DEFINE_INSTANCES(TESSERA_CPU_GEMM_INSTANCES)
TESSERA_DEFINE_INSTANCES(TESSERA_CPU_CONV2D_INSTANCES)
TESSERA_DEFINE_INSTANCES(TESSERA_CPU_BATCH_NORM_INSTANCES)
TESSERA_DEFINE_INSTANCES(TESSERA_CPU_POOL_INSTANCES)
TESSERA_DEFINE_INSTANCES(TESSERA_CPU_ELEMENTWISE_INSTANCES)
TESSERA_DEFINE_INSTANCES(TESSERA_CPU_LOSS_INSTANCES)
TESSERA_DEFINE_INSTANCES(TESSERA_CPU_OPTIM_INSTANCES)
TESSERA_DEFINE_INSTANCES(TESSERA_CPU_SOFTMAX_INSTANCES)
TESSERA_DEFINE_INSTANCES(TESSERA_CPU_NORM_INSTANCES)
TESSERA_DEFINE_INSTANCES(TESSERA_CPU_EMBEDDING_INSTANCES)
TESSERA_DEFINE_INSTANCES(TESSERA_CPU_ATTENTION_INSTANCES)

// Class templates every program instantiates the same way (their headers declare them extern).
template class BasicCachingAllocator<HostMemory>;
template class DataLoader<float>;
template class DataLoader<double>;

}  // namespace tessera

namespace tessera::detail {
TESSERA_REDUCE_ALL_INSTANCES()
}  // namespace tessera::detail

// ThreadComm's collectives for every CommScalar (comm/threads.hpp lists them).
namespace tessera {
TESSERA_THREAD_COMM_ALL_INSTANCES()
}  // namespace tessera
