// The sizes and operand layouts of one attention call, shared by the CPU kernels
// (kernels/cpu/attention.hpp) and the CUDA ones (kernels/cuda/attention.cuh).
#pragma once

#include <cstdint>

#include "tessera/core/host_device.hpp"
#include "tessera/kernels/dropout_key.hpp"

namespace tessera {

// Strides, in elements, of one attention operand: batch, head and row (the last index is 1).
struct AttentionLayout {
  std::int64_t batch = 0, head = 0, row = 0;
  // A contiguous (B, H, rows, width) tensor.
  TESSERA_HOST_DEVICE static AttentionLayout contiguous(std::int64_t heads, std::int64_t rows, std::int64_t width) {
    return {heads * rows * width, rows * width, width};
  }
  TESSERA_HOST_DEVICE std::int64_t offset(std::int64_t b, std::int64_t h) const { return b * batch + h * head; }
};

// The sizes of one attention call: B, H, T queries, S keys, d = head_dim (q and k), dv (v, out).
// causal_offset: with causal, query i sees keys j <= i + causal_offset. 0 is torch's is_causal
// (the top-left triangle); S - T aligns the last query with the last key, as a key/value cache
// needs (the T new queries are positions S - T, ..., S - 1 of the sequence).
// dropout: torch's dropout_p on the probabilities (nanoGPT's attn_dropout), element (b, h, i, j)
// masked by its DropoutKey (kernels/dropout_key.hpp), the same masks on the CPU and the GPU.
struct AttentionDims {
  std::int64_t batch = 0, heads = 0, queries = 0, keys = 0, head_dim = 0, value_dim = 0;
  std::int64_t causal_offset = 0;
  DropoutKey dropout;
};

}  // namespace tessera
