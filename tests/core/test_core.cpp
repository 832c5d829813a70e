// Core: Shape, Tensor, CachingAllocator, Rng, LocalComm, the CPU team's loops (stealing_for).
#include <catch2/catch.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "tessera/comm/local.hpp"
#include "tessera/core/allocator.hpp"
#include "tessera/core/random.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/device/cpu.hpp"
#include "tessera/io/flags.hpp"

using namespace tessera;

TEST_CASE("Shape: numel, negative dims, equality, rank limit", "[core]") {
  Shape s{2, 3, 4};
  CHECK(s.rank() == 3);
  CHECK(s.numel() == 24);
  CHECK(s.dim(-1) == 4);
  CHECK(s == Shape{2, 3, 4});
  CHECK(s != Shape{2, 3});
  CHECK(s.str() == "(2, 3, 4)");
  CHECK(Shape{}.numel() == 1);
  CHECK_THROWS_AS((Shape{1, 2, 3, 4, 5, 6, 7}), ShapeError);
  CHECK_THROWS_AS((Shape{2, -1}), ShapeError);
}

TEST_CASE("Tensor: deep copy, move, resize keeps the buffer, reshape checks numel", "[core]") {
  auto t = Tensor<float>::from({2, 2}, {1, 2, 3, 4});
  CHECK(t.at(1, 0) == 3.0f);
  Tensor<float> copy = t;
  copy[0] = 9;
  CHECK(t[0] == 1.0f);
  Tensor<float> moved = std::move(copy);
  CHECK(moved[0] == 9.0f);
  const float* before = moved.data();
  moved.resize({1, 3});  // smaller: same buffer
  CHECK(moved.data() == before);
  CHECK(moved.shape() == Shape{1, 3});
  CHECK(reinterpret_cast<std::uintptr_t>(moved.data()) % 64 == 0);
  CHECK_THROWS_AS(moved.reshape({2, 2}), ShapeError);
  CHECK_THROWS_AS(t.at(0, 0, 0), ShapeError);
  CHECK_THROWS_AS((Tensor<float>::from({3}, {1, 2})), ShapeError);
  CHECK(Tensor<float>().empty());
  CHECK(Tensor<float>().data() == nullptr);
  auto d = t.cast<double>();
  CHECK(d[3] == 4.0);
}

TEST_CASE("CachingAllocator: freed blocks are reused, no system allocation in steady state", "[core]") {
  CachingAllocator alloc;
  void* a = alloc.allocate(1000);
  alloc.deallocate(a, 1000);
  const auto before = alloc.stats();
  for (int i = 0; i < 10; ++i) {
    void* b = alloc.allocate(900);  // same size class (1024) as 1000
    CHECK(b == a);
    alloc.deallocate(b, 900);
  }
  const auto after = alloc.stats();
  CHECK(after.system_allocations == before.system_allocations);
  CHECK(after.cache_hits == before.cache_hits + 10);
  CHECK(after.bytes_in_use == 0);
  alloc.release_cached();
  CHECK(alloc.stats().bytes_cached == 0);
}

// Requested bytes are what callers asked for, blocks what they were given: 1000 B takes a 1024 B
// block, 1 MiB + 1 B a 64 KiB-rounded range. Both peaks restart at reset_peak().
TEST_CASE("CachingAllocator: requested bytes and their peak, next to the rounded blocks", "[core]") {
  CachingAllocator alloc;
  const std::size_t large = (std::size_t{1} << 20) + 1;
  void* a = alloc.allocate(1000);
  void* b = alloc.allocate(large);
  auto s = alloc.stats();
  CHECK(s.requested_bytes_in_use == 1000 + large);
  CHECK(s.bytes_in_use == 1024 + (std::size_t{1} << 20) + (std::size_t{1} << 16));
  CHECK(s.peak_requested_bytes_in_use == 1000 + large);
  alloc.deallocate(b, large);
  alloc.reset_peak();
  s = alloc.stats();
  CHECK(s.requested_bytes_in_use == 1000);
  CHECK(s.peak_requested_bytes_in_use == 1000);
  void* c = alloc.allocate(3000);
  alloc.deallocate(c, 3000);
  s = alloc.stats();
  CHECK(s.peak_requested_bytes_in_use == 4000);
  CHECK(s.peak_bytes_in_use == 1024 + 4096);
  alloc.deallocate(a, 1000);
  CHECK(alloc.stats().requested_bytes_in_use == 0);
  CHECK(alloc.stats().bytes_in_use == 0);
}

