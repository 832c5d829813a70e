// Batch normalization kernels on (N, C, HW) data (HW = H*W for images, 1 for (N, C) inputs), split
// into the steps that SyncBatchNorm interleaves with all-reduces:
//
//   forward:   batch_norm_local_stats      sum[c] = sum_{n,s} x,  sumsq[c] = sum_{n,s} x^2   (local)
//              [all-reduce sum, sumsq and the count here for SyncBatchNorm]
//              batch_norm_finalize_stats   mean = sum / M,  var = sumsq / M - mean^2,  invstd = 1/sqrt(var + eps)
//              batch_norm_update_running   running = (1 - momentum) running + momentum * (mean, var * M/(M-1))
//              batch_norm_normalize        y = gamma (x - mean) invstd + beta
//   backward:  batch_norm_backward_local_sums   sum_dy[c] = sum dy,  sum_dy_xhat[c] = sum dy * xhat   (local)
//              [all-reduce sum_dy, sum_dy_xhat here for SyncBatchNorm; dgamma = sum_dy_xhat, dbeta = sum_dy
//               stay the local sums]
//              batch_norm_backward_input   dx = gamma invstd (dy - sum_dy/M - xhat sum_dy_xhat/M)
//              batch_norm_backward_input_affine (eval mode: mean and invstd are constants) dx = gamma invstd dy
//
// M is the number of values per channel over the whole (possibly distributed) batch.
//
// A ReLU after the normalization can be fused in (`relu`, as Sequential does for every
// BatchNorm2d-ReLU pair): normalize writes max(y, 0) in the same pass, and backward takes the
// gradient through the ReLU as well, dy_bn = dy where y > 0 and 0 elsewhere, with y formed again
// from x by the same expression (batch_norm_value), so neither y nor the ReLU's output is read:
// three passes over the activation instead of five forward, and two instead of three backward.
// Sums are accumulated and exchanged in double: var = E[x^2] - mean^2 cancels, and float sums of
// 10^5 values per channel would lose the digits the difference needs.
//
// Threads: every pass deals the (sample, channel) planes, in memory order, to the team in
// contiguous runs (team_share: thread t of T takes planes [P t / T, P (t + 1) / T)), so a thread
// reads and writes the same half of the batch as the convolutions and elementwise kernels around
// it, whose static schedules split samples the same way. Split by channel instead (as before),
// half of every pass's data sat in the other core's cache: on a 2-core EPYC a core reads another
// core's freshly written lines much more slowly than its own (from 256 KiB to 4 MiB), and
// ResNet-20's memory-bound Winograd transforms ran markedly longer on one thread than on the
// other. Each thread takes its own run first and only then, idle, what is left of another's
// (detail::stealing_for). The sums over images keep one slot per plane, added per channel over the
// samples in order: the same bits on any number of threads; over (N, C) inputs (hw below
// kBatchNormPlaneSlotsMinHw) per-thread partial sums per channel, added in thread order: the same
// result on every run with the same number of threads (the last bits may change with that number).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "tessera/core/host_device.hpp"
#include "tessera/device/cpu.hpp"
#include "tessera/kernels/cpu/compiled.hpp"

