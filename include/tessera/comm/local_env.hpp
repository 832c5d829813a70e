// LocalEnv<E>: the Env of E's device, scalar and compute with the one-process communicator, and the
// rule that makes a layer, loss or model of any Env the one-process one under its own Env name.
//
// A layer never communicates: Conv2d<CpuGloo> computes exactly what Conv2d<CpuLocal> computes. So
// the class template is written once, for Envs whose communicator is LocalComm, and
// TESSERA_SAME_CODE_AS_LOCAL(Conv2d) adds the specialization for every other Env:
//
//   template <class E> requires OtherCommEnv<E>
//   class Conv2d<E> : public Conv2d<LocalEnv<E>> { using Env = E; ... };   // nothing else
//
// Conv2d<CpuThreads>, Conv2d<CpuMpi> and Conv2d<CpuGloo> are then one class's code (their forward,
// backward and constructors are Conv2d<CpuLocal>'s), which the meson build compiles once, in
// tessera_layers (src/layers_cpu.cpp), for CpuLocal, CpuLocal64 and CpuLocalBf16: each program
// declares those instances extern (TESSERA_LOCAL_EXTERN below) instead of optimizing the same
// code again for every backend it is built for. The Env name stays E's, so a model of CpuThreads
// layers is still a CpuThreads model: the strategies read its communicator type from Model::Env, and
// giving its layers to a model of another Env still fails to compile.
//
// A layer of E converts to and from the layer of LocalEnv<E> (copy or move): a comm-aware layer
// built from a dense one (tensor_parallel_resnet.hpp) takes `Conv2d<LocalEnv<E>>&`, which binds
// either.
#pragma once

#include <type_traits>
#include <utility>

#include "tessera/core/env.hpp"
#include "tessera/core/linkage.hpp"
#include "tessera/device/cpu.hpp"

namespace tessera {

class LocalComm;  // comm/local.hpp

template <class E>
using LocalEnv = Env<typename E::Device, LocalComm, typename E::Scalar, typename E::Compute>;

// An Env whose communicator is not LocalComm: its layers are the LocalEnv ones renamed.
template <class E>
concept OtherCommEnv = is_env_v<E> && !std::is_same_v<E, LocalEnv<E>>;

}  // namespace tessera

// The specialization described above, for a class template of one Env parameter
// (TESSERA_SAME_CODE_AS_LOCAL(Conv2d)) or of an Env and one more parameter, given as its kind and
// name (TESSERA_SAME_CODE_AS_LOCAL_WITH(Pointwise, class, Op)). Used at namespace tessera scope.
#define TESSERA_SAME_CODE_AS_LOCAL(Layer)                                      \
  template <class E>                                                           \
    requires OtherCommEnv<E>                                                   \
  class Layer<E> : public Layer<LocalEnv<E>> {                                 \
   public:                                                                     \
    using Env = E;                                                             \
    using Layer<LocalEnv<E>>::Layer;                                           \
    Layer() = default;                                                         \
    Layer(const Layer<LocalEnv<E>>& local) : Layer<LocalEnv<E>>(local) {}      \
    Layer(Layer<LocalEnv<E>>&& local) : Layer<LocalEnv<E>>(std::move(local)) {} \
  }

#define TESSERA_SAME_CODE_AS_LOCAL_WITH(Layer, Kind, Param)                                \
  template <class E, Kind Param>                                                           \
    requires OtherCommEnv<E>                                                               \
  class Layer<E, Param> : public Layer<LocalEnv<E>, Param> {                               \
   public:                                                                                 \
    using Env = E;                                                                         \
    using Layer<LocalEnv<E>, Param>::Layer;                                                \
    Layer() = default;                                                                     \
    Layer(const Layer<LocalEnv<E>, Param>& local) : Layer<LocalEnv<E>, Param>(local) {}    \
    Layer(Layer<LocalEnv<E>, Param>&& local) : Layer<LocalEnv<E>, Param>(std::move(local)) {} \
  }

