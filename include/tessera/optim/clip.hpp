// Gradient-norm clipping, as torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=2,
// error_if_nonfinite=False):
//
//   total = sqrt(sum over the parameters of ||grad||^2)
//   every grad *= min(1, max_norm / (total + 1e-6));   returns total
//
//   double norm = clip_grad_norm(named_tensors(model), 1.0);
//   double norm = clip_grad_norm(pipe.norm_parameters(), 1.0, pipe_comm);   // a pipeline's stages
//
// Parameters spread over ranks (a pipeline's stages each hold some): pass their group, and the
// squares are summed over it (one all_reduce of one double), so every stage scales by the whole
// model's norm, the one-process value up to the order of the sum. A parameter held by two stages
// (a pipeline's tied wte) must be counted once: Pipeline::norm_parameters() leaves the second
// copy out. Replicas of the same parameters (DataParallel) hold equal gradients after their
// all-reduce and are not summed: pass the pipeline's group, not the world.
//
// Non-finite: a NaN or infinite gradient makes total non-finite on every rank of the group alike
// (the sum carries it), so with error_if_nonfinite every rank throws the same ArgumentError before
// any gradient changes, and without it every rank scales by the same NaN, as torch does (a
// GradScaler or the optimizer's own check then skips or refuses the step).
//
// With a pipeline, clip after train_step: a zero-bubble schedule's last weight gradients (W) are
// computed inside the step, so the gradients are final once it returns, whatever the table.
#pragma once

#include <cmath>
#include <span>
#include <string>

#include "tessera/comm/communicator.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/parameter.hpp"
#include "tessera/kernels/elementwise.hpp"
#include "tessera/kernels/optim.hpp"

namespace tessera {

struct ClipOptions {
  double norm_type = 2.0;  // torch's default; the only one here
  bool error_if_nonfinite = false;
};

namespace detail {
// sum of ||grad||^2 over `params`, in double.
template <class E>
double squared_gradient_norm(const NamedTensors<E>& params) {
  double sum = 0;
  for (const auto& [name, p] : params.parameters) {
    const double norm = l2_norm(typename E::Device{}, p->grad.data(), p->grad.numel());
    sum += norm * norm;
  }
  return sum;
}
template <class E>
double clip_to(const NamedTensors<E>& params, double max_norm, double total, const ClipOptions& o) {
  using S = typename E::Scalar;
  TESSERA_CHECK(!o.error_if_nonfinite || std::isfinite(total), ArgumentError, "clip_grad_norm: the total norm of the ",
                params.parameters.size(), " gradients here (and of their group) is ", total,
                ": a gradient holds a NaN or an infinity (error_if_nonfinite)");
  // torch multiplies by min(1, coef) always; times 1 changes nothing, so only coef < 1 scales.
  // A NaN total gives a NaN coef, which fails the test and scales, as torch's clamp keeps NaN.
  const double coef = max_norm / (total + 1e-6);
  if (coef >= 1.0) return total;
  for (const auto& [name, p] : params.parameters)
    scale_elements(typename E::Device{}, p->grad.data(), p->grad.numel(), static_cast<S>(coef), p->grad.data());
  return total;
}
inline void check_clip(double max_norm, const ClipOptions& o) {
  TESSERA_CHECK(o.norm_type == 2.0, ArgumentError, "clip_grad_norm: norm_type=", o.norm_type,
                " (only the 2-norm, torch's default, is supported)");
  TESSERA_CHECK(max_norm > 0 && std::isfinite(max_norm), ArgumentError, "clip_grad_norm: max_norm=", max_norm,
                " must be positive and finite");
}
}  // namespace detail

// One process: the parameters' total gradient norm, and the gradients scaled to max_norm.
template <class E>
double clip_grad_norm(const NamedTensors<E>& params, double max_norm, const ClipOptions& o = {}) {
  detail::check_clip(max_norm, o);
  return detail::clip_to(params, max_norm, std::sqrt(detail::squared_gradient_norm(params)), o);
}

// Parameters spread over `group` (collective: every rank of the group calls it).
template <class E, class Group>
double clip_grad_norm(const NamedTensors<E>& params, double max_norm, Group& group, const ClipOptions& o = {}) {
  detail::check_clip(max_norm, o);
  double sum[1] = {detail::squared_gradient_norm(params)};
  group.all_reduce(std::span<double>(sum), ReduceOp::Sum);
  return detail::clip_to(params, max_norm, std::sqrt(sum[0]), o);
}

}  // namespace tessera
