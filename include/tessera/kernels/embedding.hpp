// Embedding kernels for every device. Only the CPU ones (kernels/cpu/embedding.hpp) exist so
// far: a layer that calls them does not compile for the Cuda device yet.
#pragma once

#include "tessera/kernels/cpu/embedding.hpp"
