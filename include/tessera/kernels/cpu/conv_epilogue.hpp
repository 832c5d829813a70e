// The inference epilogue of a CPU convolution (ConvEpilogue, kernels/conv2d_geometry.hpp): an
// eval-mode BatchNorm, a residual addend and a ReLU applied to a block's output while it is still
// in cache, instead of three more passes over the whole activation in memory (BatchNorm+ReLU and
// the residual add+ReLU each took a visible share of a ResNet-50 b8 inference profile).
#pragma once

#include <cstdint>
#include <type_traits>

#include "tessera/kernels/conv2d_geometry.hpp"
#include "tessera/kernels/cpu/batch_norm.hpp"

namespace tessera::detail {

// dst[p] = epilogue(src[p]) for the n positions of one run of channel ch; add is the addend's
// matching run (read only when e.addend is set). dst may be src.
template <class S>
void conv_epilogue_run(const ConvEpilogue<S>& e, std::int64_t ch, const S* src, S* dst, const S* add, std::int64_t n) {
  const S bias = e.bias ? e.bias[ch] : S(0);
  const S mean = e.mean[ch], scale = e.gamma[ch] * e.invstd[ch], shift = e.beta[ch];  // as batch_norm_normalize
  const auto body = [&](auto with_bias, auto with_add, auto with_relu) {
#pragma omp simd
    for (std::int64_t p = 0; p < n; ++p) {
      S v = src[p];
      if constexpr (with_bias) v = v + bias;
      v = batch_norm_value(v, mean, scale, shift);
      if constexpr (with_add) v = v + add[p];
      if constexpr (with_relu) v = v < S(0) ? S(0) : v;
      dst[p] = v;
    }
  };
  const auto relu = [&](auto with_bias, auto with_add) {
    if (e.relu) body(with_bias, with_add, std::true_type{});
    else body(with_bias, with_add, std::false_type{});
  };
  const auto addend = [&](auto with_bias) {
    if (e.addend) relu(with_bias, std::true_type{});
    else relu(with_bias, std::false_type{});
  };
  if (e.bias) addend(std::true_type{});
  else addend(std::false_type{});
}

// body(ch) for ch < channels: split over a new team when `team` (the caller runs outside any
// parallel region), else on this thread (parallel_for: no runtime call then).
template <class Body>
void for_each_channel(bool team, std::int64_t channels, const Body& body) {
  parallel_for(channels, team, body);
}

// The epilogue in place on positions [first, first + n) of every channel plane of samples
// [n0, n0 + count) of y (N, K, plane): the part of y one block wrote. `team`: called outside a
// parallel region for a block that is the whole layer (its channels split over the threads).
template <class S>
void conv_epilogue_planes(const ConvEpilogue<S>& e, S* y, std::int64_t n0, std::int64_t count, std::int64_t channels,
                          std::int64_t plane, std::int64_t first, std::int64_t n, bool team = false) {
  for_each_channel(team, channels, [&](std::int64_t ch) {
    for (std::int64_t s = n0; s < n0 + count; ++s) {
      const std::int64_t offset = (s * channels + ch) * plane + first;
      conv_epilogue_run(e, ch, y + offset, y + offset, e.addend ? e.addend + offset : nullptr, n);
    }
  });
}

}  // namespace tessera::detail
