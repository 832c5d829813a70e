// The conformance suite's buffer policy for GPU communicators (NCCL): each test vector is copied
// to device memory from the Cuda device's cache, the communicator works on the device copy, and
// fetch() copies the result back and waits for it. Copies run on the compute stream, which
// NcclComm orders its collectives after (and its Works before), so no other synchronization is
// needed.
#pragma once

#include <span>
#include <vector>

#include "tessera/device/cuda.cuh"

namespace tessera::testing {

struct DeviceBuffers {
  template <class T>
  class Buffer {
   public:
    explicit Buffer(std::vector<T>& host) : host_(host), bytes_(host.size() * sizeof(T)) {
      if (bytes_ == 0) return;
      device_ = static_cast<T*>(Cuda::allocate(bytes_));
      Cuda::copy_to_device(device_, host_.data(), bytes_);
    }
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    ~Buffer() {
      if (device_ == nullptr) return;
      (void)cudaStreamSynchronize(Cuda::stream());  // nothing in flight still uses the block
      Cuda::deallocate(device_, bytes_);
    }
    std::span<T> span() { return {device_, host_.size()}; }
    void fetch() {
      if (bytes_ == 0) return;
      Cuda::copy_to_host(host_.data(), device_, bytes_);
      Cuda::synchronize();
    }

   private:
    std::vector<T>& host_;
    std::size_t bytes_;
    T* device_ = nullptr;
  };
};

}  // namespace tessera::testing
