// Copies of short rows, and col2im's sum of a kernel row's taps (a few to a few dozen elements): the inner loops of im2col and
// col2im on small images, where a convolution's output rows are 5 to 28 values wide and not
// adjacent in memory (no padding: W' < W). A plain loop of 10 floats compiles to a vector of 8 and
// a scalar tail, or to a call to memmove; with AVX-512 one masked load and one masked store move
// up to 16 floats (measured: im2col + col2im were a large share of a LeNet-5 step).
// float only (double serves the gradient checks, where speed does not matter); with AVX2 but not
// AVX-512, 8-lane versions without masked stores (slow on AMD cores); with neither (another CPU,
// TESSERA_CPU_CAPABILITY=default, or nvcc's host pass) the plain loops. The SIMD versions are
// functions of their own, chosen at run time (kernels/cpu/capability.hpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "tessera/kernels/cpu/capability.hpp"
#include "tessera/kernels/cpu/simd_diagnostics.hpp"

TESSERA_SIMD_CODE_BEGIN

namespace tessera::detail {

#if TESSERA_X86_CPU_FEATURES  // (kernels/cpu/capability.hpp)
// Lanes [0, n) of 16, n clamped to [0, 16]. Plain integer maths on the mask type, so it is also
// there for kernels compiled for AVX-512 by a target attribute (kernels/cpu/gemm_bf16.hpp).
inline __mmask16 lanes16(std::int64_t n) {
  return static_cast<__mmask16>(n >= 16 ? 0xFFFFu : n <= 0 ? 0u : (1u << n) - 1u);
}
// w[i][j] -> w[j][i] for a 16 x 16 matrix of 32-bit words, one row per register: pairs of rows
// interleaved by 32 bits, then by 64, then 128-bit lanes exchanged twice. Like lanes16, on every
// x86 build (gemm_bf16's packing runs it under its own target attribute; the Winograd
// channel-blocked layout under -march with AVX-512).
__attribute__((target("avx512f"))) inline void transpose16(__m512i (&w)[16]) {
  __m512i t[16], u[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_epi32(w[2 * k], w[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(w[2 * k], w[2 * k + 1]);
  }
  // u[4 k + q], 128-bit lane L: column 4 L + q of rows 4 k .. 4 k + 3.
  for (int k = 0; k < 4; ++k) {
    u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int q = 0; q < 4; ++q) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[q], u[4 + q], 0x88), x1 = _mm512_shuffle_i32x4(u[q], u[4 + q], 0xdd);
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], 0x88);
    const __m512i y1 = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], 0xdd);
    w[q] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    w[8 + q] = _mm512_shuffle_i32x4(x0, y0, 0xdd);
    w[4 + q] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    w[12 + q] = _mm512_shuffle_i32x4(x1, y1, 0xdd);
  }
}
// Lanes [0, n) of 8 as a VMASKMOVPS mask (lane i's sign bit set), n clamped to [0, 8]: 8 lanes of a
// table of 8 set words then 8 clear ones, from word 8 - n: one load (the table is one cache line)
// where a float compare of n against 0..7 takes a convert, a broadcast and the compare.
alignas(64) inline constexpr std::int32_t kLanes8Table[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
__attribute__((target("avx"))) inline __m256i lanes8(std::int64_t n) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kLanes8Table + 8 - std::clamp<std::int64_t>(n, 0, 8)));
}
// w[i][j] -> w[j][i] for an 8 x 8 matrix of floats, one row per register: pairs of rows
// interleaved by 32 bits, then by 64 (shuffle_ps), then the 128-bit halves exchanged. The Winograd
// channel-blocked layout's transposition under -march with AVX but not AVX-512 (8 lanes).
__attribute__((target("avx"))) inline void transpose8(__m256 (&w)[8]) {
  __m256 t[8], u[8];
  for (int k = 0; k < 4; ++k) {
    t[2 * k] = _mm256_unpacklo_ps(w[2 * k], w[2 * k + 1]);
    t[2 * k + 1] = _mm256_unpackhi_ps(w[2 * k], w[2 * k + 1]);
  }
  // u[4 h + q], 128-bit half L: column 4 L + q of rows 4 h .. 4 h + 3.
  for (int h = 0; h < 2; ++h) {
    u[4 * h] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
    u[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xEE);
    u[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
    u[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);
  }
  for (int q = 0; q < 4; ++q) {
    w[q] = _mm256_permute2f128_ps(u[q], u[4 + q], 0x20);
    w[4 + q] = _mm256_permute2f128_ps(u[q], u[4 + q], 0x31);
  }
}
#endif

// dst[0, n) = src[0, n); the ranges do not overlap.
#if TESSERA_X86_DISPATCH
TESSERA_TARGET_AVX512 inline void copy_row_avx512(float* dst, const float* src, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_loadu_ps(src + i));
  if (i < n) {
    const __mmask16 m = lanes16(n - i);
    _mm512_mask_storeu_ps(dst + i, m, _mm512_maskz_loadu_ps(m, src + i));
  }
}
// AVX2: whole vectors of 8, the last one ending at n (overlapping the one before: stored twice,
// same values), 4 and then 1 at a time below 8. No masked store: VMASKMOVPS to memory is slow on
// AMD. std::copy calls memmove for each short row, a large share of a LeNet-5 step at one thread
// on a Zen 3 (bench/README.md, "Figures behind design choices in the headers").
TESSERA_TARGET_AVX2 inline void copy_row_avx2(float* dst, const float* src, std::int64_t n) {
  if (n >= 8) {
    std::int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_loadu_ps(src + i));
    if (i < n) _mm256_storeu_ps(dst + n - 8, _mm256_loadu_ps(src + n - 8));
    return;
  }
  if (n >= 4) {
    _mm_storeu_ps(dst, _mm_loadu_ps(src));
    _mm_storeu_ps(dst + n - 4, _mm_loadu_ps(src + n - 4));
    return;
  }
  for (std::int64_t i = 0; i < n; ++i) dst[i] = src[i];
}
#endif
template <class S>
inline void copy_row(S* dst, const S* src, std::int64_t n) {
#if TESSERA_X86_DISPATCH
  if constexpr (std::is_same_v<S, float>) {
    if (cpu_avx512()) return copy_row_avx512(dst, src, n);
    if (cpu_avx2()) return copy_row_avx2(dst, src, n);
  }
#endif
  std::copy(src, src + n, dst);
}

