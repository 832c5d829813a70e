// Weight initializers with PyTorch's formulas, drawn from tessera::Rng (so deterministic per seed).
//
// fan_in of a weight of shape (out, in, kh, kw) is in*kh*kw; fan_out is out*kh*kw.
//   kaiming_normal (He et al.):  N(0, gain^2 / fan),          gain = sqrt(2) for ReLU
//   kaiming_uniform (torch's default for Linear/Conv weights, a = sqrt(5)): U(-b, b),
//     b = sqrt(6 / ((1 + a^2) fan_in)) = 1/sqrt(fan_in)
//   bias default: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
#pragma once

#include <cmath>
#include <type_traits>

#include "tessera/core/random.hpp"
#include "tessera/core/tensor.hpp"

namespace tessera {

enum class FanMode { FanIn, FanOut };

template <class S, class D>
std::int64_t fan(const Tensor<S, D>& w, FanMode mode) {
  TESSERA_CHECK(w.rank() >= 2, ShapeError, "fan: weight must have rank >= 2, got ", w.shape());
  std::int64_t receptive = 1;
  for (int i = 2; i < w.rank(); ++i) receptive *= w.dim(i);
  return (mode == FanMode::FanIn ? w.dim(1) : w.dim(0)) * receptive;
}

namespace detail {
// Draws on the host in element order (so a seed gives the same values on every device), then
// copies to the device when it is not the host. draws(out, n) writes n consecutive values.
template <class S, class D, class Draws>
void fill_from_host(Tensor<S, D>& t, Draws draws) {
  if constexpr (D::host_accessible) {
    draws(t.data(), t.numel());
  } else {
    Tensor<S, Cpu> host(t.shape());
    draws(host.data(), host.numel());
    D::copy_to_device(t.data(), host.data(), host.bytes());
    D::synchronize();
  }
}

// float and double draw through Rng's compiled loops; another element type one value at a time.
template <class S>
constexpr bool rng_fills_v = std::is_same_v<S, float> || std::is_same_v<S, double>;
}  // namespace detail

template <class S, class D>
void uniform_(Tensor<S, D>& t, double lo, double hi, Rng& rng) {
  detail::fill_from_host(t, [&](S* out, std::int64_t n) {
    if constexpr (detail::rng_fills_v<S>) {
      rng.fill_uniform(out, n, lo, hi);
    } else {
      for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<S>(rng.uniform(lo, hi));
    }
  });
}

template <class S, class D>
void normal_(Tensor<S, D>& t, double mean, double stddev, Rng& rng) {
  detail::fill_from_host(t, [&](S* out, std::int64_t n) {
    if constexpr (detail::rng_fills_v<S>) {
      rng.fill_normal(out, n, mean, stddev);
    } else {
      for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<S>(rng.normal(mean, stddev));
    }
  });
}

// He initialization for layers followed by ReLU: std = sqrt(2 / fan).
template <class S, class D>
void kaiming_normal_(Tensor<S, D>& w, Rng& rng, FanMode mode = FanMode::FanOut) {
  normal_(w, 0.0, std::sqrt(2.0 / static_cast<double>(fan(w, mode))), rng);
}

// torch.nn.Linear / Conv2d default weight init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
template <class S, class D>
void default_weight_init_(Tensor<S, D>& w, Rng& rng) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(fan(w, FanMode::FanIn)));
  uniform_(w, -bound, bound, rng);
}

template <class S, class D>
void default_bias_init_(Tensor<S, D>& b, std::int64_t fan_in, Rng& rng) {
  const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
  uniform_(b, -bound, bound, rng);
}

}  // namespace tessera
