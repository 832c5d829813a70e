// The GPU build of example 06 from the same source (main.cpp), compiled by nvcc: one pipeline
// stage per GPU, activations and gradients between stages over NCCL send/recv.
#define TESSERA_EXAMPLE_NCCL 1
#include "main.cpp"
