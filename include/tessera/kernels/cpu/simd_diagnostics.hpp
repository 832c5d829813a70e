// TESSERA_SIMD_CODE_BEGIN / TESSERA_SIMD_CODE_END: around the headers that use AVX-512 intrinsics,
// and <immintrin.h> itself, included here first.
//
// GCC 12's intrinsics headers initialise their "undefined" vectors from themselves
// (`__m512 __Y = __Y;` in avx512fintrin.h), and once inlined into Tessera's kernels that trips
// -Wmaybe-uninitialized about 200 times per program (GCC bug 105593, fixed in GCC 13); at -O2, where
// Eigen's transposes inline them too, it reports the same as -Wuninitialized. The
// warning is reported in the intrinsics header even when Tessera is on the system include path,
// so a consumer building with -Wall -Wextra -Werror would fail on code that is correct.
// Pragmas apply by source location: the warnings inlined into Tessera's kernels are silenced by
// the region around those headers, and the ones GCC reports inside the intrinsics headers
// themselves (Eigen's AVX-512 packets, about 130) by including <immintrin.h> inside a region, here,
// before Eigen does (kernels/cpu/gemm.hpp includes this header first). GCC 13 and later, and
// clang, see no pragma.
#pragma once

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#define TESSERA_SIMD_CODE_BEGIN                                                                \
  _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"") \
      _Pragma("GCC diagnostic ignored \"-Wuninitialized\"")
#define TESSERA_SIMD_CODE_END _Pragma("GCC diagnostic pop")
#else
#define TESSERA_SIMD_CODE_BEGIN
#define TESSERA_SIMD_CODE_END
#endif

#if defined(__x86_64__) || defined(__i386__)
TESSERA_SIMD_CODE_BEGIN
#include <immintrin.h>
TESSERA_SIMD_CODE_END
#endif