// dst[i] = src[2 i] for i in [0, n): im2col's rows for stride-2 convolutions off the phase path
// (ResNet-50's 1x1 stride-2 layers; its 7x7 stem and 3x3 stride-2 layers until im2col_phases).
// The plain loop compiles to scalar loads two at a time (most of im2col's share of a ResNet-50 b8
// inference profile); AVX-512 picks the even lanes of two loads with one permute. src[2 (n - 1)] is the last element read.
#if TESSERA_X86_DISPATCH
TESSERA_TARGET_AVX512 inline void copy_row_stride2_avx512(float* dst, const float* src, std::int64_t n) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  std::int64_t i = 0;
  // Whole vectors while both loads stay inside the row (src[2 i + 31] <= src[2 (n - 1)]), then one
  // masked pass: g++ peels the masks out of a single masked loop by itself, clang does not (it
  // kept both loads masked in every pass, and im2col took a larger share of a ResNet-50 step:
  // docs/testing.md, "clang++ is the build's compiler").
  for (; i + 17 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_permutex2var_ps(_mm512_loadu_ps(src + 2 * i), even,
                                                     _mm512_loadu_ps(src + 2 * i + 16)));
  for (; i < n; i += 16) {
    const std::int64_t lanes = std::min<std::int64_t>(16, n - i), span = 2 * lanes - 1;  // elements read
    const __m512 lo = _mm512_maskz_loadu_ps(lanes16(span), src + 2 * i);
    const __m512 hi = _mm512_maskz_loadu_ps(lanes16(span - 16), src + 2 * i + 16);
    _mm512_mask_storeu_ps(dst + i, lanes16(lanes), _mm512_permutex2var_ps(lo, even, hi));
  }
}
#endif
template <class S>
inline void copy_row_stride2(S* dst, const S* src, std::int64_t n) {
#if TESSERA_X86_DISPATCH
  if constexpr (std::is_same_v<S, float>) {
    if (cpu_avx512()) return copy_row_stride2_avx512(dst, src, n);
  }
#endif
  for (std::int64_t i = 0; i < n; ++i) dst[i] = src[2 * i];
}

