// The precompiled header shared by the build's programs (src/pch/meson.build): everything that
// tessera/tessera.hpp includes, parsed once per build instead of once per program. Nothing here
// depends on a program's backend define pair (tessera/build_env.hpp stays out), so one header
// serves every CPU backend's examples and tests. (No #pragma once: a header compiled on its own
// is a main file, and the programs include it once, first, with -include.)

#include "tessera/tessera.hpp"
