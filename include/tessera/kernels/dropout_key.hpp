// Dropout masks as a pure function of where an element sits, not of the order it was drawn in.
//
// A DropoutKey names one dropout site in one training step (key: a 64-bit draw per step, mixed
// with the site's number) and where this call's tensor sits in the global one: its first batch
// row, head and sequence position. Element (b, h, t, j) of the site keeps its value with
// probability 1 - p:
//
//   u = mix(mix(mix(mix(key + b + batch_offset) + h + head_offset) + t + seq_offset) + j)   (64 bits)
//   keep  <=>  u >= p 2^64          mask = keep / (1 - p)          (inverted dropout, as torch's)
//
// with mix splitmix64's finalizer (a bijection of 64 bits that passes BigCrush as a counter
// hash). Why not a stream of draws, as the Dropout layer has: a pipeline stage runs micro-batch m
// of rows [m B/M, (m+1) B/M), a tensor-parallel rank the heads [r H/p, (r+1) H/p) and the
// sequence positions [r T/p, (r+1) T/p), and a recomputing backward (activation checkpointing) runs
// a block again later. With the mask a function of the global position, each of them draws the
// very mask one process draws at that position, so they compute the one-process model exactly,
// and backward needs no stored mask: it computes the mask again.
//
// For a (B, T, C) activation the coordinates are (row, 0, position, channel); for attention
// probabilities (row, head, query, key).
#pragma once

#include <cmath>
#include <cstdint>

#include "tessera/core/host_device.hpp"
#include "tessera/device/cpu.hpp"

namespace tessera {

struct DropoutKey {
  double p = 0;                // the probability of zeroing an element; 0: the identity
  std::uint64_t key = 0;       // this step's draw, mixed with the site's number (site_key)
  std::int64_t batch_offset = 0, head_offset = 0, seq_offset = 0;  // this call's place in the global tensor

  TESSERA_HOST_DEVICE bool active() const { return p > 0; }
  TESSERA_HOST_DEVICE static std::uint64_t mix(std::uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // The key of site `site` (0, 1, ...) in the step whose draw is step_key.
  TESSERA_HOST_DEVICE static std::uint64_t site_key(std::uint64_t step_key, std::uint64_t site) {
    return mix(step_key ^ mix(site + 0x9e3779b97f4a7c15ULL));
  }
  // The hash prefix of one row (b, h, t) of local coordinates; element j then hashes mix(row + j).
  TESSERA_HOST_DEVICE std::uint64_t row(std::int64_t b, std::int64_t h, std::int64_t t) const {
    std::uint64_t z = mix(key + static_cast<std::uint64_t>(b + batch_offset));
    z = mix(z + static_cast<std::uint64_t>(h + head_offset));
    return mix(z + static_cast<std::uint64_t>(t + seq_offset));
  }
  // Elements whose hash lies below this are dropped: p 2^64, so P(keep) = 1 - p to 2^-64.
  TESSERA_HOST_DEVICE std::uint64_t threshold() const {
    return p > 0 ? static_cast<std::uint64_t>(ldexp(p, 64)) : 0;  // < 2^64 for every double p < 1
  }
  TESSERA_HOST_DEVICE double scale() const { return 1.0 / (1.0 - p); }
  // Whether element j of the row whose hash is `row` keeps its value (threshold: threshold()'s).
  TESSERA_HOST_DEVICE static bool keeps(std::uint64_t row, std::int64_t j, std::uint64_t threshold) {
    return mix(row + static_cast<std::uint64_t>(j)) >= threshold;
  }
  // Element j's mask value (keep / (1 - p), or 0) in the row whose hash is `row`.
  TESSERA_HOST_DEVICE double mask(std::uint64_t row, std::int64_t j) const {
    return keeps(row, j, threshold()) ? scale() : 0.0;
  }
};

// One row's mask values (keep / (1 - p) or 0) for elements [j0, j0 + n) of row hash `row`.
template <class S>
inline void dropout_row_mask(std::uint64_t row, std::uint64_t threshold, S scale, std::int64_t j0, std::int64_t n,
                             S* mask) {
  for (std::int64_t j = 0; j < n; ++j) mask[j] = DropoutKey::keeps(row, j0 + j, threshold) ? scale : S(0);
}

// y = x * mask for a (B, T, C) activation (coordinates (b, 0, t, c)): forward with x the input,
// backward with x = dy (the same mask, computed again). y may be x. x * 0 stays NaN for a NaN x,
// as torch's x * mask does.
template <class S>
void dropout_rows(Cpu, const DropoutKey& key, std::int64_t batch, std::int64_t t, std::int64_t width, const S* x,
                  S* y) {
  const std::uint64_t threshold = key.threshold();
  const S scale = static_cast<S>(key.scale());
  detail::parallel_for(batch * t, true, [&](std::int64_t bt) {
    const std::uint64_t row = key.row(bt / t, 0, bt % t);
    const S* xr = x + bt * width;
    S* yr = y + bt * width;
    for (std::int64_t j = 0; j < width; ++j) yr[j] = xr[j] * (DropoutKey::keeps(row, j, threshold) ? scale : S(0));
  });
}
// The CUDA overload: kernels/cuda/elementwise.cuh.

}  // namespace tessera
