// The GPU builds of example 08 from the same source as the CPU ones (main.cpp), compiled by nvcc:
// 08_resnet50_cuda (one GPU, CudaLocal) and, with -DTESSERA_EXAMPLE_NCCL, 08_resnet50_nccl (one
// process per GPU, gradients and pipeline activations over NCCL).
#define TESSERA_EXAMPLE_CUDA 1
#include "main.cpp"
