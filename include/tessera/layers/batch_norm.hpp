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
// backward cannot mix the two.
//
// Synchronized statistics (SyncBatchNorm, see parallel/sync_batch_norm.hpp): with a
// StatsAllReduce set, training-mode forward sums (sum x, sum x^2, count) per channel over every
// rank before normalizing, and backward sums (sum dy, sum dy xhat) before forming dx, so M and
// the statistics are the whole distributed batch's. The layer itself never sees a communicator:
// the hook is a function that sums a span of doubles over the group. dgamma and dbeta stay the
// local sums, which data parallelism then averages, as in torch.nn.SyncBatchNorm.
//
// Fused with a following ReLU (forward_relu, recompute_output_relu, backward_relu; Sequential and
// the ResNet stem use them for every BatchNorm2d-ReLU pair): forward writes max(y, 0) straight
// into the ReLU's cache and never forms this layer's y; backward takes dL/d(ReLU output) and masks
// it with y > 0, y formed again from x (kernels/cpu/batch_norm.hpp). The numbers are the unfused
// pair's, bit for bit; the ReLU's own forward and backward are skipped.
//
// Fused into the convolution before it (Mode::Inference, forward only; inference_epilogue): the
// running statistics become that convolution's epilogue (ConvEpilogue), the same expression applied
// while each block of its output is in cache; this layer's y is never formed, and backward on that
// cache throws.
//
// num_batches_tracked: counted as torch counts it (+1 per training-mode forward) and visited as
// v.integer_buffer(prefix + "num_batches_tracked", std::int64_t&) for visitors that have that member
// (state_dict and checkpoint I/O, where it is torch's int64 scalar tensor); visitors without it
// (optimizers, gradient reducers) never see it. It does not affect the numbers: torch only uses it
// for momentum=None, which is not offered.
#pragma once

#include <algorithm>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "tessera/comm/local_env.hpp"
#include "tessera/core/concepts.hpp"
#include "tessera/core/memory_format.hpp"
#include "tessera/core/parameter.hpp"
#include "tessera/kernels/batch_norm.hpp"
#include "tessera/kernels/conv2d_geometry.hpp"
#include "tessera/layers/activation.hpp"

namespace tessera {

template <class E>
class BatchNorm2d {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  // Sums its argument element-wise over the ranks of a group, in place.
  using StatsAllReduce = std::function<void(std::span<double>)>;

  // Backward reads x (the batch statistics' input) and the saved statistics, never y: a ReLU
  // or a residual add after this layer lets its y go (core/concepts.hpp).
  static constexpr bool kBackwardReadsOutput = false;
  // The weight half (backward_weight) adds sums the input half kept: it reads neither x nor dy.
  static constexpr bool kWeightReadsInput = false;
  static constexpr bool kWeightReadsOutputGrad = false;
  struct Cache {
    const Tensor* x = nullptr;
    Tensor y, dx;
    Tensor mean, invstd;                   // (C): the statistics the forward normalized with
    tessera::Tensor<double, D> sum, sum2;  // (C): per-channel sums, scratch for forward and backward
    // (C): this rank's sum dy and sum dy xhat, kept from backward_input for backward_weight (sum and
    // sum2 then hold the group's, under SyncBatchNorm).
    tessera::Tensor<double, D> weight_sum, weight_sum2;
    bool weight_grads_pending = false;
    bool train = false;
    bool forward_only = false;  // fused into the convolution before it (Mode::Inference): no backward
    std::int64_t count = 0;  // M: values per channel the statistics were taken over (all ranks)
  };

  explicit BatchNorm2d(std::int64_t num_features, double eps = 1e-5, double momentum = 0.1)
      : channels_(num_features), eps_(eps), momentum_(momentum) {
    TESSERA_CHECK(num_features > 0, ArgumentError, "BatchNorm2d: num_features=", num_features, " must be positive");
    TESSERA_CHECK(eps >= 0, ArgumentError, "BatchNorm2d(", num_features, "): eps=", eps, " must be >= 0");
    TESSERA_CHECK(momentum >= 0 && momentum <= 1, ArgumentError, "BatchNorm2d(", num_features,
                  "): momentum=", momentum, " must lie in [0, 1]");
    weight_ = Parameter<S, D>({num_features}, ParamKind::Norm);
    bias_ = Parameter<S, D>({num_features}, ParamKind::Norm);
    weight_.value.fill(S(1));
    running_mean_ = Tensor({num_features}, S(0));
    running_var_ = Tensor({num_features}, S(1));
  }

