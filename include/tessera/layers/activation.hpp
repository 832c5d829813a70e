// Activation layers, any input shape, y like x:
//
//   ReLU:  y = max(x, 0)                                  dx = dy * (y > 0)
//   GELU:  y = 0.5 x (1 + erf(x / sqrt 2))   (exact)      dx = dy (Phi(x) + x phi(x))
//          tanh form (approximate = Tanh, torch's approximate='tanh'):
//          y = 0.5 x (1 + t), t = tanh(u), u = sqrt(2/pi) (x + 0.044715 x^3)
//          dx = dy (0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2))
//   LeakyReLU: y = x if x > 0 else slope x                dx = dy (x > 0 ? 1 : slope)
//
// None works in place: y is a new tensor in the cache, so the input (often a BatchNorm output
// that the BatchNorm backward still needs) stays intact. No parameters.
#pragma once

#include <cmath>
#include <concepts>
#include <string>
#include <type_traits>

#include "tessera/comm/local_env.hpp"
#include "tessera/core/concepts.hpp"
#include "tessera/core/host_device.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/kernels/elementwise.hpp"

namespace tessera {

// A parameter-free pointwise layer y = f(x), any shape. Op is one of two kinds:
//  - a per-element functor, possibly with state (a slope, a temperature), that runs on every
//    device through the generic map kernels:
//        static constexpr const char* name;
//        template <class S> TESSERA_HOST_DEVICE S value(S x) const;            // f(x)
//        template <class S> TESSERA_HOST_DEVICE S derivative(S x, S y) const;  // f'(x), y = f(x)
//  - a kernel provider, for activations with hand-written kernels (ReLU, GELU), possibly with
//    state too (GELU's approximation):
//        void forward(D, x, n, y) const;   void backward(D, dy, x, y, n, dx) const;   (or static)
// Pointwise<E, Op>(op) keeps a copy of op.
template <class E, class Op>
class Pointwise : public ParameterFree {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  // Element by element: the same in every memory format (core/memory_format.hpp).
  static constexpr bool kElementwise = true;
  struct Cache {
    const Tensor* x = nullptr;
    Tensor y, dx;
  };
  // An Op whose backward needs only y (ReLU: y > 0 exactly where x > 0) says so with
  // kBackwardReadsInput = false; then the layer before may free x once this forward ran.
  static constexpr bool kBackwardReadsInput = [] {
    if constexpr (requires { Op::kBackwardReadsInput; }) return Op::kBackwardReadsInput;
    else return true;
  }();
  static constexpr bool kPerElement = requires(const Op& op, S v) {
    { op.value(v) } -> std::convertible_to<S>;
    { op.derivative(v, v) } -> std::convertible_to<S>;
  };

  Pointwise() = default;
  explicit Pointwise(Op op) : op_(op) {}

  const Tensor& forward(const Tensor& x, Cache& c) {
    c.x = &x;
    c.y.resize(x.shape());
    if constexpr (kPerElement) map_forward(D{}, op_, x.data(), x.numel(), c.y.data());
    else op_.forward(D{}, x.data(), x.numel(), c.y.data());
    return c.y;
  }
  // y again from x, which the caller has made whole again (see Sequential's recomputation).
  void recompute_output(Cache& c) { forward(*c.x, c); }

  const Tensor& backward(const Tensor& dy, Cache& c) {
    TESSERA_CHECK(c.x != nullptr, Error, Op::name, "::backward called before forward on this cache");
    TESSERA_CHECK(dy.shape() == c.y.shape(), ShapeError, Op::name, "::backward: dy ", dy.shape(),
                  " does not match output ", c.y.shape());
    if (needs_input_grad_) {
      c.dx.resize(dy.shape());
      // x may have been released (kBackwardReadsInput false): then the Op does not read it.
      const S* x = kBackwardReadsInput ? c.x->data() : nullptr;
      if constexpr (kPerElement) map_backward(D{}, op_, dy.data(), x, c.y.data(), dy.numel(), c.dx.data());
      else op_.backward(D{}, dy.data(), x, c.y.data(), dy.numel(), c.dx.data());
    }
    return c.dx;
  }

