// Concepts checked with static_assert where each type is used, so that a type missing a member
// fails with one sentence naming the member instead of a wall of constraint notes.
#pragma once

#include <concepts>
#include <cstddef>
#include <string>
#include <type_traits>

#include "tessera/core/error.hpp"

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

// Train: batch statistics, dropout on. Eval: running statistics, dropout off, backward still
// allowed (fine-tuning with frozen statistics, saliency). Inference: Eval's numbers, forward only
// (torch.inference_mode): composite layers may then fuse a convolution with the eval BatchNorm,
// ReLU and residual add after it (kernels/conv2d_geometry.hpp: ConvEpilogue), and refuse backward.
enum class Mode { Train, Eval, Inference };

// What a composite layer's backward checks first: its forward may have fused layers whose inputs
// a backward would need. `who` names the layer in the message.
inline void check_backward_allowed(Mode mode, const std::string& who) {
  TESSERA_CHECK(mode != Mode::Inference, Error, who, ": backward in Mode::Inference, which is forward only ",
                "(set Mode::Train or Mode::Eval before the forward to differentiate)");
}

// The visit protocol (see core/parameter.hpp) with nothing behind it: what a layer's visit must
// accept. v.parameter(name, Parameter&), v.buffer(name, Tensor&), v.rng(name, Rng&).
struct VisitorArchetype {
  template <class P>
  void parameter(const std::string&, P&) {}
  template <class T>
  void buffer(const std::string&, T&) {}
  template <class R>
  void rng(const std::string&, R&) {}
};

// A layer without parameters, buffers or random state says so by deriving from ParameterFree:
// every layer must have visit, so one that owns parameters and forgets to expose them (they would
// never be updated, saved or all-reduced) fails to compile instead of training silently.
struct ParameterFree {
  template <class V>
  void visit(V&, const std::string&) {}
};

// A layer computes y = f(x; theta) and its backward. Activations backward needs live in a
// per-micro-batch Cache owned by the caller, never in the layer, so a pipeline stage may have
// several micro-batches in flight. backward returns dL/dx and *accumulates* dL/dtheta; visit
// hands every parameter, buffer and generator to a visitor under its state_dict name.
//
//   using Env = E;  using Tensor = tessera::Tensor<S, D>;  struct Cache { ... };
//   const Tensor& forward(const Tensor& x, Cache&);     const Tensor& backward(const Tensor& dy, Cache&);
//   template <class V> void visit(V&, const std::string& prefix);   (or derive from ParameterFree)
//   void set_mode(Mode);
namespace detail {
template <class L>
concept HasEnv = requires { typename L::Env; };
template <class L>
concept HasTensor = requires { typename L::Tensor; };
template <class L>
concept HasCache = requires { typename L::Cache; } && std::default_initializable<typename L::Cache>;
template <class L>
concept HasForward = requires(L& l, const typename L::Tensor& t, typename L::Cache& c) {
  { l.forward(t, c) } -> std::same_as<const typename L::Tensor&>;
};
template <class L>
concept HasBackward = requires(L& l, const typename L::Tensor& t, typename L::Cache& c) {
  { l.backward(t, c) } -> std::same_as<const typename L::Tensor&>;
};
template <class L>
concept HasBackwardInput = requires(L& l, const typename L::Tensor& t, typename L::Cache& c) {
  { l.backward_input(t, c) } -> std::same_as<const typename L::Tensor&>;
};
template <class L>
concept HasBackwardWeight = requires(L& l, typename L::Cache& c) { l.backward_weight(c); };
template <class L>
concept HasSetMode = requires(L& l) { l.set_mode(Mode::Train); };
template <class L>
concept HasVisit = requires(L& l, VisitorArchetype& v, const std::string& prefix) { l.visit(v, prefix); };
}  // namespace detail

template <class L>
concept Layer = detail::HasEnv<L> && detail::HasTensor<L> && detail::HasCache<L> && detail::HasForward<L> &&
                detail::HasBackward<L> && detail::HasSetMode<L> && detail::HasVisit<L>;

