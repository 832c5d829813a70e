// Scaled dot-product attention on the CPU, fused and tiled (FlashAttention's scheme, Dao et al.
// 2022 and 2023): for every (batch b, head h)
//
//   scores = scale q k^T   (T, S)     p = softmax(scores) along the keys     out = p v   (T, dv)
//
// with q (T, d), k (S, d), v (S, dv), scale = 1/sqrt(d) by default, and, when causal, query i
// seeing only keys j <= i (torch's is_causal: the lower triangle of a (T, S) matrix of ones).
//
// Memory: the (T, S) matrix is never formed. Forward walks the keys in tiles of kKeyTile for a
// tile of kQueryTile queries and keeps the softmax online: per query row the running maximum m
// and sum l, and the output rescaled whenever m grows,
//   m' = max(m, max_j s_j)   l' = l e^(m - m') + sum_j e^(s_j - m')   o' = o e^(m - m') + sum_j e^(s_j - m') v_j
// then out = o / l, and lse = m + log l (the row's log-sum-exp, (T) per head) is all that backward
// keeps. Backward recomputes p = exp(scores - lse) tile by tile:
//   dv += p^T dout     dp = dout v^T     ds = p (dp - D)  with D_i = sum_e dout_ie out_ie
//   dq += scale ds k   dk += scale ds^T q
// So the extra memory is lse (T per head) plus one tile set per thread: linear in T, not T^2.
//
// Dropout on the probabilities (n.dropout, torch's dropout_p): out = (p o M) v with M = keep/(1-p)
// per element (kernels/dropout_key.hpp: a hash of (b, h, i, j), so backward computes M again and
// stores nothing). Forward sums the undropped p into l (the softmax is of the scores) and
// multiplies the tile by M only for the product with v. Backward: dv += (p o M)^T dout,
// dp = (dout v^T) o M, ds = p (dp - D) = (p o M) o (dout v^T) - p D, where D_i = sum_j
// (p o M)_ij (dout v^T)_ij = sum_e dout_ie out_ie still (out is the dropped product).
// The tile products are gemm's serial products (kernels/cpu/gemm.hpp: OpenBLAS or Eigen on the
// calling thread). Forward splits (head, query tile) pairs over the OpenMP team, backward the
// heads (dq of a head collects from every key tile, so one thread owns a head).
//
// Strided operands: element (b, h, i, e) of an operand sits at b*batch + h*head + i*row + e
// (AttentionLayout), so the heads of a (B, T, 3C) c_attn output or of a (B, T, C) output are
// read and written in place, without a transpose to (B, H, T, d).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "tessera/core/scratch.hpp"
#include "tessera/device/cpu.hpp"
#include "tessera/kernels/cpu/compiled.hpp"
#include "tessera/kernels/cpu/fast_exp.hpp"
#include "tessera/kernels/attention_dims.hpp"
#include "tessera/kernels/cpu/gemm.hpp"
#include "tessera/kernels/dropout_key.hpp"

