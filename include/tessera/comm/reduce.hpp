// Element-wise reduction kernels shared by the communicator backends.
//
// ReduceOp::Avg is reduced as a sum and divided by the number of ranks at the end (integers
// truncate). Half and BHalf (is_16bit_float_v) are widened to float for the arithmetic and
// rounded back once per element, so reduce_many over n ranks rounds once, not n - 1 times.
#pragma once

#include <algorithm>
#include <cstddef>
#include <type_traits>

#include "tessera/comm/communicator.hpp"
#include "tessera/core/linkage.hpp"

namespace tessera::detail {

// The type the arithmetic is done in: float for Half and BHalf, the type itself otherwise.
template <CommScalar T>
using ReduceAccum = std::conditional_t<is_16bit_float_v<T>, float, T>;

template <CommScalar T>
inline ReduceAccum<T> widen(T v) {
  if constexpr (is_16bit_float_v<T>) return static_cast<float>(v);
  else return v;
}
template <CommScalar T>
inline T narrow(ReduceAccum<T> v) {
  if constexpr (is_16bit_float_v<T>) return T(v);
  else return v;
}

template <class A>
inline void combine_block(A* acc, const A* x, std::size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:
      for (std::size_t i = 0; i < n; ++i) acc[i] += x[i];
      break;
    case ReduceOp::Max:
      for (std::size_t i = 0; i < n; ++i) acc[i] = std::max(acc[i], x[i]);
      break;
    case ReduceOp::Min:
      for (std::size_t i = 0; i < n; ++i) acc[i] = std::min(acc[i], x[i]);
      break;
  }
}

template <class A>
inline void divide_block(A* acc, std::size_t n, int ranks) {
  if constexpr (std::is_floating_point_v<A>) {
    const A inv = A(1) / static_cast<A>(ranks);
    for (std::size_t i = 0; i < n; ++i) acc[i] *= inv;
  } else {
    for (std::size_t i = 0; i < n; ++i) acc[i] /= static_cast<A>(ranks);
  }
}

// acc[i] = acc[i] op x[i]. Avg accumulates a sum: call finish_avg once all ranks are in.
template <CommScalar T>
void reduce_into(T* acc, const T* x, std::size_t n, ReduceOp op) {
  if constexpr (is_16bit_float_v<T>) {
    constexpr std::size_t kBlock = 1024;
    float a[kBlock], b[kBlock];
    for (std::size_t start = 0; start < n; start += kBlock) {
      const std::size_t len = std::min(kBlock, n - start);
      for (std::size_t i = 0; i < len; ++i) a[i] = static_cast<float>(acc[start + i]);
      for (std::size_t i = 0; i < len; ++i) b[i] = static_cast<float>(x[start + i]);
      combine_block(a, b, len, op);
      for (std::size_t i = 0; i < len; ++i) acc[start + i] = T(a[i]);
    }
  } else {
    combine_block(acc, x, n, op);
  }
}

// c[i] = a[i] op b[i] in one pass (c may alias a or b); Avg sums. Half and BHalf go through float.
template <CommScalar T>
void combine_into(T* c, const T* a, const T* b, std::size_t n, ReduceOp op) {
  if constexpr (is_16bit_float_v<T>) {
    if (c == b) return reduce_into(c, a, n, op);  // every op is commutative
    if (c != a) std::copy_n(a, n, c);
    reduce_into(c, b, n, op);
  } else {
    switch (op) {
      case ReduceOp::Sum:
      case ReduceOp::Avg:
        for (std::size_t i = 0; i < n; ++i) c[i] = a[i] + b[i];
        break;
      case ReduceOp::Max:
        for (std::size_t i = 0; i < n; ++i) c[i] = std::max(a[i], b[i]);
        break;
      case ReduceOp::Min:
        for (std::size_t i = 0; i < n; ++i) c[i] = std::min(a[i], b[i]);
        break;
    }
  }
}

