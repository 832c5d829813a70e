// Env<Device, Comm, Scalar, Compute>: the one policy bundle every layer, loss, optimizer, model and
// strategy takes. Plain layers read Device and Scalar; the strategies (DataParallel, Zero1, LocalSgd,
// Pipeline) and the comm-aware layers (tensor-parallel linears and convolutions) take their
// communicator *type* from Comm, so a program switches backend by changing its Env alias and
// nothing else. Named aliases (CpuLocal, CpuThreads, CpuMpi, CpuGloo, CudaLocal, CudaNccl, and
// their float64 twins) live next to each communicator, so a backend stays in its own header.
//
// Compute is the precision of the matrix products (Linear, Conv2d): the Scalar itself (default),
// or BFloat16 for mixed precision, as PyTorch's autocast to bfloat16: parameters, gradients,
// optimizer state and activations stay float (the "master" copies), each product rounds its
// operands to bfloat16 and accumulates in float. On the CPU, kernels/cpu/gemm_bf16.hpp
// (AVX512-BF16 where the CPU has it, detected at run time, else the float product); on the GPU,
// cuBLAS's bf16 tensor-core products and cuDNN's bf16 convolutions, whose outputs are also rounded
// to bfloat16 before they are widened into the float tensor, as autocast's are
// (kernels/cuda/conv2d.cuh). Aliases CpuLocalBf16, CpuThreadsBf16, CudaLocalBf16 and
// CudaNcclBf16; any other communicator as Env<Cpu, MpiComm, float, BFloat16>.
//
// Impossible bundles fail where the Env is first used, with a sentence naming the fix:
// a Device that is not a device, a Scalar that is not float/double, or a communicator that
// cannot move this device's memory (a communicator may declare
// `template <class D> static consteval bool accepts_device()` holding its own static_assert).
#pragma once

#include <type_traits>

#include "tessera/core/concepts.hpp"

namespace tessera {

namespace detail {
template <class C, class D>
consteval bool comm_accepts_device() {
  if constexpr (requires { C::template accepts_device<D>(); })
    return C::template accepts_device<D>();
  else
    return true;
}
}  // namespace detail

// Compute type tag: matrix products in bfloat16 with float accumulation (see above).
struct BFloat16 {};

template <class D, class C, class S = float, class P = S>
struct Env {
  static_assert(Device<D>, "Env<Device, Comm, Scalar>: the first argument is not a device (it needs allocate, "
                           "deallocate, copy, copy_to_device, copy_to_host, synchronize, host_accessible): use Cpu "
                           "or Cuda");
  static_assert(std::is_floating_point_v<S>, "Env<Device, Comm, Scalar>: Scalar must be float or double");
  static_assert(detail::comm_accepts_device<C, D>(), "Env<Device, Comm, Scalar>: this communicator cannot move "
                                                     "this device's memory");
  static_assert(std::is_same_v<P, S> || (std::is_same_v<P, BFloat16> && std::is_same_v<S, float>),
                "Env<Device, Comm, Scalar, Compute>: Compute is the Scalar itself, or BFloat16 with Scalar float "
                "(float master weights, bfloat16 products)");
  using Device = D;
  using Comm = C;
  using Scalar = S;
  using Compute = P;
  // Whether Linear and Conv2d round their products' operands to bfloat16.
  static constexpr bool bf16_compute = std::is_same_v<P, BFloat16>;
};

template <class T>
inline constexpr bool is_env_v = false;
template <class D, class C, class S, class P>
inline constexpr bool is_env_v<Env<D, C, S, P>> = true;

// Two parts of one program that must agree on their bundle (a model and its optimizer, a model
// and its strategy). The assertion reads as one sentence in the compiler's output; the
// instantiation line above it names both Envs.
template <class Expected, class Got>
consteval bool check_same_env() {
  static_assert(std::is_same_v<Expected, Got>,
                "Tessera: these parts were built for different Envs (the model's Env decides: build the "
                "optimizer, strategy and model from one alias, e.g. `using E = CpuThreads;` and "
                "lenet5<E>(...), Sgd<E>, DataParallel(model, comm) deduces E)");
  return true;
}

// A communicator object handed to a strategy or comm-aware layer must be of the Env's Comm type.
template <class E, class GivenComm>
consteval bool check_comm_of_env() {
  static_assert(std::is_same_v<typename E::Comm, std::remove_cvref_t<GivenComm>>,
                "Tessera: the communicator passed here is not the Env's Comm type (the Env picks the "
                "backend: build the model with the Env of this communicator, e.g. CpuThreads for "
                "ThreadComm, CpuMpi for MpiComm, CpuGloo for GlooComm, CudaNccl for NcclComm)");
  return true;
}

// The communicator a strategy keeps: `comm` itself when it is of the Env's Comm type; otherwise
// check_comm_of_env's sentence is the whole error (the reference is never formed).
template <class E, class GivenComm>
typename E::Comm& comm_of_env(GivenComm& comm) {
  if constexpr (std::is_same_v<typename E::Comm, GivenComm>) {
    return comm;
  } else {
    static_assert(check_comm_of_env<E, GivenComm>());
    return *static_cast<typename E::Comm*>(nullptr);
  }
}

}  // namespace tessera
