// CachingAllocator: keeps freed memory and hands it out again, so that a training step that frees
// and re-requests the same sizes as the step before touches the system allocator zero times (the
// same idea as PyTorch's CUDA caching allocator, here for host memory too).
//
// Two pools:
//  - Small requests (< kLargeBytes, 1 MiB) come in power-of-two size classes from 64 bytes up: a
//    request wastes at most half its block, and a free list per class makes reuse O(1).
//  - Large requests (activations, gradients, workspaces) are rounded to 64 KiB and carved
//    best-fit out of segments; a freed range merges with free neighbours of the same segment.
//    Size classes would not do here: a network frees its activations in one set of sizes while
//    its backward asks for gradients in others, and memory parked in one class cannot serve
//    another, so the footprint becomes the sum of each class's high-water mark instead of the
//    high-water mark of the sum (measured on ResNet-50 b32: 3086 MiB resident against about
//    2640 MiB live). A segment is Backing::kSegmentBytes or the request, if larger: host memory
//    takes 1 GiB segments, whose pages the kernel commits only when touched, so one segment
//    serves a whole network and reuse stays in pages already resident; device memory is committed
//    by cudaMalloc, so its segments are exactly the request (0).
// A limit (set_limit; for the host allocator also the environment variable TESSERA_MEMORY_LIMIT,
// e.g. "512M", "2G") caps the bytes in use: a request that would pass it throws OutOfMemoryError
// naming the request, what it was for (the innermost MemoryScope on the calling thread: "all_gather
// of unit layer2", "backward") and the bytes in use, instead of the process growing until the
// operating system kills it (or a GPU's cudaMalloc fails without saying for what). One process's
// allocator serves all of its ranks when ranks are threads: the limit is then theirs together.
// Blocks are 64-byte aligned (one cache line, enough for AVX-512 loads).
// Thread-safe: the data loader's prefetch thread allocates while the training thread does.
// The memory behind it is a policy (Backing: allocate(bytes) -> pointer or nullptr, release(p),
// kSegmentBytes), so the same caching serves host memory here and device memory in device/cuda.cuh.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#include "tessera/core/error.hpp"
#include "tessera/core/linkage.hpp"

namespace tessera {

// What the calling thread is allocating for, while it lives (nested scopes: the innermost
// speaks): the allocator's out-of-memory error quotes it. A pointer store on construction and
// destruction: cheap enough around every phase of a step. `what` must outlive the scope.
class MemoryScope {
 public:
  explicit MemoryScope(const char* what) noexcept : outer_(innermost()) { innermost() = what; }
  MemoryScope(const MemoryScope&) = delete;
  MemoryScope& operator=(const MemoryScope&) = delete;
  ~MemoryScope() { innermost() = outer_; }
  // The innermost scope's text on this thread, or nullptr.
  static const char* current() noexcept { return innermost(); }