// check_layer<L>(): the Layer concept, one sentence per missing member. The type is named by the
// compiler's "In instantiation of ... [with L = ...]" line right above the sentence. Members that
// need Tensor/Cache are checked only once those exist, so one mistake gives one message.
// The bools are computed first: a static_assert on a plain bool prints no constraint notes.
template <class L>
consteval bool check_layer() {
  constexpr bool has_env = detail::HasEnv<L>, has_tensor = detail::HasTensor<L>, has_cache = detail::HasCache<L>;
  static_assert(has_env, "Tessera Layer: missing `using Env = E;` (the layer's Env<Device, Comm, Scalar>)");
  static_assert(has_tensor, "Tessera Layer: missing `using Tensor = tessera::Tensor<S, D>;`");
  static_assert(has_cache, "Tessera Layer: missing `struct Cache { ... };` (default-constructible; holds what "
                           "backward needs, one per micro-batch)");
  if constexpr (has_tensor && has_cache) {
    constexpr bool has_forward = detail::HasForward<L>, has_backward = detail::HasBackward<L>;
    static_assert(has_forward, "Tessera Layer: missing `const Tensor& forward(const Tensor& x, Cache& cache)`");
    static_assert(has_backward, "Tessera Layer: missing `const Tensor& backward(const Tensor& dy, Cache& cache)` "
                                "(returns dL/dx, accumulates parameter gradients)");
    constexpr bool has_input_half = detail::HasBackwardInput<L>, has_weight_half = detail::HasBackwardWeight<L>;
    static_assert(has_input_half == has_weight_half,
                  "Tessera Layer: a split backward, for zero-bubble pipeline schedules, takes both halves: "
                  "`const Tensor& backward_input(const Tensor& dy, Cache&)` returns dL/dx and keeps in the "
                  "cache what `void backward_weight(Cache&)` then needs to accumulate the parameter gradients, "
                  "the two together giving backward's bits (a layer without parameters needs neither)");
  }
  constexpr bool has_set_mode = detail::HasSetMode<L>, has_visit = detail::HasVisit<L>;
  static_assert(has_set_mode, "Tessera Layer: missing `void set_mode(Mode)` (Train/Eval; empty if the layer "
                              "behaves the same in both)");
  static_assert(has_visit, "Tessera Layer: missing `template <class V> void visit(V& v, const std::string& prefix)`: "
                           "a layer with parameters must hand each to v.parameter(prefix + \"weight\", p), or it "
                           "is never updated, saved or all-reduced; a layer without any derives from "
                           "tessera::ParameterFree");
  return Layer<L>;
}

// Split backward (optional), for zero-bubble pipeline schedules (parallel/pipeline_schedule.hpp),
// which run the input gradient (I) a stage upstream waits for first and the weight gradients (W)
// later, in what would be a bubble:
//   const Tensor& backward_input(const Tensor& dy, Cache&);   returns dL/dx; keeps what W needs
//   void backward_weight(Cache&);                             accumulates dL/dtheta
// The two together must give backward's bits; the caller keeps x and dy alive and unchanged from
// one to the other. A layer with parameters but no split runs its whole backward as the input
// half (correct, but its weight work cannot fill a bubble); one without parameters needs none.
template <class L>
concept SplitsBackward = detail::HasBackwardInput<L> && detail::HasBackwardWeight<L>;
template <class L, class T, class C>
const T& split_backward_input(L& layer, const T& dy, C& cache) {
  if constexpr (SplitsBackward<L>) return layer.backward_input(dy, cache);
  else return layer.backward(dy, cache);
}
template <class L, class C>
void split_backward_weight(L& layer, C& cache) {
  if constexpr (SplitsBackward<L>) layer.backward_weight(cache);
}
// A composite's sublayer during its backward (input_only false) or its input half (true): one code
// path for both, so the two can only differ in which half runs.
template <class L, class T, class C>
const T& backward_or_input(L& layer, const T& dy, C& cache, bool input_only) {
  return input_only ? split_backward_input(layer, dy, cache) : layer.backward(dy, cache);
}
// What a split layer's weight half reads back, so that a composite layer frees the rest between
// the halves (optional; the defaults are the safe ones, and a layer without a split reads nothing):
//   static constexpr bool kWeightReadsInput = false;       backward_weight never reads x
//   static constexpr bool kWeightReadsOutputGrad = false;  backward_weight never reads dy
// BatchNorm2d reads neither (its weight half adds sums the input half kept).
template <class L>
consteval bool weight_reads_input() {
  if constexpr (!SplitsBackward<L>) return false;
  else if constexpr (requires { L::kWeightReadsInput; }) return L::kWeightReadsInput;
  else return true;
}
template <class L>
consteval bool weight_reads_output_grad() {
  if constexpr (!SplitsBackward<L>) return false;
  else if constexpr (requires { L::kWeightReadsOutputGrad; }) return L::kWeightReadsOutputGrad;
  else return true;
}

