// Compiled CPU kernels: the float and double instances of the CPU kernels (gemm, conv2d, batch
// norm, pooling, and the elementwise, loss, softmax and optimizer loops; comm/reduce.hpp adds the
// shared-memory reductions) compiled once, in src/kernels_cpu.cpp, instead of in every translation
// unit that includes a layer. The library builds at -O3 and the programs at -O2 (meson.build): a
// training step's time is spent in these instances, so the programs' level does not change it.
//
// Tessera stays header-only: without TESSERA_COMPILED_KERNELS every kernel is an ordinary
// template, instantiated where it is used. The meson build defines TESSERA_COMPILED_KERNELS on
// tessera_dep (option compiled_kernels, default on) and links the library tessera_kernels, which
// defines TESSERA_COMPILING_KERNELS and instantiates each kernel header's list. A user translation
// unit then still parses the kernel bodies but generates no code for them, and does not parse
// Eigen at all (gemm's body is hidden): on ResNet-50's example that is about a quarter of its
// compile time (bench/compile.py).
//
// A kernel header lists its instances once, as a macro over (PREFIX, S), and ends with
// TESSERA_CPU_KERNEL_INSTANCES(list): `extern` declarations in compiled mode, nothing otherwise.
// Other scalar types (none today) would be instantiated implicitly as before, except gemm, whose
// body is not visible in compiled mode and which therefore only takes float and double.
#pragma once

// The mode's macros live in core/linkage.hpp, so that a header below the kernels (comm/reduce.hpp)
// can list its instances too.
#include "tessera/core/linkage.hpp"