 private:
  static const char*& innermost() noexcept {
    thread_local const char* what = nullptr;
    return what;
  }
  const char* outer_;
};

// "1.5 GiB", "12.0 MiB", "640 B": byte counts in error texts.
inline std::string format_bytes(std::size_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  char text[32];
  std::snprintf(text, sizeof text, u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
  return text;
}

// Parses a memory size: a number of bytes with an optional suffix K, M, G or T (powers of 1024;
// "KiB", "MB" and the like read the same), e.g. "512M", "1.5G", "1048576". Throws ArgumentError
// naming `what` (where the text came from) otherwise.
inline std::size_t parse_memory_size(const std::string& text, const char* what) {
  std::size_t used = 0;
  double value = -1;
  try {
    value = std::stod(text, &used);
  } catch (...) {
    used = 0;
  }
  std::string suffix = text.substr(used);
  for (char& c : suffix) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double scale = 0;
  for (const auto& [name, factor] : {std::pair<const char*, double>{"", 1}, {"B", 1}, {"K", 0x1p10}, {"KB", 0x1p10},
                                     {"KIB", 0x1p10}, {"M", 0x1p20}, {"MB", 0x1p20}, {"MIB", 0x1p20}, {"G", 0x1p30},
                                     {"GB", 0x1p30}, {"GIB", 0x1p30}, {"T", 0x1p40}, {"TB", 0x1p40}, {"TIB", 0x1p40}})
    if (suffix == name) scale = factor;
  TESSERA_CHECK(used > 0 && value >= 0 && scale > 0 && value * scale < 0x1p62, ArgumentError, what, ": '", text,
                "' is not a memory size (bytes, or a number with K, M, G or T: 512M, 1.5G)");
  return static_cast<std::size_t>(value * scale);
}

struct AllocatorStats {
  std::size_t system_allocations = 0;  // calls that reached the backing memory (aligned_alloc, cudaMalloc)
  std::size_t cache_hits = 0;          // requests served from a free list
  std::size_t bytes_in_use = 0;        // handed out and not yet returned
  std::size_t bytes_cached = 0;        // held and not in use (a host segment's untouched rest included)
  std::size_t peak_bytes_in_use = 0;   // the most bytes_in_use since construction or reset_peak()
  // The same two for the bytes callers asked for, before rounding to a block (PyTorch's
  // memory_stats "requested_bytes"): what a formula counting tensor sizes predicts.
  std::size_t requested_bytes_in_use = 0;
  std::size_t peak_requested_bytes_in_use = 0;
};

// Host memory, 64-byte aligned; blocks of 2 MiB and more (the segments) 2 MiB aligned and marked
// for transparent huge pages (MADV_HUGEPAGE: Debian's default THP mode, "madvise", gives them
// only to memory that asks). A training step's activations are tensors of tens to hundreds of
// MiB, which its convolutions read by rows a page or more apart: with 4 KiB pages each of those
// rows is a TLB entry of its own. ResNet-50 b8's training step at two threads won every
// alternating pair with them, b32's medians were level (bench/README.md, "On the AMD EPYC Zen 5,
// 2026-12-08"). Where THP is off ("never") the advice does nothing. A segment's untouched rest
// still costs nothing (a huge page is zeroed on its first touch), and decommit (release_cached)
// splits the huge pages it gives back.
struct HostMemory {
  static constexpr const char* kName = "host";
  static constexpr std::size_t kSegmentBytes = std::size_t{1} << 30;  // address space; pages commit on touch
  static constexpr std::size_t kHugePageBytes = std::size_t{1} << 21;
  static void* allocate(std::size_t bytes) noexcept {
    if (bytes < kHugePageBytes) return std::aligned_alloc(64, bytes);
    void* p = nullptr;
    if (posix_memalign(&p, kHugePageBytes, bytes) != 0) return nullptr;
    (void)madvise(p, bytes / kHugePageBytes * kHugePageBytes, MADV_HUGEPAGE);
    return p;
  }
  static void release(void* p) noexcept { std::free(p); }
  // Gives the whole pages inside [p, p + bytes) back to the kernel; the range stays mapped and
  // reads as zeros when next touched (release_cached on a segment that is partly in use).
  static void decommit(void* p, std::size_t bytes) noexcept {
    const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
    const auto begin = (reinterpret_cast<std::uintptr_t>(p) + page - 1) / page * page;
    const auto end = (reinterpret_cast<std::uintptr_t>(p) + bytes) / page * page;
    if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
  }
};

template <class Backing>
class BasicCachingAllocator {
 public:
  static constexpr std::size_t kAlignment = 64;
  static constexpr std::size_t kLargeBytes = std::size_t{1} << 20;  // from here on: the segment pool
  static constexpr std::size_t kLargeGranule = std::size_t{1} << 16;

  BasicCachingAllocator() = default;
  BasicCachingAllocator(const BasicCachingAllocator&) = delete;
  BasicCachingAllocator& operator=(const BasicCachingAllocator&) = delete;
  ~BasicCachingAllocator() { release_cached(); }

  void* allocate(std::size_t bytes) {
    if (bytes == 0) return nullptr;
    TESSERA_CHECK(bytes <= (std::size_t{1} << 62), Error, "CachingAllocator: request of ", bytes,
                  " bytes is larger than any machine's memory (corrupt shape?)");
    if (bytes >= kLargeBytes) return allocate_large(round_large(bytes), bytes);
    const int cls = size_class(bytes);
    const std::size_t block = std::size_t{1} << cls;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      check_limit(block, bytes);
      auto& list = free_[static_cast<std::size_t>(cls)];
      if (!list.empty()) {
        void* p = list.back();
        list.pop_back();
        stats_.cache_hits++;
        stats_.bytes_cached -= block;
        add_in_use(block, bytes);
        return p;
      }
      stats_.system_allocations++;
      add_in_use(block, bytes);
    }
    void* p = Backing::allocate(block);
    if (p == nullptr) {
      release_cached();  // memory may be sitting in other size classes: give it back and retry once
      p = Backing::allocate(block);
    }
    if (p == nullptr) {
      std::lock_guard<std::mutex> lock(mutex_);
      stats_.bytes_in_use -= block;
      stats_.requested_bytes_in_use -= bytes;
      throw_out_of_memory(block);
    }
    return p;
  }

  // `bytes` must be the size passed to allocate() for p.
  void deallocate(void* p, std::size_t bytes) noexcept {
    if (p == nullptr) return;
    if (bytes >= kLargeBytes) return deallocate_large(static_cast<char*>(p), bytes);
    const int cls = size_class(bytes);
    const std::size_t block = std::size_t{1} << cls;
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.bytes_in_use -= block;
    stats_.requested_bytes_in_use -= bytes;
    stats_.bytes_cached += block;
    try {
      free_[static_cast<std::size_t>(cls)].push_back(p);
    } catch (...) {  // the free list could not grow: return the block to the system instead
      stats_.bytes_cached -= block;
      Backing::release(p);
    }
  }

  // Returns every cached small block and every segment with nothing in use to the system, and
  // the pages of the other segments' free ranges (e.g. between phases with different shapes).
  void release_cached() noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    release_cached_locked();
  }