// dst[r w_out + q] = src[2 r w_in + 2 q] for r < rows, q < w_out (2 (w_out - 1) < w_in): a plane's
// even rows' even columns, one col row of a 1x1 stride-2 unpadded convolution (ResNet's
// downsampling shortcuts; im2col's subsample path). Output rows of up to 8 values (W' = 7 from 14)
// go two at a time: one masked load from each input row, one permute, one store of 2 W' lanes;
// wider rows one at a time, without the generic loop's per-row bounds and padding checks (figures
// in bench/README.md, "Figures behind design choices in the headers").
#if TESSERA_X86_DISPATCH
TESSERA_TARGET_AVX512 inline void gather_rows_stride2_avx512(float* dst, const float* src, std::int64_t rows,
                                                             std::int64_t w_out, std::int64_t w_in) {
  if (w_out > 8) {
    for (std::int64_t r = 0; r < rows; ++r) copy_row_stride2_avx512(dst + r * w_out, src + 2 * r * w_in, w_out);
    return;
  }
  alignas(64) std::int32_t lane[16] = {};
  for (std::int64_t q = 0; q < w_out; ++q) lane[q] = static_cast<std::int32_t>(2 * q), lane[w_out + q] = static_cast<std::int32_t>(16 + 2 * q);
  const __m512i pick = _mm512_load_si512(lane);
  const __mmask16 read = lanes16(2 * w_out - 1);
  std::int64_t r = 0;
  for (; r + 2 <= rows; r += 2) {
    const __m512 a = _mm512_maskz_loadu_ps(read, src + 2 * r * w_in);
    const __m512 b = _mm512_maskz_loadu_ps(read, src + 2 * (r + 1) * w_in);
    _mm512_mask_storeu_ps(dst + r * w_out, lanes16(2 * w_out), _mm512_permutex2var_ps(a, pick, b));
  }
  if (r < rows)
    _mm512_mask_storeu_ps(dst + r * w_out, lanes16(w_out),
                          _mm512_permutexvar_ps(pick, _mm512_maskz_loadu_ps(read, src + 2 * r * w_in)));
}
#endif
template <class S>
inline void gather_rows_stride2(S* dst, const S* src, std::int64_t rows, std::int64_t w_out, std::int64_t w_in) {
#if TESSERA_X86_DISPATCH
  if constexpr (std::is_same_v<S, float>) {
    if (cpu_avx512()) return gather_rows_stride2_avx512(dst, src, rows, w_out, w_in);
  }
#endif
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t q = 0; q < w_out; ++q) dst[r * w_out + q] = src[2 * r * w_in + 2 * q];
}

// The inverse, assigning: for input rows ih < in_rows of a plane w_in wide, dst[ih w_in + 2 q] =
// src[(ih / 2) w_out + q] on even rows and every other entry 0 (col2im's subsample path, where no
// other tap reaches those pixels, so dx needs no zero fill first). AVX-512: 8 values spread over
// 16 lanes, odd lanes zeroed, by one masked permute.
#if TESSERA_X86_DISPATCH
TESSERA_TARGET_AVX512 inline void scatter_rows_stride2_avx512(float* dst, const float* src, std::int64_t in_rows,
                                                              std::int64_t w_out, std::int64_t w_in) {
  const __m512i spread = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  for (std::int64_t ih = 0; ih < in_rows; ++ih) {
    float* row = dst + ih * w_in;
    if (ih % 2 == 1) {
      std::fill(row, row + w_in, 0.0f);
      continue;
    }
    const float* from = src + ih / 2 * w_out;
    for (std::int64_t q0 = 0; 2 * q0 < w_in; q0 += 8) {
      const __m512 v = _mm512_maskz_loadu_ps(lanes16(w_out - q0), from + q0);
      _mm512_mask_storeu_ps(row + 2 * q0, lanes16(w_in - 2 * q0), _mm512_maskz_permutexvar_ps(0x5555, spread, v));
    }
  }
}
#endif
template <class S>
inline void scatter_rows_stride2(S* dst, const S* src, std::int64_t in_rows, std::int64_t w_out, std::int64_t w_in) {
#if TESSERA_X86_DISPATCH
  if constexpr (std::is_same_v<S, float>) {
    if (cpu_avx512()) return scatter_rows_stride2_avx512(dst, src, in_rows, w_out, w_in);
  }
#endif
  for (std::int64_t ih = 0; ih < in_rows; ++ih) {
    S* row = dst + ih * w_in;
    std::fill(row, row + w_in, S(0));
    if (ih % 2 == 0)
      for (std::int64_t q = 0; 2 * q < w_in; ++q) row[2 * q] = src[ih / 2 * w_out + q];
  }
}

