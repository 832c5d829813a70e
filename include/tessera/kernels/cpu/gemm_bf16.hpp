// gemm_bf16: C = alpha * op(A) * op(B) + beta * C on float matrices, computed as PyTorch's CPU
// autocast computes a bfloat16 matmul: each element of A and B is rounded to bfloat16 (round to
// nearest even; 8 significant bits, float's exponent range), every product of two bfloat16 values
// is exact in float, and the sums are accumulated in float. C stays float. Same shapes and
// conventions as gemm (kernels/cpu/gemm.hpp): row-major, op(A) (m, k), op(B) (k, n), C (m, n).
//
// The kernel is VDPBF16PS (AVX512-BF16: Zen 4, Cooper Lake, Sapphire Rapids), which multiplies
// pairs of bfloat16 and adds both products into one float lane:
//   acc[j] += a[2j] b[2j] + a[2j+1] b[2j+1]          (16 float lanes per 512-bit register)
// i.e. twice the multiply-adds of an FMA per instruction. So both operands are packed as pairs
// along k, one 32-bit word (low half: even k, high half: odd k) per (row, pair):
//   A panel:  [pair p][row i of kMr]      a word is broadcast to all lanes
//   B panel:  [pair p][column j of kNr]   kNr / 16 registers per pair
// The micro-kernel keeps a kMr x kNr tile of C in 24 registers (fewer on the last panel).
// Blocking follows Goto's scheme: a (kKcPairs x kNc) block of B is packed once and stays in L2; a
// (kMc x kKcPairs) block of A is packed per row block; one B micro-panel (kKcPairs x kNr words = 24 KiB) stays in L1 while the
// A micro-panels stream past it. Odd k and partial tiles are padded with zeros when packing
// (a zero pair adds nothing) and masked when C is written.
//
// Where the CPU lacks AVX512-BF16 (detected at run time, cpu_has_avx512_bf16()), where
// TESSERA_CPU_CAPABILITY=default asks for the portable kernels (kernels/cpu/capability.hpp), or where
// set_cpu_bf16_enabled(false) turned it off, gemm_bf16 is the float gemm: the fp32 fallback.
// Threads: as gemm, split over the OpenMP team outside a parallel region, one thread inside one.
// On a CPU with AMX (and where set_cpu_bf16_library asks), large products run on oneDNN's matmul
// instead, with the same rounding (kernels/cpu/onednn_gemm.hpp, onednn_gemm_chosen).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define TESSERA_HAVE_BF16_KERNEL 1
#else
#define TESSERA_HAVE_BF16_KERNEL 0
#endif

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "tessera/core/half.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/device/cpu.hpp"
#include "tessera/kernels/cpu/capability.hpp"
#include "tessera/kernels/cpu/gemm.hpp"
#include "tessera/kernels/cpu/onednn_gemm.hpp"
#include "tessera/kernels/cpu/short_rows.hpp"

#include "tessera/kernels/cpu/simd_diagnostics.hpp"

TESSERA_SIMD_CODE_BEGIN

