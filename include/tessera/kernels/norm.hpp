// LayerNorm and RMSNorm kernels for every device. Only the CPU ones (kernels/cpu/norm.hpp) exist so
// far: a layer that calls them does not compile for the Cuda device yet.
#pragma once

#include "tessera/kernels/cpu/norm.hpp"