  // Starts a new high-water mark at the current use (to measure one phase, e.g. a training step).
  void reset_peak() noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.peak_bytes_in_use = stats_.bytes_in_use;
    stats_.peak_requested_bytes_in_use = stats_.requested_bytes_in_use;
  }

  AllocatorStats stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

  // At most `bytes` in use (in whole blocks, as bytes_in_use counts them); 0: no limit. Requests
  // past it throw OutOfMemoryError; what is already in use stays.
  void set_limit(std::size_t bytes) noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    limit_ = bytes;
  }
  std::size_t limit() const noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    return limit_;
  }

 private:
  // A range of a segment, in use or free. ranges_ holds them all, sorted by address, so a
  // segment's ranges are neighbours; a vector rather than a tree, so that a steady step, whose
  // ranges number no more than the step before, never calls malloc (a map allocates a node per
  // insert). Best fit is a linear scan: a network has a few hundred large tensors at most.
  struct Range {
    char* base = nullptr;
    std::size_t bytes = 0;
    char* segment = nullptr;         // base of its segment (ranges merge within one only)
    std::size_t segment_bytes = 0;
    bool free = false;
  };

  static int size_class(std::size_t bytes) {
    const std::size_t rounded = std::bit_ceil(bytes < kAlignment ? kAlignment : bytes);
    return std::countr_zero(rounded);
  }
  static std::size_t round_large(std::size_t bytes) { return (bytes + kLargeGranule - 1) / kLargeGranule * kLargeGranule; }

  // `block` bytes handed out for a request of `requested`.
  void add_in_use(std::size_t block, std::size_t requested) {
    stats_.bytes_in_use += block;
    stats_.peak_bytes_in_use = std::max(stats_.peak_bytes_in_use, stats_.bytes_in_use);
    stats_.requested_bytes_in_use += requested;
    stats_.peak_requested_bytes_in_use = std::max(stats_.peak_requested_bytes_in_use, stats_.requested_bytes_in_use);
  }
  // For what the calling thread allocates: " for <scope>", or nothing.
  static std::string purpose() {
    const char* what = MemoryScope::current();
    return what ? std::string(" for ") + what : std::string();
  }
  [[noreturn]] void throw_out_of_memory(std::size_t bytes) {
    throw OutOfMemoryError(detail::cat("CachingAllocator: out of ", Backing::kName, " memory allocating ",
                                       format_bytes(bytes), purpose(), " (", format_bytes(stats_.bytes_in_use),
                                       " in use)"));
  }
  // `block` bytes more in use would pass the limit: the named error (the mutex is held).
  void check_limit(std::size_t block, std::size_t requested) const {
    if (limit_ == 0 || stats_.bytes_in_use + block <= limit_) return;
    throw OutOfMemoryError(detail::cat(
        "CachingAllocator: the ", Backing::kName, " memory limit of ", format_bytes(limit_), " (", limit_,
        " bytes: TESSERA_MEMORY_LIMIT or set_limit) would be passed allocating ", format_bytes(requested), purpose(),
        ", with ", format_bytes(stats_.bytes_in_use), " in use (peak ", format_bytes(stats_.peak_bytes_in_use),
        "); raise the limit, lower the batch size, or shard the model (FullyShardedDataParallel)"));
  }

  // bytes: the request rounded to kLargeGranule.
  void* allocate_large(std::size_t bytes, std::size_t requested) {
    std::lock_guard<std::mutex> lock(mutex_);
    check_limit(bytes, requested);
    std::size_t best = ranges_.size();
    for (std::size_t i = 0; i < ranges_.size(); ++i) {
      const Range& r = ranges_[i];
      if (r.free && r.bytes >= bytes && usable(r, bytes) && (best == ranges_.size() || r.bytes < ranges_[best].bytes))
        best = i;
    }
    if (best != ranges_.size()) {
      stats_.cache_hits++;
      return take(best, bytes, requested);
    }
    // A new segment: the request, or Backing's segment size where that is larger.
    std::size_t segment_bytes = std::max(bytes, Backing::kSegmentBytes);
    char* base = static_cast<char*>(Backing::allocate(segment_bytes));
    if (base == nullptr) {
      release_cached_locked();
      base = static_cast<char*>(Backing::allocate(segment_bytes));
    }
    if (base == nullptr && segment_bytes > bytes) {  // no room for a whole segment (ulimit -v): the request alone
      segment_bytes = bytes;
      base = static_cast<char*>(Backing::allocate(segment_bytes));
    }
    if (base == nullptr) throw_out_of_memory(bytes);
    auto at = std::lower_bound(ranges_.begin(), ranges_.end(), base,
                               [](const Range& r, const char* p) { return r.base < p; });
    try {
      at = ranges_.insert(at, Range{base, segment_bytes, base, segment_bytes, true});
    } catch (...) {  // the vector could not grow: nothing was handed out
      Backing::release(base);
      throw;
    }
    stats_.system_allocations++;
    stats_.bytes_cached += segment_bytes;
    return take(static_cast<std::size_t>(at - ranges_.begin()), bytes, requested);
  }
  // Whether free range r may serve `bytes`. Memory committed when allocated (a GPU's, whose
  // segments are each one request) is not split into a piece much smaller than the range: the
  // piece in use would pin the rest, which release_cached could then not give back (PyTorch caps
  // splitting with max_split_size for the same reason). Host segments are split freely: their
  // free pages cost nothing until touched, and release_cached decommits them.
  static bool usable(const Range& r, std::size_t bytes) {
    if constexpr (Backing::kSegmentBytes > 0) return true;
    else return r.bytes - bytes < bytes;
  }
  // Hands out the first `bytes` of free range i, leaving the rest free (a new range after it).
  void* take(std::size_t i, std::size_t bytes, std::size_t requested) {
    const Range r = ranges_[i];
    if (r.bytes > bytes)  // may throw (the vector grows): then nothing has changed
      ranges_.insert(ranges_.begin() + static_cast<std::ptrdiff_t>(i) + 1,
                     Range{r.base + bytes, r.bytes - bytes, r.segment, r.segment_bytes, true});
    ranges_[i].bytes = bytes;
    ranges_[i].free = false;
    stats_.bytes_cached -= bytes;
    add_in_use(bytes, requested);
    return r.base;
  }
  void deallocate_large(char* p, std::size_t requested) noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = std::lower_bound(ranges_.begin(), ranges_.end(), p,
                               [](const Range& r, const char* q) { return r.base < q; });
    if (it == ranges_.end() || it->base != p || it->free) return;  // not ours, or freed twice
    stats_.bytes_in_use -= it->bytes;
    stats_.requested_bytes_in_use -= requested;
    stats_.bytes_cached += it->bytes;
    it->free = true;
    // Merge with the free neighbours of the same segment (erasing never allocates).
    auto next = std::next(it);
    if (next != ranges_.end() && next->free && next->segment == it->segment) {
      it->bytes += next->bytes;
      it = std::prev(ranges_.erase(next));
    }
    if (it != ranges_.begin()) {
      auto prev = std::prev(it);
      if (prev->free && prev->segment == it->segment) {
        prev->bytes += it->bytes;
        ranges_.erase(it);
      }
    }
  }
  void release_cached_locked() noexcept {
    for (auto& list : free_) {
      for (void* p : list) Backing::release(p);
      list.clear();
    }
    // A segment with nothing in use is one free range spanning all of it: it goes back. The free
    // ranges of segments partly in use give their pages back where the Backing can.
    std::size_t cached = 0;
    std::erase_if(ranges_, [&](const Range& r) {
      const bool whole = r.free && r.base == r.segment && r.bytes == r.segment_bytes;
      if (whole) {
        Backing::release(r.base);
      } else if (r.free) {
        cached += r.bytes;
        if constexpr (requires { Backing::decommit(r.base, r.bytes); }) Backing::decommit(r.base, r.bytes);
      }
      return whole;
    });
    stats_.bytes_cached = cached;
  }

  mutable std::mutex mutex_;
  std::array<std::vector<void*>, 64> free_{};
  std::vector<Range> ranges_;
  AllocatorStats stats_{};
  std::size_t limit_ = 0;
};

using CachingAllocator = BasicCachingAllocator<HostMemory>;

// The host instance is compiled once, in tessera_kernels (core/linkage.hpp): every program uses it,
// and its pool and segment code is a few kilobytes of machine code per translation unit otherwise.
#if TESSERA_CPU_KERNELS_EXTERN
extern template class BasicCachingAllocator<HostMemory>;
#endif

}  // namespace tessera
