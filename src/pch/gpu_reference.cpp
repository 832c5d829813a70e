// Never compiled: the GPU programs' reference (reference.cpp says why), with their dependencies.
#include "tessera_gpu_pch.hpp"

int main() { return 0; }
