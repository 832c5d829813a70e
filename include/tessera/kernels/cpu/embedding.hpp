// Embedding lookup on the CPU, as torch.nn.Embedding: a gather of rows of the table W (num, dim)
// and, backward, their scatter-add.
//
//   forward   y[i, :] = W[ids[i], :]                          y (count, dim)
//   backward  dW[ids[i], :] += dy[i, :] for every i whose id is not skip_id
// The ids are checked by the layer (in range) before they reach these loops. A token that occurs
// twice adds twice, so backward splits the columns (not the tokens) over the OpenMP team: no two
// threads add to one element.
#pragma once

#include <algorithm>
#include <cstdint>

#include "tessera/device/cpu.hpp"
#include "tessera/kernels/cpu/compiled.hpp"

namespace tessera {

namespace detail {
inline constexpr std::int64_t kEmbeddingParallelGrain = 1 << 15;  // elements below which one thread does it
}

template <class S>
void embedding_forward(Cpu, const S* weight, std::int64_t dim, const std::int64_t* ids, std::int64_t count, S* y) {
  detail::parallel_for(count, count * dim >= detail::kEmbeddingParallelGrain,
                       [&](std::int64_t i) { std::copy_n(weight + ids[i] * dim, dim, y + i * dim); });
}

// skip_id: the padding index (its row receives no gradient), or -1 for none.
template <class S>
void embedding_backward(Cpu, const S* dy, const std::int64_t* ids, std::int64_t count, std::int64_t dim,
                        std::int64_t skip_id, S* dweight) {
  constexpr std::int64_t kBlock = 64;  // columns per task
  const std::int64_t blocks = (dim + kBlock - 1) / kBlock;
  detail::parallel_for(blocks, count * dim >= detail::kEmbeddingParallelGrain && blocks > 1, [&](std::int64_t blk) {
    const std::int64_t j0 = blk * kBlock, j1 = std::min(dim, j0 + kBlock);
    for (std::int64_t i = 0; i < count; ++i) {
      if (ids[i] == skip_id) continue;
      S* row = dweight + ids[i] * dim;
      const S* g = dy + i * dim;
      for (std::int64_t j = j0; j < j1; ++j) row[j] += g[j];
    }
  });
}

// Compiled once in compiled-kernels mode (kernels/cpu/compiled.hpp).
#define TESSERA_CPU_EMBEDDING_INSTANCES(PREFIX, S)                                                          \
  PREFIX template void embedding_forward<S>(Cpu, const S*, std::int64_t, const std::int64_t*, std::int64_t, S*); \
  PREFIX template void embedding_backward<S>(Cpu, const S*, const std::int64_t*, std::int64_t, std::int64_t,     \
                                             std::int64_t, S*);
TESSERA_CPU_KERNEL_INSTANCES(TESSERA_CPU_EMBEDDING_INSTANCES)

}  // namespace tessera
