// e^x written so that a loop over it vectorizes (no calls, no branches): libm's expf and tanhf
// are scalar calls, and GELU's tanh form, attention's and cross-entropy's softmax through them took
// most of a small GPT's training step outside its matrix products (bench/README.md, "GPT training
// against PyTorch").
//
//   exp_nonpositive(x)  float, x in [-87, 0] (a little above 0 too): Cephes' expf, within 2 ulp
//   exp_le0(x)          e^x for x <= 0 or -inf (0 below float's range); NaN stays NaN. double: std::exp
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

namespace tessera::detail {

// Cephes' expf: n = round(x / ln 2), r = x - n ln 2 in two parts, a degree-6 polynomial, times 2^n
// through the exponent bits.
inline float exp_nonpositive(float x) {
  constexpr float kRound = 12582912.0f;  // 1.5 x 2^23: adding it rounds to an integer
  const float shifted = x * 1.44269504088896341f + kRound;
  const float n = shifted - kRound;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  const float z = r * r;
  const float p = (((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r +
                    1.6666665459e-1f) * r + 5.0000001201e-1f) * z + r + 1.0f;
  const std::int32_t e = (std::bit_cast<std::int32_t>(shifted) - std::bit_cast<std::int32_t>(kRound) + 127) << 23;
  return p * std::bit_cast<float>(e);
}
// Softmax's e^(x - max): arguments <= 0, and -inf for masked or underflowing entries.
inline float exp_le0(float x) { return x < -87.0f ? 0.0f : exp_nonpositive(std::max(x, -87.0f)); }
inline double exp_le0(double x) { return std::exp(x); }

}  // namespace tessera::detail
