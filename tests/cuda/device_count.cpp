// Prints how many CUDA devices this process sees (0 without a GPU or driver): the probe that
// tests/cuda/if_gpus.sh uses to skip (exit 77) GPU tests that need more devices than there are.
#include <cstdio>

#include "tessera/device/cuda.cuh"

int main() { std::printf("%d\n", tessera::Cuda::device_count()); }
