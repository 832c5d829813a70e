// Never compiled: the timed programs' reference (reference.cpp says why), at the project's
// optimization level.
#include "tessera_timed_pch.hpp"

int main() { return 0; }
