// Scratch memory for the duration of one kernel call (im2col column buffers, per-thread partial
// sums), shared by every layer that runs on the calling thread.
//
// Layers run one after another on a thread, so one buffer sized for the largest request serves
// them all: ResNet-50's convolutions need the maximum of their workspaces instead of the sum
// (about 200 MB less at 2 threads). It is thread_local, so model replicas driven by different
// threads (ThreadComm ranks) never share it. It only grows: steady state allocates nothing.
// Requires: the pointer is used only until the next scratch() call on the same thread.
#pragma once

#include <cstdint>

#include "tessera/core/tensor.hpp"

namespace tessera {

template <class S, class D = Cpu>
S* scratch(std::int64_t elements) {
  thread_local Tensor<S, D> buffer;
  if (buffer.numel() < elements) buffer.resize({elements});
  return buffer.data();
}

}  // namespace tessera
