// Dropout (inverted, as torch.nn.Dropout), any input shape, y like x:
//
//   train:  y = x * mask,  mask_i = keep_i / (1 - p),  keep_i ~ Bernoulli(1 - p)    dx = dy * mask
//   eval:   y = x (forward returns x itself, backward returns dy itself: no copy)
//
// The mask (already scaled by 1/(1-p)) lives in the cache, so each micro-batch keeps its own.
// The masks come from an Rng owned by the layer: rng() exposes it so a checkpoint can save and
// restore its state (and a test can replay one mask). Requires 0 <= p < 1.
#pragma once

#include <cstdint>
#include <string>

#include "tessera/comm/local_env.hpp"
#include "tessera/core/concepts.hpp"
#include "tessera/core/random.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/kernels/elementwise.hpp"

namespace tessera {

template <class E>
class Dropout {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  // Element by element (its mask drawn in memory order): any memory format (core/memory_format.hpp).
  static constexpr bool kElementwise = true;
  struct Cache {
    const Tensor* x = nullptr;
    Tensor y, dx;
    Tensor mask;           // keep / (1 - p), like x; valid when `applied`
    bool applied = false;  // false: forward was the identity (eval mode or p = 0)
  };

  Dropout(double p, std::uint64_t seed) : p_(p), rng_(seed) {
    TESSERA_CHECK(p >= 0.0 && p < 1.0, ArgumentError, "Dropout: p=", p, " must lie in [0, 1)");
  }

  const Tensor& forward(const Tensor& x, Cache& c) {
    c.x = &x;
    c.applied = mode_ == Mode::Train && p_ > 0.0;
    if (!c.applied) return x;
    c.mask.resize(x.shape());
    c.y.resize(x.shape());
    dropout_mask(D{}, x.numel(), p_, rng_, c.mask.data());
    multiply(D{}, x.data(), c.mask.data(), x.numel(), c.y.data());
    return c.y;
  }

  const Tensor& backward(const Tensor& dy, Cache& c) {
    TESSERA_CHECK(c.x != nullptr, Error, "Dropout::backward called before forward on this cache");
    TESSERA_CHECK(dy.shape() == c.x->shape(), ShapeError, "Dropout(p=", p_, ")::backward: dy ", dy.shape(),
                  " does not match output ", c.x->shape());
    if (!c.applied) return dy;
    if (needs_input_grad_) {
      c.dx.resize(dy.shape());
      multiply(D{}, dy.data(), c.mask.data(), dy.numel(), c.dx.data());
    }
    return c.dx;
  }

  template <class V>
  void visit(V& v, const std::string& prefix) {
    v.rng(prefix + "rng", rng_);  // the mask stream: saved in checkpoints for exact resume
  }
  void set_mode(Mode mode) { mode_ = mode; }
  void set_needs_input_grad(bool needed) { needs_input_grad_ = needed; }

  double p() const { return p_; }
  Rng& rng() { return rng_; }

 private:
  double p_;
  Rng rng_;
  Mode mode_ = Mode::Train;
  bool needs_input_grad_ = true;
};

// The class of any other Env is this one renamed (comm/local_env.hpp).
TESSERA_SAME_CODE_AS_LOCAL(Dropout);
TESSERA_LOCAL_EXTERN(Dropout)

}  // namespace tessera
