// Which of the hand-written SIMD kernels run, chosen at run time rather than by the compiler's
// -march: a program built for the x86-64 baseline (on a login node, for older compute nodes) runs
// the AVX-512 kernels where the CPU has them, the AVX2 ones where it has AVX2 and FMA only (AMD
// Zen 2 and 3, Intel Haswell to Alder Lake) and the plain loops elsewhere, and one built with
// -march=native runs the same code as before, the check being one predictable branch per call.
//
// Each SIMD kernel is a function of its own under TESSERA_TARGET_AVX512 (GCC/Clang compile that
// function, and only it, for AVX-512F/BW/DQ/VL) or TESSERA_TARGET_AVX2 (AVX2 and FMA), reached
// through `if (cpu_avx512())` or `if (cpu_avx2())` from a caller compiled for whatever the program
// was built for; with -march=native the kernel still inlines into its caller. The capability is the
// best the CPU (and the OS, which must save the wider registers) runs, capped by the environment, as
// ATen's ATEN_CPU_CAPABILITY:
//
//   TESSERA_CPU_CAPABILITY=default   the portable loops only (what an older CPU runs)
//   TESSERA_CPU_CAPABILITY=avx2      AVX2 kernels at most (on an AVX-512 CPU: what a Zen 3 runs)
//   TESSERA_CPU_CAPABILITY=avx512    AVX-512 kernels where the CPU has them (the same as unset)
//
// Read once, when the program starts (a value that is none of these ends it there, naming the
// variable). What stays decided at compile time: the width of the
// compiler's own vectorization, and the Winograd tile vectors (kernels/cpu/winograd.hpp), whose
// layout is the compile-time vector width.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "tessera/core/error.hpp"

// TESSERA_X86_CPU_FEATURES: the CPU can be asked (every TU of a program agrees on the answer).
// TESSERA_X86_DISPATCH: the AVX-512 kernels are compiled here; not in nvcc's passes, whose front
// end sees the host code too (a .cu file's CPU kernels are the plain loops, as before).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TESSERA_X86_CPU_FEATURES 1
#else
#define TESSERA_X86_CPU_FEATURES 0
#endif
#if TESSERA_X86_CPU_FEATURES && !defined(__CUDACC__)
#define TESSERA_X86_DISPATCH 1
#define TESSERA_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
#define TESSERA_TARGET_AVX2 __attribute__((target("avx2,fma")))
#else
#define TESSERA_X86_DISPATCH 0
#define TESSERA_TARGET_AVX512
#define TESSERA_TARGET_AVX2
#endif

namespace tessera {

// In order: each runs the kernels of those before it (an AVX-512 CPU has AVX2 and FMA).
enum class CpuCapability { Default, Avx2, Avx512 };

inline const char* cpu_capability_name(CpuCapability c) {
  return c == CpuCapability::Avx512 ? "avx512" : c == CpuCapability::Avx2 ? "avx2" : "default";
}

// The capability a value of TESSERA_CPU_CAPABILITY asks for; `where` names the variable in the error.
inline CpuCapability parse_cpu_capability(const std::string& value, const std::string& where) {
  if (value == "default") return CpuCapability::Default;
  if (value == "avx2") return CpuCapability::Avx2;
  if (value == "avx512") return CpuCapability::Avx512;
  throw ArgumentError(where + "='" + value + "' is not a CPU capability: use default (portable loops only), " +
                      "avx2 (AVX2 kernels at most) or avx512 (AVX-512 kernels where the CPU has them)");
}

// What this CPU runs: AVX-512 F, BW, DQ and VL, or else AVX2 and FMA, with the OS saving their
// registers (__builtin_cpu_supports checks XGETBV as well as CPUID).
inline CpuCapability cpu_capability_supported() {
#if TESSERA_X86_CPU_FEATURES
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl"))
    return CpuCapability::Avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return CpuCapability::Avx2;
#endif
  return CpuCapability::Default;
}

// The capability the kernels use: the supported one, capped by TESSERA_CPU_CAPABILITY.
inline CpuCapability cpu_capability() {
  static const CpuCapability chosen = [] {
    const CpuCapability supported = cpu_capability_supported();
    const char* cap = std::getenv("TESSERA_CPU_CAPABILITY");
    if (cap == nullptr || *cap == '\0') return supported;
    const CpuCapability asked = parse_cpu_capability(cap, "TESSERA_CPU_CAPABILITY");
    return asked < supported ? asked : supported;
  }();
  return chosen;
}

// The branches in front of the AVX-512 and the AVX2 kernels (true on AVX-512 CPUs too: a caller
// asks for AVX-512 first).
inline bool cpu_avx512() { return cpu_capability() == CpuCapability::Avx512; }
inline bool cpu_avx2() { return cpu_capability() >= CpuCapability::Avx2; }

namespace detail {

// TESSERA_CPU_CAPABILITY is checked when the program starts, not at the first kernel call: that
// call is usually on an OpenMP thread inside a parallel region, where an exception cannot reach
// the caller, and two threads throwing at once ended the program in std::terminate with the
// message cut off ("terminate called recursively"). A bad value ends it here instead, with the
// message an uncaught ArgumentError would print and exit status 2. (TESSERA_CPU_BF16 likewise,
// kernels/cpu/gemm_bf16.hpp.)
template <class ReadSetting>
auto setting_or_exit(ReadSetting read) {
  try {
    return read();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessera: %s\n", e.what());
    std::exit(2);
  }
}
inline const CpuCapability cpu_capability_at_start = setting_or_exit([] { return cpu_capability(); });

}  // namespace detail

}  // namespace tessera
