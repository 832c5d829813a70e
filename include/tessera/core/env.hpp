// Env<Device, Comm, Scalar>: the one policy bundle every layer, loss, optimizer and model takes.
//
// Plain layers read only Device and Scalar; Comm is used by the strategy wrappers and comm-aware
// layers. Named aliases (CpuLocal, CpuLocal64, and per backend CpuMpi, CpuGloo, ...) live next to
// each communicator so that a backend stays entirely in its own header.
#pragma once

#include <type_traits>

#include "tessera/core/concepts.hpp"

namespace tessera {

template <Device D, class C, class S = float>
struct Env {
  static_assert(std::is_floating_point_v<S>, "Env<Device, Comm, Scalar>: Scalar must be float or double");
  using Device = D;
  using Comm = C;
  using Scalar = S;
};

}  // namespace tessera
