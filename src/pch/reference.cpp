// Never compiled: its compile command in compile_commands.json, which meson writes with the
// options of the programs that use the precompiled header, is the one the header is compiled with
// (src/pch/meson.build).
#include "tessera_pch.hpp"

int main() { return 0; }
