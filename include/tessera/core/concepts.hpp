// Concepts checked with static_assert where each type is defined, so that a type missing a member
// fails with a message naming the member instead of an error deep inside a template.
#pragma once

#include <concepts>
#include <cstddef>

namespace tessera {

// A device: raw memory, copies to and from the host, synchronization. Cpu and Cuda.
template <class D>
concept Device = requires(void* dst, const void* src, std::size_t n) {
  { D::allocate(n) } -> std::same_as<void*>;
  D::deallocate(dst, n);
  D::copy(dst, src, n);
  D::copy_to_device(dst, src, n);
  D::copy_to_host(dst, src, n);
  D::synchronize();
  { D::host_accessible } -> std::convertible_to<bool>;
};

enum class Mode { Train, Eval };

// A layer computes y = f(x; theta) and its backward. Activations backward needs live in a
// per-micro-batch Cache owned by the caller, never in the layer, so a pipeline stage may have
// several micro-batches in flight. backward returns dL/dx and *accumulates* dL/dtheta.
template <class L>
concept Layer = requires(L& layer, const typename L::Tensor& t, typename L::Cache& cache) {
  typename L::Env;
  typename L::Cache;
  { layer.forward(t, cache) } -> std::same_as<const typename L::Tensor&>;
  { layer.backward(t, cache) } -> std::same_as<const typename L::Tensor&>;
  layer.set_mode(Mode::Train);
};

}  // namespace tessera
