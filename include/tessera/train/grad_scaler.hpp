// GradScaler: dynamic loss scaling for mixed-precision training, as torch.cuda.amp.GradScaler.
//
// With reduced-precision compute (Cuda::set_math_precision(MathPrecision::Float16 / BFloat16)),
// products round their inputs to 16 bits; a small loss gradient would round to zero in them
// (fp16's smallest normal is 6e-5). Scaling the loss gradient by S moves every backward value up
// by S; the parameter gradients (kept in fp32, the master weights' precision) are divided by S
// before the optimizer sees them. When any gradient is inf or NaN the scale was too large: the
// step is skipped and S halves; after growth_interval clean steps in a row S doubles.
//
//   GradScaler<CudaLocal> scaler(named, {});
//   const auto& dy = scaler.scale_gradient(loss.backward(loss_cache));   // dL/dlogits * S
//   model.backward(dy, cache);
//   (data parallel: all-reduce the gradients here, so every rank sees the same inf/NaN)
//   const bool stepped = scaler.step(optimizer);   // unscale, check, step or skip, update S
//
// Works on every device (the CPU has no reduced-precision compute, but the logic is the same and
// is tested there).
#pragma once

#include <cmath>
#include <cstring>
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/core/parameter.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/kernels/elementwise.hpp"
#include "tessera/kernels/loss.hpp"
#include "tessera/optim/optimizer.hpp"

namespace tessera {

struct GradScalerOptions {
  double init_scale = 65536.0;  // 2^16, torch's default
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  std::int64_t growth_interval = 2000;  // clean steps in a row before the scale grows
  bool enabled = true;                  // false: scale 1, no checks (the same code path in fp32 runs)
};

template <class E>
class GradScaler {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;

  template <class Other>
  GradScaler(const NamedTensors<Other>& named, GradScalerOptions o = {})
      : GradScaler(parameters_of_env<E>(named), o) {}
  GradScaler(const NamedTensors<E>& named, GradScalerOptions o = {}) : o_(o), scale_(o.init_scale) {
    TESSERA_CHECK(o.init_scale > 0 && std::isfinite(o.init_scale), ArgumentError, "GradScaler: init_scale=",
                  o.init_scale, " must be positive and finite");
    TESSERA_CHECK(o.growth_factor > 1 && o.backoff_factor > 0 && o.backoff_factor < 1 && o.growth_interval > 0,
                  ArgumentError, "GradScaler: need growth_factor > 1, 0 < backoff_factor < 1, growth_interval > 0 (got ",
                  o.growth_factor, ", ", o.backoff_factor, ", ", o.growth_interval, ")");
    TESSERA_CHECK(!named.parameters.empty(), ArgumentError, "GradScaler: no parameters");
    for (const auto& [name, p] : named.parameters) params_.push_back(p);
    found_.resize({1});
  }

  double scale() const { return o_.enabled ? scale_ : 1.0; }
  std::int64_t skipped_steps() const { return skipped_; }

  // dy * scale(), in a buffer of the scaler's (dy itself is left alone).
  const Tensor<S, D>& scale_gradient(const Tensor<S, D>& dy) {
    scaled_.resize(dy.shape());
    scale_elements(D{}, dy.data(), dy.numel(), static_cast<S>(scale()), scaled_.data());
    return scaled_;
  }

  // Divides every parameter gradient by the scale; true when all of them are finite. One flag in
  // device memory collects every parameter's check, read back once.
  bool unscale() {
    // The gradients must be final (averaged across ranks) before they are checked.
    run_update_guards(params_, [](Parameter<S, D>* p) { return p; });
    if (!o_.enabled) return true;
    found_.zero();
    const S inv = static_cast<S>(1.0 / scale_);
    for (Parameter<S, D>* p : params_) unscale_and_flag(D{}, p->grad.data(), p->grad.numel(), inv, found_.data());
    std::int32_t found = 0;
    D::copy_to_host(&found, found_.data(), sizeof found);
    D::synchronize();
    return found == 0;
  }

  // unscale(); optimizer.step() unless a gradient was inf/NaN; then the scale's update.
  // Returns whether the optimizer stepped.
  template <class Optimizer>
  bool step(Optimizer& optimizer) {
    const bool finite = unscale();
    if (finite) optimizer.step();
    update(finite);
    return finite;
  }

  void update(bool finite) {
    if (!o_.enabled) return;
    if (!finite) {
      scale_ *= o_.backoff_factor;
      clean_steps_ = 0;
      ++skipped_;
      return;
    }
    if (++clean_steps_ >= o_.growth_interval) {
      scale_ *= o_.growth_factor;
      clean_steps_ = 0;
    }
  }

  // For checkpoints: the scale (as its bits, exact) and the clean-step counter.
  template <class V>
  void visit_state(V& v) {
    std::int64_t bits = 0;
    static_assert(sizeof bits == sizeof scale_);
    std::memcpy(&bits, &scale_, sizeof bits);
    v.integer("grad_scaler.scale_bits", bits);
    std::memcpy(&scale_, &bits, sizeof bits);
    v.integer("grad_scaler.clean_steps", clean_steps_);
  }

 private:
  GradScalerOptions o_;
  double scale_;
  std::int64_t clean_steps_ = 0, skipped_ = 0;
  std::vector<Parameter<S, D>*> params_;
  Tensor<S, D> scaled_;
  Tensor<std::int32_t, D> found_;
};

}  // namespace tessera