  const Tensor& forward(const Tensor& x, Cache& c) {
    c.y.resize(x.shape());
    normalize(x, c, c.y, false);
    return c.y;
  }
  // y again, bit for bit, from the x and the statistics forward saved (the parameters have not
  // moved between forward and backward): lets a Sequential drop y and what is computed from it.
  void recompute_output(Cache& c) { renormalize(c, c.y, false); }
  const Tensor& backward(const Tensor& dy, Cache& c) { return backward_impl(dy, c, false); }

  // The ReLU after this layer, fused (see the top): relu(forward(x)) into the ReLU's cache r, which
  // then holds what relu.forward would have left there (its input pointer is this layer's y, which
  // stays unformed); its output again, bit for bit; and the pair's backward from dy = dL/d(ReLU
  // output).
  const Tensor& forward_relu(const Tensor& x, Cache& c, typename ReLU<E>::Cache& r) {
    r.x = &c.y;
    r.y.resize(x.shape());
    normalize(x, c, r.y, true);
    return r.y;
  }
  void recompute_output_relu(Cache& c, typename ReLU<E>::Cache& r) { renormalize(c, r.y, true); }
  const Tensor& backward_relu(const Tensor& dy, Cache& c) { return backward_impl(dy, c, true); }

  // The backward in two halves, for zero-bubble pipeline schedules (parallel/pipeline_schedule.hpp):
  // backward_input (backward_relu_input for the fused pair) forms dx and keeps this rank's sum dy
  // and sum dy xhat, which dx needs anyway; backward_weight adds them to dbeta and dgamma. The same
  // sums as backward's, so the same bits; the W half is C additions, as cheap as it gets.
  const Tensor& backward_input(const Tensor& dy, Cache& c) { return backward_impl(dy, c, false, true); }
  const Tensor& backward_relu_input(const Tensor& dy, Cache& c) { return backward_impl(dy, c, true, true); }
  void backward_weight(Cache& c) {
    TESSERA_CHECK(c.weight_grads_pending, Error, name(),
                  "::backward_weight called without backward_input on this cache");
    batch_norm_accumulate_affine_grads(D{}, channels_, c.weight_sum.data(), c.weight_sum2.data(), weight_.grad.data(),
                                       bias_.grad.data());
    weight_.grad_ready();
    bias_.grad_ready();
    c.weight_grads_pending = false;
  }

  // Train or Eval, at the end of a residual block (Residual, through Sequential::forward_norm_add_relu):
  // y = relu(forward(x) + addend) in one pass, the unfused steps' value per element
  // (batch_norm_normalize_add_relu). This layer's y is never formed; its backward, which reads x,
  // is unchanged, and the block's takes dL/dy through the ReLU as before.
  const Tensor& forward_add_relu(const Tensor& x, Cache& c, const Tensor& addend, Tensor& y) {
    TESSERA_CHECK(addend.shape() == x.shape(), ShapeError, name(), ": the residual addend ", addend.shape(),
                  " does not match the input ", x.shape(), " (a block that changes shape needs a projection)");
    y.resize(x.shape());
    normalize(x, c, y, false, addend.data());
    return y;
  }

  // Forward only (Mode::Inference), fused into the convolution before it (Sequential, Residual,
  // the ResNet stem): the running statistics as that convolution's epilogue (ConvEpilogue; the
  // caller adds the addend and the ReLU). This layer's y is never formed and c refuses backward.
  // `channels`: the convolution's output channels.
  ConvEpilogue<S> inference_epilogue(Cache& c, std::int64_t channels) {
    TESSERA_CHECK(mode_ == Mode::Inference, Error, name(), ": a forward fused into the convolution before it needs ",
                  "Mode::Inference");
    TESSERA_CHECK(channels == channels_, ShapeError, name(), ": expected input (N, ", channels_,
                  ", H, W), got ", channels, " channels from the convolution before it");
    c.x = nullptr;
    c.train = false;
    c.forward_only = true;
    c.invstd.resize({channels_});
    batch_norm_invstd(D{}, channels_, running_var_.data(), eps_, c.invstd.data());
    ConvEpilogue<S> e;
    e.mean = running_mean_.data();
    e.invstd = c.invstd.data();
    e.gamma = weight_.value.data();
    e.beta = bias_.value.data();
    return e;
  }