namespace tessera {

// Whether this CPU (and the OS, which must save the 512-bit registers) runs AVX512-BF16.
inline bool cpu_has_avx512_bf16() {
#if TESSERA_HAVE_BF16_KERNEL
  // AVX-512 as kernels/cpu/capability.hpp decides it (TESSERA_CPU_CAPABILITY=default turns this
  // kernel off too), plus the BF16 extension.
  static const bool has = cpu_avx512() && __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

namespace detail {
inline std::atomic<bool>& cpu_bf16_enabled_flag() {
  static std::atomic<bool> enabled{true};
  return enabled;
}
}  // namespace detail

// Process-wide switch, on by default: off makes every gemm_bf16 take the fp32 fallback (tests use
// it to run the fallback on a CPU that has the instructions).
inline void set_cpu_bf16_enabled(bool enabled) { detail::cpu_bf16_enabled_flag() = enabled; }

// Whether a bfloat16 Env computes in bfloat16 on a CPU with AVX512-BF16, from TESSERA_CPU_BF16:
//   auto (or unset)  where it runs faster than float: AMX tiles (oneDNN), or VDPBF16PS doing at
//                    least kBf16MinDotSpeedup times the multiply-adds per second of float FMAs
//   on               wherever the CPU has AVX512-BF16 (the tests use it, to check the kernel on
//                    every such CPU)
//   off              never: float, as on a CPU without AVX512-BF16
// A CPU may decode VDPBF16PS and still run it slower than float: on an Intel Xeon of family 6 model
// 207 (Emerald Rapids, its AMX hidden by the hypervisor) it issues at a quarter of FMA's rate, so
// its two multiply-adds a lane come to half of FMA's one, and bfloat16 training ran slower than
// float32 (bench/README.md, "bfloat16 where VDPBF16PS is slow"). On Zen 4 and Zen 5 the bfloat16
// products ran faster than float's, as a rate above FMA's must.
enum class CpuBf16Setting { Auto, On, Off };

// The setting a value of TESSERA_CPU_BF16 asks for; `where` names the variable in the error.
inline CpuBf16Setting parse_cpu_bf16_setting(const std::string& value, const std::string& where) {
  if (value.empty() || value == "auto") return CpuBf16Setting::Auto;
  if (value == "on") return CpuBf16Setting::On;
  if (value == "off") return CpuBf16Setting::Off;
  throw ArgumentError(where + "='" + value + "' is not a bfloat16 setting: use auto (bfloat16 where it runs faster " +
                      "than float here), on (wherever the CPU has AVX512-BF16) or off (float)");
}

inline constexpr double kBf16MinDotSpeedup = 1.25;

// Auto's rule, apart from the measurement so that it can be tested: AMX, or dot products fast enough.
inline bool cpu_bf16_pays(CpuBf16Setting setting, bool amx, double dot_speedup) {
  if (setting != CpuBf16Setting::Auto) return setting == CpuBf16Setting::On;
  return amx || dot_speedup >= kBf16MinDotSpeedup;
}

#if TESSERA_HAVE_BF16_KERNEL
namespace detail {

// Seconds for `rounds` x 12 independent VDPBF16PS (bf16 == true) or VFMADD231PS on zmm registers:
// 12 chains hide either instruction's latency, so the time is the issue rate. In assembly, so that
// the accumulators stay in registers at any optimization level (at -O1 a C++ loop kept them on the
// stack and timed the stores instead), and zeroed first (garbage could hold denormals, which slow
// FMA down). Both multiply 0.999 (as float; as bfloat16 pairs about 1 and -0.24): no overflow.
__attribute__((target("avx512f,avx512bf16"), noinline)) inline double bf16_rate_probe_seconds(bool bf16,
                                                                                          std::int64_t rounds) {
#define TESSERA_PROBE_ZERO                                                                                 \
  "vxorps %%xmm0, %%xmm0, %%xmm0\n\tvxorps %%xmm1, %%xmm1, %%xmm1\n\tvxorps %%xmm2, %%xmm2, %%xmm2\n\t"     \
  "vxorps %%xmm3, %%xmm3, %%xmm3\n\tvxorps %%xmm4, %%xmm4, %%xmm4\n\tvxorps %%xmm5, %%xmm5, %%xmm5\n\t"     \
  "vxorps %%xmm6, %%xmm6, %%xmm6\n\tvxorps %%xmm7, %%xmm7, %%xmm7\n\tvxorps %%xmm8, %%xmm8, %%xmm8\n\t"     \
  "vxorps %%xmm9, %%xmm9, %%xmm9\n\tvxorps %%xmm10, %%xmm10, %%xmm10\n\tvxorps %%xmm11, %%xmm11, %%xmm11\n\t"
#define TESSERA_PROBE_12(OP)                                                                                  \
  OP " %[x], %[x], %%zmm0\n\t" OP " %[x], %[x], %%zmm1\n\t" OP " %[x], %[x], %%zmm2\n\t" OP                  \
     " %[x], %[x], %%zmm3\n\t" OP " %[x], %[x], %%zmm4\n\t" OP " %[x], %[x], %%zmm5\n\t" OP " %[x], %[x], %%zmm6\n\t" \
     OP " %[x], %[x], %%zmm7\n\t" OP " %[x], %[x], %%zmm8\n\t" OP " %[x], %[x], %%zmm9\n\t" OP                 \
     " %[x], %[x], %%zmm10\n\t" OP " %[x], %[x], %%zmm11\n\t"
  const __m512 x = _mm512_set1_ps(0.999f);
  std::int64_t n = rounds;
  const auto start = std::chrono::steady_clock::now();
  if (bf16)
    __asm__ volatile(TESSERA_PROBE_ZERO "1:\n\t" TESSERA_PROBE_12("vdpbf16ps") "dec %[n]\n\tjnz 1b"
                     : [n] "+r"(n)
                     : [x] "v"(x)
                     : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
                       "cc");
  else
    __asm__ volatile(TESSERA_PROBE_ZERO "1:\n\t" TESSERA_PROBE_12("vfmadd231ps") "dec %[n]\n\tjnz 1b"
                     : [n] "+r"(n)
                     : [x] "v"(x)
                     : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
                       "cc");
#undef TESSERA_PROBE_12
#undef TESSERA_PROBE_ZERO
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Multiply-adds per second of VDPBF16PS (two per lane) over those of FMA (one per lane) on the
// calling core. Each is timed 7 times, alternating, and its fastest run kept: an interruption only
// lengthens a run, so the minimum is the instruction's rate (the first runs also wake the 512-bit
// units). Its cost, once per process: bench/README.md, "bfloat16 where VDPBF16PS is slow".
inline double bf16_dot_speedup() {
  constexpr std::int64_t kRounds = 20000;  // 240,000 instructions a run
  double fma = 1e30, dot = 1e30;
  for (int run = 0; run < 7; ++run) {
    fma = std::min(fma, bf16_rate_probe_seconds(false, kRounds));
    dot = std::min(dot, bf16_rate_probe_seconds(true, kRounds));
  }
  return 2.0 * fma / dot;
}

}  // namespace detail
#endif

// TESSERA_CPU_BF16, read once (a bad value ends the program when it starts, as
// TESSERA_CPU_CAPABILITY's does).
inline CpuBf16Setting cpu_bf16_setting() {
  static const CpuBf16Setting setting = [] {
    const char* value = std::getenv("TESSERA_CPU_BF16");
    return value == nullptr ? CpuBf16Setting::Auto : parse_cpu_bf16_setting(value, "TESSERA_CPU_BF16");
  }();
  return setting;
}

namespace detail {
inline const CpuBf16Setting cpu_bf16_setting_at_start = setting_or_exit([] { return cpu_bf16_setting(); });

// VDPBF16PS's rate over FMA's on this CPU (bf16_dot_speedup), measured once, on first use; 0 where
// the CPU has no AVX512-BF16.
inline double cpu_bf16_dot_speedup_measured() {
#if TESSERA_HAVE_BF16_KERNEL
  static const double speedup = cpu_has_avx512_bf16() ? bf16_dot_speedup() : 0.0;
  return speedup;
#else
  return 0.0;
#endif
}

// Whether bfloat16 products pay here (cpu_bf16_pays under the process's setting), decided once.
// Asked on every gemm_bf16 call: the measurement runs on the first, and only where the CPU has
// AVX512-BF16, the setting is auto and there is no AMX.
inline bool cpu_bf16_pays_here() {
  static const bool pays = [] {
    if (!cpu_has_avx512_bf16()) return false;
    const CpuBf16Setting setting = cpu_bf16_setting();
    const bool amx = onednn_uses_amx();
    const bool measure = setting == CpuBf16Setting::Auto && !amx;
    return cpu_bf16_pays(setting, amx, measure ? cpu_bf16_dot_speedup_measured() : 0.0);
  }();
  return pays;
}
}  // namespace detail

// True when gemm_bf16 computes in bfloat16 now, false when it falls back to float.
inline bool cpu_bf16_active() {
  return cpu_has_avx512_bf16() && detail::cpu_bf16_enabled_flag().load() && detail::cpu_bf16_pays_here();
}

// What gemm_bf16 runs, for benchmark reports.
inline std::string cpu_bf16_kernel() {
  if (cpu_bf16_active()) {
    const std::string onednn = onednn_gemm_report();
    return onednn.empty() ? "AVX512-BF16 VDPBF16PS, float accumulation"
                          : onednn + ", AVX512-BF16 VDPBF16PS for the rest, float accumulation";
  }
  if (cpu_has_avx512_bf16() && !detail::cpu_bf16_pays_here()) {
    if (cpu_bf16_setting() == CpuBf16Setting::Off) return "float gemm (TESSERA_CPU_BF16=off)";
    char speedup[32];
    std::snprintf(speedup, sizeof speedup, "%.2f", detail::cpu_bf16_dot_speedup_measured());
    return std::string("float gemm (VDPBF16PS does ") + speedup +
           "x float FMA's multiply-adds per second here, no AMX: TESSERA_CPU_BF16=on forces it)";
  }
  if (cpu_has_avx512_bf16()) return "float gemm (bf16 turned off)";
  return cpu_avx512() || cpu_capability_supported() != CpuCapability::Avx512
             ? "float gemm (this CPU has no AVX512-BF16)"
             : std::string("float gemm (TESSERA_CPU_CAPABILITY=") + cpu_capability_name(cpu_capability()) + ")";
}

// float -> bfloat16 bits, round to nearest even; a NaN stays a (quiet) NaN: the scalar reference
// of what VCVTNEPS2BF16 does, for tests and tails (core/half.hpp's, which BHalf also uses).
inline std::uint16_t float_to_bf16_bits(float value) { return detail::float_to_bhalf_bits(value); }
inline float bf16_bits_to_float(std::uint16_t bits) { return detail::bhalf_bits_to_float(bits); }
// The float a value becomes when rounded to bfloat16.
inline float round_to_bf16(float value) { return bf16_bits_to_float(float_to_bf16_bits(value)); }

#if TESSERA_HAVE_BF16_KERNEL
namespace detail {

#define TESSERA_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

inline constexpr std::int64_t kBf16Mr = 8;         // rows of C per micro-tile
inline constexpr std::int64_t kBf16Nr = 48;        // columns of C per micro-tile: 3 registers
inline constexpr std::int64_t kBf16KcPairs = 128;  // k pairs per block: B micro-panel 24 KiB (L1)
inline constexpr std::int64_t kBf16Mc = 96;        // rows of A per block: 48 KiB packed (L2)
inline constexpr std::int64_t kBf16Nc = 1536;      // columns of B per block: 768 KiB packed (L2)

// Element (r, kk) of a matrix read through strides: r is the row of A / the column of B.
struct Bf16Source {
  const float* p;
  std::int64_t stride_r, stride_k;
};

// Packs rows [r0, r0 + rows) x k-range [k0, k0 + kk) of src into panels of `width` rows:
// out[panel][pair][width] words, zero-padded to whole panels and an even k. width is a template
// argument so that the loop over a panel's vectors unrolls (3 for B's 48, 1 for A's 8) with its
// loads in flight together: g++ did that only where it inlined the call, clang nowhere, and the
// packing, bound by those loads, took a larger share of a bfloat16 ResNet-50 step under clang
// (docs/testing.md, "clang++ is the build's compiler").
template <std::int64_t width>
TESSERA_BF16_TARGET inline void bf16_pack(const Bf16Source& src, std::int64_t r0, std::int64_t rows, std::int64_t k0,
                                          std::int64_t kk, std::uint32_t* out) {
  const std::int64_t pairs = (kk + 1) / 2, panels = (rows + width - 1) / width;
  if (src.stride_r == 1) {
    // Rows contiguous (B stored (k, n), or A stored transposed): 16 rows of one k at a time,
    // rounded by VCVTNEPS2BF16 and interleaved with the next k as (low, high) halves.
    for (std::int64_t panel = 0; panel < panels; ++panel) {
      const std::int64_t pr = panel * width, live = std::min(width, rows - pr);
      std::uint32_t* dst = out + panel * pairs * width;
      for (std::int64_t p = 0; p < pairs; ++p) {
        const float* even = src.p + (k0 + 2 * p) * src.stride_k + r0 + pr;
        const bool has_odd = 2 * p + 1 < kk;
        for (std::int64_t v = 0; v < width; v += 16) {  // width: 48 (B) or 8 (A), so a store may be partial
          const __mmask16 m = lanes16(live - v), slots = lanes16(width - v);
          const __m512 lo = _mm512_maskz_loadu_ps(m, even + v);
          const __m512 hi = has_odd ? _mm512_maskz_loadu_ps(m, even + src.stride_k + v) : _mm512_setzero_ps();
          const __m512i lo16 = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(lo)));
          const __m512i hi16 = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(hi)));
          _mm512_mask_storeu_epi32(dst + p * width + v, slots, _mm512_or_si512(lo16, _mm512_slli_epi32(hi16, 16)));
        }
      }
    }
    return;
  }
  // k contiguous per row (A stored (m, k), or B stored transposed): a row's pairs are adjacent
  // already; 32 values of a row round to 16 words (VCVTNE2PS2BF16). 16 rows x 16 pairs are
  // turned in registers (transpose16) into 16 pairs x 16 rows, stored whole: one 16-row store in a
  // B panel (width 48), two 8-row halves into two A panels (width 8).
  const std::int64_t padded_rows = panels * width;
  for (std::int64_t q0 = 0; q0 < padded_rows; q0 += 16) {
    for (std::int64_t p0 = 0; p0 < pairs; p0 += 16) {
      const std::int64_t left = kk - 2 * p0;  // values of each row still to read (> 0)
      const __mmask16 m0 = lanes16(left), m1 = lanes16(left - 16);
      __m512i w[16];
      for (int i = 0; i < 16; ++i) {
        if (q0 + i >= rows) {
          w[i] = _mm512_setzero_si512();
          continue;
        }
        const float* row = src.p + (r0 + q0 + i) * src.stride_r + k0 + 2 * p0;
        const __m512 x0 = _mm512_maskz_loadu_ps(m0, row), x1 = _mm512_maskz_loadu_ps(m1, row + 16);
        w[i] = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(x1, x0));
      }
      transpose16(w);  // w[j]: pair p0 + j of rows q0 .. q0 + 15
      const std::int64_t count = std::min<std::int64_t>(16, pairs - p0);
      for (std::int64_t j = 0; j < count; ++j) {
        const std::int64_t p = p0 + j;
        if constexpr (width % 16 == 0) {
          _mm512_storeu_si512(out + (q0 / width) * pairs * width + p * width + q0 % width, w[j]);
        } else {  // width 8: rows q0 .. q0 + 7 and q0 + 8 .. q0 + 15 are two panels
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (q0 / 8) * pairs * 8 + p * 8),
                              _mm512_castsi512_si256(w[j]));
          if (q0 + 8 < padded_rows)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (q0 / 8 + 1) * pairs * 8 + p * 8),
                                _mm512_extracti64x4_epi64(w[j], 1));
        }
      }
    }
  }
}