  void set_mode(Mode) {}
  void set_needs_input_grad(bool needed) { needs_input_grad_ = needed; }
  const Op& op() const { return op_; }

 private:
  Op op_{};
  bool needs_input_grad_ = true;
};

// torch.nn.LeakyReLU(negative_slope=0.01): y = x for x > 0, negative_slope * x otherwise.
// LeakyReLU<E>({.negative_slope = 0.2}).
struct LeakyReluOp {
  static constexpr const char* name = "LeakyReLU";
  double negative_slope = 0.01;
  template <class S>
  TESSERA_HOST_DEVICE S value(S x) const {
    return x > S(0) ? x : static_cast<S>(negative_slope) * x;
  }
  template <class S>
  TESSERA_HOST_DEVICE S derivative(S x, S) const {
    return x > S(0) ? S(1) : static_cast<S>(negative_slope);
  }
};

struct ReluOp {
  static constexpr const char* name = "ReLU";
  static constexpr bool kBackwardReadsInput = false;  // backward reads y only
  template <class Dev, class S>
  static void forward(Dev d, const S* x, std::int64_t n, S* y) {
    relu_forward(d, x, n, y);
  }
  template <class Dev, class S>
  static void backward(Dev d, const S* dy, const S* /*x*/, const S* y, std::int64_t n, S* dx) {
    relu_backward(d, dy, y, n, dx);  // y > 0 exactly where x > 0
  }
};

// torch.nn.GELU(approximate='none' | 'tanh').
enum class GeluApproximate { None, Tanh };

namespace detail {
// The tanh form per element, for the generic map kernels (formulas at the top of this file).
struct GeluTanhMath {
  template <class S>
  TESSERA_HOST_DEVICE S value(S x) const {
    using std::tanh;  // tanh(float) in float, as torch computes it (the C tanh would use double)
    const S k = S(0.7978845608028654);  // sqrt(2 / pi)
    return S(0.5) * x * (S(1) + tanh(k * (x + S(0.044715) * x * x * x)));
  }
  template <class S>
  TESSERA_HOST_DEVICE S derivative(S x, S) const {
    using std::tanh;
    const S k = S(0.7978845608028654);
    const S t = tanh(k * (x + S(0.044715) * x * x * x));
    return S(0.5) * (S(1) + t) + S(0.5) * x * (S(1) - t * t) * k * (S(1) + S(3 * 0.044715) * x * x);
  }
};
}  // namespace detail

// GELU<E>() is the exact erf form (torch's default); GELU<E>({.approximate = GeluApproximate::Tanh})
// the tanh form.
struct GeluOp {
  static constexpr const char* name = "GELU";
  GeluApproximate approximate = GeluApproximate::None;
  template <class Dev, class S>
  void forward(Dev d, const S* x, std::int64_t n, S* y) const {
    if (approximate != GeluApproximate::Tanh) gelu_forward(d, x, n, y);
    else if constexpr (std::is_same_v<Dev, Cpu>) gelu_tanh_forward(d, x, n, y);  // vectorized, compiled at -O3
    else map_forward(d, detail::GeluTanhMath{}, x, n, y);
  }
  template <class Dev, class S>
  void backward(Dev d, const S* dy, const S* x, const S* y, std::int64_t n, S* dx) const {
    if (approximate != GeluApproximate::Tanh) gelu_backward(d, dy, x, n, dx);
    else if constexpr (std::is_same_v<Dev, Cpu>) gelu_tanh_backward(d, dy, x, n, dx);
    else map_backward(d, detail::GeluTanhMath{}, dy, x, y, n, dx);
  }
};

template <class E>
using ReLU = Pointwise<E, ReluOp>;
template <class E>
using GELU = Pointwise<E, GeluOp>;
template <class E>
using LeakyReLU = Pointwise<E, LeakyReluOp>;

// The class of any other Env is this one renamed (comm/local_env.hpp).
TESSERA_SAME_CODE_AS_LOCAL_WITH(Pointwise, class, Op);
TESSERA_LOCAL_EXTERN(Pointwise, ReluOp)
TESSERA_LOCAL_EXTERN(Pointwise, GeluOp)

}  // namespace tessera
