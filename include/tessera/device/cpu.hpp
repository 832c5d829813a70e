// Cpu: the host device. Memory comes from one process-wide CachingAllocator; parallel kernels use
// OpenMP threads (Eigen's matrix products use the same OpenMP team), settable at run time.
//
// Contract (the Device concept): allocate/deallocate raw bytes, copy between two buffers of this
// device, copy_to_device/copy_to_host between it and ordinary host memory (plain copies here;
// asynchronous on a GPU), synchronize() returns when all work on the device is done (on the CPU
// it always is). host_accessible says whether the host may dereference the device's pointers.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "tessera/core/allocator.hpp"
#include "tessera/core/error.hpp"

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

  // How long a thread of an OpenMP team that has nothing to do spins before it sleeps, in
  // milliseconds (0: it sleeps at once), for every thread of the process from now on; the
  // environment's KMP_BLOCKTIME does the same from the start. Spinning starts the next parallel
  // region sooner; sleeping gives the core back. LLVM's runtime (libomp, the clang build's) spins
  // by default far longer than the gaps between a step's regions, at every barrier and after
  // every region. On a VM whose vCPUs the host rations, that spin spends the ration while the
  // other thread still works, and the host then stops the vCPUs for whole accounting periods:
  // there a short spin helped ResNet-50 at two threads, and hurt the MLP and LeNet-5, whose
  // steps are many short regions (their sleeping threads wake late). So the default stays the
  // runtime's, and the benchmarks try both (bench/README.md, "Idle threads that spin"). Applies
  // through LLVM's and Intel's runtimes (kmp_set_defaults, which reaches threads started later as
  // well) and returns true there; GCC's libgomp reads its policy from the environment only
  // (OMP_WAIT_POLICY, GOMP_SPINCOUNT), and this returns false.
  static bool set_idle_spin_ms(int ms) {
    TESSERA_CHECK(ms >= 0, ArgumentError, "Cpu::set_idle_spin_ms: ms=", ms, " must be >= 0");
#if defined(_OPENMP) && defined(KMP_VERSION_MAJOR)
    char setting[40];
    std::snprintf(setting, sizeof setting, "KMP_BLOCKTIME=%d", ms);
    kmp_set_defaults(setting);
    return true;
#else
    return false;
#endif
  }
  // The calling thread's current setting, or -1 where the runtime does not say (libgomp, no OpenMP).
  static int idle_spin_ms() {
#if defined(_OPENMP) && defined(KMP_VERSION_MAJOR)
    return kmp_get_blocktime();
#else
    return -1;
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

// body(i) for i in [0, n), as `#pragma omp for schedule(static)` runs it: inside a team, this
// thread's contiguous share (team_share) and then a barrier unless `nowait`; outside one, all of
// it. Written out instead of `omp for` because LLVM's libomp 14 as Debian builds it formats a debug
// string (malloc, vsnprintf, free) three times per thread at the start of every `omp for` loop:
// 220 heap allocations per ResNet-50 inference forward at batch 8, where a steady step must make
// none (bench/README.md, "Inference and training memory").
template <class Body>
void static_for(std::int64_t n, const Body& body, bool nowait = false) {
  std::int64_t begin, end;
  team_share(n, begin, end);
  for (std::int64_t i = begin; i < end; ++i) body(i);
  if (!nowait && Cpu::team_size() > 1) {
#pragma omp barrier
  }
}

// The items of a loop that the threads of a team take one at a time, as `#pragma omp for
// schedule(dynamic, 1)` hands them out, written out for the same reason as static_for: libomp 14
// allocates at the start of every `omp for` loop (225 heap allocations per attention forward +
// backward at 2 threads, 12 heads). Made outside the region and shared by the team; each thread
// runs `for (i = items.first(); i < n; i = items.next())`. Thread t's first item is t, then each
// takes the next one no thread has: so with at least as many items as threads every thread works
// in every call, and its per-thread state (scratch, gemm workspaces) is made in the first call
// rather than in whichever later one a slow-to-wake thread first gets an item. No barrier at the
// end. Outside a team: 0, 1, 2, ...
class DynamicItems {
 public:
  std::int64_t first() const { return Cpu::thread_index(); }
  std::int64_t next() { return Cpu::team_size() + taken_.fetch_add(1, std::memory_order_relaxed); }

 private:
  std::atomic<std::int64_t> taken_{0};  // items handed out after each thread's first
};

// The shared state of stealing_for over n items, made outside the parallel region for a team of
// Cpu::num_threads(): each thread's static share, its front and its back (exclusive) packed into
// one word, so that the owner taking from the front and a thief taking from the back can never
// both take the last item.
struct StealRanges {
  static constexpr int kMaxTeam = 64;
  int team;
  std::atomic<std::uint64_t> range[kMaxTeam];
  explicit StealRanges(std::int64_t n) : team(Cpu::num_threads()) {
    if (team > kMaxTeam || n >= (std::int64_t(1) << 32)) team = 0;  // stealing_for runs static shares
    for (int t = 0; t < team; ++t)
      range[t].store((std::uint64_t(n * t / team) << 32) | std::uint64_t(n * (t + 1) / team), std::memory_order_relaxed);
  }
  // Item `front` (or `back - 1`) of thread t's range, which is taken; -1 once the range is empty.
  std::int64_t take(int t, bool from_front) {
    std::uint64_t v = range[t].load(std::memory_order_relaxed);
    for (;;) {
      const std::uint64_t front = v >> 32, back = v & 0xffffffffu;
      if (front >= back) return -1;
      const std::uint64_t next = from_front ? ((front + 1) << 32) | back : (front << 32) | (back - 1);
      if (range[t].compare_exchange_weak(v, next, std::memory_order_relaxed))
        return static_cast<std::int64_t>(from_front ? front : back - 1);
    }
  }
};

// body(i) for the n items of `ranges` on every thread of a team (no barrier at the end): each thread
// runs its static_for share front to back, then takes items from the back of the others' shares
// until none is left. For items that may run on any thread, in any order: the cores of a
// shared machine do not run at the same speed (interrupts, other tenants; which one is slower
// changes from start to start), and a static split leaves the faster one waiting at the next
// barrier (figures in bench/README.md, "Work stealing for independent blocks"). Outside a team,
// or in a team of another size than the ranges were made for: static_for without its barrier.
template <class Body>
void stealing_for(StealRanges& ranges, std::int64_t n, const Body& body) {
  const int team = Cpu::team_size(), t = Cpu::thread_index();
  if (team == 1 || team != ranges.team) return static_for(n, body, true);
  for (std::int64_t i = ranges.take(t, true); i >= 0; i = ranges.take(t, true)) body(i);
  for (int k = 1; k < team; ++k) {
    const int victim = (t + k) % team;
    for (std::int64_t i = ranges.take(victim, false); i >= 0; i = ranges.take(victim, false)) body(i);
  }
}

// Whether a `parallel if (parallel)` loop over n items opens a team here: only outside any team
// and with more than one thread. Otherwise the helpers below make no OpenMP call at all (an
// inactive `parallel if (false)` region costs a runtime call and, in libomp, an allocation).
inline bool opens_team(std::int64_t n, bool parallel) {
#if defined(_OPENMP)
  return parallel && n > 1 && !omp_in_parallel() && omp_get_max_threads() > 1;
#else
  (void)n, (void)parallel;
  return false;
#endif
}

// run(begin, end) over contiguous shares of [0, n): one per thread of a new team when
// opens_team(n, parallel), else [0, n) on this thread.
template <class Run>
void parallel_ranges(std::int64_t n, bool parallel, const Run& run) {
  if (opens_team(n, parallel)) {
#pragma omp parallel
    {
      std::int64_t begin, end;
      team_share(n, begin, end);
      run(begin, end);
    }
    return;
  }
  run(std::int64_t{0}, n);
}

// body(i) for i in [0, n), as `#pragma omp parallel for schedule(static) if (parallel)` runs it,
// without the runtime's loop start (static_for).
template <class Body>
void parallel_for(std::int64_t n, bool parallel, const Body& body) {
  parallel_ranges(n, parallel, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) body(i);
  });
}

