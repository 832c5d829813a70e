// MseLoss: mean squared error between a prediction y and a target of the same shape, as
// torch.nn.MSELoss(reduction):
//
//   loss = sum_i (y_i - t_i)^2 / numel  (Mean)   or   sum_i (y_i - t_i)^2  (Sum)
//   dL/dy = 2 (y - t) / numel           (Mean)   or   2 (y - t)            (Sum)      (like y)
//
// Not a layer: no parameters. forward keeps y - t in the cache, so neither input needs to outlive it.
// Shapes must match exactly (no broadcasting: torch only warns, and it is nearly always a bug).
#pragma once

#include <cstdint>
#include <string>

#include "tessera/comm/local_env.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/kernels/elementwise.hpp"
#include "tessera/kernels/loss.hpp"
#include "tessera/losses/reduction.hpp"

namespace tessera {

template <class E>
class MseLoss {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  struct Cache {
    Tensor diff;  // y - t
    Tensor dy;    // dL/dy, filled by backward
  };

  explicit MseLoss(Reduction reduction = Reduction::Mean) : reduction_(reduction) {}

  S forward(const Tensor& y, const Tensor& target, Cache& c) {
    TESSERA_CHECK(y.shape() == target.shape(), ShapeError, "MseLoss(reduction=", to_string(reduction_),
                  "): prediction ", y.shape(), " and target ", target.shape(), " must have the same shape");
    const std::int64_t n = y.numel();
    c.diff.resize(y.shape());
    const double total = squared_error_forward(D{}, y.data(), target.data(), n, c.diff.data());
    // Mean of no elements is 0 / 0 = NaN, as torch.nn.MSELoss gives (Sum of none is 0).
    return static_cast<S>(reduction_ == Reduction::Mean ? total / static_cast<double>(n) : total);
  }

  const Tensor& backward(Cache& c) {
    const std::int64_t n = c.diff.numel();
    const S scale = static_cast<S>(reduction_ == Reduction::Mean && n > 0 ? 2.0 / static_cast<double>(n) : 2.0);
    c.dy.resize(c.diff.shape());
    scale_elements(D{}, c.diff.data(), n, scale, c.dy.data());
    return c.dy;
  }

  Reduction reduction() const { return reduction_; }

 private:
  Reduction reduction_;
};

// The class of any other Env is this one renamed (comm/local_env.hpp).
TESSERA_SAME_CODE_AS_LOCAL(MseLoss);
TESSERA_LOCAL_EXTERN(MseLoss)

}  // namespace tessera
