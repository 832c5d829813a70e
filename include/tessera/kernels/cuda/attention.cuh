// Scaled dot-product attention on the GPU: the Cuda overloads of kernels/cpu/attention.hpp (same
// maths, layouts and causal rule, see there). Correct first: one block per query row (forward, dq)
// or per key row (dk, dv), its scores in shared memory in double, so a row holds at most
// kMaxAttentionKeys keys (forward, dq) or queries (dk, dv); the extra memory is still the per-row
// log-sum-exp and D = rowsum(dout out), never a (T, S) matrix. A fused tensor-core kernel
// (FlashAttention's, cuDNN's SDPA) is issue 47's. Dropout (n.dropout) multiplies each probability
// by its mask M_ij, computed again wherever it is needed (kernels/dropout_key.hpp: the CPU's very
// masks): out = (P o M) v, dv_j = sum_i P_ij M_ij dout_i, ds_ij = P_ij (M_ij dout_i . v_j - D_i).
#pragma once

#include <cmath>
#include <cstdint>

#include "tessera/core/error.hpp"
#include "tessera/kernels/attention_dims.hpp"
#include "tessera/kernels/cuda/launch.cuh"
#include "tessera/kernels/cuda/loss.cuh"
#include "tessera/kernels/cuda/reduce.cuh"

