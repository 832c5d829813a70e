// Sequential<Ls...>: layers applied in order, held flat in a std::tuple and walked with fold
// expressions (no recursive network types: compile errors stay short, compile time stays linear).
//
// forward: y = L_{n-1}( ... L_1(L_0(x)) )        backward: the chain rule in reverse order.
// Cache is the tuple of the layers' caches: one Cache per micro-batch in flight.
// Units: every layer is one unit of a pipeline stage (forward_units/backward_units/visit_units
// run the layers [begin, end) only; see parallel/pipeline.hpp).
// Fusion: a BatchNorm2d followed by a ReLU runs as one layer whenever both run in the same call
// (layers/batch_norm.hpp: one pass less forward, one backward; the numbers are the unfused ones).
// In Mode::Inference (forward only) a Conv2d followed by a BatchNorm2d, and the ReLU after it,
// run as one convolution whose blocks finish their output in cache (ConvEpilogue); backward is
// then refused.
// Parameter names follow torch.nn.Sequential ("0.weight", "2.bias"), or names given with
// set_names() so that models match torchvision's state_dict ("conv1.weight", "bn1.running_mean").
#pragma once

#include <array>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "tessera/core/concepts.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/memory_format.hpp"
#include "tessera/core/tensor.hpp"

namespace tessera {

namespace detail {
// What Sequential holds in place of a type that is not a Layer, once check_layer has said why:
// it accepts every call, so the one static_assert sentence is the whole error output (no cascade
// of "no member named ..." from every place the tuple is walked).
struct NotALayer : ParameterFree {
  struct Cache {};
  template <class T>
  explicit NotALayer(T&&) {}
  template <class T, class C>
  const T& forward(const T& x, C&) { return x; }
  template <class T, class C>
  const T& backward(const T& dy, C&) { return dy; }
  void set_mode(Mode) {}
};
template <class L>
using LayerSlot = std::conditional_t<check_layer<L>(), L, NotALayer>;

// The first type of the list that is a Layer gives Sequential its Env and Tensor.
struct NoLayerFound {
  using Env = void;
  struct Tensor {};
};
template <class... Ls>
struct FirstLayer {
  using type = NoLayerFound;
};
template <class L, class... Rest>
struct FirstLayer<L, Rest...> {
  using type = std::conditional_t<Layer<L>, L, typename FirstLayer<Rest...>::type>;
};
// A layer that can run fused with the layer after it: BatchNorm2d with a ReLU (the ReLU's Cache is
// the only one forward_relu takes).
template <class A, class B>
concept FusesWithNext = requires(A& a, const typename A::Tensor& x, typename A::Cache& ca, typename B::Cache& cb) {
  a.forward_relu(x, ca, cb);
  a.recompute_output_relu(ca, cb);
  a.backward_relu(x, ca);
};
// A convolution that can finish its output with the eval BatchNorm after it in Mode::Inference
// (Conv2d's forward_epilogue with BatchNorm2d's inference_epilogue).
template <class A, class B>
concept FusesInference = requires(A& a, B& b, const typename A::Tensor& x, typename A::Tensor& y,
                                  typename A::Cache& ca, typename B::Cache& cb) {
  a.forward_epilogue(x, ca, y, b.inference_epilogue(cb, a.out_channels()));
};
// Whether the last two of Ls fuse in inference: false for fewer than two. A trait rather than
// `size >= 2 && FusesInference<tuple_element_t<size - 2, ...>, ...>`, whose tuple_element_t clang
// instantiates (a hard error) for one layer, where `&&` would not have evaluated it.
template <class... Ls>
struct LastTwoFuseInference : std::false_type {};
template <class A, class B>
struct LastTwoFuseInference<A, B> : std::bool_constant<FusesInference<LayerSlot<A>, LayerSlot<B>>> {};
template <class A, class B, class C, class... Rest>
struct LastTwoFuseInference<A, B, C, Rest...> : LastTwoFuseInference<B, C, Rest...> {};
}  // namespace detail

template <class... Ls>
class Sequential {
  static_assert(sizeof...(Ls) > 0, "Sequential needs at least one layer");
  using First = typename detail::FirstLayer<Ls...>::type;