// even[q] = src[2 q] for q < (n + 1) / 2 and odd[q] = src[2 q + 1] for q < n / 2: an input row of
// a stride-2 convolution split into its two column phases (im2col's phase path, kernels/cpu/conv2d.hpp).
// AVX-512: two loads, two permutes and two stores per 32 values; src[n - 1] is the last read.
#if TESSERA_X86_DISPATCH
TESSERA_TARGET_AVX512 inline void split_row_stride2_avx512(float* even, float* odd, const float* src, std::int64_t n) {
  const __m512i even_lanes = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd_lanes = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  std::int64_t q = 0;
  for (; 2 * q + 32 <= n; q += 16) {
    const __m512 lo = _mm512_loadu_ps(src + 2 * q), hi = _mm512_loadu_ps(src + 2 * q + 16);
    _mm512_storeu_ps(even + q, _mm512_permutex2var_ps(lo, even_lanes, hi));
    _mm512_storeu_ps(odd + q, _mm512_permutex2var_ps(lo, odd_lanes, hi));
  }
  if (2 * q < n) {
    const std::int64_t left = n - 2 * q;  // 1 to 31 values
    const __m512 lo = _mm512_maskz_loadu_ps(lanes16(left), src + 2 * q);
    const __m512 hi = _mm512_maskz_loadu_ps(lanes16(left - 16), src + 2 * q + 16);
    _mm512_mask_storeu_ps(even + q, lanes16((left + 1) / 2), _mm512_permutex2var_ps(lo, even_lanes, hi));
    _mm512_mask_storeu_ps(odd + q, lanes16(left / 2), _mm512_permutex2var_ps(lo, odd_lanes, hi));
  }
}
#endif
template <class S>
inline void split_row_stride2(S* even, S* odd, const S* src, std::int64_t n) {
#if TESSERA_X86_DISPATCH
  if constexpr (std::is_same_v<S, float>) {
    if (cpu_avx512()) return split_row_stride2_avx512(even, odd, src, n);
  }
#endif
  for (std::int64_t q = 0; 2 * q < n; ++q) even[q] = src[2 * q];
  for (std::int64_t q = 0; 2 * q + 1 < n; ++q) odd[q] = src[2 * q + 1];
}

// dst[2 q] += even[q] and dst[2 q + 1] += odd[q] for the entries of dst[0, n): the inverse of
// split_row_stride2, adding (col2im's phase path); with Assign, = instead of += (whole-sample
// blocks, whose dx is then not zeroed first). AVX-512: two loads, two permutes and two stores per
// 32 values.
#if TESSERA_X86_DISPATCH
template <bool Assign>
TESSERA_TARGET_AVX512 inline void interleave_row_avx512(float* dst, const float* even, const float* odd, std::int64_t n) {
  const __m512i low_lanes = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i high_lanes = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  std::int64_t q = 0;
  for (; 2 * q + 32 <= n; q += 16) {
    const __m512 e = _mm512_loadu_ps(even + q), o = _mm512_loadu_ps(odd + q);
    __m512 low = _mm512_permutex2var_ps(e, low_lanes, o), high = _mm512_permutex2var_ps(e, high_lanes, o);
    if constexpr (!Assign) {
      low = _mm512_add_ps(_mm512_loadu_ps(dst + 2 * q), low);
      high = _mm512_add_ps(_mm512_loadu_ps(dst + 2 * q + 16), high);
    }
    _mm512_storeu_ps(dst + 2 * q, low);
    _mm512_storeu_ps(dst + 2 * q + 16, high);
  }
  if (2 * q < n) {
    const std::int64_t left = n - 2 * q;
    const __m512 e = _mm512_maskz_loadu_ps(lanes16((left + 1) / 2), even + q);
    const __m512 o = _mm512_maskz_loadu_ps(lanes16(left / 2), odd + q);
    const __mmask16 m0 = lanes16(left), m1 = lanes16(left - 16);
    __m512 low = _mm512_permutex2var_ps(e, low_lanes, o), high = _mm512_permutex2var_ps(e, high_lanes, o);
    if constexpr (!Assign) {
      low = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, dst + 2 * q), low);
      high = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, dst + 2 * q + 16), high);
    }
    _mm512_mask_storeu_ps(dst + 2 * q, m0, low);
    _mm512_mask_storeu_ps(dst + 2 * q + 16, m1, high);
  }
}
#endif
template <bool Assign = false, class S>
inline void interleave_row(S* dst, const S* even, const S* odd, std::int64_t n) {
#if TESSERA_X86_DISPATCH
  if constexpr (std::is_same_v<S, float>) {
    if (cpu_avx512()) return interleave_row_avx512<Assign>(dst, even, odd, n);
  }
#endif
  for (std::int64_t q = 0; 2 * q < n; ++q) dst[2 * q] = Assign ? even[q] : dst[2 * q] + even[q];
  for (std::int64_t q = 0; 2 * q + 1 < n; ++q) dst[2 * q + 1] = Assign ? odd[q] : dst[2 * q + 1] + odd[q];
}

