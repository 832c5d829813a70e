// Where Tessera's non-template functions are compiled: in every translation unit that includes
// them (header-only use), or once, in the library the meson build links.
//
// Tessera stays header-only: without TESSERA_COMPILED_KERNELS a header defines its functions as
// `inline`, and any program may include it. The meson build defines TESSERA_COMPILED_KERNELS on
// tessera_dep and links tessera_kernels (src/kernels_cpu.cpp), which defines
// TESSERA_COMPILING_KERNELS and includes those headers: there they are ordinary (non-inline)
// definitions, compiled once; every other source of the build sees declarations only. None of
// these functions depends on the Env, so compiling them once per program and backend (the parser,
// the safetensors reader, the flags, the agreement check's text) only repeated the same work.
//
// A header writes
//
//   class Flags { public: Flags(int argc, char** argv); ... };       // declarations
//   #if TESSERA_HEADER_DEFINITIONS
//   TESSERA_LINKAGE Flags::Flags(int argc, char** argv) { ... }      // definitions
//   #endif
//
// and lists its header in src/kernels_cpu.cpp. Templates stay in the class body as before.
#pragma once

#if defined(TESSERA_COMPILING_KERNELS)
#define TESSERA_HEADER_DEFINITIONS 1
#define TESSERA_LINKAGE
#elif defined(TESSERA_COMPILED_KERNELS)
#define TESSERA_HEADER_DEFINITIONS 0
#define TESSERA_LINKAGE
#else
#define TESSERA_HEADER_DEFINITIONS 1
#define TESSERA_LINKAGE inline
#endif

// Explicit instantiations of templates (kernels/cpu/compiled.hpp explains): in compiled mode a
// header's list of instances becomes `extern template` declarations everywhere but in
// src/kernels_cpu.cpp, which defines them.
#if defined(TESSERA_COMPILED_KERNELS) && !defined(TESSERA_COMPILING_KERNELS)
#define TESSERA_CPU_KERNELS_EXTERN 1
#define TESSERA_CPU_KERNEL_INSTANCES(LIST) LIST(extern, float) LIST(extern, double)
#else
#define TESSERA_CPU_KERNELS_EXTERN 0
#define TESSERA_CPU_KERNEL_INSTANCES(LIST)
#endif
