// Cpu: the host device. Memory comes from one process-wide CachingAllocator; parallel kernels use
// OpenMP threads (Eigen's matrix products use the same OpenMP team), settable at run time.
//
// Contract (the Device concept): allocate/deallocate raw bytes, copy between two buffers of this
// device, copy_to_device/copy_to_host between it and ordinary host memory (plain copies here;
// asynchronous on a GPU), synchronize() returns when all work on the device is done (on the CPU
// it always is). host_accessible says whether the host may dereference the device's pointers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string_view>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "tessera/core/allocator.hpp"

namespace tessera {

struct Cpu {
  static constexpr std::string_view name = "cpu";
  static constexpr bool host_accessible = true;

  // Deliberately never destroyed (as PyTorch's allocators): tensors with static or thread
  // storage may be freed after every function-local static is gone.
  // TESSERA_MEMORY_LIMIT ("512M", "2G") sets its limit (BasicCachingAllocator::set_limit).
  static CachingAllocator& allocator() {
    static CachingAllocator* instance = [] {
      auto* a = new CachingAllocator;
      if (const char* limit = std::getenv("TESSERA_MEMORY_LIMIT"); limit != nullptr && *limit != '\0')
        a->set_limit(parse_memory_size(limit, "TESSERA_MEMORY_LIMIT"));
      return a;
    }();
    return *instance;
  }
  static void* allocate(std::size_t bytes) { return allocator().allocate(bytes); }
  static void deallocate(void* p, std::size_t bytes) noexcept { allocator().deallocate(p, bytes); }
  static void copy(void* dst, const void* src, std::size_t bytes) {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  static void copy_to_device(void* dst, const void* host, std::size_t bytes) { copy(dst, host, bytes); }
  static void copy_to_host(void* host, const void* src, std::size_t bytes) { copy(host, src, bytes); }
  // The data loader's path to the device (a GPU stages it through page-locked memory).
  static void upload(void* dst, const void* host, std::size_t bytes) { copy(dst, host, bytes); }
  static void synchronize() {}

  // Threads used by kernels from now on; n <= 0 means "all cores" (OpenMP's default).
  static void set_num_threads(int n) {
#if defined(_OPENMP)
    omp_set_num_threads(n > 0 ? n : omp_get_num_procs());
#else
    (void)n;
#endif
  }
  static int num_threads() {
#if defined(_OPENMP)
    return omp_get_max_threads();
#else
    return 1;
#endif
  }
  // Inside a parallel region: this thread's index and the team's size (0 and 1 outside one).
  static int thread_index() {
#if defined(_OPENMP)
    return omp_get_thread_num();
#else
    return 0;
#endif
  }
  static int team_size() {
#if defined(_OPENMP)
    return omp_get_num_threads();
#else
    return 1;
#endif
  }
};

namespace detail {

// [begin, end) of n items for this thread of the team (all of them outside a team).
inline void team_share(std::int64_t n, std::int64_t& begin, std::int64_t& end) {
  const std::int64_t team = Cpu::team_size(), t = Cpu::thread_index();
  begin = n * t / team;
  end = n * (t + 1) / team;
}

// body() on every thread of an OpenMP team when `parallel`, else once on this thread outside any
// region (its orphaned `omp for` loops then run whole). Not `parallel if (...)`: an inactive
// region of one thread still counts as a nesting level, so a gemm inside would open a nested
// team, for which libgomp starts fresh threads every time (each rebuilding its thread_local
// packing buffers: 32 allocations and thread starts per ResNet-50 forward at batch 1). Outside
// any region the gemm's own team is the pooled one.
template <class Body>
void run_in_team_if(bool parallel, const Body& body) {
  if (parallel) {
#pragma omp parallel
    body();
  } else {
    body();
  }
}

}  // namespace detail

// The one kernel every device must have: Tensor::fill goes through it (a GPU launches a kernel).
// Large fills (a ResNet-50's gradients: 25M elements) are split over the OpenMP team.
template <class S>
void fill_elements(Cpu, S* p, std::int64_t n, S value) {
#pragma omp parallel for simd schedule(static) if (n >= (1 << 15))
  for (std::int64_t i = 0; i < n; ++i) p[i] = value;
}

}  // namespace tessera