// dx_row[x] += sum over j in [0, taps) of first[j * ld + x - j], for 0 <= x - j < n: col2im of
// the taps (i, 0..taps-1) of one output row onto one input row (stride 1, no column padding, so
// the input row is n + taps - 1 wide). Each input value is loaded, summed over its taps in a
// register and stored once; adding tap by tap instead reloads values just stored one lane over,
// which defeats store-to-load forwarding (measured on Zen 4: most of col2im's time in that stall).
#if TESSERA_X86_DISPATCH
TESSERA_TARGET_AVX512 inline void add_shifted_rows_avx512(float* dx_row, const float* first, std::int64_t ld,
                                                         std::int64_t taps, std::int64_t n) {
  const std::int64_t width = n + taps - 1;
  for (std::int64_t x0 = 0; x0 < width; x0 += 16) {
    const std::int64_t lanes = std::min<std::int64_t>(16, width - x0);
    const __mmask16 m = lanes16(lanes);
    __m512 acc = _mm512_maskz_loadu_ps(m, dx_row + x0);
    for (std::int64_t j = 0; j < taps; ++j) {
      // Lanes l with 0 <= x0 + l - j < n; masked-off lanes are neither read nor faulted on.
      const std::int64_t lo = std::max<std::int64_t>(0, j - x0), hi = std::min(lanes, n + j - x0);
      if (lo >= hi) continue;
      const auto mask = static_cast<__mmask16>(lanes16(hi) & ~lanes16(lo));
      acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(mask, first + j * ld + x0 - j));
    }
    _mm512_mask_storeu_ps(dx_row + x0, m, acc);
  }
}
// AVX2: the same, 8 lanes at a time, for `rows` rows (dx_row + r dx_step from first + r
// first_step): which taps reach which lanes of each vector is the same on every row, so it is
// worked out once (a plan of at most kShiftedVectors vectors by kShiftedTaps taps; wider rows or
// more taps go row by row, their last 1 to 7 values one by one). Taps' partial lanes at
// the row's ends by masked loads (which are fast, unlike masked stores). A row not a whole number
// of vectors ends with a vector that overlaps the one before it, summed onto dx_row's values as
// they were before any store: its lanes shared with that vector get the same sums, stored twice.
// (Per row, with the last 1 to 7 values one by one and the masks rebuilt for each row, col2im
// took 2.5 times as long in a LeNet-5 step on a Zen 3.)
constexpr std::int64_t kShiftedVectors = 4, kShiftedTaps = 8;
// Which lanes l of the vector at x0 tap j reaches (0 <= x0 + l - j < n): 0 none, 1 all 8, 2 those
// in `mask` (masked-off lanes are neither read nor faulted on).
TESSERA_TARGET_AVX2 inline std::int8_t shifted_tap_lanes(std::int64_t x0, std::int64_t j, std::int64_t n, __m256i& mask) {
  const std::int64_t lo = std::max<std::int64_t>(0, j - x0), hi = std::min<std::int64_t>(8, n + j - x0);
  if (lo >= hi) return 0;
  if (lo == 0 && hi == 8) return 1;
  mask = _mm256_andnot_si256(lanes8(lo), lanes8(hi));
  return 2;
}
struct ShiftedRowsPlan {
  std::int64_t vectors = 0, first_lane[kShiftedVectors] = {};
  // Per vector and tap, shifted_tap_lanes: 0 no lane, 1 all 8 lanes, 2 the lanes in mask.
  std::int8_t kind[kShiftedVectors][kShiftedTaps] = {};
  __m256i mask[kShiftedVectors][kShiftedTaps];
};
TESSERA_TARGET_AVX2 inline void add_shifted_rows_planned_avx2(const ShiftedRowsPlan& plan, float* dx_row,
                                                             const float* first, std::int64_t ld, std::int64_t taps) {
  __m256 sums[kShiftedVectors];
  for (std::int64_t v = 0; v < plan.vectors; ++v) {
    const std::int64_t x0 = plan.first_lane[v];
    __m256 acc = _mm256_loadu_ps(dx_row + x0);  // every load before the first store (the overlap)
    for (std::int64_t j = 0; j < taps; ++j) {
      const float* from = first + j * ld + x0 - j;
      if (plan.kind[v][j] == 1) acc = _mm256_add_ps(acc, _mm256_loadu_ps(from));
      else if (plan.kind[v][j] == 2) acc = _mm256_add_ps(acc, _mm256_maskload_ps(from, plan.mask[v][j]));
    }
    sums[v] = acc;
  }
  for (std::int64_t v = 0; v < plan.vectors; ++v) _mm256_storeu_ps(dx_row + plan.first_lane[v], sums[v]);
}
TESSERA_TARGET_AVX2 inline void add_shifted_rows_avx2(float* dx_row, std::int64_t dx_step, const float* first,
                                                     std::int64_t first_step, std::int64_t rows, std::int64_t ld,
                                                     std::int64_t taps, std::int64_t n) {
  const std::int64_t width = n + taps - 1;
  if (width < 8) {
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = 0; j < taps; ++j)
        for (std::int64_t x = 0; x < n; ++x) dx_row[r * dx_step + x + j] += first[r * first_step + j * ld + x];
    return;
  }
  const std::int64_t vectors = (width + 7) / 8;
  if (vectors > kShiftedVectors || taps > kShiftedTaps) {
    // Row by row: whole vectors, then the last 1 to 7 values one by one.
    for (std::int64_t r = 0; r < rows; ++r) {
      float* row = dx_row + r * dx_step;
      const float* row_first = first + r * first_step;
      std::int64_t x0 = 0;
      for (; x0 + 8 <= width; x0 += 8) {
        __m256 acc = _mm256_loadu_ps(row + x0);
        for (std::int64_t j = 0; j < taps; ++j) {
          __m256i mask;
          const std::int8_t kind = shifted_tap_lanes(x0, j, n, mask);
          const float* from = row_first + j * ld + x0 - j;
          if (kind == 1) acc = _mm256_add_ps(acc, _mm256_loadu_ps(from));
          else if (kind == 2) acc = _mm256_add_ps(acc, _mm256_maskload_ps(from, mask));
        }
        _mm256_storeu_ps(row + x0, acc);
      }
      for (std::int64_t x = x0; x < width; ++x) {
        float sum = row[x];
        for (std::int64_t j = std::max<std::int64_t>(0, x - n + 1); j < taps && j <= x; ++j) sum += row_first[j * ld + x - j];
        row[x] = sum;
      }
    }
    return;
  }
  ShiftedRowsPlan plan;
  plan.vectors = vectors;
  for (std::int64_t v = 0; v < vectors; ++v) {
    const std::int64_t x0 = std::min(8 * v, width - 8);  // the last one overlaps when width % 8 != 0
    plan.first_lane[v] = x0;
    for (std::int64_t j = 0; j < taps; ++j) plan.kind[v][j] = shifted_tap_lanes(x0, j, n, plan.mask[v][j]);
  }
  for (std::int64_t r = 0; r < rows; ++r)
    add_shifted_rows_planned_avx2(plan, dx_row + r * dx_step, first + r * first_step, ld, taps);
}
#endif
// add_shifted_rows for `rows` rows: dx_row + r dx_step from first + r first_step.
template <class S>
inline void add_shifted_rows(S* dx_row, std::int64_t dx_step, const S* first, std::int64_t first_step,
                             std::int64_t rows, std::int64_t ld, std::int64_t taps, std::int64_t n) {
#if TESSERA_X86_DISPATCH
  if constexpr (std::is_same_v<S, float>) {
    if (cpu_avx512()) {
      for (std::int64_t r = 0; r < rows; ++r) add_shifted_rows_avx512(dx_row + r * dx_step, first + r * first_step, ld, taps, n);
      return;
    }
    if (cpu_avx2()) return add_shifted_rows_avx2(dx_row, dx_step, first, first_step, rows, ld, taps, n);
  }
#endif
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < taps; ++j)
      for (std::int64_t x = 0; x < n; ++x) dx_row[r * dx_step + x + j] += first[r * first_step + j * ld + x];
}

