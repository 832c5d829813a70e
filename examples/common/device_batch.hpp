// The loader's host batches where the model computes: on the CPU the host tensor itself, on a GPU
// a device copy kept in this object (so it outlives the step, as layer caches point at their
// inputs) and sent through the device's page-locked staging (Cuda::upload). The examples' GPU
// builds use it in place of `batch.images`.
#pragma once

#include <type_traits>

#include "tessera/core/tensor.hpp"

namespace examples {

template <class Device>
class DeviceBatch {
 public:
  template <class Host>  // a template, so that the branch not taken is never compiled
  const tessera::Tensor<float, Device>& operator()(const tessera::Tensor<float, Host>& host) {
    if constexpr (std::is_same_v<Device, Host>) {
      return host;
    } else {
      device_.resize(host.shape());
      Device::upload(device_.data(), host.data(), host.bytes());
      return device_;
    }
  }

 private:
  tessera::Tensor<float, Device> device_;
};

}  // namespace examples
