// Prints how many CUDA devices this process sees (0 without a GPU or driver): the probe that
// tests/cuda/if_gpus.sh uses to skip (exit 77) GPU tests that need more devices than there are.
// The runtime alone (not tessera's headers): the probe must build and run fast.
#include <cuda_runtime.h>

#include <cstdio>

int main() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  std::printf("%d\n", n);
}