 public:
  using Env = typename First::Env;
  using Tensor = typename First::Tensor;
  // The layers' caches side by side (std::get<I>(cache) is layer I's), and what a split backward
  // needs to know to release buffers between its halves (the second layer of a fused pair, or
  // Dropout in eval, passes its argument through):
  //   handed_on[I]: layer I's backward returned the very gradient layer I + 1 returned;
  //   passed_on[I]: layer I's forward returned its input, so layer I - 1's output is read beyond it.
  struct Cache : std::tuple<typename detail::LayerSlot<Ls>::Cache...> {
    std::array<bool, sizeof...(Ls)> handed_on{}, passed_on{};
  };
  static constexpr std::size_t kSize = sizeof...(Ls);
  using FirstSlot = detail::LayerSlot<std::tuple_element_t<0, std::tuple<Ls...>>>;
  using LastSlot = detail::LayerSlot<std::tuple_element_t<kSize - 1, std::tuple<Ls...>>>;
  // Activation memory (core/concepts.hpp): x is read back by the first layer only, y is the last
  // layer's; inside, each output is released once it is dead and each gradient once consumed.
  static constexpr bool kBackwardReadsInput = backward_reads_input<FirstSlot>();
  static constexpr bool kBackwardReadsOutput = backward_reads_output<LastSlot>();
  static constexpr bool kWeightReadsInput = weight_reads_input<FirstSlot>();
  static constexpr bool kWeightReadsOutputGrad = weight_reads_output_grad<LastSlot>();

  explicit Sequential(Ls... layers) : layers_(detail::LayerSlot<Ls>(std::move(layers))...) {
    for (std::size_t i = 0; i < kSize; ++i) names_[i] = std::to_string(i);
  }

  const Tensor& forward(const Tensor& x, Cache& cache) {
    return forward_impl(x, cache, std::index_sequence_for<Ls...>{});
  }
  const Tensor& backward(const Tensor& dy, Cache& cache) {
    check_backward_allowed(mode_, "Sequential");
    return backward_impl(dy, cache, std::index_sequence_for<Ls...>{});
  }