// The instances every program of the meson build shares, compiled once: the CPU ones (CpuLocal,
// CpuLocal64, CpuLocalBf16) in tessera_layers (src/layers_cpu.cpp), the GPU ones (CudaLocal,
// CudaLocal64) in tessera_cuda_kernels (src/layers_cuda.cpp). After a class's definition,
// `TESSERA_LOCAL_EXTERN(Conv2d)` declares them extern where the build links them (core/linkage.hpp's
// TESSERA_CPU_KERNELS_EXTERN; TESSERA_COMPILED_CUDA_KERNELS in the GPU programs), and is empty
// elsewhere (header-only use); the sources expand the lists with an empty prefix. Extra template
// arguments follow the name: TESSERA_LOCAL_EXTERN(Pointwise, ReluOp).
#define TESSERA_LOCAL_ENV_INSTANCE(PREFIX, Layer, EnvArgs, ...) \
  PREFIX template class Layer<::tessera::Env<TESSERA_UNPAREN EnvArgs> __VA_OPT__(, ) __VA_ARGS__>;
#define TESSERA_UNPAREN(...) __VA_ARGS__
#define TESSERA_LOCAL_CPU_INSTANCES(PREFIX, Layer, ...)                                                   \
  TESSERA_LOCAL_ENV_INSTANCE(PREFIX, Layer, (::tessera::Cpu, ::tessera::LocalComm, float), __VA_ARGS__)  \
  TESSERA_LOCAL_ENV_INSTANCE(PREFIX, Layer, (::tessera::Cpu, ::tessera::LocalComm, double), __VA_ARGS__) \
  TESSERA_LOCAL_ENV_INSTANCE(PREFIX, Layer, (::tessera::Cpu, ::tessera::LocalComm, float, ::tessera::BFloat16), \
                             __VA_ARGS__)
#define TESSERA_LOCAL_CUDA_INSTANCES(PREFIX, Layer, ...)                                                   \
  TESSERA_LOCAL_ENV_INSTANCE(PREFIX, Layer, (::tessera::Cuda, ::tessera::LocalComm, float), __VA_ARGS__)  \
  TESSERA_LOCAL_ENV_INSTANCE(PREFIX, Layer, (::tessera::Cuda, ::tessera::LocalComm, double), __VA_ARGS__)

// TESSERA_LOCAL_EXTERN_FLOAT: the float instances only (CpuLocal, CudaLocal), for the models, whose
// class declarations are large (ResNet's caches and blocks) while their double and bfloat16 instances
// serve few programs. An extern declaration instantiates the class where it stands, in every unit
// that includes the header (the precompiled header of the build's programs holds it once); a
// program of another instance compiles that one itself, as it would without the library.
#if TESSERA_CPU_KERNELS_EXTERN
#define TESSERA_LOCAL_EXTERN_CPU(...) TESSERA_LOCAL_CPU_INSTANCES(extern, __VA_ARGS__)
#define TESSERA_LOCAL_EXTERN_FLOAT_CPU(Layer, ...) \
  TESSERA_LOCAL_ENV_INSTANCE(extern, Layer, (::tessera::Cpu, ::tessera::LocalComm, float), __VA_ARGS__)
#else
#define TESSERA_LOCAL_EXTERN_CPU(...)
#define TESSERA_LOCAL_EXTERN_FLOAT_CPU(...)
#endif
#if defined(TESSERA_COMPILED_CUDA_KERNELS) && !defined(__CUDACC__)
#include "tessera/device/cuda.cuh"  // the Env<Cuda, ...> named below is complete
#define TESSERA_LOCAL_EXTERN_CUDA(...) TESSERA_LOCAL_CUDA_INSTANCES(extern, __VA_ARGS__)
#define TESSERA_LOCAL_EXTERN_FLOAT_CUDA(Layer, ...) \
  TESSERA_LOCAL_ENV_INSTANCE(extern, Layer, (::tessera::Cuda, ::tessera::LocalComm, float), __VA_ARGS__)
#else
#define TESSERA_LOCAL_EXTERN_CUDA(...)
#define TESSERA_LOCAL_EXTERN_FLOAT_CUDA(...)
#endif
#define TESSERA_LOCAL_EXTERN(...) TESSERA_LOCAL_EXTERN_CPU(__VA_ARGS__) TESSERA_LOCAL_EXTERN_CUDA(__VA_ARGS__)
#define TESSERA_LOCAL_EXTERN_FLOAT(...) \
  TESSERA_LOCAL_EXTERN_FLOAT_CPU(__VA_ARGS__) TESSERA_LOCAL_EXTERN_FLOAT_CUDA(__VA_ARGS__)