  template <class V>
  void visit(V& v, const std::string& prefix) {
    if constexpr (requires { v.batch_norm(prefix, *this); }) v.batch_norm(prefix, *this);  // e.g. to synchronize
    v.parameter(prefix + "weight", weight_);
    v.parameter(prefix + "bias", bias_);
    v.buffer(prefix + "running_mean", running_mean_);
    v.buffer(prefix + "running_var", running_var_);
    if constexpr (requires { v.integer_buffer(prefix, num_batches_tracked_); })
      v.integer_buffer(prefix + "num_batches_tracked", num_batches_tracked_);
  }
  void set_mode(Mode mode) { mode_ = mode; }
  Mode mode() const { return mode_; }
  // The layout of 4-D inputs (core/memory_format.hpp): channels_last normalizes NHWC rows.
  void set_memory_format(MemoryFormat f) { format_ = f; }
  void set_needs_input_grad(bool needed) { needs_input_grad_ = needed; }

  // Synchronized statistics over a group (nullptr: this rank's batch only, the default).
  void set_stats_all_reduce(StatsAllReduce f) { stats_all_reduce_ = std::move(f); }
  bool synchronized() const { return static_cast<bool>(stats_all_reduce_); }

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
  std::int64_t num_batches_tracked() const { return num_batches_tracked_; }

 private:
  // The statistics (train) or the running ones (eval) into c, then y (c.y, a fused ReLU's, or a
  // residual block's relu(y + addend)).
  void normalize(const Tensor& x, Cache& c, Tensor& y, bool relu, const S* addend = nullptr) {
    const BatchNormShape s = shape_of(x);
    c.x = &x;
    c.train = mode_ == Mode::Train;
    c.forward_only = false;
    c.mean.resize({channels_});
    c.invstd.resize({channels_});
    if (c.train) {
      TESSERA_CHECK(s.count() > 1, ShapeError, name(), ": expected more than 1 value per channel when training, got ",
                    "input ", x.shape());
      c.sum.resize({channels_});
      c.sum2.resize({channels_});
      batch_norm_local_stats(D{}, x.data(), s, c.sum.data(), c.sum2.data());
      c.count = s.count();
      if (stats_all_reduce_) c.count = all_reduce_stats(c.sum.data(), c.sum2.data(), s.count());
      batch_norm_finalize_stats(D{}, channels_, c.sum.data(), c.sum2.data(), c.count, eps_, c.mean.data(),
                                c.invstd.data());
      batch_norm_update_running(D{}, channels_, c.sum.data(), c.sum2.data(), c.count, momentum_,
                                running_mean_.data(), running_var_.data());
      ++num_batches_tracked_;
    } else {
      D::copy(c.mean.data(), running_mean_.data(), running_mean_.bytes());
      batch_norm_invstd(D{}, channels_, running_var_.data(), eps_, c.invstd.data());
    }
    if (addend != nullptr)
      batch_norm_normalize_add_relu(D{}, x.data(), s, c.mean.data(), c.invstd.data(), weight_.value.data(),
                                    bias_.value.data(), addend, y.data());
    else
      batch_norm_normalize(D{}, x.data(), s, c.mean.data(), c.invstd.data(), weight_.value.data(),
                           bias_.value.data(), y.data(), relu);
  }

  void check_differentiable(const Cache& c) const {
    TESSERA_CHECK(!c.forward_only, Error, name(), ": backward after a forward in Mode::Inference, which fused ",
                  "this layer into the convolution before it (forward only; run forward in Mode::Eval or ",
                  "Mode::Train to differentiate)");
  }

  void renormalize(Cache& c, Tensor& y, bool relu) {
    check_differentiable(c);
    TESSERA_CHECK(c.x != nullptr, Error, name(), "::recompute_output called before forward on this cache");
    const Tensor& x = *c.x;
    y.resize(x.shape());
    batch_norm_normalize(D{}, x.data(), shape_of(x), c.mean.data(), c.invstd.data(), weight_.value.data(),
                         bias_.value.data(), y.data(), relu);
  }

