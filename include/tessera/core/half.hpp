// Half: IEEE 754 binary16 storage type (1 sign, 5 exponent, 10 mantissa bits) for compressed
// communication. Arithmetic is done in float: convert, compute, round back. Conversion rounds to
// nearest even, keeps inf/nan, and flushes nothing (subnormals are kept).
//
// BHalf: bfloat16 (1 sign, 8 exponent, 7 stored mantissa bits), the top 16 bits of a float32, as
// PyTorch's torch.bfloat16 and NCCL's ncclBfloat16. It keeps float32's exponent, so its range is
// float32's (no overflow where Half's 65504 overflows, no early underflow: gradients need no loss
// scaling), at the price of precision: 8 significant bits (relative rounding error 2^-8 against
// Half's 2^-11). That trade is why DDP's bf16_compress_hook uses it for gradients.
#pragma once

#include <bit>
#include <cstdint>
#include <type_traits>

namespace tessera {

namespace detail {

inline std::uint16_t float_to_half_bits(float value) {
  const std::uint32_t f = std::bit_cast<std::uint32_t>(value);
  const std::uint32_t sign = (f >> 16) & 0x8000u;
  const std::uint32_t abs = f & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or nan: keep a quiet nan's payload bit so it stays a nan
    return static_cast<std::uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x0200u : 0u));
  }
  if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds above 65504
  if (abs < 0x38800000u) {  // below 2^-14: subnormal half (or zero), value = m * 2^-24
    // Adding 0.5f aligns the float's mantissa so that its low bits are the half's subnormal
    // mantissa; the FPU does the round-to-nearest-even for us.
    const float shifted = std::bit_cast<float>(abs) + 0.5f;
    return static_cast<std::uint16_t>(sign | (std::bit_cast<std::uint32_t>(shifted) - 0x3f000000u));
  }
  // Normal: rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits to nearest even.
  const std::uint32_t mantissa_odd = (abs >> 13) & 1u;
  const std::uint32_t rounded = abs + 0xc8000fffu + mantissa_odd;  // -(112 << 23) + 0xfff + odd
  return static_cast<std::uint16_t>(sign | (rounded >> 13));
}

inline float half_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  const std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: m * 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// float -> bfloat16: drop the low 16 bits, rounding to nearest even. Adding 0x7fff plus the kept
// part's lowest bit carries into bit 16 exactly when the dropped half is above the midpoint, or at
// it with an odd kept part; a carry out of the mantissa bumps the exponent, which is right (and
// rounds the largest finite values up to inf, as IEEE rounding does). inf has a zero low half and
// stays inf. A NaN is kept a quiet NaN (bit 6 of the bfloat16, the float's quiet bit 22): its
// payload may sit in the dropped bits only, and rounding could otherwise carry it into inf.
inline std::uint16_t float_to_bhalf_bits(float value) {
  const std::uint32_t f = std::bit_cast<std::uint32_t>(value);
  if ((f & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((f >> 16) | 0x0040u);
  return static_cast<std::uint16_t>((f + 0x7fffu + ((f >> 16) & 1u)) >> 16);
}

// bfloat16 -> float is exact: the bits are the float's top half.
inline float bhalf_bits_to_float(std::uint16_t b) { return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16); }

}  // namespace detail

struct Half {
  std::uint16_t bits = 0;

  Half() = default;
  explicit Half(float value) : bits(detail::float_to_half_bits(value)) {}
  static Half from_bits(std::uint16_t b) {
    Half h;
    h.bits = b;
    return h;
  }
  explicit operator float() const { return detail::half_bits_to_float(bits); }
  friend bool operator==(Half a, Half b) { return static_cast<float>(a) == static_cast<float>(b); }
};

static_assert(sizeof(Half) == 2, "Half must be exactly 16 bits so buffers of it can be sent as is");

// bfloat16 storage type (see the top of this file): arithmetic in float, like Half.
struct BHalf {
  std::uint16_t bits = 0;

  BHalf() = default;
  explicit BHalf(float value) : bits(detail::float_to_bhalf_bits(value)) {}
  static BHalf from_bits(std::uint16_t b) {
    BHalf h;
    h.bits = b;
    return h;
  }
  explicit operator float() const { return detail::bhalf_bits_to_float(bits); }
  friend bool operator==(BHalf a, BHalf b) { return static_cast<float>(a) == static_cast<float>(b); }
};

static_assert(sizeof(BHalf) == 2, "BHalf must be exactly 16 bits so buffers of it can be sent as is");

// The 16-bit floating-point storage types: reduced in float, converted on the way in and out.
template <class T>
inline constexpr bool is_16bit_float_v = std::is_same_v<T, Half> || std::is_same_v<T, BHalf>;

}  // namespace tessera