// A limit on the bytes in use: a request past it throws OutOfMemoryError naming the request, the
// innermost MemoryScope and the use, and leaves the allocator as it was; small and large requests.
TEST_CASE("CachingAllocator: a memory limit ends in a named error, not a killed process", "[core]") {
  CachingAllocator alloc;
  alloc.set_limit(std::size_t{3} << 20);  // 3 MiB
  CHECK(alloc.limit() == std::size_t{3} << 20);
  void* a = alloc.allocate(std::size_t{2} << 20);
  void* b = alloc.allocate(1000);
  const auto before = alloc.stats();
  {
    const MemoryScope outer("the forward pass");
    const MemoryScope inner("unit 3's gathered parameters");
    CHECK_THROWS_AS(alloc.allocate(std::size_t{3} << 19), OutOfMemoryError);
    CHECK_THROWS_WITH(alloc.allocate(std::size_t{3} << 19),
                         Catch::Matchers::Contains("memory limit of 3.0 MiB") &&
                             Catch::Matchers::Contains("allocating 1.5 MiB for unit 3's gathered parameters") &&
                             Catch::Matchers::Contains("with 2.0 MiB in use"));
  }
  CHECK(MemoryScope::current() == nullptr);
  CHECK_THROWS_WITH(alloc.allocate(std::size_t{1} << 20), Catch::Matchers::Contains("allocating 1.0 MiB,"));  // no scope
  const auto after = alloc.stats();
  CHECK(after.bytes_in_use == before.bytes_in_use);
  CHECK(after.requested_bytes_in_use == before.requested_bytes_in_use);
  void* c = alloc.allocate(std::size_t{1} << 19);  // still fits: 2 MiB + 1 KiB + 0.5 MiB
  alloc.deallocate(c, std::size_t{1} << 19);
  alloc.set_limit(0);  // none
  void* d = alloc.allocate(std::size_t{8} << 20);
  alloc.deallocate(d, std::size_t{8} << 20);
  alloc.deallocate(b, 1000);
  alloc.deallocate(a, std::size_t{2} << 20);
  CHECK(alloc.stats().bytes_in_use == 0);
}

TEST_CASE("parse_memory_size: TESSERA_MEMORY_LIMIT's sizes", "[core]") {
  CHECK(parse_memory_size("1048576", "x") == std::size_t{1} << 20);
  CHECK(parse_memory_size("512M", "x") == std::size_t{512} << 20);
  CHECK(parse_memory_size("512MiB", "x") == std::size_t{512} << 20);
  CHECK(parse_memory_size("1.5G", "x") == std::size_t{3} << 29);
  CHECK(parse_memory_size("64k", "x") == std::size_t{64} << 10);
  for (const char* bad : {"", "M", "12X", "-1G", "1e30T"})
    CHECK_THROWS_WITH(parse_memory_size(bad, "TESSERA_MEMORY_LIMIT"),
                         Catch::Matchers::StartsWith("TESSERA_MEMORY_LIMIT: '" + std::string(bad) + "' is not a memory size"));
  CHECK(format_bytes(640) == "640 B");
  CHECK(format_bytes(std::size_t{3} << 29) == "1.5 GiB");
}

// A Backing with segments of kSegment bytes (0: each one the request) that counts its live blocks,
// so the tests see every segment come and go.
template <std::size_t kSegment>
struct CountedSegments {
  static constexpr const char* kName = "test";
  static constexpr std::size_t kSegmentBytes = kSegment;
  static inline int live = 0;
  static void* allocate(std::size_t bytes) noexcept {
    ++live;
    return std::aligned_alloc(64, bytes);
  }
  static void release(void* p) noexcept {
    --live;
    std::free(p);
  }
};
using SmallSegments = CountedSegments<std::size_t{8} << 20>;  // 8 MiB segments