#if TESSERA_X86_DISPATCH
// body(std::integral_constant<std::int64_t, n>{}) for n in [1, Max], else with the constant 0 (a
// run-time count): the short-row gathers' chunk loops unrolled for the counts that occur.
template <std::int64_t Max, class Body>
void with_fixed_count(std::int64_t n, Body&& body) {
  [&]<std::int64_t... C>(std::integer_sequence<std::int64_t, C...>) {
    const bool fixed = ((n == C + 1 ? (body(std::integral_constant<std::int64_t, C + 1>{}), true) : false) || ...);
    if (!fixed) body(std::integral_constant<std::int64_t, 0>{});
  }(std::make_integer_sequence<std::int64_t, Max>{});
}

// im2col's rows for an unpadded stride-1 convolution with short output rows (W' < 16, such as
// LeNet-5's second layer: 10 wide on a 14-wide input). Column q of a band's col row for tap
// (i, j) holds input element (oh0 + i) W + j + (q / W') W + q % W': runs of W' values, W apart.
// Copying them one output row at a time is one masked load and store of W' values each, with the
// loop around it, a few cycles a row; here each 16 columns come from the (at most 32)
// input values they span: two masked loads, one two-register permute, one full store. The
// pattern of a chunk depends only on its column, so it is built once per band and serves every
// row and sample. Lanes past a chunk's last needed element are masked off in the loads, so
// nothing outside the input plane is read. AVX-512 only: callers check cpu_avx512() first.
class ShortRowGather {
 public:
  static constexpr std::int64_t kMaxChunks = 64;  // 1024 columns per band

