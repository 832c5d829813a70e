// The GPU build of example 04 from the same source (main.cpp), compiled by nvcc: one process per
// GPU, LeNet-5 on each, gradients averaged over NCCL.
#define TESSERA_EXAMPLE_NCCL 1
#include "main.cpp"
