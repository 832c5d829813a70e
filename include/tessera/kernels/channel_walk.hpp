// The walk a GPU block takes over one channel of (N, C, HW) data, without a division per value.
//
// The CUDA BatchNorm kernels give each block one channel ch and a range of images [n_begin, n_end):
// the block's values are the planes x[n, ch, :] of those images, each `units` consecutive units long
// (a unit is V values loaded as one 16-byte pack, or one value). Thread t visits units t, t + step,
// t + 2 step, ... of that range, where unit k is at image n_begin + k / units, offset k % units, i.e.
// at unit index ((n_begin + k / units) C + ch) units + k % units of x. A 64-bit division costs more
// than the load it addresses, so the walk divides once, at its first unit, and then advances the
// index by (step / units) planes and step % units units, with one carry when the offset wraps past
// the plane's end (a carry skips the other C - 1 channels' planes).
#pragma once

#include <cstdint>

#include "tessera/core/host_device.hpp"

namespace tessera::detail {

class ChannelWalk {
 public:
  // units: units per plane (HW / V); channels: C; first: this thread's first unit of the range
  // (threadIdx.x); step: units between a thread's visits (blockDim.x).
  TESSERA_HOST_DEVICE ChannelWalk(std::int64_t units, std::int64_t channels, std::int64_t ch, std::int64_t n_begin,
                                  std::int64_t n_end, std::int64_t first, std::int64_t step)
      : units_(units), total_(units > 0 ? (n_end - n_begin) * units : 0), k_(first), step_(step) {
    if (k_ >= total_) return;
    const std::int64_t plane_stride = channels * units;  // from x[n, ch, 0] to x[n + 1, ch, 0]
    offset_ = k_ % units;
    unit_ = ((n_begin + k_ / units) * channels + ch) * units + offset_;
    step_offset_ = step % units;
    jump_ = (step / units) * plane_stride + step_offset_;
    carry_ = plane_stride - units;
  }
  TESSERA_HOST_DEVICE bool valid() const { return k_ < total_; }
  // The unit's index into x (in units): its values are x[unit V .. unit V + V - 1].
  TESSERA_HOST_DEVICE std::int64_t unit() const { return unit_; }
  TESSERA_HOST_DEVICE void next() {
    k_ += step_;
    unit_ += jump_;
    offset_ += step_offset_;
    if (offset_ >= units_) {
      offset_ -= units_;
      unit_ += carry_;
    }
  }

 private:
  std::int64_t units_, total_, k_, step_;
  std::int64_t offset_ = 0, unit_ = 0, step_offset_ = 0, jump_ = 0, carry_ = 0;
};

}  // namespace tessera::detail