// Activation memory (docs/design.md, "Activation memory"). A layer's Cache keeps its output y for
// the next layer and its input gradient dx for the layer before; both are dead long before the
// next step reuses them, and holding every one of them doubles a network's footprint. Composite
// layers (Sequential, Residual, models) therefore release buffers as soon as they are consumed,
// back to the caching allocator, which hands the same blocks to the next layer: the footprint
// falls and a steady step still makes no system allocation.
//
// What a layer may declare, all optional (the defaults are the safe ones):
//   static constexpr bool kBackwardReadsInput = false;   backward never reads the x forward saw
//   static constexpr bool kBackwardReadsOutput = false;  backward never reads its own output y
//   void release_output(Cache&);      frees y (called only when the layer after has consumed it)
//   void release_input_grad(Cache&);  frees what backward returned (after the caller consumed it)
// Without release_input_grad, a Cache member `dx` is released; without release_output, `y`.
template <class L>
consteval bool backward_reads_input() {
  if constexpr (requires { L::kBackwardReadsInput; }) return L::kBackwardReadsInput;
  else return true;
}
template <class L>
consteval bool backward_reads_output() {
  if constexpr (requires { L::kBackwardReadsOutput; }) return L::kBackwardReadsOutput;
  else return true;
}
template <class L, class C>
void release_input_grad(L& layer, C& cache) {
  if constexpr (requires { layer.release_input_grad(cache); }) layer.release_input_grad(cache);
  else if constexpr (requires { cache.dx.release(); }) cache.dx.release();
}
template <class L, class C>
void release_output(L& layer, C& cache) {
  if constexpr (requires { layer.release_output(cache); }) layer.release_output(cache);
  else if constexpr (requires { cache.y.release(); }) cache.y.release();
}
// A layer that can compute its output again from its input and what its Cache saved, bit for
// bit: void recompute_output(Cache&) (BatchNorm2d, the pointwise activations).
template <class L>
concept RecomputesOutput = requires(L& layer, typename L::Cache& cache) { layer.recompute_output(cache); };
// Whether a layer's output was released (its storage is gone).
template <class C>
bool output_released(const C& cache) {
  if constexpr (requires { cache.y.data(); }) return cache.y.data() == nullptr;
  else return false;
}
// y_prev = prev.forward(...), then next.forward(y_prev): once next has run, y_prev is dead when
// neither prev's backward nor next's backward reads it. `next_output` guards layers that return
// their input itself (an identity Flatten or Dropout): then y_prev lives on as next's output.
template <class Next, class Prev, class C, class T>
void release_dead_output(Prev& prev, C& prev_cache, const T& prev_output, const T& next_output) {
  if constexpr (!backward_reads_output<Prev>() && !backward_reads_input<Next>()) {
    if (&prev_output != &next_output) release_output(prev, prev_cache);
  }
}

// What checkpoints, optimizers and strategies need of a model: visit (parameters by name).
template <class M>
consteval bool check_visitable() {
  constexpr bool has_env = detail::HasEnv<M>, has_visit = detail::HasVisit<M>;
  static_assert(has_env, "Tessera: the model has no `using Env = E;` (build it from layers or a model of "
                         "tessera/models, or add the alias)");
  static_assert(has_visit, "Tessera: the model has no `visit(v, prefix)`: its parameters cannot be found "
                           "(layers expose them with visit; see docs/adding-a-layer.md)");
  return has_env && has_visit;
}

}  // namespace tessera
