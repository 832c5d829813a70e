// BatchNorm2d: per-channel normalization of x (N, C, H, W), or of x (N, C) as BatchNorm1d does,
// with PyTorch's conventions exactly:
//
//   train:  y = gamma (x - mean_B) / sqrt(var_B + eps) + beta,  mean_B, var_B (biased) over N*H*W values;
//           running_mean = (1 - momentum) running_mean + momentum mean_B
//           running_var  = (1 - momentum) running_var  + momentum var_B * M / (M - 1)   (unbiased, M = N*H*W)
//   eval:   y = gamma (x - running_mean) / sqrt(running_var + eps) + beta
//
// Backward (dy like y):  dgamma += sum dy * xhat,  dbeta += sum dy   (C)
//   train:  dx = gamma invstd (dy - mean(dy) - xhat mean(dy xhat))   (the batch statistics depend on x)
//   eval:   dx = gamma invstd dy
// gamma ("weight") starts at 1, beta ("bias") at 0, running_mean at 0, running_var at 1.
// The mode a cache was filled in decides its backward, so switching modes between forward and
// backward cannot mix the two. torch's num_batches_tracked buffer is not kept (it only matters for
// momentum=None, which is not offered).
#pragma once

#include <algorithm>
#include <string>

#include "tessera/core/concepts.hpp"
#include "tessera/core/parameter.hpp"
#include "tessera/kernels/cpu/batch_norm.hpp"

namespace tessera {

template <class E>
class BatchNorm2d {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  struct Cache {
    const Tensor* x = nullptr;
    Tensor y, dx;
    Tensor mean, invstd;                   // (C): the statistics the forward normalized with
    tessera::Tensor<double, D> sum, sum2;  // (C): per-channel sums, scratch for forward and backward
    bool train = false;
  };

  explicit BatchNorm2d(std::int64_t num_features, double eps = 1e-5, double momentum = 0.1)
      : channels_(num_features), eps_(eps), momentum_(momentum) {
    TESSERA_CHECK(num_features > 0, ArgumentError, "BatchNorm2d: num_features=", num_features, " must be positive");
    TESSERA_CHECK(eps > 0, ArgumentError, "BatchNorm2d(", num_features, "): eps=", eps, " must be positive");
    TESSERA_CHECK(momentum >= 0 && momentum <= 1, ArgumentError, "BatchNorm2d(", num_features,
                  "): momentum=", momentum, " must lie in [0, 1]");
    weight_ = Parameter<S, D>({num_features}, ParamKind::Norm);
    bias_ = Parameter<S, D>({num_features}, ParamKind::Norm);
    weight_.value.fill(S(1));
    running_mean_ = Tensor({num_features}, S(0));
    running_var_ = Tensor({num_features}, S(1));
  }

  const Tensor& forward(const Tensor& x, Cache& c) {
    const BatchNormShape s = shape_of(x);
    c.x = &x;
    c.train = mode_ == Mode::Train;
    c.y.resize(x.shape());
    c.mean.resize({channels_});
    c.invstd.resize({channels_});
    if (c.train) {
      TESSERA_CHECK(s.count() > 1, ShapeError, name(), ": expected more than 1 value per channel when training, got ",
                    "input ", x.shape());
      c.sum.resize({channels_});
      c.sum2.resize({channels_});
      batch_norm_local_stats(D{}, x.data(), s, c.sum.data(), c.sum2.data());
      batch_norm_finalize_stats(D{}, channels_, c.sum.data(), c.sum2.data(), s.count(), eps_, c.mean.data(),
                                c.invstd.data());
      batch_norm_update_running(D{}, channels_, c.sum.data(), c.sum2.data(), s.count(), momentum_,
                                running_mean_.data(), running_var_.data());
    } else {
      std::copy(running_mean_.begin(), running_mean_.end(), c.mean.begin());
      batch_norm_invstd(D{}, channels_, running_var_.data(), eps_, c.invstd.data());
    }
    batch_norm_normalize(D{}, x.data(), s, c.mean.data(), c.invstd.data(), weight_.value.data(),
                         bias_.value.data(), c.y.data());
    return c.y;
  }

  const Tensor& backward(const Tensor& dy, Cache& c) {
    TESSERA_CHECK(c.x != nullptr, Error, name(), "::backward called before forward on this cache");
    const Tensor& x = *c.x;
    TESSERA_CHECK(dy.shape() == x.shape(), ShapeError, name(), "::backward: dy ", dy.shape(),
                  " does not match the input ", x.shape());
    const BatchNormShape s = shape_of(x);
    c.sum.resize({channels_});
    c.sum2.resize({channels_});
    double* sum_dy = c.sum.data();
    double* sum_dy_xhat = c.sum2.data();
    batch_norm_backward_local_sums(D{}, dy.data(), x.data(), s, c.mean.data(), c.invstd.data(), sum_dy,
                                   sum_dy_xhat);
    for (std::int64_t ch = 0; ch < channels_; ++ch) {
      weight_.grad[ch] += static_cast<S>(sum_dy_xhat[ch]);
      bias_.grad[ch] += static_cast<S>(sum_dy[ch]);
    }
    weight_.grad_ready();
    bias_.grad_ready();
    if (needs_input_grad_) {
      c.dx.resize(x.shape());
      if (c.train)
        batch_norm_backward_input(D{}, dy.data(), x.data(), s, c.mean.data(), c.invstd.data(), weight_.value.data(),
                                  sum_dy, sum_dy_xhat, s.count(), c.dx.data());
      else
        batch_norm_backward_input_affine(D{}, dy.data(), s, c.invstd.data(), weight_.value.data(), c.dx.data());
    }
    return c.dx;
  }

  template <class V>
  void visit(V& v, const std::string& prefix) {
    v.parameter(prefix + "weight", weight_);
    v.parameter(prefix + "bias", bias_);
    v.buffer(prefix + "running_mean", running_mean_);
    v.buffer(prefix + "running_var", running_var_);
  }
  void set_mode(Mode mode) { mode_ = mode; }
  Mode mode() const { return mode_; }
  void set_needs_input_grad(bool needed) { needs_input_grad_ = needed; }

  // Goyal et al. (2017): the last BN of each residual block starts at gamma = 0, so every block
  // starts as the identity and very deep networks train from the first step.
  void zero_init_weight() { weight_.value.zero(); }

  std::int64_t num_features() const { return channels_; }
  double eps() const { return eps_; }
  double momentum() const { return momentum_; }
  Parameter<S, D>& weight() { return weight_; }
  Parameter<S, D>& bias() { return bias_; }
  Tensor& running_mean() { return running_mean_; }
  Tensor& running_var() { return running_var_; }

 private:
  std::string name() const { return detail::cat("BatchNorm2d(", channels_, ", eps=", eps_, ", momentum=", momentum_, ")"); }

  BatchNormShape shape_of(const Tensor& x) const {
    TESSERA_CHECK((x.rank() == 4 || x.rank() == 2) && x.dim(1) == channels_, ShapeError, name(),
                  ": expected input (N, ", channels_, ", H, W) or (N, ", channels_, "), got ", x.shape());
    return {x.dim(0), channels_, x.rank() == 4 ? x.dim(2) * x.dim(3) : 1};
  }

  std::int64_t channels_;
  double eps_, momentum_;
  Mode mode_ = Mode::Train;
  bool needs_input_grad_ = true;
  Parameter<S, D> weight_, bias_;
  Tensor running_mean_, running_var_;
};

}  // namespace tessera