// Large requests: best fit within a segment, split and merged again, so memory freed in one size
// serves a request of another (activations freed, gradients of other shapes asked for).
TEST_CASE("CachingAllocator: large blocks are carved from one segment and merge when freed", "[core]") {
  constexpr std::size_t MiB = std::size_t{1} << 20;
  {
    BasicCachingAllocator<SmallSegments> alloc;
    char* a = static_cast<char*>(alloc.allocate(3 * MiB));
    char* b = static_cast<char*>(alloc.allocate(3 * MiB + 1));  // rounded to 64 KiB
    CHECK(SmallSegments::live == 1);                            // both in the first segment
    CHECK(b == a + 3 * MiB);
    CHECK(alloc.stats().bytes_in_use == 6 * MiB + 64 * 1024);
    CHECK(reinterpret_cast<std::uintptr_t>(b) % 64 == 0);
    alloc.deallocate(a, 3 * MiB);
    alloc.deallocate(b, 3 * MiB + 1);
    // a and b merged back with the segment's tail: 8 MiB in one piece, no new segment.
    const auto before = alloc.stats();
    char* c = static_cast<char*>(alloc.allocate(7 * MiB));
    CHECK(c == a);
    CHECK(alloc.stats().system_allocations == before.system_allocations);
    // Best fit: a 1 MiB hole between two blocks is taken before the larger tail.
    alloc.deallocate(c, 7 * MiB);
    char* d = static_cast<char*>(alloc.allocate(2 * MiB));
    char* e = static_cast<char*>(alloc.allocate(1 * MiB));
    char* f = static_cast<char*>(alloc.allocate(2 * MiB));
    alloc.deallocate(e, 1 * MiB);
    CHECK(alloc.allocate(1 * MiB) == e);
    // A request larger than a segment gets a segment of its own.
    void* big = alloc.allocate(20 * MiB);
    CHECK(SmallSegments::live == 2);
    alloc.deallocate(big, 20 * MiB);
    alloc.release_cached();  // the big segment is wholly free and goes back; the first is in use
    CHECK(SmallSegments::live == 1);
    // Steady state: the same sequence again allocates nothing.
    const auto steady = alloc.stats();
    for (int i = 0; i < 5; ++i) {
      void* x = alloc.allocate(MiB);  // with y, fits in the segment's free 3 MiB
      void* y = alloc.allocate(MiB + 5);
      alloc.deallocate(x, MiB);
      alloc.deallocate(y, MiB + 5);
    }
    CHECK(alloc.stats().system_allocations == steady.system_allocations);
    alloc.deallocate(d, 2 * MiB);
    alloc.deallocate(e, 1 * MiB);
    alloc.deallocate(f, 2 * MiB);
    CHECK(alloc.stats().bytes_in_use == 0);
    CHECK(alloc.stats().bytes_cached == 8 * MiB);
  }
  CHECK(SmallSegments::live == 0);  // the destructor returned the rest
}

// Host segments are 2 MiB aligned and advised for transparent huge pages (core/allocator.hpp,
// HostMemory): the kernel marks such a mapping "hg" in its VmFlags (/proc/self/smaps), whatever
// the system's THP mode; small blocks stay plain 64-byte-aligned ones.
TEST_CASE("HostMemory: segments are 2 MiB aligned and ask for transparent huge pages", "[core]") {
  constexpr std::size_t MiB = std::size_t{1} << 20;
  void* small = HostMemory::allocate(4096);
  REQUIRE(small != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(small) % 64 == 0);
  HostMemory::release(small);
  const std::size_t bytes = 8 * MiB + 64 * 1024;  // not a multiple of 2 MiB: the advice covers the whole pages
  char* p = static_cast<char*>(HostMemory::allocate(bytes));
  REQUIRE(p != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(p) % (2 * MiB) == 0);
  std::fill(p, p + bytes, char{1});
  std::ifstream smaps("/proc/self/smaps");
  if (!smaps || !std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled")) {
    HostMemory::release(p);
    WARN("skipped the advice's check: /proc/self/smaps cannot be read here, or this kernel has no THP");
    return;
  }
  // The mapping holding p: a header line "begin-end perms ...", then fields up to "VmFlags: ...".
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  bool inside = false, found = false;
  std::string line, flags;
  while (std::getline(smaps, line)) {
    std::uintptr_t begin = 0, end = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &begin, &end) == 2) {  // field lines ("Size:", "Anonymous:") fail
      inside = begin <= at && at < end;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      flags = line + " ";
      found = true;
      break;
    }
  }
  HostMemory::release(p);
  REQUIRE(found);
  INFO("VmFlags of the segment's mapping: " << flags);
  CHECK(flags.find(" hg ") != std::string::npos);
}

// Committed memory (a GPU's): a segment is the request, and a free range is not split into a piece
// much smaller than itself. A Backing that cannot give a whole segment gets asked for the request.
using CommittedSegments = CountedSegments<0>;
struct NoRoomForSegments {  // refuses anything above 16 MiB, as under ulimit -v
  static constexpr const char* kName = "test";
  static constexpr std::size_t kSegmentBytes = std::size_t{1} << 30;
  static void* allocate(std::size_t bytes) noexcept {
    return bytes > (std::size_t{16} << 20) ? nullptr : std::aligned_alloc(64, bytes);
  }
  static void release(void* p) noexcept { std::free(p); }
};

