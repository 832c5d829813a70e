// Learning-rate schedules: pure functions of a fractional epoch, lr = schedule(epoch).
//
// Epochs are fractional so that a trainer can update the learning rate every iteration
// (epoch = iteration / iterations_per_epoch), which is how Goyal et al. warm up. At integer epochs
// each schedule equals the torch.optim.lr_scheduler value after `epoch` calls to step():
//
//   ConstantLr{b}(e)            = b
//   StepLr{b, s, gamma}(e)      = b * gamma^floor(e / s)                               StepLR
//   MultiStepLr{b, ms, gamma}(e)= b * gamma^(number of milestones <= e)                MultiStepLR
//   CosineLr{b, T, eta_min}(e)  = eta_min + (b - eta_min) * (1 + cos(pi e / T)) / 2    CosineAnnealingLR
//                                 (past T it rises again, as torch's does)
//   LinearWarmup{inner, W, f}(e)= inner(e) * (f + (1 - f) * min(e, W) / W)             LinearLR(f, 1, W)
//                                 chained with inner (torch's ChainedScheduler multiplies factors)
//   SequentialLr{{M1, ..}, s0, s1, ..}(e) = s_k(e - M_k) for M_k <= e < M_k+1 (M_0 = 0)     SequentialLR
//                                 each stage on its own clock: a warmup, then any schedule
//
// Use: opt.set_lr(schedule(epoch + double(i) / iterations_per_epoch)) before each step.
// Constructors throw ArgumentError on a negative base lr, non-positive periods, a negative
// milestone or warmup length, a start factor outside (0, 1], and SequentialLr milestones that are
// not increasing and positive or not one fewer than the stages; operator() on a negative epoch.
// linear_scaling_rule (from optimizer.hpp) scales the base lr for a large global batch.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <numbers>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/optim/optimizer.hpp"

namespace tessera {

template <class F>
concept LrSchedule = requires(const F& f, double epoch) {
  { f(epoch) } -> std::convertible_to<double>;
};

namespace detail {
// Epoch counts and periods may be integers or fractions: StepLr{0.1, 30} and CosineLr{lr, epochs}
// with an int64 `epochs` must not trip brace-initialization's narrowing rule.
template <class T>
concept EpochCount = std::is_arithmetic_v<T>;

inline void check_base_lr(double base_lr, const char* schedule) {
  TESSERA_CHECK(base_lr >= 0, ArgumentError, schedule, ": base_lr=", base_lr, " must be >= 0");
}
inline void check_epoch(double epoch, const char* schedule) {
  TESSERA_CHECK(epoch >= 0, ArgumentError, schedule, ": epoch=", epoch, " must be >= 0");
}
}  // namespace detail

struct ConstantLr {
  double base_lr;

  explicit ConstantLr(double base) : base_lr(base) { detail::check_base_lr(base, "ConstantLr"); }
  double operator()(double epoch) const {
    detail::check_epoch(epoch, "ConstantLr");
    return base_lr;
  }
};

struct StepLr {
  double base_lr;
  double step_size;
  double gamma;

  StepLr(double base, detail::EpochCount auto step, double g = 0.1)
      : base_lr(base), step_size(double(step)), gamma(g) {
    detail::check_base_lr(base, "StepLr");
    TESSERA_CHECK(step > 0, ArgumentError, "StepLr: step_size=", step, " must be positive");
  }
  double operator()(double epoch) const {
    detail::check_epoch(epoch, "StepLr");
    return base_lr * std::pow(gamma, std::floor(epoch / step_size));
  }
};

struct MultiStepLr {
  double base_lr;
  std::vector<double> milestones;  // sorted; a repeated milestone applies gamma twice, as in torch
  double gamma;

  MultiStepLr(double base, std::vector<double> ms, double g = 0.1)
      : base_lr(base), milestones(std::move(ms)), gamma(g) {
    detail::check_base_lr(base, "MultiStepLr");
    std::sort(milestones.begin(), milestones.end());
    TESSERA_CHECK(milestones.empty() || milestones.front() >= 0, ArgumentError, "MultiStepLr: milestone ",
                  milestones.front(), " must be >= 0");
  }
  double operator()(double epoch) const {
    detail::check_epoch(epoch, "MultiStepLr");
    const auto passed = std::count_if(milestones.begin(), milestones.end(),
                                      [=](double m) { return m <= epoch; });
    return base_lr * std::pow(gamma, static_cast<double>(passed));
  }
};

struct CosineLr {
  double base_lr;
  double t_max;
  double eta_min;

  CosineLr(double base, detail::EpochCount auto t, double min_lr = 0)
      : base_lr(base), t_max(double(t)), eta_min(min_lr) {
    detail::check_base_lr(base, "CosineLr");
    TESSERA_CHECK(t > 0, ArgumentError, "CosineLr: t_max=", t, " must be positive");
    TESSERA_CHECK(min_lr >= 0, ArgumentError, "CosineLr: eta_min=", min_lr, " must be >= 0");
  }
  double operator()(double epoch) const {
    detail::check_epoch(epoch, "CosineLr");
    return eta_min +
           (base_lr - eta_min) * (1 + std::cos(std::numbers::pi * epoch / t_max)) / 2;
  }
};

// Gradual warmup (Goyal et al.): the factor ramps linearly from start_factor at epoch 0 to 1 at
// warmup_epochs and multiplies the inner schedule, which then runs on unchanged. warmup_epochs = 0
// means no warmup.
template <LrSchedule Inner>
struct LinearWarmup {
  Inner inner;
  double warmup_epochs;
  double start_factor;