  // False (and the caller copies row by row) when a band has more than kMaxChunks chunks or 16
  // columns span more than 32 input values (W' small against the kernel's width).
  TESSERA_TARGET_AVX512 bool build(std::int64_t in_width, std::int64_t out_width, std::int64_t columns) {
    if (out_width <= 0 || out_width >= 16 || in_width < out_width || columns <= 0) return false;
    chunks_ = (columns + 15) / 16;
    if (chunks_ > kMaxChunks) return false;
    auto offset = [&](std::int64_t q) { return q / out_width * in_width + q % out_width; };
    for (std::int64_t m = 0; m < chunks_; ++m) {
      const std::int64_t q0 = 16 * m, lanes = std::min<std::int64_t>(16, columns - q0);
      alignas(64) std::int32_t lane_index[16] = {};
      std::int64_t needed = 0;
      start_[m] = offset(q0);
      for (std::int64_t t = 0; t < lanes; ++t) {
        const std::int64_t at = offset(q0 + t) - start_[m];
        if (at > 31) return false;
        lane_index[t] = static_cast<std::int32_t>(at);
        needed = at + 1;
      }
      index_[m] = _mm512_load_si512(lane_index);
      low_[m] = lanes16(needed);
      high_[m] = lanes16(needed - 16);
      store_[m] = lanes16(lanes);
    }
    return true;
  }

  // Elements from src that a write may read: when src + reach() is still inside the buffer, the
  // write may use plain loads (unmasked; the masks cost measurable time).
  std::int64_t reach() const { return start_[chunks_ - 1] + 32; }

  // Calls rows(write) once; write(dst, src, unmasked) sets dst[q] = src[offset(q)] for the band's
  // columns, src being the input at (oh0 + i) W + j. Up to kUnrolled chunks, write's loop is
  // unrolled at compile time, and rows is instantiated for the count so that write inlines into
  // its loop: with a run-time count of 7 (LeNet-5), or a call per row, the same work took longer.
  template <class Rows>
  void run(Rows&& rows) const {
    with_fixed_count<kUnrolled>(chunks_, [&](auto count) { rows(Writer<decltype(count)::value>{*this}); });
  }

 private:
  static constexpr std::int64_t kUnrolled = 16;

  template <bool Masked>
  TESSERA_TARGET_AVX512 __m512 chunk(std::int64_t m, const float* src) const {
    const float* at = src + start_[m];
    if constexpr (Masked)
      return _mm512_permutex2var_ps(_mm512_maskz_loadu_ps(low_[m], at), index_[m],
                                    _mm512_maskz_loadu_ps(high_[m], at + 16));
    return _mm512_permutex2var_ps(_mm512_loadu_ps(at), index_[m], _mm512_loadu_ps(at + 16));
  }
  // Every chunk but the last is whole (a full store); the last is stored under its mask.
  template <bool Masked>
  TESSERA_TARGET_AVX512 void write(std::int64_t chunks, float* dst, const float* src) const {
    std::int64_t m = 0;
    for (; m + 1 < chunks; ++m) _mm512_storeu_ps(dst + 16 * m, chunk<Masked>(m, src));
    _mm512_mask_storeu_ps(dst + 16 * m, store_[m], chunk<Masked>(m, src));
  }
  template <std::int64_t Chunks>  // 0: the run-time count
  struct Writer {
    const ShortRowGather& g;
    TESSERA_TARGET_AVX512 void operator()(float* dst, const float* src, bool unmasked) const {
      const std::int64_t chunks = Chunks > 0 ? Chunks : g.chunks_;
      if (unmasked)
        g.write<false>(chunks, dst, src);
      else
        g.write<true>(chunks, dst, src);
    }
  };

  std::int64_t chunks_ = 0;
  __m512i index_[kMaxChunks];
  std::int64_t start_[kMaxChunks];
  __mmask16 low_[kMaxChunks], high_[kMaxChunks], store_[kMaxChunks];
};