TEST_CASE("CachingAllocator: committed segments split only into large pieces; fallback to the request", "[core]") {
  constexpr std::size_t MiB = std::size_t{1} << 20;
  {
    BasicCachingAllocator<CommittedSegments> alloc;
    void* a = alloc.allocate(8 * MiB);
    alloc.deallocate(a, 8 * MiB);
    void* small = alloc.allocate(MiB);  // would pin 7 MiB of the free 8: a segment of its own
    CHECK(small != a);
    CHECK(CommittedSegments::live == 2);
    void* half = alloc.allocate(5 * MiB);  // leaves 3 MiB, less than it takes: served from the 8 MiB range
    CHECK(half == a);
    CHECK(CommittedSegments::live == 2);
    alloc.deallocate(half, 5 * MiB);
    alloc.deallocate(small, MiB);
    alloc.release_cached();
    CHECK(CommittedSegments::live == 0);
  }
  BasicCachingAllocator<NoRoomForSegments> alloc;
  void* p = alloc.allocate(3 * MiB);
  CHECK(p != nullptr);
  CHECK(alloc.stats().bytes_cached == 0);  // the segment is the request itself
  alloc.deallocate(p, 3 * MiB);
  CHECK_THROWS_WITH(alloc.allocate(32 * MiB), Catch::Contains("out of test memory allocating 32.0 MiB (0 B in use)"));
}

TEST_CASE("Rng: reproducible, uniform range, normal moments, state round-trip", "[core]") {
  Rng a(7), b(7), c(8);
  CHECK(a.next_u64() == b.next_u64());
  CHECK(a.next_u64() != c.next_u64());
  double sum = 0, sq = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    const double x = a.normal();
    sum += x;
    sq += x * x;
  }
  CHECK(std::abs(sum / n) < 0.01);
  CHECK(std::abs(sq / n - 1.0) < 0.02);
  for (int i = 0; i < 1000; ++i) {
    const double u = a.uniform();
    REQUIRE((u >= 0.0 && u < 1.0));
    REQUIRE(a.below(7) < 7);
  }
  a.normal();  // leaves a spare normal in the state
  const auto saved = a.state();
  const double x1 = a.normal(), x2 = a.normal();
  Rng restored;
  restored.set_state(saved);
  CHECK(restored.normal() == x1);
  CHECK(restored.normal() == x2);
  std::vector<int> v(100);
  std::iota(v.begin(), v.end(), 0);
  a.shuffle(v.begin(), v.end());
  CHECK(std::set<int>(v.begin(), v.end()).size() == 100);
}

TEST_CASE("LocalComm: every collective is the identity on one rank", "[core]") {
  LocalComm comm;
  CHECK(comm.rank() == 0);
  CHECK(comm.size() == 1);
  std::vector<float> buf{1, 2, 3};
  comm.all_reduce(std::span<float>(buf), ReduceOp::Avg);
  CHECK(buf == std::vector<float>{1, 2, 3});
  comm.all_reduce_async(std::span<float>(buf), ReduceOp::Sum).wait();
  std::vector<float> out(3);
  comm.all_gather(std::span<const float>(buf), std::span<float>(out));
  CHECK(out == buf);
  CHECK_THROWS_AS(comm.broadcast(std::span<float>(buf), 1), CommError);
  CHECK_THROWS_AS(comm.send(std::span<const float>(buf), 1), CommError);
  std::vector<float> wrong(2);
  CHECK_THROWS_AS(comm.all_gather(std::span<const float>(buf), std::span<float>(wrong)), CommError);
  CHECK(comm.split(0, 0).size() == 1);
}

TEST_CASE("Flags: typed values, defaults kept exactly, unknown flags and bad values rejected", "[core]") {
  const char* argv[] = {"prog", "--epochs=3", "--lr", "0.25", "--verbose", "--name=x"};
  Flags flags(6, const_cast<char**>(argv));
  CHECK(flags.get("epochs", std::int64_t{1}) == 3);
  CHECK(flags.get("lr", 0.1) == 0.25);
  CHECK(flags.get("verbose", false));
  CHECK(flags.get("name", "y") == "x");
  CHECK(flags.get("eps", 1e-7) == 1e-7);  // an absent flag returns its default bit for bit
  flags.finish();
  const char* typo[] = {"prog", "--epoch=3"};
  Flags bad(2, const_cast<char**>(typo));
  bad.get("epochs", std::int64_t{1});
  CHECK_THROWS_WITH(bad.finish(), Catch::Contains("unknown flag --epoch"));
  const char* not_int[] = {"prog", "--epochs=three"};
  Flags bad_value(2, const_cast<char**>(not_int));
  CHECK_THROWS_AS(bad_value.get("epochs", std::int64_t{1}), ArgumentError);
}