  LinearWarmup(Inner in, detail::EpochCount auto warmup, double start = 1.0 / 3)
      : inner(std::move(in)), warmup_epochs(double(warmup)), start_factor(start) {
    TESSERA_CHECK(warmup >= 0, ArgumentError, "LinearWarmup: warmup_epochs=", warmup, " must be >= 0");
    TESSERA_CHECK(start > 0 && start <= 1, ArgumentError, "LinearWarmup: start_factor=", start,
                  " must lie in (0, 1] (as torch's LinearLR requires)");
  }
  double operator()(double epoch) const {
    detail::check_epoch(epoch, "LinearWarmup");
    const double lr = inner(epoch);
    if (epoch >= warmup_epochs) return lr;
    return lr * (start_factor + (1 - start_factor) * epoch / warmup_epochs);
  }
};

// Schedules one after another, torch.optim.lr_scheduler.SequentialLR(optimizer, schedulers,
// milestones): stage k runs from milestone k-1 (0 for the first stage) up to milestone k, on its
// own clock. With M_0 = 0 and M_k <= e < M_{k+1},  lr(e) = stage_k(e - M_k).
//
// That is what torch 1.13 does: at a milestone SequentialLR calls step(0) on the next scheduler,
// which sets it to its closed form at its own epoch 0 (its base lr times its factor at 0), and its
// later step()s continue from there. So the next stage starts from its beginning whatever the
// previous one ended at: a warmup cut short by its milestone is followed by the full lr, and a
// StepLR/CosineAnnealingLR stage counts epochs from its milestone. Examples (base lr 0.4):
//
//   // SequentialLR([LinearLR(opt, 0.1, total_iters=5), CosineAnnealingLR(opt, T_max=85)], [5])
//   SequentialLr warmup_cosine{{5}, LinearWarmup{ConstantLr{0.4}, 5, 0.1}, CosineLr{0.4, 85}};
//   // SequentialLR([ConstantLR(opt, factor=0.25, total_iters=3), StepLR(opt, 30)], [3])
//   SequentialLr hold_then_step{{3}, ConstantLr{0.1}, StepLr{0.4, 30}};
//
// Stages are any LrSchedule, a SequentialLr too (torch's ConstantLR that ends before the
// milestone is SequentialLr{{2}, ConstantLr{f * b}, ConstantLr{b}} as a stage). Milestones are in
// epochs and may be fractional, like every epoch here. Requires one milestone fewer than stages,
// strictly increasing and positive (torch accepts any list; unsorted or zero ones make it pick
// stages in a confusing order): ArgumentError otherwise.
template <LrSchedule... Stages>
struct SequentialLr {
  static_assert(sizeof...(Stages) >= 1, "SequentialLr needs at least one stage");

  std::vector<double> milestones;  // milestones[k] starts stage k + 1
  std::tuple<Stages...> stages;

  SequentialLr(std::vector<double> ms, Stages... s) : milestones(std::move(ms)), stages(std::move(s)...) {
    TESSERA_CHECK(milestones.size() + 1 == sizeof...(Stages), ArgumentError, "SequentialLr: ", sizeof...(Stages),
                  " stages need ", sizeof...(Stages) - 1, " milestones, got ", milestones.size());
    for (std::size_t k = 0; k < milestones.size(); ++k)
      TESSERA_CHECK(milestones[k] > (k == 0 ? 0.0 : milestones[k - 1]) && std::isfinite(milestones[k]),
                    ArgumentError, "SequentialLr: milestone ", k, " = ", milestones[k],
                    " must be finite, positive and greater than the one before");
  }

  double operator()(double epoch) const {
    detail::check_epoch(epoch, "SequentialLr");
    // The stage is the number of milestones <= epoch (torch: bisect_right(milestones, epoch)).
    const auto k = static_cast<std::size_t>(std::upper_bound(milestones.begin(), milestones.end(), epoch) -
                                            milestones.begin());
    return stage_at<0>(k, k == 0 ? epoch : epoch - milestones[k - 1]);
  }

 private:
  template <std::size_t I>
  double stage_at(std::size_t k, double local) const {
    if constexpr (I + 1 == sizeof...(Stages)) {
      return std::get<I>(stages)(local);
    } else {
      return k == I ? std::get<I>(stages)(local) : stage_at<I + 1>(k, local);
    }
  }
};

static_assert(LrSchedule<ConstantLr> && LrSchedule<StepLr> && LrSchedule<MultiStepLr> && LrSchedule<CosineLr> &&
              LrSchedule<LinearWarmup<StepLr>> && LrSchedule<SequentialLr<LinearWarmup<ConstantLr>, CosineLr>>);

}  // namespace tessera
