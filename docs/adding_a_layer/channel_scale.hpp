// ChannelScale: y[n, c, h, w] = x[n, c, h, w] * alpha[c], the worked example of
// docs/adding-a-layer.md (compiled and gradient-checked by tests/docs/test_adding_a_layer.cpp).
//
// Backward, dy (N, C, H, W):
//   dalpha[c] += sum_{n,h,w} dy[n,c,h,w] * x[n,c,h,w]        dx = dy * alpha[c]
#pragma once

#include <string>

#include "tessera/core/concepts.hpp"
#include "tessera/core/parameter.hpp"

namespace tessera {

template <class E>
class ChannelScale {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  // What backward needs from forward, per micro-batch: the input (by pointer) and the outputs.
  struct Cache {
    const Tensor* x = nullptr;
    Tensor y, dx;
  };

  explicit ChannelScale(std::int64_t channels) : alpha_({channels}, ParamKind::Norm) { alpha_.value.fill(S(1)); }

  const Tensor& forward(const Tensor& x, Cache& c) {
    TESSERA_CHECK(x.rank() == 4 && x.dim(1) == alpha_.value.dim(0), ShapeError, "ChannelScale(",
                  alpha_.value.dim(0), "): expected input (N, ", alpha_.value.dim(0), ", H, W), got ", x.shape());
    c.x = &x;
    c.y.resize(x.shape());  // reuses the buffer from the previous step: no allocation
    const std::int64_t channels = x.dim(1), plane = x.dim(2) * x.dim(3);
    for (std::int64_t n = 0; n < x.dim(0); ++n)
      for (std::int64_t ch = 0; ch < channels; ++ch) {
        const S a = alpha_.value[ch];
        const S* in = x.data() + (n * channels + ch) * plane;
        S* out = c.y.data() + (n * channels + ch) * plane;
        for (std::int64_t i = 0; i < plane; ++i) out[i] = in[i] * a;
      }
    return c.y;
  }

  const Tensor& backward(const Tensor& dy, Cache& c) {
    const Tensor& x = *c.x;
    const std::int64_t channels = x.dim(1), plane = x.dim(2) * x.dim(3);
    c.dx.resize(x.shape());
    for (std::int64_t n = 0; n < x.dim(0); ++n)
      for (std::int64_t ch = 0; ch < channels; ++ch) {
        const S a = alpha_.value[ch];
        const S* g = dy.data() + (n * channels + ch) * plane;
        const S* in = x.data() + (n * channels + ch) * plane;
        S* out = c.dx.data() + (n * channels + ch) * plane;
        S acc = 0;
        for (std::int64_t i = 0; i < plane; ++i) {
          acc += g[i] * in[i];
          out[i] = g[i] * a;
        }
        alpha_.grad[ch] += acc;  // accumulate: several micro-batches may add to one step
      }
    alpha_.grad_ready();  // lets DataParallel start this gradient's all-reduce now
    return c.dx;
  }

  template <class V>
  void visit(V& v, const std::string& prefix) {
    v.parameter(prefix + "alpha", alpha_);
  }
  void set_mode(Mode) {}

 private:
  Parameter<S, D> alpha_;
};

}  // namespace tessera