  std::size_t unit_count() const { return kSize; }
  const Tensor& forward_units(const Tensor& x, Cache& cache, std::size_t begin, std::size_t end) {
    const Tensor* current = &x;
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      ((I >= begin && I < end ? forward_one<I>(current, cache, begin, end) : void()), ...);
    }(std::index_sequence_for<Ls...>{});
    return *current;
  }
  const Tensor& backward_units(const Tensor& dy, Cache& cache, std::size_t begin, std::size_t end) {
    check_backward_allowed(mode_, "Sequential");
    const Tensor* current = &dy;
    constexpr std::size_t last = kSize - 1;
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      ((last - I >= begin && last - I < end ? backward_one<last - I>(current, cache, begin, end) : void()), ...);
    }(std::index_sequence_for<Ls...>{});
    return *current;
  }
  // The backward in two halves, for zero-bubble pipeline schedules (parallel/pipeline_schedule.hpp;
  // core/concepts.hpp, SplitsBackward): the input half runs each layer's backward_input (its whole
  // backward if it does not split; a parameter-free layer has nothing else to do) and releases
  // only what no weight half reads (weight_reads_input, weight_reads_output_grad); the weight half
  // then runs the layers' backward_weight from the last to the first, releasing the rest as
  // backward would have once it is dead. Together the bits are backward's.
  const Tensor& backward_input(const Tensor& dy, Cache& cache) { return backward_units_input(dy, cache, 0, kSize); }
  void backward_weight(Cache& cache) { backward_units_weight(cache, 0, kSize); }
  const Tensor& backward_units_input(const Tensor& dy, Cache& cache, std::size_t begin, std::size_t end) {
    check_backward_allowed(mode_, "Sequential");
    const Tensor* current = &dy;
    constexpr std::size_t last = kSize - 1;
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      ((last - I >= begin && last - I < end ? backward_one<last - I, true>(current, cache, begin, end) : void()), ...);
    }(std::index_sequence_for<Ls...>{});
    return *current;
  }
  void backward_units_weight(Cache& cache, std::size_t begin, std::size_t end) {
    constexpr std::size_t last = kSize - 1;
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      ((last - I >= begin && last - I < end ? weight_one<last - I>(cache, end) : void()), ...);
    }(std::index_sequence_for<Ls...>{});
  }
  // The output of the last layer and the input gradient of the first, for the caller to release
  // once it has consumed them.
  void release_output(Cache& cache) { tessera::release_output(std::get<kSize - 1>(layers_), std::get<kSize - 1>(cache)); }
  void release_input_grad(Cache& cache) { tessera::release_input_grad(std::get<0>(layers_), std::get<0>(cache)); }
  template <class V>
  void visit_units(V& v, const std::string& prefix, std::size_t begin, std::size_t end) {
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      ((I >= begin && I < end ? visit_one(std::get<I>(layers_), v, prefix + names_[I] + ".") : void()), ...);
    }(std::index_sequence_for<Ls...>{});
  }
  std::string unit_name(std::size_t i) const { return names_.at(i); }
  // Layer I itself (e.g. to set a tensor-parallel block's timeline).
  template <std::size_t I>
  auto& layer() {
    return std::get<I>(layers_);
  }

  void set_mode(Mode mode) {
    mode_ = mode;
    std::apply([mode](auto&... layer) { (layer.set_mode(mode), ...); }, layers_);
  }
  // Each layer's memory format (core/memory_format.hpp); refused when a layer works on NCHW only.
  void set_memory_format(MemoryFormat f) {
    std::apply([f](auto&... layer) { (apply_memory_format(layer, f, "Sequential"), ...); }, layers_);
  }

  // Forward only (Mode::Inference), for a residual block whose branch ends in a convolution and
  // its BatchNorm: y = relu(forward(x) + addend), the last convolution finishing its output with
  // the BatchNorm, the addend and the ReLU in one pass (layers/residual.hpp).
  const Tensor& forward_add_relu(const Tensor& x, Cache& cache, const Tensor& addend, Tensor& y)
    requires(detail::LastTwoFuseInference<Ls...>::value)
  {
    constexpr std::size_t conv = kSize - 2;
    TESSERA_CHECK(mode_ == Mode::Inference, Error, "Sequential::forward_add_relu needs Mode::Inference");
    const Tensor& h = forward_units(x, cache, 0, conv);
    auto e = std::get<conv + 1>(layers_).inference_epilogue(std::get<conv + 1>(cache),
                                                            std::get<conv>(layers_).out_channels());
    e.relu = true;
    const Tensor& out = std::get<conv>(layers_).forward_epilogue(h, std::get<conv>(cache), y, e, &addend);
    if constexpr (conv > 0) tessera::release_output(std::get<conv - 1>(layers_), std::get<conv - 1>(cache));
    return out;
  }
  // Train or Eval, for a residual block whose branch ends in a BatchNorm2d: y = relu(forward(x) +
  // addend), the BatchNorm writing the sum's ReLU itself (BatchNorm2d::forward_add_relu), so the
  // branch's output is never stored apart (layers/residual.hpp).
  const Tensor& forward_norm_add_relu(const Tensor& x, Cache& cache, const Tensor& addend, Tensor& y)
    requires(requires(LastSlot& last, typename LastSlot::Cache& c, const Tensor& t, Tensor& out) {
      last.forward_add_relu(t, c, t, out);
    })
  {
    const Tensor& h = forward_units(x, cache, 0, kSize - 1);
    const Tensor& out = std::get<kSize - 1>(layers_).forward_add_relu(h, std::get<kSize - 1>(cache), addend, y);
    cache.passed_on[kSize - 1] = false;
    if constexpr (kSize > 1)  // as forward_one does after a layer
      release_dead_output<LastSlot>(std::get<kSize - 2>(layers_), std::get<kSize - 2>(cache), h, out);
    return out;
  }
  void set_needs_input_grad(bool needed) {
    if constexpr (requires { std::get<0>(layers_).set_needs_input_grad(needed); })
      std::get<0>(layers_).set_needs_input_grad(needed);
  }

  template <class V>
  void visit(V& v, const std::string& prefix) {
    visit_impl(v, prefix, std::index_sequence_for<Ls...>{});
  }
  void set_names(const std::array<std::string, kSize>& names) { names_ = names; }

  template <std::size_t I>
  auto& get() {
    return std::get<I>(layers_);
  }

 private:
  template <std::size_t... I>
  const Tensor& forward_impl(const Tensor& x, Cache& cache, std::index_sequence<I...>) {
    const Tensor* current = &x;
    (forward_one<I>(current, cache, 0, kSize), ...);
    return *current;
  }
  template <std::size_t... I>
  const Tensor& backward_impl(const Tensor& dy, Cache& cache, std::index_sequence<I...>) {
    const Tensor* current = &dy;
    constexpr std::size_t last = kSize - 1;
    (backward_one<last - I>(current, cache, 0, kSize), ...);
    return *current;
  }
  // Layer I's forward on *current; then layer I-1's output (when layer I-1 ran in this call,
  // I > begin) is released if neither of the two reads it back in backward.
  template <std::size_t I>
  using Slot = std::tuple_element_t<I, std::tuple<detail::LayerSlot<Ls>...>>;
  // Recomputation: layer I's output (a ReLU after a BatchNorm) is dropped once layer I+1's
  // forward has read it, and computed again just before layer I+1's backward reads it back:
  // from layer I-1's output, itself recomputed from the input layer I-1 keeps for its own
  // backward (BatchNorm keeps the convolution output). Two pointwise passes in backward instead
  // of holding one activation per ReLU from forward to backward, as torch.utils.checkpoint would
  // do for a BatchNorm-ReLU segment. Layer I-1's output is dead already (the first rule).
  template <std::size_t I>
  static consteval bool recomputed() {
    if constexpr (I == 0 || I + 1 >= kSize) {
      return false;
    } else {
      return RecomputesOutput<Slot<I>> && RecomputesOutput<Slot<I - 1>> && backward_reads_input<Slot<I - 1>>() &&
             !backward_reads_output<Slot<I - 1>>() && !backward_reads_input<Slot<I>>();
    }
  }

  // Layer I fuses with layer I+1 (detail::FusesWithNext) when both run in the same call.
  template <std::size_t I>
  static consteval bool fuses_with_next() {
    if constexpr (I + 1 >= kSize) return false;
    else return detail::FusesWithNext<Slot<I>, Slot<I + 1>>;
  }
  template <std::size_t I>
  static consteval bool fuses_with_previous() {
    if constexpr (I == 0) return false;
    else return fuses_with_next<I - 1>();
  }

  // Layer I is a convolution that takes the eval BatchNorm at I + 1 as its epilogue in
  // Mode::Inference (detail::FusesInference), with the ReLU at I + 2 when there is one.
  template <std::size_t I>
  static consteval bool conv_bn() {
    if constexpr (I + 1 >= kSize) return false;
    else return detail::FusesInference<Slot<I>, Slot<I + 1>>;
  }
  template <std::size_t I>
  static consteval bool bn_after_conv() {
    if constexpr (I == 0) return false;
    else return conv_bn<I - 1>();
  }

  // Layers I (convolution), I + 1 (BatchNorm) and the ReLU at I + 2 when it runs in this call, as
  // one forward in Mode::Inference: the output lands where the group's last layer keeps its own
  // (the ReLU then passes it on as after a fused BatchNorm-ReLU pair; a lone BatchNorm likewise).
  template <std::size_t I>
  const Tensor& forward_conv_bn(const Tensor& x, Cache& cache, std::size_t end) {
    auto& conv = std::get<I>(layers_);
    auto e = std::get<I + 1>(layers_).inference_epilogue(std::get<I + 1>(cache), conv.out_channels());
    if constexpr (fuses_with_next<I + 1>()) {
      if (I + 2 < end) {
        auto& relu = std::get<I + 2>(cache);
        relu.x = nullptr;
        e.relu = true;
        return conv.forward_epilogue(x, std::get<I>(cache), relu.y, e);
      }
    }
    return conv.forward_epilogue(x, std::get<I>(cache), std::get<I + 1>(cache).y, e);
  }

  // Layer I's forward, or its share of a fused pair: the first layer computes both outputs, and
  // the second's is then already *current.
  template <std::size_t I>
  const Tensor& forward_layer(const Tensor& x, Cache& cache, std::size_t begin, std::size_t end) {
    if constexpr (conv_bn<I>()) {
      if (mode_ == Mode::Inference && I + 1 < end) return forward_conv_bn<I>(x, cache, end);
    }
    if constexpr (bn_after_conv<I>()) {
      if (mode_ == Mode::Inference && I - 1 >= begin) return x;
    }
    if constexpr (fuses_with_next<I>()) {
      if (I + 1 < end) return std::get<I>(layers_).forward_relu(x, std::get<I>(cache), std::get<I + 1>(cache));
    }
    if constexpr (fuses_with_previous<I>()) {
      if (I - 1 >= begin) return x;
    }
    return std::get<I>(layers_).forward(x, std::get<I>(cache));
  }
  // Likewise backward: the first layer of a fused pair takes dy through both, the second passes it
  // on. InputOnly: the input half of a split backward (backward_units_input).
  template <std::size_t I, bool InputOnly = false>
  const Tensor& backward_layer(const Tensor& dy, Cache& cache, std::size_t begin, std::size_t end) {
    auto& layer = std::get<I>(layers_);
    auto& c = std::get<I>(cache);
    if constexpr (fuses_with_next<I>()) {
      if (I + 1 < end) {
        if constexpr (InputOnly && requires { layer.backward_relu_input(dy, c); }) return layer.backward_relu_input(dy, c);
        else return layer.backward_relu(dy, c);
      }
    }
    if constexpr (fuses_with_previous<I>()) {
      if (I - 1 >= begin) return dy;
    }
    if constexpr (InputOnly) return split_backward_input(layer, dy, c);
    else return layer.backward(dy, c);
  }
  // The weight half of layer I (after layers I + 1 ... end - 1 had theirs), then the releases
  // backward_one made after layer I's backward, now that nothing reads those buffers.
  template <std::size_t I>
  void weight_one(Cache& cache, std::size_t end) {
    split_backward_weight(std::get<I>(layers_), std::get<I>(cache));
    const bool handed_on = cache.handed_on[I];
    if constexpr (I + 1 < kSize) {
      if (I + 1 < end) {
        if (!handed_on) tessera::release_input_grad(std::get<I + 1>(layers_), std::get<I + 1>(cache));
        tessera::release_output(std::get<I>(layers_), std::get<I>(cache));
      }
    }
    if constexpr (fuses_with_next<I>() && I + 2 < kSize) {
      if (I + 2 < end && !handed_on) tessera::release_input_grad(std::get<I + 2>(layers_), std::get<I + 2>(cache));
    }
  }

  // Layer I's forward on *current; then layer I-1's output (when layer I-1 ran in this call,
  // I > begin) is released if neither of the two reads it back in backward, or if it is
  // recomputed (above; then layer I-2 ran in this call too).
  template <std::size_t I>
  void forward_one(const Tensor*& current, Cache& cache, std::size_t begin, std::size_t end) {
    const Tensor& out = forward_layer<I>(*current, cache, begin, end);
    cache.passed_on[I] = &out == current;
    if constexpr (I > 0) {
      if (I > begin) release_dead_output<Slot<I>>(std::get<I - 1>(layers_), std::get<I - 1>(cache), *current, out);
    }
    if constexpr (I >= 2) {
      if constexpr (recomputed<I - 1>()) {
        if (I - 2 >= begin && current != &out) tessera::release_output(std::get<I - 1>(layers_), std::get<I - 1>(cache));
      }
    }
    current = &out;
  }
  // Layer I's backward on *current, which layer I+1 returned when it ran in this call (I + 1 <
  // end): consumed now, so layer I+1 releases it (unless layer I handed that same tensor on).
  // Layer I's input, if recomputation dropped it, is rebuilt first; layer I's own output is
  // dead after its backward (layer I+1's backward ran before) and released too, as PyTorch frees
  // saved tensors as its backward passes them.
  // A fused pair's first layer consumes the gradient layer I+2 returned: that one it releases.
  // InputOnly: the input half of a split backward, which releases only what no weight half reads
  // (weight_one releases the rest, later).
  template <std::size_t I, bool InputOnly = false>
  void backward_one(const Tensor*& current, Cache& cache, std::size_t begin, std::size_t end) {
    if constexpr (I >= 2) {
      if constexpr (recomputed<I - 1>()) {
        if (output_released(std::get<I - 1>(cache))) {
          if constexpr (fuses_with_next<I - 2>()) {
            std::get<I - 2>(layers_).recompute_output_relu(std::get<I - 2>(cache), std::get<I - 1>(cache));
          } else {
            std::get<I - 2>(layers_).recompute_output(std::get<I - 2>(cache));
            std::get<I - 1>(layers_).recompute_output(std::get<I - 1>(cache));
            tessera::release_output(std::get<I - 2>(layers_), std::get<I - 2>(cache));
          }
        }
      }
    }
    const Tensor* in = current;
    current = &backward_layer<I, InputOnly>(*in, cache, begin, end);
    if constexpr (InputOnly) {
      // Only what a weight half still reads stays: layer I's dy (unless handed on: then it is
      // layer I - 1's too) and layer I's output (layer I + 1's x, or beyond when layer I + 1
      // passed it on). weight_one frees the rest.
      const bool handed_on = current == in;
      cache.handed_on[I] = handed_on;
      if constexpr (I + 1 < kSize) {
        if (I + 1 < end) {
          if (!handed_on && !weight_reads_output_grad<Slot<I>>())
            tessera::release_input_grad(std::get<I + 1>(layers_), std::get<I + 1>(cache));
          if constexpr (!weight_reads_input<Slot<I + 1>>()) {
            if (!cache.passed_on[I + 1]) tessera::release_output(std::get<I>(layers_), std::get<I>(cache));
          }
        }
      }
      if constexpr (fuses_with_next<I>() && I + 2 < kSize && !weight_reads_output_grad<Slot<I>>()) {
        if (I + 2 < end && !handed_on) tessera::release_input_grad(std::get<I + 2>(layers_), std::get<I + 2>(cache));
      }
      return;
    }
    if constexpr (I + 1 < kSize) {
      if (I + 1 < end) {
        if (current != in) tessera::release_input_grad(std::get<I + 1>(layers_), std::get<I + 1>(cache));
        tessera::release_output(std::get<I>(layers_), std::get<I>(cache));
      }
    }
    if constexpr (fuses_with_next<I>() && I + 2 < kSize) {
      if (I + 2 < end && current != in) tessera::release_input_grad(std::get<I + 2>(layers_), std::get<I + 2>(cache));
    }
  }
  template <class V, std::size_t... I>
  void visit_impl(V& v, const std::string& prefix, std::index_sequence<I...>) {
    (visit_one(std::get<I>(layers_), v, prefix + names_[I] + "."), ...);
  }
  template <class L, class V>
  static void visit_one(L& layer, V& v, const std::string& prefix) {
    layer.visit(v, prefix);
  }

  std::tuple<detail::LayerSlot<Ls>...> layers_;
  std::array<std::string, kSize> names_;
  Mode mode_ = Mode::Train;
};

}  // namespace tessera
