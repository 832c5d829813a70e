// Heap allocation counting for the benchmarks: every malloc-family call made while `g_counting`
// is set adds one to `g_allocations` (Eigen's and OpenMP's allocations count too, not only
// operator new). It defines malloc & co., so exactly one source file of a program includes it:
// each benchmark is one file.
#pragma once

#include <atomic>
#include <cstddef>

extern "C" void* __libc_malloc(std::size_t);
extern "C" void* __libc_calloc(std::size_t, std::size_t);
extern "C" void* __libc_realloc(void*, std::size_t);
extern "C" void* __libc_memalign(std::size_t, std::size_t);
static std::atomic<bool> g_counting{false};
static std::atomic<long> g_allocations{0};
static inline void note_allocation() {
  if (g_counting.load(std::memory_order_relaxed)) g_allocations.fetch_add(1, std::memory_order_relaxed);
}
extern "C" void* malloc(std::size_t n) {
  note_allocation();
  return __libc_malloc(n);
}
extern "C" void* calloc(std::size_t n, std::size_t m) {
  note_allocation();
  return __libc_calloc(n, m);
}
extern "C" void* realloc(void* p, std::size_t n) {
  note_allocation();
  return __libc_realloc(p, n);
}
extern "C" void* aligned_alloc(std::size_t a, std::size_t n) {
  note_allocation();
  return __libc_memalign(a, n);
}
extern "C" int posix_memalign(void** out, std::size_t a, std::size_t n) {
  note_allocation();
  *out = __libc_memalign(a, n);
  return *out ? 0 : 12;
}