TEST_CASE("Shape refuses element counts that would overflow", "[core]") {
  CHECK_THROWS_AS((Shape{std::int64_t{1} << 32, std::int64_t{1} << 32}), ShapeError);
  Tensor<float> t;
  CHECK_THROWS_AS(t.resize({std::int64_t{1} << 40, std::int64_t{1} << 30}), ShapeError);
  CHECK(t.empty());  // refused when the shape is built, before any allocation
}

TEST_CASE("stealing_for runs every item once, and a thread done early takes the other's last items", "[core]") {
  constexpr std::int64_t n = 400;
  SECTION("outside a team: every item, in order, on this thread") {
    detail::StealRanges ranges(n);
    std::vector<std::int64_t> order;
    detail::stealing_for(ranges, n, [&](std::int64_t i) { order.push_back(i); });
    std::vector<std::int64_t> want(n);
    std::iota(want.begin(), want.end(), 0);
    CHECK(order == want);
  }
#if defined(_OPENMP)
  SECTION("a team of two, the first thread slowed down on its first item") {
    const int threads = Cpu::num_threads();
    Cpu::set_num_threads(2);  // the ranges are made for a team of Cpu::num_threads()
    for (const std::int64_t items : {std::int64_t{0}, std::int64_t{1}, std::int64_t{3}, n}) {
      detail::StealRanges ranges(items);
      std::vector<std::atomic<int>> runs(static_cast<std::size_t>(items));
      std::vector<int> runner(static_cast<std::size_t>(items), -1);
      int team = 0;
      std::atomic<bool> stolen{false};
#pragma omp parallel num_threads(2)
      {
#pragma omp single
        team = Cpu::team_size();
        detail::stealing_for(ranges, items, [&](std::int64_t i) {
          const int t = Cpu::thread_index();
          // Thread 0 stays on its first item (item 0) until thread 1 has taken one of its items,
          // for 5 s at most: without stealing it would wait the 5 s and then run them all itself.
          if (i == 0 && t == 0 && team == 2 && items == n) {
            const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
            while (!stolen.load() && std::chrono::steady_clock::now() < deadline)
              std::this_thread::sleep_for(std::chrono::milliseconds(1));
          }
          if (t == 1 && i < items / 2) stolen.store(true);
          runs[static_cast<std::size_t>(i)].fetch_add(1);
          runner[static_cast<std::size_t>(i)] = t;
        });
      }
      for (std::int64_t i = 0; i < items; ++i) {
        INFO("items " << items << ", item " << i);
        CHECK(runs[static_cast<std::size_t>(i)].load() == 1);
      }
      if (team == 2 && items == n) {
        // Thread 1 owned [200, 400) and took thread 0's items from the back while thread 0 waited.
        // Thread 0 starts its range at item 0, unless it was not scheduled before thread 1 had
        // taken all of it (seen once under ASan on 2 cores): then it ran nothing.
        CHECK(runner[n - 1] == 1);
        if (std::count(runner.begin(), runner.end(), 0) > 0) CHECK(runner[0] == 0);
        CHECK(runner[n / 2 - 1] == 1);
      }
    }
    Cpu::set_num_threads(threads);
  }
#endif
}

TEST_CASE("Cpu::set_idle_spin_ms reaches the calling thread, threads started later and a team's workers") {
  CHECK_THROWS_AS(Cpu::set_idle_spin_ms(-1), ArgumentError);
  const int before = Cpu::idle_spin_ms();
  if (!Cpu::set_idle_spin_ms(7)) {  // libgomp or no OpenMP: no such setting to read back either
    CHECK(before == -1);
    return;
  }
  CHECK(Cpu::idle_spin_ms() == 7);
  int later = -2;
  std::thread([&later] { later = Cpu::idle_spin_ms(); }).join();
  CHECK(later == 7);
  std::atomic<int> worker{-2};
#pragma omp parallel num_threads(2)
  {
    if (Cpu::thread_index() == Cpu::team_size() - 1) worker = Cpu::idle_spin_ms();
  }
  CHECK(worker.load() == 7);
  Cpu::set_idle_spin_ms(before);
  CHECK(Cpu::idle_spin_ms() == before);
}