// C tile (mr <= kMr rows, nr <= 16 NV columns, row stride ldc) += alpha * A panel x B panel.
// NV < 3 for the last, narrower panel of C: a 49-column C is one full tile and one of NV = 1,
// rather than two full ones (which made 512 x 49 products slower than float).
template <int NV>
TESSERA_BF16_TARGET inline void bf16_micro_kernel(std::int64_t pairs, const std::uint32_t* a, const std::uint32_t* b,
                                                  float alpha, float* c, std::int64_t ldc, std::int64_t mr,
                                                  std::int64_t nr) {
  __m512 acc[kBf16Mr][NV];
#pragma GCC unroll 8
  for (int i = 0; i < kBf16Mr; ++i)
#pragma GCC unroll 3
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
  for (std::int64_t p = 0; p < pairs; ++p) {
    __m512bh bv[NV];
#pragma GCC unroll 3
    for (int j = 0; j < NV; ++j) bv[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + p * kBf16Nr + 16 * j));
#pragma GCC unroll 8
    for (int i = 0; i < kBf16Mr; ++i) {
      const __m512bh ai = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(a[p * kBf16Mr + i])));
#pragma GCC unroll 3
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], ai, bv[j]);
    }
  }
  const __m512 va = _mm512_set1_ps(alpha);
  __mmask16 masks[NV];
  for (int j = 0; j < NV; ++j) masks[j] = lanes16(nr - 16 * j);