namespace tessera {

namespace cuda_detail {

// A block may use 48 KiB of shared memory without opting in: the row's doubles (halved where two
// arrays are kept) plus block_reduce's 32, so 6016 keys (47 KiB) leave it room.
inline constexpr std::int64_t kMaxAttentionKeys = 6016;
inline constexpr unsigned kAttentionThreads = 128;
// Doubles allocated past each row array. compute-sanitizer's memcheck on an H200 (2026-12-04,
// bench/results/nvidia-h200-2026-12-04/README.md) saw the forward kernel make a 16-byte shared read
// reaching past the block's shared memory, in every thread of a warp, while its results were right.
// The PTX (nvcc 13.0, sm_90) reads the row only inside its bounds: two doubles at a time in the
// unrolled loop over the keys, one at a time in the loop's remainder. The SASS (no disassembler
// here) may widen a remainder read to a pair, or load the unrolled loop's next four doubles before
// its exit test, and use none of them; four doubles of slack keep such reads inside the block's
// memory (6,020 of them and block_reduce's 32 still fit in 48 KiB). Not yet rerun under memcheck.
inline constexpr std::int64_t kAttentionSlack = 4;

// Dynamic shared memory for `count` row doubles.
inline std::size_t attention_shared_bytes(std::int64_t count) {
  return static_cast<std::size_t>(count + kAttentionSlack) * sizeof(double);
}

__device__ inline std::int64_t attention_visible(bool causal, std::int64_t i, const AttentionDims& n) {
  if (!causal) return n.keys;
  const std::int64_t v = i + 1 + n.causal_offset;
  return v < 0 ? 0 : (v > n.keys ? n.keys : v);
}

template <class S>
__device__ double attention_dot(const S* a, const S* b, std::int64_t d) {
  double s = 0;
  for (std::int64_t e = 0; e < d; ++e) s += double(a[e]) * double(b[e]);
  return s;
}

template <class S>
__global__ void attention_forward_kernel(AttentionDims n, const S* q, AttentionLayout ql, const S* k,
                                         AttentionLayout kl, const S* v, AttentionLayout vl, double scale, bool causal,
                                         S* out, AttentionLayout ol, S* lse) {
  extern __shared__ double p[];  // the row's scores, then probabilities (unnormalized)
  __shared__ double scratch[32];
  const std::int64_t row = blockIdx.x, i = row % n.queries, bh = row / n.queries;
  const std::int64_t b = bh / n.heads, h = bh % n.heads;
  const S* qi = q + ql.offset(b, h) + i * ql.row;
  const S* kh = k + kl.offset(b, h);
  const S* vh = v + vl.offset(b, h);
  const std::int64_t visible = attention_visible(causal, i, n);
  double local_max = -INFINITY;
  for (std::int64_t j = threadIdx.x; j < visible; j += blockDim.x) {
    p[j] = scale * attention_dot(qi, kh + j * kl.row, n.head_dim);
    local_max = fmax(local_max, p[j]);
  }
  const double m = block_reduce<true>(local_max, scratch);
  double local_sum = 0;
  for (std::int64_t j = threadIdx.x; j < visible; j += blockDim.x) local_sum += (p[j] = exp(p[j] - m));
  const double l = block_reduce<false>(local_sum, scratch);  // its barriers publish p to the block
  if (n.dropout.active()) {  // after the sum: l is the softmax's denominator, of every probability
    const std::uint64_t hash = n.dropout.row(b, h, i);
    for (std::int64_t j = threadIdx.x; j < visible; j += blockDim.x) p[j] *= n.dropout.mask(hash, j);
    __syncthreads();
  }
  S* oi = out + ol.offset(b, h) + i * ol.row;
  for (std::int64_t e = threadIdx.x; e < n.value_dim; e += blockDim.x) {
    double acc = 0;
    for (std::int64_t j = 0; j < visible; ++j) acc += p[j] * double(vh[j * vl.row + e]);
    oi[e] = S(acc / l);
  }
  if (threadIdx.x == 0) lse[bh * n.queries + i] = S(m + ::log(l));
}

// D_i = sum_e dout_ie out_ie, per query row.
template <class S>
__global__ void attention_rowdot_kernel(AttentionDims n, const S* out, const S* dout, AttentionLayout ol, double* dvec) {
  __shared__ double scratch[32];
  const std::int64_t row = blockIdx.x, i = row % n.queries, bh = row / n.queries;
  const std::int64_t off = ol.offset(bh / n.heads, bh % n.heads) + i * ol.row;
  double s = 0;
  for (std::int64_t e = threadIdx.x; e < n.value_dim; e += blockDim.x) s += double(dout[off + e]) * double(out[off + e]);
  s = block_reduce<false>(s, scratch);
  if (threadIdx.x == 0) dvec[row] = s;
}

// dq_i = scale sum_j ds_ij k_j with ds_ij = p_ij (dout_i . v_j - D_i), per query row.
template <class S>
__global__ void attention_dq_kernel(AttentionDims n, const S* q, AttentionLayout ql, const S* k, AttentionLayout kl,
                                    const S* v, AttentionLayout vl, const S* dout, AttentionLayout ol, const S* lse,
                                    const double* dvec, double scale, bool causal, S* dq, AttentionLayout dql) {
  extern __shared__ double ds[];
  const std::int64_t row = blockIdx.x, i = row % n.queries, bh = row / n.queries;
  const std::int64_t b = bh / n.heads, h = bh % n.heads;
  const S* qi = q + ql.offset(b, h) + i * ql.row;
  const S* kh = k + kl.offset(b, h);
  const S* vh = v + vl.offset(b, h);
  const S* doi = dout + ol.offset(b, h) + i * ol.row;
  const std::int64_t visible = attention_visible(causal, i, n);
  const double li = double(lse[row]), di = dvec[row];
  const std::uint64_t hash = n.dropout.active() ? n.dropout.row(b, h, i) : 0;
  for (std::int64_t j = threadIdx.x; j < visible; j += blockDim.x) {
    const double pij = exp(scale * attention_dot(qi, kh + j * kl.row, n.head_dim) - li);
    const double mij = n.dropout.active() ? n.dropout.mask(hash, j) : 1.0;
    ds[j] = pij * (mij * attention_dot(doi, vh + j * vl.row, n.value_dim) - di);
  }
  __syncthreads();
  S* dqi = dq + dql.offset(b, h) + i * dql.row;
  for (std::int64_t e = threadIdx.x; e < n.head_dim; e += blockDim.x) {
    double acc = 0;
    for (std::int64_t j = 0; j < visible; ++j) acc += ds[j] * double(kh[j * kl.row + e]);
    dqi[e] = S(scale * acc);
  }
}

// dv_j = sum_i p_ij dout_i and dk_j = scale sum_i ds_ij q_i, per key row, over the queries that see key j.
template <class S>
__global__ void attention_dkdv_kernel(AttentionDims n, const S* q, AttentionLayout ql, const S* k, AttentionLayout kl,
                                      const S* v, AttentionLayout vl, const S* dout, AttentionLayout ol, const S* lse,
                                      const double* dvec, double scale, bool causal, S* dk, AttentionLayout dkl, S* dv,
                                      AttentionLayout dvl) {
  extern __shared__ double shared[];
  double* p = shared;               // p_ij for every query i
  double* ds = shared + n.queries;  // ds_ij
  const std::int64_t row = blockIdx.x, j = row % n.keys, bh = row / n.keys;
  const std::int64_t b = bh / n.heads, h = bh % n.heads;
  const S* qh = q + ql.offset(b, h);
  const S* kj = k + kl.offset(b, h) + j * kl.row;
  const S* vj = v + vl.offset(b, h) + j * vl.row;
  const S* doh = dout + ol.offset(b, h);
  for (std::int64_t i = threadIdx.x; i < n.queries; i += blockDim.x) {
    if (j < attention_visible(causal, i, n)) {
      const double pij = exp(scale * attention_dot(qh + i * ql.row, kj, n.head_dim) - double(lse[bh * n.queries + i]));
      const double mij = n.dropout.active() ? n.dropout.mask(n.dropout.row(b, h, i), j) : 1.0;
      p[i] = pij * mij;  // dv's weights: the dropped probabilities
      ds[i] = pij * (mij * attention_dot(doh + i * ol.row, vj, n.value_dim) - dvec[bh * n.queries + i]);
    } else {
      p[i] = ds[i] = 0;
    }
  }
  __syncthreads();
  S* dvj = dv + dvl.offset(b, h) + j * dvl.row;
  for (std::int64_t e = threadIdx.x; e < n.value_dim; e += blockDim.x) {
    double acc = 0;
    for (std::int64_t i = 0; i < n.queries; ++i) acc += p[i] * double(doh[i * ol.row + e]);
    dvj[e] = S(acc);
  }
  S* dkj = dk + dkl.offset(b, h) + j * dkl.row;
  for (std::int64_t e = threadIdx.x; e < n.head_dim; e += blockDim.x) {
    double acc = 0;
    for (std::int64_t i = 0; i < n.queries; ++i) acc += ds[i] * double(qh[i * ql.row + e]);
    dkj[e] = S(scale * acc);
  }
}

inline void check_attention_size(const AttentionDims& n) {
  TESSERA_CHECK(n.keys <= kMaxAttentionKeys && 2 * n.queries <= kMaxAttentionKeys, ShapeError,
                "attention on the GPU: ", n.queries, " queries and ", n.keys, " keys; this kernel takes at most ",
                kMaxAttentionKeys, " keys and ", kMaxAttentionKeys / 2, " queries per head");
}

}  // namespace cuda_detail

template <class S>
void attention_forward(Cuda, const AttentionDims& n, const S* q, AttentionLayout ql, const S* k, AttentionLayout kl,
                       const S* v, AttentionLayout vl, double scale, bool causal, S* out, AttentionLayout ol, S* lse) {
  const std::int64_t rows = n.batch * n.heads * n.queries;
  if (rows == 0) return;
  cuda_detail::check_attention_size(n);
  cuda_detail::attention_forward_kernel<S>
      <<<static_cast<unsigned>(rows), cuda_detail::kAttentionThreads, cuda_detail::attention_shared_bytes(n.keys),
         Cuda::stream()>>>(n, q, ql, k, kl, v, vl, scale, causal, out, ol, lse);
  TESSERA_CUDA_CHECK(cudaGetLastError());
}

template <class S>
void attention_backward(Cuda, const AttentionDims& n, const S* q, AttentionLayout ql, const S* k, AttentionLayout kl,
                        const S* v, AttentionLayout vl, const S* out, const S* dout, AttentionLayout ol, const S* lse,
                        double scale, bool causal, S* dq, AttentionLayout dql, S* dk, AttentionLayout dkl, S* dv,
                        AttentionLayout dvl) {
  const std::int64_t query_rows = n.batch * n.heads * n.queries, key_rows = n.batch * n.heads * n.keys;
  if (query_rows == 0 || key_rows == 0) return;
  cuda_detail::check_attention_size(n);
  cuda_detail::DeviceScratch dvec(static_cast<std::size_t>(query_rows) * sizeof(double));
  const auto threads = cuda_detail::kAttentionThreads;
  cuda_detail::attention_rowdot_kernel<S><<<static_cast<unsigned>(query_rows), threads, 0, Cuda::stream()>>>(
      n, out, dout, ol, dvec.as<double>());
  TESSERA_CUDA_CHECK(cudaGetLastError());
  cuda_detail::attention_dq_kernel<S>
      <<<static_cast<unsigned>(query_rows), threads, cuda_detail::attention_shared_bytes(n.keys), Cuda::stream()>>>(
          n, q, ql, k, kl, v, vl, dout, ol, lse, dvec.as<double>(), scale, causal, dq, dql);
  TESSERA_CUDA_CHECK(cudaGetLastError());
  cuda_detail::attention_dkdv_kernel<S>
      <<<static_cast<unsigned>(key_rows), threads, cuda_detail::attention_shared_bytes(2 * n.queries), Cuda::stream()>>>(
          n, q, ql, k, kl, v, vl, dout, ol, lse, dvec.as<double>(), scale, causal, dk, dkl, dv, dvl);
  TESSERA_CUDA_CHECK(cudaGetLastError());
  Cuda::synchronize();  // dvec is freed on return
}

}  // namespace tessera