namespace tessera {

// x viewed as (n, c, hw): element (i, ch, s) at (i * c + ch) * hw + s, or with channels_last
// (MemoryFormat::ChannelsLast) at (i * hw + s) * c + ch: rows of c values, one per pixel.
struct BatchNormShape {
  std::int64_t n = 0, c = 0, hw = 1;
  bool channels_last = false;
  // constexpr: callable from CUDA kernels too (nvcc --expt-relaxed-constexpr).
  constexpr std::int64_t numel() const { return n * c * hw; }
  constexpr std::int64_t count() const { return n * hw; }  // values per channel
};

namespace detail {
// Below this many elements the OpenMP fork costs more than it saves.
inline constexpr std::int64_t kBatchNormParallelThreshold = 1 << 14;
}

// One element of the normalization, y = (x - mean) scale + shift with scale = gamma invstd, shift =
// beta. Every kernel that needs y (normalize, and a fused ReLU's mask in backward) forms it with
// this one expression, so the mask agrees bit for bit with the y forward produced.
template <class S>
TESSERA_HOST_DEVICE inline S batch_norm_value(S x, S mean, S scale, S shift) {
  return (x - mean) * scale + shift;
}
// The gradient a ReLU lets through at output y: none where y <= 0, dy where y > 0 or y is NaN
// (torch's threshold_backward, as relu_backward).
template <class S>
TESSERA_HOST_DEVICE inline S relu_pass(S y, S dy) {
  return y <= S(0) ? S(0) : dy;
}
namespace detail {
// relu_pass as a bit mask on dy: the same value, but GCC vectorizes it where the select would not be
// (widened to double for the local sums, the select's comparison may trap: -ftrapping-math).
template <class S>
inline S relu_pass_masked(S y, S dy) {
  using Bits = std::conditional_t<sizeof(S) == 4, std::uint32_t, std::uint64_t>;
  static_assert(sizeof(S) == sizeof(Bits));
  const Bits keep = Bits(0) - static_cast<Bits>(!(y <= S(0)));
  return std::bit_cast<S>(static_cast<Bits>(std::bit_cast<Bits>(dy) & keep));
}
}  // namespace detail

namespace detail {
// Units per piece of work: whole units of about 2^15 elements (128 KiB of float) at least.
inline std::int64_t batch_norm_chunk_units(BatchNormShape s, std::int64_t units) {
  const std::int64_t per_unit = std::max<std::int64_t>(1, s.numel() / std::max<std::int64_t>(units, 1));
  return std::max<std::int64_t>(1, (std::int64_t(1) << 15) / per_unit);
}

// body(u0, u1) over [0, units) in contiguous runs: outside a team (or below the threshold), once
// for all of it; else on each thread of a new team, over its static share of the runs of
// batch_norm_chunk_units units, front to back, and then over runs from the back of the others'
// shares that they have not reached (detail::stealing_for: the two cores' speeds differ). Units
// are the flat plane index p = sample * c + channel, or in channels last the rows (one pixel's c
// values each), so each thread reads and writes one contiguous share of memory unless it is idle.
// The runs of batch_norm_chunk_units units, for stealing_for; body(u0, u1) for each run this thread takes.
struct BatchNormRuns {
  std::int64_t units, chunk;
  StealRanges ranges;
  BatchNormRuns(BatchNormShape s, std::int64_t n)
      : units(n), chunk(batch_norm_chunk_units(s, n)), ranges((n + chunk - 1) / chunk) {}
  template <class Body>
  void run(const Body& body) {
    stealing_for(ranges, (units + chunk - 1) / chunk,
                 [&](std::int64_t i) { body(i * chunk, std::min(units, (i + 1) * chunk)); });
  }
};

template <class Body>
void batch_norm_units(BatchNormShape s, std::int64_t units, const Body& body) {
  if (s.numel() < kBatchNormParallelThreshold || units < 2) {
    body(std::int64_t{0}, units);
    return;
  }
  BatchNormRuns runs(s, units);
  run_in_team_if(true, [&] { runs.run(body); });
}
template <class Body>
void batch_norm_planes(BatchNormShape s, const Body& body) {
  batch_norm_units(s, s.n * s.c, body);
}
template <class Body>
void batch_norm_rows(BatchNormShape s, const Body& body) {
  batch_norm_units(s, s.n * s.hw, body);
}

// out_a[ch] = sum over r of a[r stride + ch], likewise out_b from b, for this thread's share of
// the channels (all of them outside a team), r in order.
inline void batch_norm_add_rows(std::int64_t c, std::int64_t rows, std::int64_t stride, const double* a,
                                const double* b, double* out_a, double* out_b) {
  std::int64_t c0, c1;
  team_share(c, c0, c1);
  for (std::int64_t ch = c0; ch < c1; ++ch) {
    double sa = 0, sb = 0;
    for (std::int64_t r = 0; r < rows; ++r) sa += a[r * stride + ch], sb += b[r * stride + ch];
    out_a[ch] = sa;
    out_b[ch] = sb;
  }
}

// out_a[ch], out_b[ch]: sums over `units`, where unit(u, a, b) adds unit u's contributions to the
// channel vectors a (c) and b (c). Each thread sums its run of units into its own row of
// `scratch` (team x 2c doubles, this calling thread's: the ranks of ThreadComm call concurrently;
// it only grows), then each channel's partial sums are added in thread order. One thread adds in
// the same order as a plain loop over the units.
template <class Unit>
void batch_norm_unit_sums(BatchNormShape s, std::int64_t units, double* out_a, double* out_b, const Unit& unit) {
  if (s.numel() < kBatchNormParallelThreshold) {
    std::fill(out_a, out_a + s.c, 0.0);
    std::fill(out_b, out_b + s.c, 0.0);
    for (std::int64_t u = 0; u < units; ++u) unit(u, out_a, out_b);
    return;
  }
  thread_local std::vector<double> scratch;
  const std::size_t need = static_cast<std::size_t>(Cpu::num_threads() * 2 * s.c);
  if (scratch.size() < need) scratch.resize(need);
  double* partial = scratch.data();
  run_in_team_if(true, [&] {
    const std::int64_t t = Cpu::thread_index(), team = Cpu::team_size();
    double* a = partial + t * 2 * s.c;
    double* b = a + s.c;
    std::fill(a, a + 2 * s.c, 0.0);
    std::int64_t u0, u1;
    team_share(units, u0, u1);
    for (std::int64_t u = u0; u < u1; ++u) unit(u, a, b);
    if (team > 1) {
#pragma omp barrier
    }
    batch_norm_add_rows(s.c, team, 2 * s.c, partial, partial + s.c, out_a, out_b);
  });
}
// The planes' sums: plane(i, ch, a, b) adds plane (i, ch)'s contribution to the scalars a and b.
// Planes of at least kBatchNormPlaneSlotsMinHw values (images) each put their sums in a slot of
// their own (2 n c doubles of this calling thread's `scratch`), taken by any thread of the team
// (batch_norm_units), and then each channel's slots are added over the samples in order: the bits
// of one thread's plain loop over the planes, on any team, whichever thread summed a plane.
inline constexpr std::int64_t kBatchNormPlaneSlotsMinHw = 16;
template <class Plane>
void batch_norm_channel_sums(BatchNormShape s, double* out_a, double* out_b, const Plane& plane) {
  const std::int64_t planes = s.n * s.c;
  if (s.numel() < kBatchNormParallelThreshold || s.hw < kBatchNormPlaneSlotsMinHw) {
    return batch_norm_unit_sums(s, planes, out_a, out_b, [&](std::int64_t p, double* a, double* b) {
      plane(p / s.c, p % s.c, a[p % s.c], b[p % s.c]);
    });
  }
  thread_local std::vector<double> scratch;
  if (scratch.size() < static_cast<std::size_t>(2 * planes)) scratch.resize(static_cast<std::size_t>(2 * planes));
  double* slot_a = scratch.data();
  double* slot_b = slot_a + planes;
  BatchNormRuns runs(s, planes);
  run_in_team_if(true, [&] {
    runs.run([&](std::int64_t p0, std::int64_t p1) {
      for (std::int64_t p = p0; p < p1; ++p) {
        slot_a[p] = slot_b[p] = 0.0;
        plane(p / s.c, p % s.c, slot_a[p], slot_b[p]);
      }
    });
    if (Cpu::team_size() > 1) {
#pragma omp barrier
    }
    batch_norm_add_rows(s.c, s.n, s.c, slot_a, slot_b, out_a, out_b);
  });
}
// Channels last: row(r, a, b) adds row r's c values' contributions to the channel vectors a and b.
template <class Row>
void batch_norm_row_sums(BatchNormShape s, double* out_a, double* out_b, const Row& row) {
  batch_norm_unit_sums(s, s.n * s.hw, out_a, out_b, row);
}
}  // namespace detail

template <class S>
void batch_norm_local_stats(Cpu, const S* x, BatchNormShape s, double* sum, double* sumsq) {
  if (s.channels_last) {
    detail::batch_norm_row_sums(s, sum, sumsq, [&](std::int64_t r, double* a, double* b) {
      const S* xr = x + r * s.c;
#pragma omp simd
      for (std::int64_t ch = 0; ch < s.c; ++ch) {
        const double v = xr[ch];
        a[ch] += v;
        b[ch] += v * v;
      }
    });
    return;
  }
  detail::batch_norm_channel_sums(s, sum, sumsq, [&](std::int64_t i, std::int64_t ch, double& acc, double& acc2) {
    const S* row = x + (i * s.c + ch) * s.hw;
    double a = 0, a2 = 0;
#pragma omp simd reduction(+ : a, a2)
    for (std::int64_t k = 0; k < s.hw; ++k) {
      const double v = row[k];
      a += v;
      a2 += v * v;
    }
    acc += a;
    acc2 += a2;
  });
}

// mean and invstd of the batch from the (global) sums over `count` values per channel.
template <class S>
void batch_norm_finalize_stats(Cpu, std::int64_t channels, const double* sum, const double* sumsq,
                               std::int64_t count, double eps, S* mean, S* invstd) {
  const double m = static_cast<double>(count);
  for (std::int64_t ch = 0; ch < channels; ++ch) {
    const double mu = sum[ch] / m;
    const double var = std::max(sumsq[ch] / m - mu * mu, 0.0);  // biased, as the normalization uses
    mean[ch] = static_cast<S>(mu);
    invstd[ch] = static_cast<S>(1.0 / std::sqrt(var + eps));
  }
}

// Running statistics as torch.nn.BatchNorm2d keeps them: the variance is the unbiased one (M - 1).
// Requires count > 1.
template <class S>
void batch_norm_update_running(Cpu, std::int64_t channels, const double* sum, const double* sumsq,
                               std::int64_t count, double momentum, S* running_mean, S* running_var) {
  const double m = static_cast<double>(count);
  for (std::int64_t ch = 0; ch < channels; ++ch) {
    const double mu = sum[ch] / m;
    const double var = std::max(sumsq[ch] / m - mu * mu, 0.0) * (m / (m - 1.0));
    running_mean[ch] = static_cast<S>((1.0 - momentum) * running_mean[ch] + momentum * mu);
    running_var[ch] = static_cast<S>((1.0 - momentum) * running_var[ch] + momentum * var);
  }
}

// invstd = 1 / sqrt(var + eps), for eval mode from the running variance.
template <class S>
void batch_norm_invstd(Cpu, std::int64_t channels, const S* var, double eps, S* invstd) {
  for (std::int64_t ch = 0; ch < channels; ++ch)
    invstd[ch] = static_cast<S>(1.0 / std::sqrt(static_cast<double>(var[ch]) + eps));
}

// y = (x - mean) scale + beta with scale = gamma invstd, then max(y, 0) when `relu` (NaN passes, as
// in torch.relu). Centring first (rather than folding mean into the shift) keeps float32 accurate
// when a channel's mean is large against its spread.
template <class S>
void batch_norm_normalize(Cpu, const S* x, BatchNormShape s, const S* mean, const S* invstd, const S* gamma,
                          const S* beta, S* y, bool relu = false) {
  if (s.channels_last) {  // the same expression per element, the channel's constants from vectors
    detail::batch_norm_rows(s, [&](std::int64_t r0, std::int64_t r1) {
      for (std::int64_t r = r0; r < r1; ++r) {
        const S* xr = x + r * s.c;
        S* yr = y + r * s.c;
#pragma omp simd
        for (std::int64_t ch = 0; ch < s.c; ++ch) {
          const S v = batch_norm_value(xr[ch], mean[ch], gamma[ch] * invstd[ch], beta[ch]);
          yr[ch] = relu && v < S(0) ? S(0) : v;
        }
      }
    });
    return;
  }
  detail::batch_norm_planes(s, [&](std::int64_t p0, std::int64_t p1) {
    for (std::int64_t p = p0; p < p1; ++p) {
      const std::int64_t ch = p % s.c;
      const S scale = gamma[ch] * invstd[ch];
      const S mu = mean[ch];
      const S shift = beta[ch];
      const S* xr = x + p * s.hw;
      S* yr = y + p * s.hw;
      if (relu) {
#pragma omp simd
        for (std::int64_t k = 0; k < s.hw; ++k) {
          const S v = batch_norm_value(xr[k], mu, scale, shift);
          yr[k] = v < S(0) ? S(0) : v;
        }
      } else {
#pragma omp simd
        for (std::int64_t k = 0; k < s.hw; ++k) yr[k] = batch_norm_value(xr[k], mu, scale, shift);
      }
    }
  });
}

// y = max(bn(x) + addend, 0): the end of a residual block (BatchNorm, the shortcut's add and the
// ReLU) in one pass over x, addend and y instead of three, with the unfused steps' roundings
// (batch_norm_value rounded to S, then the add, then the ReLU as add_relu_forward's), so y is
// theirs bit for bit. The BatchNorm's own output is never formed: its backward reads x.
template <class S>
void batch_norm_normalize_add_relu(Cpu, const S* x, BatchNormShape s, const S* mean, const S* invstd, const S* gamma,
                                   const S* beta, const S* addend, S* y) {
  if (s.channels_last) {
    detail::batch_norm_rows(s, [&](std::int64_t r0, std::int64_t r1) {
      for (std::int64_t r = r0; r < r1; ++r) {
        const S* xr = x + r * s.c;
        const S* ar = addend + r * s.c;
        S* yr = y + r * s.c;
#pragma omp simd
        for (std::int64_t ch = 0; ch < s.c; ++ch) {
          const S v = batch_norm_value(xr[ch], mean[ch], gamma[ch] * invstd[ch], beta[ch]);
          const S sum = v + ar[ch];
          yr[ch] = sum < S(0) ? S(0) : sum;
        }
      }
    });
    return;
  }
  detail::batch_norm_planes(s, [&](std::int64_t p0, std::int64_t p1) {
    for (std::int64_t p = p0; p < p1; ++p) {
      const std::int64_t ch = p % s.c;
      const S scale = gamma[ch] * invstd[ch];
      const S mu = mean[ch];
      const S shift = beta[ch];
      const S* xr = x + p * s.hw;
      const S* ar = addend + p * s.hw;
      S* yr = y + p * s.hw;
#pragma omp simd
      for (std::int64_t k = 0; k < s.hw; ++k) {
        const S v = batch_norm_value(xr[k], mu, scale, shift);
        const S sum = v + ar[k];
        yr[k] = sum < S(0) ? S(0) : sum;
      }
    }
  });
}

// sum_dy[c] = sum dy;  sum_dy_xhat[c] = sum dy * (x - mean) * invstd   (the local dbeta and dgamma).
// With `relu`, dy is the fused ReLU's output gradient and what is summed is dy_bn (see the top);
// gamma and beta are read only then.
template <class S>
void batch_norm_backward_local_sums(Cpu, const S* dy, const S* x, BatchNormShape s, const S* mean,
                                    const S* invstd, double* sum_dy, double* sum_dy_xhat, bool relu = false,
                                    const S* gamma = nullptr, const S* beta = nullptr) {
  // sum_dy_xhat holds sum dy (x - mean) until the end, when each channel is scaled by invstd.
  if (s.channels_last) {
    detail::batch_norm_row_sums(s, sum_dy, sum_dy_xhat, [&](std::int64_t r, double* a, double* b) {
      const S* dyr = dy + r * s.c;
      const S* xr = x + r * s.c;
#pragma omp simd
      for (std::int64_t ch = 0; ch < s.c; ++ch) {
        const double g =
            relu ? detail::relu_pass_masked(batch_norm_value(xr[ch], mean[ch], gamma[ch] * invstd[ch], beta[ch]), dyr[ch])
                 : dyr[ch];
        a[ch] += g;
        b[ch] += g * (static_cast<double>(xr[ch]) - static_cast<double>(mean[ch]));
      }
    });
    for (std::int64_t ch = 0; ch < s.c; ++ch) sum_dy_xhat[ch] *= static_cast<double>(invstd[ch]);
    return;
  }
  detail::batch_norm_channel_sums(s, sum_dy, sum_dy_xhat, [&](std::int64_t i, std::int64_t ch, double& acc_dy,
                                                              double& acc_xmu) {
    const double mu = mean[ch];
    const S mu_s = mean[ch], scale = relu ? gamma[ch] * invstd[ch] : S(0), shift = relu ? beta[ch] : S(0);
    const std::int64_t off = (i * s.c + ch) * s.hw;
    const S* dyr = dy + off;
    const S* xr = x + off;
    double acc = 0, xmu = 0;
    if (relu) {
#pragma omp simd reduction(+ : acc, xmu)
      for (std::int64_t k = 0; k < s.hw; ++k) {
        const double g = detail::relu_pass_masked(batch_norm_value(xr[k], mu_s, scale, shift), dyr[k]);
        acc += g;
        xmu += g * (static_cast<double>(xr[k]) - mu);
      }
    } else {
#pragma omp simd reduction(+ : acc, xmu)
      for (std::int64_t k = 0; k < s.hw; ++k) {
        const double g = dyr[k];
        acc += g;
        xmu += g * (static_cast<double>(xr[k]) - mu);
      }
    }
    acc_dy += acc;
    acc_xmu += xmu;
  });
  for (std::int64_t ch = 0; ch < s.c; ++ch) sum_dy_xhat[ch] *= static_cast<double>(invstd[ch]);
}

// Train-mode dx, with mean and invstd functions of the batch:
//   dx = gamma invstd (dy - sum_dy/M - xhat sum_dy_xhat/M),  xhat = (x - mean) invstd,
// evaluated per element as a dy + b (x - mean) + c with per-channel a, b, c; with `relu`, dy_bn in
// place of dy (the sums are dy_bn's too; beta is read only then).
template <class S>
void batch_norm_backward_input(Cpu, const S* dy, const S* x, BatchNormShape s, const S* mean, const S* invstd,
                               const S* gamma, const double* sum_dy, const double* sum_dy_xhat, std::int64_t count,
                               S* dx, bool relu = false, const S* beta = nullptr) {
  const double m = static_cast<double>(count);
  if (s.channels_last) {
    // The per-channel a, b, c of the planar loop below, as vectors (this thread's scratch).
    thread_local std::vector<S> coefficients;
    coefficients.resize(static_cast<std::size_t>(3 * s.c));
    S* ca = coefficients.data();
    S* cb = ca + s.c;
    S* cc = cb + s.c;
    for (std::int64_t ch = 0; ch < s.c; ++ch) {
      const double is = invstd[ch];
      const double k = static_cast<double>(gamma[ch]) * is;
      ca[ch] = static_cast<S>(k);
      cb[ch] = static_cast<S>(-k * is * sum_dy_xhat[ch] / m);
      cc[ch] = static_cast<S>(-k * sum_dy[ch] / m);
    }
    detail::batch_norm_rows(s, [&](std::int64_t r0, std::int64_t r1) {
      for (std::int64_t r = r0; r < r1; ++r) {
        const S* dyr = dy + r * s.c;
        const S* xr = x + r * s.c;
        S* dxr = dx + r * s.c;
#pragma omp simd
        for (std::int64_t ch = 0; ch < s.c; ++ch) {
          const S g = relu ? detail::relu_pass_masked(
                                 batch_norm_value(xr[ch], mean[ch], gamma[ch] * invstd[ch], beta[ch]), dyr[ch])
                           : dyr[ch];
          dxr[ch] = ca[ch] * g + cb[ch] * (xr[ch] - mean[ch]) + cc[ch];
        }
      }
    });
    return;
  }
  detail::batch_norm_planes(s, [&](std::int64_t p0, std::int64_t p1) {
    for (std::int64_t p = p0; p < p1; ++p) {
      const std::int64_t ch = p % s.c;
      const double is = invstd[ch];
      const double k = static_cast<double>(gamma[ch]) * is;
      const S a = static_cast<S>(k);
      const S b = static_cast<S>(-k * is * sum_dy_xhat[ch] / m);
      const S c = static_cast<S>(-k * sum_dy[ch] / m);
      const S mu = mean[ch];
      const S scale = relu ? gamma[ch] * invstd[ch] : S(0), shift = relu ? beta[ch] : S(0);
      const S* dyr = dy + p * s.hw;
      const S* xr = x + p * s.hw;
      S* dxr = dx + p * s.hw;
      if (relu) {
#pragma omp simd
        for (std::int64_t k2 = 0; k2 < s.hw; ++k2) {
          const S g = detail::relu_pass_masked(batch_norm_value(xr[k2], mu, scale, shift), dyr[k2]);
          dxr[k2] = a * g + b * (xr[k2] - mu) + c;
        }
      } else {
#pragma omp simd
        for (std::int64_t k2 = 0; k2 < s.hw; ++k2) dxr[k2] = a * dyr[k2] + b * (xr[k2] - mu) + c;
      }
    }
  });
}

// Eval-mode dx: the statistics are constants, so dx = gamma invstd dy; with `relu`, dy_bn in place
// of dy (x, mean and beta are read only then).
template <class S>
void batch_norm_backward_input_affine(Cpu, const S* dy, BatchNormShape s, const S* invstd, const S* gamma, S* dx,
                                      bool relu = false, const S* x = nullptr, const S* mean = nullptr,
                                      const S* beta = nullptr) {
  if (s.channels_last) {
    detail::batch_norm_rows(s, [&](std::int64_t r0, std::int64_t r1) {
      for (std::int64_t r = r0; r < r1; ++r) {
        const S* dyr = dy + r * s.c;
        S* dxr = dx + r * s.c;
        if (relu) {
          const S* xr = x + r * s.c;
#pragma omp simd
          for (std::int64_t ch = 0; ch < s.c; ++ch) {
            const S a = gamma[ch] * invstd[ch];
            dxr[ch] = a * detail::relu_pass_masked(batch_norm_value(xr[ch], mean[ch], a, beta[ch]), dyr[ch]);
          }
        } else {
#pragma omp simd
          for (std::int64_t ch = 0; ch < s.c; ++ch) dxr[ch] = gamma[ch] * invstd[ch] * dyr[ch];
        }
      }
    });
    return;
  }
  detail::batch_norm_planes(s, [&](std::int64_t p0, std::int64_t p1) {
    for (std::int64_t p = p0; p < p1; ++p) {
      const std::int64_t ch = p % s.c;
      const S a = gamma[ch] * invstd[ch];
      const S mu = relu ? mean[ch] : S(0), shift = relu ? beta[ch] : S(0);
      const S* dyr = dy + p * s.hw;
      S* dxr = dx + p * s.hw;
      if (relu) {
        const S* xr = x + p * s.hw;
#pragma omp simd
        for (std::int64_t k = 0; k < s.hw; ++k)
          dxr[k] = a * detail::relu_pass_masked(batch_norm_value(xr[k], mu, a, shift), dyr[k]);
      } else {
#pragma omp simd
        for (std::int64_t k = 0; k < s.hw; ++k) dxr[k] = a * dyr[k];
      }
    }
  });
}

// dgamma[c] += sum_dy_xhat[c], dbeta[c] += sum_dy[c]: the affine parameters' gradients.
template <class S>
void batch_norm_accumulate_affine_grads(Cpu, std::int64_t channels, const double* sum_dy, const double* sum_dy_xhat,
                                        S* dgamma, S* dbeta) {
  for (std::int64_t ch = 0; ch < channels; ++ch) {
    dgamma[ch] += static_cast<S>(sum_dy_xhat[ch]);
    dbeta[ch] += static_cast<S>(sum_dy[ch]);
  }
}

// Compiled once in compiled-kernels mode (kernels/cpu/compiled.hpp).
#define TESSERA_CPU_BATCH_NORM_INSTANCES(PREFIX, S)                                                                 \
  PREFIX template void batch_norm_local_stats<S>(Cpu, const S*, BatchNormShape, double*, double*);                  \
  PREFIX template void batch_norm_finalize_stats<S>(Cpu, std::int64_t, const double*, const double*, std::int64_t,  \
                                                    double, S*, S*);                                                \
  PREFIX template void batch_norm_update_running<S>(Cpu, std::int64_t, const double*, const double*, std::int64_t,  \
                                                    double, S*, S*);                                                \
  PREFIX template void batch_norm_invstd<S>(Cpu, std::int64_t, const S*, double, S*);                               \
  PREFIX template void batch_norm_normalize<S>(Cpu, const S*, BatchNormShape, const S*, const S*, const S*,         \
                                               const S*, S*, bool);                                                 \
  PREFIX template void batch_norm_normalize_add_relu<S>(Cpu, const S*, BatchNormShape, const S*, const S*,        \
                                                        const S*, const S*, const S*, S*);                          \
  PREFIX template void batch_norm_backward_local_sums<S>(Cpu, const S*, const S*, BatchNormShape, const S*,         \
                                                         const S*, double*, double*, bool, const S*, const S*);     \
  PREFIX template void batch_norm_backward_input<S>(Cpu, const S*, const S*, BatchNormShape, const S*, const S*,    \
                                                    const S*, const double*, const double*, std::int64_t, S*, bool, \
                                                    const S*);                                                      \
  PREFIX template void batch_norm_backward_input_affine<S>(Cpu, const S*, BatchNormShape, const S*, const S*, S*,   \
                                                           bool, const S*, const S*, const S*);                     \
  PREFIX template void batch_norm_accumulate_affine_grads<S>(Cpu, std::int64_t, const double*, const double*, S*,   \
                                                             S*);
TESSERA_CPU_KERNEL_INSTANCES(TESSERA_CPU_BATCH_NORM_INSTANCES)

}  // namespace tessera