namespace tessera {

namespace detail {
inline constexpr std::int64_t kQueryTile = 64;
inline constexpr std::int64_t kKeyTile = 64;

// Keys [0, end) that query i may see: all, or j <= i + offset (none when that is negative).
inline std::int64_t visible_keys(bool causal, std::int64_t i, const AttentionDims& n) {
  return causal ? std::clamp<std::int64_t>(i + 1 + n.causal_offset, 0, n.keys) : n.keys;
}
}  // namespace detail

// out (strided) and lse (B, H, T contiguous) from q, k, v (strided).
template <class S>
void attention_forward(Cpu, const AttentionDims& n, const S* q, AttentionLayout ql, const S* k, AttentionLayout kl,
                       const S* v, AttentionLayout vl, double scale, bool causal, S* out, AttentionLayout ol, S* lse) {
  using detail::kKeyTile;
  using detail::kQueryTile;
  const std::int64_t d = n.head_dim, dv = n.value_dim;
  const std::int64_t query_tiles = (n.queries + kQueryTile - 1) / kQueryTile;
  const std::int64_t items = n.batch * n.heads * query_tiles;
  const S neg_inf = -std::numeric_limits<S>::infinity();
  const bool drop = n.dropout.active();
  const std::uint64_t threshold = n.dropout.threshold();
  const S keep_scale = drop ? static_cast<S>(n.dropout.scale()) : S(1);
  detail::DynamicItems schedule;  // the team's items, taken one at a time
  detail::run_in_team_if(true, [&] {
    // Per thread: scores/probabilities (Br, Bc), the output accumulator (Br, dv), m and l (Br).
    S* tile = scratch<S>(kQueryTile * kKeyTile + kQueryTile * dv + 2 * kQueryTile);
    S* acc = tile + kQueryTile * kKeyTile;
    S* m = acc + kQueryTile * dv;
    S* l = m + kQueryTile;
    for (std::int64_t item = schedule.first(); item < items; item = schedule.next()) {
      const std::int64_t bh = item / query_tiles, qt = item % query_tiles;
      const std::int64_t b = bh / n.heads, h = bh % n.heads;
      const std::int64_t i0 = qt * kQueryTile, rows = std::min(kQueryTile, n.queries - i0);
      const S* qi = q + ql.offset(b, h) + i0 * ql.row;
      const S* kh = k + kl.offset(b, h);
      const S* vh = v + vl.offset(b, h);
      std::fill(acc, acc + rows * dv, S(0));
      std::fill(m, m + rows, neg_inf);
      std::fill(l, l + rows, S(0));
      const std::int64_t key_end = detail::visible_keys(causal, i0 + rows - 1, n);
      for (std::int64_t j0 = 0; j0 < key_end; j0 += kKeyTile) {
        const std::int64_t cols = std::min(kKeyTile, key_end - j0);
        gemm(Cpu{}, false, true, rows, cols, d, static_cast<S>(scale), qi, ql.row, kh + j0 * kl.row, kl.row, S(0),
             tile, kKeyTile);
        for (std::int64_t r = 0; r < rows; ++r) {
          S* s = tile + r * kKeyTile;
          const std::int64_t valid = std::clamp<std::int64_t>(detail::visible_keys(causal, i0 + r, n) - j0, 0, cols);
          S mx = neg_inf;
#pragma omp simd reduction(max : mx)
          for (std::int64_t c = 0; c < valid; ++c) mx = std::max(mx, s[c]);
          const S m_new = std::max(m[r], mx);
          if (m_new == neg_inf) {  // nothing visible yet (or every score -inf): no mass
            std::fill(s, s + cols, S(0));
            continue;
          }
          const S alpha = std::exp(m[r] - m_new);
          S sum = 0;
#pragma omp simd reduction(+ : sum)
          for (std::int64_t c = 0; c < valid; ++c) {
            s[c] = detail::exp_le0(s[c] - m_new);
            sum += s[c];
          }
          std::fill(s + valid, s + cols, S(0));
          if (drop) {  // after the sum: l is the softmax's denominator, of every probability
            const std::uint64_t row = n.dropout.row(b, h, i0 + r);
            for (std::int64_t c = 0; c < valid; ++c)
              s[c] *= DropoutKey::keeps(row, j0 + c, threshold) ? keep_scale : S(0);
          }
          l[r] = l[r] * alpha + sum;
          m[r] = m_new;
          if (alpha != S(1)) {
            S* o = acc + r * dv;
            for (std::int64_t e = 0; e < dv; ++e) o[e] *= alpha;
          }
        }
        gemm(Cpu{}, false, false, rows, dv, cols, S(1), tile, kKeyTile, vh + j0 * vl.row, vl.row, S(1), acc, dv);
      }
      S* oi = out + ol.offset(b, h) + i0 * ol.row;
      S* lse_i = lse + bh * n.queries + i0;
      for (std::int64_t r = 0; r < rows; ++r) {
        const S inv = S(1) / l[r];
        for (std::int64_t e = 0; e < dv; ++e) oi[r * ol.row + e] = acc[r * dv + e] * inv;
        lse_i[r] = m[r] + std::log(l[r]);
      }
    }
  });
}

// dq, dk, dv (strided; overwritten) from dout (laid out as out), out and lse of forward.
template <class S>
void attention_backward(Cpu, const AttentionDims& n, const S* q, AttentionLayout ql, const S* k, AttentionLayout kl,
                        const S* v, AttentionLayout vl, const S* out, const S* dout, AttentionLayout ol, const S* lse,
                        double scale, bool causal, S* dq, AttentionLayout dql, S* dk, AttentionLayout dkl, S* dv,
                        AttentionLayout dvl) {
  using detail::kKeyTile;
  using detail::kQueryTile;
  const std::int64_t d = n.head_dim, dvw = n.value_dim, heads = n.batch * n.heads;
  const S sc = static_cast<S>(scale);
  const bool drop = n.dropout.active();
  const std::uint64_t threshold = n.dropout.threshold();
  const S keep_scale = drop ? static_cast<S>(n.dropout.scale()) : S(1);
  detail::DynamicItems schedule;  // the team's heads, taken one at a time
  detail::run_in_team_if(true, [&] {
    // Per thread: p and ds tiles (Br, Bc), and D (T); with dropout also p o M (Br, Bc).
    S* p = scratch<S>((drop ? 3 : 2) * kQueryTile * kKeyTile + n.queries);
    S* ds = p + kQueryTile * kKeyTile;
    S* dvec = ds + kQueryTile * kKeyTile;
    S* pm = dvec + n.queries;
    for (std::int64_t bh = schedule.first(); bh < heads; bh = schedule.next()) {
      const std::int64_t b = bh / n.heads, h = bh % n.heads;
      const S* qh = q + ql.offset(b, h);
      const S* kh = k + kl.offset(b, h);
      const S* vh = v + vl.offset(b, h);
      const S* oh = out + ol.offset(b, h);
      const S* doh = dout + ol.offset(b, h);
      const S* lse_h = lse + bh * n.queries;
      S* dqh = dq + dql.offset(b, h);
      S* dkh = dk + dkl.offset(b, h);
      S* dvh = dv + dvl.offset(b, h);
      for (std::int64_t i = 0; i < n.queries; ++i) {
        double sum = 0;
        for (std::int64_t e = 0; e < dvw; ++e) sum += static_cast<double>(doh[i * ol.row + e]) * oh[i * ol.row + e];
        dvec[i] = static_cast<S>(sum);
        std::fill_n(dqh + i * dql.row, d, S(0));
      }
      for (std::int64_t j = 0; j < n.keys; ++j) {
        std::fill_n(dkh + j * dkl.row, d, S(0));
        std::fill_n(dvh + j * dvl.row, dvw, S(0));
      }
      for (std::int64_t j0 = 0; j0 < n.keys; j0 += kKeyTile) {
        const std::int64_t cols = std::min(kKeyTile, n.keys - j0);
        // Causal: query tiles whose last query sees no key of this tile are skipped.
        const std::int64_t first =
            causal ? (std::clamp<std::int64_t>(j0 - n.causal_offset, 0, n.queries) / kQueryTile) * kQueryTile : 0;
        for (std::int64_t i0 = first; i0 < n.queries; i0 += kQueryTile) {
          const std::int64_t rows = std::min(kQueryTile, n.queries - i0);
          if (causal && detail::visible_keys(causal, i0 + rows - 1, n) <= j0) continue;
          gemm(Cpu{}, false, true, rows, cols, d, sc, qh + i0 * ql.row, ql.row, kh + j0 * kl.row, kl.row, S(0), p,
               kKeyTile);
          for (std::int64_t r = 0; r < rows; ++r) {
            S* pr = p + r * kKeyTile;
            const S li = lse_h[i0 + r];
            const std::int64_t valid =
                std::clamp<std::int64_t>(detail::visible_keys(causal, i0 + r, n) - j0, 0, cols);
            for (std::int64_t c = 0; c < valid; ++c) pr[c] = detail::exp_le0(pr[c] - li);
            std::fill(pr + valid, pr + cols, S(0));
            if (drop) {
              S* pmr = pm + r * kKeyTile;
              dropout_row_mask(n.dropout.row(b, h, i0 + r), threshold, keep_scale, j0, cols, pmr);
              for (std::int64_t c = 0; c < cols; ++c) pmr[c] *= pr[c];
            }
          }
          const S* doi = doh + i0 * ol.row;
          // dv_j += (p o M)^T dout_i;  dp = dout_i v_j^T (into ds)
          gemm(Cpu{}, true, false, cols, dvw, rows, S(1), drop ? pm : p, kKeyTile, doi, ol.row, S(1),
               dvh + j0 * dvl.row, dvl.row);
          gemm(Cpu{}, false, true, rows, cols, dvw, S(1), doi, ol.row, vh + j0 * vl.row, vl.row, S(0), ds, kKeyTile);
          for (std::int64_t r = 0; r < rows; ++r) {
            const S di = dvec[i0 + r];
            S* dsr = ds + r * kKeyTile;
            const S* pr = p + r * kKeyTile;
            if (drop) {
              const S* pmr = pm + r * kKeyTile;
              for (std::int64_t c = 0; c < cols; ++c) dsr[c] = pmr[c] * dsr[c] - pr[c] * di;
            } else {
              for (std::int64_t c = 0; c < cols; ++c) dsr[c] = pr[c] * (dsr[c] - di);
            }
          }
          // dq_i += scale ds k_j;  dk_j += scale ds^T q_i
          gemm(Cpu{}, false, false, rows, d, cols, sc, ds, kKeyTile, kh + j0 * kl.row, kl.row, S(1),
               dqh + i0 * dql.row, dql.row);
          gemm(Cpu{}, true, false, cols, d, rows, sc, ds, kKeyTile, qh + i0 * ql.row, ql.row, S(1),
               dkh + j0 * dkl.row, dkl.row);
        }
      }
    }
  });
}

// Compiled once in compiled-kernels mode (kernels/cpu/compiled.hpp).
#define TESSERA_CPU_ATTENTION_INSTANCES(PREFIX, S)                                                                \
  PREFIX template void attention_forward<S>(Cpu, const AttentionDims&, const S*, AttentionLayout, const S*,          \
                                            AttentionLayout, const S*, AttentionLayout, double, bool, S*,           \
                                            AttentionLayout, S*);                                                   \
  PREFIX template void attention_backward<S>(Cpu, const AttentionDims&, const S*, AttentionLayout, const S*,         \
                                             AttentionLayout, const S*, AttentionLayout, const S*, const S*,         \
                                             AttentionLayout, const S*, double, bool, S*, AttentionLayout, S*,       \
                                             AttentionLayout, S*, AttentionLayout);
TESSERA_CPU_KERNEL_INSTANCES(TESSERA_CPU_ATTENTION_INSTANCES)

}  // namespace tessera
