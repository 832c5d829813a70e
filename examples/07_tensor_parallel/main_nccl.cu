// The GPU build of example 07 from the same source (main.cpp), compiled by nvcc: the MLP's layers
// split over one GPU per rank, the activations' all-gathers and all-reduces over NCCL.
#define TESSERA_EXAMPLE_NCCL 1
#include "main.cpp"