  // defer_weight: keep the local sums for backward_weight instead of adding them to the grads now.
  const Tensor& backward_impl(const Tensor& dy, Cache& c, bool relu, bool defer_weight = false) {
    check_differentiable(c);
    TESSERA_CHECK(c.x != nullptr, Error, name(), "::backward called before forward on this cache");
    const Tensor& x = *c.x;
    TESSERA_CHECK(dy.shape() == x.shape(), ShapeError, name(), "::backward: dy ", dy.shape(),
                  " does not match the input ", x.shape());
    const BatchNormShape s = shape_of(x);
    c.sum.resize({channels_});
    c.sum2.resize({channels_});
    double* sum_dy = c.sum.data();
    double* sum_dy_xhat = c.sum2.data();
    const S* gamma = weight_.value.data();
    const S* beta = bias_.value.data();
    batch_norm_backward_local_sums(D{}, dy.data(), x.data(), s, c.mean.data(), c.invstd.data(), sum_dy,
                                   sum_dy_xhat, relu, gamma, beta);
    if (defer_weight) {
      c.weight_sum.resize({channels_});
      c.weight_sum2.resize({channels_});
      const std::size_t bytes = static_cast<std::size_t>(channels_) * sizeof(double);
      D::copy(c.weight_sum.data(), sum_dy, bytes);
      D::copy(c.weight_sum2.data(), sum_dy_xhat, bytes);
      c.weight_grads_pending = true;
    } else {
      batch_norm_accumulate_affine_grads(D{}, channels_, sum_dy, sum_dy_xhat, weight_.grad.data(), bias_.grad.data());
      weight_.grad_ready();
      bias_.grad_ready();
    }
    if (needs_input_grad_) {
      c.dx.resize(x.shape());
      // Synchronized: dx needs the group's sums (every rank must run this backward, as it ran forward).
      if (c.train && stats_all_reduce_) all_reduce_stats(sum_dy, sum_dy_xhat, -1);
      if (c.train)
        batch_norm_backward_input(D{}, dy.data(), x.data(), s, c.mean.data(), c.invstd.data(), gamma, sum_dy,
                                  sum_dy_xhat, c.count, c.dx.data(), relu, beta);
      else
        batch_norm_backward_input_affine(D{}, dy.data(), s, c.invstd.data(), gamma, c.dx.data(), relu, x.data(),
                                         c.mean.data(), beta);
    }
    return c.dx;
  }

  std::string name() const { return detail::cat("BatchNorm2d(", channels_, ", eps=", eps_, ", momentum=", momentum_, ")"); }

  BatchNormShape shape_of(const Tensor& x) const {
    TESSERA_CHECK((x.rank() == 4 || x.rank() == 2) && x.dim(1) == channels_, ShapeError, name(),
                  ": expected input (N, ", channels_, ", H, W) or (N, ", channels_, "), got ", x.shape());
    return {x.dim(0), channels_, x.rank() == 4 ? x.dim(2) * x.dim(3) : 1,
            x.rank() == 4 && format_ == MemoryFormat::ChannelsLast};
  }

  // Sums a (C) and b (C) over the group (and the count when count >= 0, returned summed).
  std::int64_t all_reduce_stats(double* a, double* b, std::int64_t count) {
    // One message: [a (C), b (C), count] in device memory (a GPU communicator reduces in place there).
    const std::size_t bytes = static_cast<std::size_t>(channels_) * sizeof(double);
    stats_buffer_.resize({2 * channels_ + 1});
    double* buffer = stats_buffer_.data();
    D::copy(buffer, a, bytes);
    D::copy(buffer + channels_, b, bytes);
    double total = static_cast<double>(count);
    D::copy_to_device(buffer + 2 * channels_, &total, sizeof(double));
    stats_all_reduce_(std::span<double>(buffer, static_cast<std::size_t>(2 * channels_ + (count >= 0 ? 1 : 0))));
    D::copy(a, buffer, bytes);
    D::copy(b, buffer + channels_, bytes);
    D::copy_to_host(&total, buffer + 2 * channels_, sizeof(double));
    D::synchronize();
    return static_cast<std::int64_t>(total);
  }

  std::int64_t channels_;
  double eps_, momentum_;
  StatsAllReduce stats_all_reduce_;
  tessera::Tensor<double, D> stats_buffer_;  // all_reduce_stats' message, kept across steps
  Mode mode_ = Mode::Train;
  MemoryFormat format_ = MemoryFormat::Contiguous;
  bool needs_input_grad_ = true;
  Parameter<S, D> weight_, bias_;
  Tensor running_mean_, running_var_;
  std::int64_t num_batches_tracked_ = 0;
};

// The class of any other Env is this one renamed (comm/local_env.hpp).
TESSERA_SAME_CODE_AS_LOCAL(BatchNorm2d);
TESSERA_LOCAL_EXTERN(BatchNorm2d)

}  // namespace tessera
