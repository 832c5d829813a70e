// Scaled dot-product attention kernels for every device. Only the CPU ones (kernels/cpu/attention.hpp) exist so
// far: a layer that calls them does not compile for the Cuda device yet.
#pragma once

#include "tessera/kernels/cpu/attention.hpp"