// parallel_for whose loops the compiler vectorizes (`omp simd`): as `#pragma omp parallel for simd
// schedule(static) if (parallel)`; body(i) must be independent across i.
template <class Body>
void parallel_for_simd(std::int64_t n, bool parallel, const Body& body) {
  parallel_ranges(n, parallel, [&](std::int64_t begin, std::int64_t end) {
#pragma omp simd
    for (std::int64_t i = begin; i < end; ++i) body(i);
  });
}

// The sum over i in [0, n) of part(begin, end), the partial sum of a contiguous range, as
// `#pragma omp parallel for reduction(+ : total) schedule(static) if (parallel)` computes it
// (each thread one range, the partial sums then added) without the runtime's loop start.
template <class T, class Part>
T parallel_sum(std::int64_t n, bool parallel, const Part& part) {
  if (!opens_team(n, parallel)) return part(std::int64_t{0}, n);
  T total = T(0);
#pragma omp parallel reduction(+ : total)
  {
    std::int64_t begin, end;
    team_share(n, begin, end);
    total += part(begin, end);
  }
  return total;
}

// Whether a `#pragma omp parallel` region entered here has a team: more than one thread, or an
// enclosing team (the region then nests as a team of one, which the body's static_for shares rely
// on). At the top level with one thread (OMP_NUM_THREADS=1, --threads=1: one rank per core) it
// has none, and entering it anyway costs a runtime call and, in libomp 14, a heap block for the
// serialized region's dispatch buffer: 113 allocations per ResNet-20 training step and 21 to 33
// per ResNet-50 inference forward, where a steady step must make none
// (tests/bench/check_steady_allocations.py runs at 1 thread too).
inline bool region_has_team() {
#if defined(_OPENMP)
  return omp_in_parallel() || omp_get_max_threads() > 1;
#else
  return false;
#endif
}

// body() on every thread of an OpenMP team when `parallel` and the region has a team
// (region_has_team), else once on this thread outside any region (its static_for loops then run
// whole, as in a team of one). Not `parallel if (...)`: an inactive region of one thread still
// counts as a nesting level, so a gemm inside would open a nested team, for which libgomp starts
// fresh threads every time (each rebuilding its thread_local packing buffers: 32 allocations and
// thread starts per ResNet-50 forward at batch 1). Outside any region the gemm's own team is the
// pooled one.
template <class Body>
void run_in_team_if(bool parallel, const Body& body) {
  if (parallel && region_has_team()) {
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
  // Blocks of 4096 elements per iteration: the inner fill vectorizes (std::fill).
  constexpr std::int64_t kBlock = 4096;
  detail::parallel_for((n + kBlock - 1) / kBlock, n >= (1 << 15), [&](std::int64_t blk) {
    std::fill(p + blk * kBlock, p + std::min(n, (blk + 1) * kBlock), value);
  });
}

}  // namespace tessera
