// CachingAllocator: keeps freed blocks in size classes and hands them out again, so that a
// training step that frees and re-requests the same sizes as the step before touches the system
// allocator zero times (the same idea as PyTorch's CUDA caching allocator, here for host memory).
//
// Size classes are powers of two from 64 bytes up, so a request wastes at most half its block;
// blocks are 64-byte aligned (one cache line, enough for AVX-512 loads).
// Thread-safe: the data loader's prefetch thread allocates while the training thread does.
// The memory behind it is a policy (Backing: allocate(bytes) -> pointer or nullptr, release(p)),
// so the same caching serves host memory here and device memory in device/cuda.cuh.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdlib>
#include <mutex>
#include <new>
#include <vector>

#include "tessera/core/error.hpp"

namespace tessera {

struct AllocatorStats {
  std::size_t system_allocations = 0;  // calls that reached the backing memory (aligned_alloc, cudaMalloc)
  std::size_t cache_hits = 0;          // requests served from a free list
  std::size_t bytes_in_use = 0;        // handed out and not yet returned
  std::size_t bytes_cached = 0;        // held in free lists
  std::size_t peak_bytes_in_use = 0;   // the most bytes_in_use since construction or reset_peak()
};

// Host memory, 64-byte aligned.
struct HostMemory {
  static constexpr const char* kName = "host";
  static void* allocate(std::size_t bytes) noexcept { return std::aligned_alloc(64, bytes); }
  static void release(void* p) noexcept { std::free(p); }
};

template <class Backing>
class BasicCachingAllocator {
 public:
  static constexpr std::size_t kAlignment = 64;

  BasicCachingAllocator() = default;
  BasicCachingAllocator(const BasicCachingAllocator&) = delete;
  BasicCachingAllocator& operator=(const BasicCachingAllocator&) = delete;
  ~BasicCachingAllocator() { release_cached(); }

  void* allocate(std::size_t bytes) {
    if (bytes == 0) return nullptr;
    TESSERA_CHECK(bytes <= (std::size_t{1} << 62), Error, "CachingAllocator: request of ", bytes,
                  " bytes is larger than any machine's memory (corrupt shape?)");
    const int cls = size_class(bytes);
    const std::size_t block = std::size_t{1} << cls;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& list = free_[static_cast<std::size_t>(cls)];
      stats_.bytes_in_use += block;
      stats_.peak_bytes_in_use = std::max(stats_.peak_bytes_in_use, stats_.bytes_in_use);
      if (!list.empty()) {
        void* p = list.back();
        list.pop_back();
        stats_.cache_hits++;
        stats_.bytes_cached -= block;
        return p;
      }
      stats_.system_allocations++;
    }
    void* p = Backing::allocate(block);
    if (p == nullptr) {
      release_cached();  // memory may be sitting in other size classes: give it back and retry once
      p = Backing::allocate(block);
    }
    if (p == nullptr) {
      std::lock_guard<std::mutex> lock(mutex_);
      stats_.bytes_in_use -= block;
      throw Error(detail::cat("CachingAllocator: out of ", Backing::kName, " memory allocating ", block, " bytes (",
                              stats_.bytes_in_use, " bytes in use)"));
    }
    return p;
  }

  // `bytes` must be the size passed to allocate() for p.
  void deallocate(void* p, std::size_t bytes) noexcept {
    if (p == nullptr) return;
    const int cls = size_class(bytes);
    const std::size_t block = std::size_t{1} << cls;
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.bytes_in_use -= block;
    stats_.bytes_cached += block;
    try {
      free_[static_cast<std::size_t>(cls)].push_back(p);
    } catch (...) {  // the free list could not grow: return the block to the system instead
      stats_.bytes_cached -= block;
      Backing::release(p);
    }
  }

  // Returns every cached block to the system (e.g. between phases with different shapes).
  void release_cached() noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& list : free_) {
      for (void* p : list) Backing::release(p);
      list.clear();
    }
    stats_.bytes_cached = 0;
  }

  // Starts a new high-water mark at the current use (to measure one phase, e.g. a training step).
  void reset_peak() noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.peak_bytes_in_use = stats_.bytes_in_use;
  }

  AllocatorStats stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

 private:
  static int size_class(std::size_t bytes) {
    const std::size_t rounded = std::bit_ceil(bytes < kAlignment ? kAlignment : bytes);
    return std::countr_zero(rounded);
  }

  mutable std::mutex mutex_;
  std::array<std::vector<void*>, 64> free_{};
  AllocatorStats stats_{};
};

using CachingAllocator = BasicCachingAllocator<HostMemory>;

}  // namespace tessera