#pragma GCC unroll 8
  for (int i = 0; i < kBf16Mr; ++i) {
    if (i >= mr) break;
    float* row = c + i * ldc;
#pragma GCC unroll 3
    for (int j = 0; j < NV; ++j) {
      const __m512 old = _mm512_maskz_loadu_ps(masks[j], row + 16 * j);
      _mm512_mask_storeu_ps(row + 16 * j, masks[j], _mm512_fmadd_ps(va, acc[i][j], old));
    }
  }
}

// One thread's packing buffers; they only grow, so a steady state allocates nothing.
struct Bf16Workspace {
  Tensor<float> packed_a, packed_b;  // raw 32-bit words, stored in float tensors (same size and alignment)
  static Bf16Workspace& local() {
    thread_local Bf16Workspace workspace;
    return workspace;
  }
};

// C += alpha op(A) op(B) on the calling thread.
TESSERA_BF16_TARGET inline void gemm_bf16_serial(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n,
                                                 std::int64_t k, float alpha, const float* a, std::int64_t lda,
                                                 const float* b, std::int64_t ldb, float* c, std::int64_t ldc) {
  const Bf16Source sa{a, trans_a ? 1 : lda, trans_a ? lda : 1};
  const Bf16Source sb{b, trans_b ? ldb : 1, trans_b ? 1 : ldb};
  auto& ws = Bf16Workspace::local();
  const std::int64_t nc_max = std::min(kBf16Nc, (n + kBf16Nr - 1) / kBf16Nr * kBf16Nr);
  const std::int64_t mc_max = std::min(kBf16Mc, (m + kBf16Mr - 1) / kBf16Mr * kBf16Mr);
  const std::int64_t kc_pairs_max = std::min(kBf16KcPairs, (k + 1) / 2);
  if (ws.packed_b.numel() < nc_max * kc_pairs_max) ws.packed_b.resize({nc_max * kc_pairs_max});
  if (ws.packed_a.numel() < mc_max * kc_pairs_max) ws.packed_a.resize({mc_max * kc_pairs_max});
  auto* pb = reinterpret_cast<std::uint32_t*>(ws.packed_b.data());
  auto* pa = reinterpret_cast<std::uint32_t*>(ws.packed_a.data());
  for (std::int64_t jc = 0; jc < n; jc += kBf16Nc) {
    const std::int64_t nc = std::min(kBf16Nc, n - jc);
    for (std::int64_t pc = 0; pc < k; pc += 2 * kBf16KcPairs) {
      const std::int64_t kc = std::min(2 * kBf16KcPairs, k - pc), pairs = (kc + 1) / 2;
      bf16_pack<kBf16Nr>(sb, jc, nc, pc, kc, pb);
      for (std::int64_t ic = 0; ic < m; ic += kBf16Mc) {
        const std::int64_t mc = std::min(kBf16Mc, m - ic);
        bf16_pack<kBf16Mr>(sa, ic, mc, pc, kc, pa);
        for (std::int64_t jr = 0; jr < nc; jr += kBf16Nr) {
          const std::int64_t nr = std::min(kBf16Nr, nc - jr);
          const auto kernel = nr > 32 ? bf16_micro_kernel<3> : nr > 16 ? bf16_micro_kernel<2> : bf16_micro_kernel<1>;
          for (std::int64_t ir = 0; ir < mc; ir += kBf16Mr)
            kernel(pairs, pa + ir * pairs, pb + jr * pairs, alpha, c + (ic + ir) * ldc + jc + jr, ldc,
                   std::min(kBf16Mr, mc - ir), nr);
        }
      }
    }
  }
}

#undef TESSERA_BF16_TARGET

}  // namespace detail
#endif  // TESSERA_HAVE_BF16_KERNEL

inline void gemm_bf16(Cpu, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                      const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
                      std::int64_t ldc) {
#if defined(TESSERA_OPENBLAS)
  detail::openblas_single_threaded();  // the idle pool's polling, as gemm's (kernels/cpu/gemm.hpp)
#endif
#if TESSERA_HAVE_BF16_KERNEL
  if (cpu_bf16_active()) {
    // oneDNN's matmul where onednn_gemm_chosen says (AMX tiles), unless it has no kernel for this one.
    if (onednn_gemm_chosen(m, n, k) &&
        onednn_gemm_bf16(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc))
      return;
    detail::gemm_split(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, detail::gemm_bf16_serial);
    return;
  }
#endif
  gemm(Cpu{}, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace tessera

TESSERA_SIMD_CODE_END
