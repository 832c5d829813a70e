// Swish (SiLU with a temperature): y = x * sigmoid(beta x), the worked example of a pointwise
// layer in docs/adding-a-layer.md (tests/docs/test_adding_a_layer.cpp checks it). The op holds
// the per-element maths; Pointwise<E, Op> is the layer (caches, shape checks, CPU threads and the
// CUDA map kernel), so the whole layer is this file.
//
//   s = sigmoid(beta x),  y = x s,  dy/dx = s + beta x s (1 - s) = s + beta y (1 - s)
// beta = 1 is torch.nn.SiLU.
#pragma once

#include <cmath>

#include "tessera/layers/activation.hpp"

namespace tessera {

struct SwishOp {
  static constexpr const char* name = "Swish";
  double beta = 1.0;
  template <class S>
  TESSERA_HOST_DEVICE S value(S x) const {
    return x / (S(1) + exp(-static_cast<S>(beta) * x));
  }
  template <class S>
  TESSERA_HOST_DEVICE S derivative(S x, S y) const {
    const S s = S(1) / (S(1) + exp(-static_cast<S>(beta) * x));
    return s + static_cast<S>(beta) * y * (S(1) - s);
  }
};

template <class E>
using Swish = Pointwise<E, SwishOp>;

}  // namespace tessera