// The same gather in 8 lanes, for CPUs with AVX2 but not AVX-512 (callers check cpu_avx2()): each
// 8 columns come from the (at most 16) input values they span, by two loads, two in-lane-crossing
// permutes (VPERMPS) of one index vector and a blend of the two by the lanes past the first 8
// values; a chunk inside one input row needs the first load alone. No masked store (slow on AMD
// cores): a band whose columns are not a multiple of 8 ends with a chunk that overlaps the one
// before it (same values stored twice), so a band needs at least 8 columns. Per row of LeNet-5's
// second layer's col (100 columns), 13 chunks replace ten short copies and their loop.
class ShortRowGatherAvx2 {
 public:
  static constexpr std::int64_t kMaxChunks = 128;  // 1024 columns per band

  // False (the caller copies row by row) when a band has fewer than 8 or more than 8 kMaxChunks
  // columns, or 8 columns span more than 16 input values.
  TESSERA_TARGET_AVX2 bool build(std::int64_t in_width, std::int64_t out_width, std::int64_t columns) {
    if (out_width <= 0 || out_width >= 16 || in_width < out_width || columns < 8) return false;
    chunks_ = (columns + 7) / 8;
    if (chunks_ > kMaxChunks) return false;
    auto offset = [&](std::int64_t q) { return q / out_width * in_width + q % out_width; };
    for (std::int64_t m = 0; m < chunks_; ++m) {
      const std::int64_t q0 = std::min(8 * m, columns - 8);
      alignas(32) std::int32_t lane_index[8], past_first[8];
      start_[m] = offset(q0);
      std::int64_t needed = 0;
      for (std::int64_t t = 0; t < 8; ++t) {
        const std::int64_t at = offset(q0 + t) - start_[m];
        if (at > 15) return false;
        lane_index[t] = static_cast<std::int32_t>(at & 7);
        past_first[t] = at >= 8 ? -1 : 0;
        needed = at + 1;
      }
      column_[m] = q0;
      index_[m] = _mm256_load_si256(reinterpret_cast<const __m256i*>(lane_index));
      blend_[m] = _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(past_first)));
      two_[m] = needed > 8;
      low_[m] = lanes8(needed);
      high_[m] = lanes8(needed - 8);
    }
    return true;
  }

  // As ShortRowGather::reach: unmasked loads are safe while src + reach() is inside the buffer.
  std::int64_t reach() const { return start_[chunks_ - 1] + 16; }

  // As ShortRowGather::run.
  template <class Rows>
  void run(Rows&& rows) const {
    with_fixed_count<kUnrolled>(chunks_, [&](auto count) { rows(Writer<decltype(count)::value>{*this}); });
  }

 private:
  static constexpr std::int64_t kUnrolled = 16;

  template <bool Masked>
  TESSERA_TARGET_AVX2 __m256 chunk(std::int64_t m, const float* src) const {
    const float* at = src + start_[m];
    const __m256 low = _mm256_permutevar8x32_ps(Masked ? _mm256_maskload_ps(at, low_[m]) : _mm256_loadu_ps(at), index_[m]);
    if (!two_[m]) return low;
    const __m256 high =
        _mm256_permutevar8x32_ps(Masked ? _mm256_maskload_ps(at + 8, high_[m]) : _mm256_loadu_ps(at + 8), index_[m]);
    return _mm256_blendv_ps(low, high, blend_[m]);
  }
  template <bool Masked>
  TESSERA_TARGET_AVX2 void write(std::int64_t chunks, float* dst, const float* src) const {
    for (std::int64_t m = 0; m < chunks; ++m) _mm256_storeu_ps(dst + column_[m], chunk<Masked>(m, src));
  }
  template <std::int64_t Chunks>  // 0: the run-time count
  struct Writer {
    const ShortRowGatherAvx2& g;
    TESSERA_TARGET_AVX2 void operator()(float* dst, const float* src, bool unmasked) const {
      const std::int64_t chunks = Chunks > 0 ? Chunks : g.chunks_;
      if (unmasked)
        g.write<false>(chunks, dst, src);
      else
        g.write<true>(chunks, dst, src);
    }
  };

  std::int64_t chunks_ = 0;
  __m256i index_[kMaxChunks], low_[kMaxChunks], high_[kMaxChunks];
  __m256 blend_[kMaxChunks];
  std::int64_t start_[kMaxChunks], column_[kMaxChunks];
  bool two_[kMaxChunks];
};
#endif

}  // namespace tessera::detail

TESSERA_SIMD_CODE_END