// Half and Avg over a library that reduces pairwise in fp16 (MPI, Gloo): each rank divides its
// own values by the rank count first and the library sums (NCCL's pre-multiplied sum), so the
// running sum cannot overflow fp16 (max 65504) when the average itself fits. BHalf has float's
// range, but is treated the same so that both 16-bit types reduce alike on every backend. True when the
// caller must then reduce with Sum and skip finish_avg.
template <CommScalar T>
bool prescale_half_avg(T* buf, std::size_t n, ReduceOp op, int ranks) {
  if constexpr (!is_16bit_float_v<T>) {
    return false;
  } else {
    if (op != ReduceOp::Avg || ranks == 1) return false;
    const float inv = 1.0f / static_cast<float>(ranks);
    for (std::size_t i = 0; i < n; ++i) buf[i] = T(static_cast<float>(buf[i]) * inv);
    return true;
  }
}

// buf[i] /= ranks when op is Avg (the sum has been formed); nothing otherwise.
template <CommScalar T>
void finish_avg(T* buf, std::size_t n, ReduceOp op, int ranks) {
  if (op != ReduceOp::Avg || ranks == 1) return;
  if constexpr (is_16bit_float_v<T>) {
    for (std::size_t i = 0; i < n; ++i) buf[i] = T(static_cast<float>(buf[i]) / static_cast<float>(ranks));
  } else {
    divide_block(buf, n, ranks);
  }
}

// For each element i: r = op over q of sources[q][i] (fixed order q = 0, 1, ..., count - 1, so
// every rank that computes an element gets the same bits), then outputs[k][i] = r for every k.
// Outputs may alias sources: a block of every source is read before any output is written.
// Writing the result straight into every rank's buffer is what lets the shared-memory all_reduce
// finish in one pass over memory (see threads.hpp).
template <CommScalar T>
void reduce_many(const T* const* sources, int count, T* const* outputs, int output_count, std::size_t n,
                 ReduceOp op) {
  using A = ReduceAccum<T>;
  constexpr std::size_t kBlock = 2048;
  A acc[kBlock];
  A widened[is_16bit_float_v<T> ? kBlock : 1];
  for (std::size_t start = 0; start < n; start += kBlock) {
    const std::size_t len = std::min(kBlock, n - start);
    for (std::size_t i = 0; i < len; ++i) acc[i] = widen(sources[0][start + i]);
    for (int q = 1; q < count; ++q) {
      if constexpr (is_16bit_float_v<T>) {
        for (std::size_t i = 0; i < len; ++i) widened[i] = static_cast<float>(sources[q][start + i]);
        combine_block(acc, widened, len, op);
      } else {
        combine_block(acc, sources[q] + start, len, op);
      }
    }
    if (op == ReduceOp::Avg) divide_block(acc, len, count);
    for (int k = 0; k < output_count; ++k) {
      T* out = outputs[k] + start;
      if constexpr (is_16bit_float_v<T>) {
        for (std::size_t i = 0; i < len; ++i) out[i] = T(acc[i]);
      } else {
        std::copy(acc, acc + len, out);
      }
    }
  }
}

// Compiled once, for every CommScalar, in compiled-kernels mode (core/linkage.hpp explains): the
// shared-memory all_reduce's loops run at the library's -O3 whatever the program's level.
#define TESSERA_REDUCE_INSTANCES(PREFIX, T)                                                         \
  PREFIX template void reduce_into<T>(T*, const T*, std::size_t, ReduceOp);                        \
  PREFIX template void combine_into<T>(T*, const T*, const T*, std::size_t, ReduceOp);             \
  PREFIX template bool prescale_half_avg<T>(T*, std::size_t, ReduceOp, int);                       \
  PREFIX template void finish_avg<T>(T*, std::size_t, ReduceOp, int);                              \
  PREFIX template void reduce_many<T>(const T* const*, int, T* const*, int, std::size_t, ReduceOp);
#define TESSERA_REDUCE_ALL_INSTANCES(PREFIX) TESSERA_FOR_EACH_COMM_SCALAR(TESSERA_REDUCE_INSTANCES, PREFIX)
#if TESSERA_CPU_KERNELS_EXTERN
TESSERA_REDUCE_ALL_INSTANCES(extern)
#endif

}  // namespace tessera::detail
