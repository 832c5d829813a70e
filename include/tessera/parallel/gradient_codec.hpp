// Gradient codecs: how DataParallel reduces one bucket of gradients across ranks (PyTorch: a DDP
// communication hook, register_comm_hook). DataParallel packs a bucket, the codec encodes it and
// starts its collectives, and once they are done decodes the average back into the bucket:
//
//   AverageCodec  all_reduce(Avg) in the model's scalar type (GradientCompression::None)
//   Fp16Codec     cast to IEEE half, all_reduce(Avg) in half, cast back: half the bytes (Fp16)
//   Bf16Codec     the same in bfloat16: float's range, 8 significant bits (Bf16)
//   TopKCodec     error feedback (Stich et al. 2018; Lin et al. 2018): send the k = ceil(ratio n)
//                 largest entries of gradient + residual as (index, value) pairs with two
//                 all_gathers, keep the rest as the next residual (TopK)
//
// A user's codec derives from GradientCodec<E> and is installed with dp.register_codec(...): about
// 15 lines for a float64 model whose gradients travel as float32 (tests/parallel/test_strategy.cpp).
//
// The contract. launch() gets the bucket's values: its gradients and, in the last bucket, one more
// value, the step's error flag, which must come back averaged over ranks like a gradient (it is how
// every rank learns that one rank's step failed, with no extra collective). decode() runs once the
// work launch() returned is complete, and leaves the average in the same values. Every rank issues
// the same collectives in the same order (DataParallel launches buckets in order). commit(bucket)
// runs when the whole step succeeded on every rank: state that a failed step must not change (the
// residual) moves forward there. save_state/load_state keep per-rank state across a checkpoint.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "tessera/comm/communicator.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/half.hpp"
#include "tessera/parallel/strategy.hpp"

namespace tessera {

// One bucket as a codec sees it.
template <class S>
struct CodecBucket {
  std::size_t index = 0;     // bucket number, in launch order (the same on every rank)
  std::span<S> values;       // the gradients, then (has_flag) the error flag
  std::size_t elements = 0;  // gradients: values.size() - has_flag
  bool has_flag = false;
};

// The collectives a codec started for a bucket (at most two); default: nothing pending.
struct CodecWork {
  Work first, second;
};

// all_reduce(Avg) of `values` on this thread (blocking: done on return) or started asynchronously:
// the reduction most codecs run on what they encoded.
template <class Comm, class T>
CodecWork average_over_ranks(Comm& comm, std::span<T> values, bool blocking) {
  if (!blocking) return {comm.all_reduce_async(values, ReduceOp::Avg), Work()};
  comm.all_reduce(values, ReduceOp::Avg);
  return {};
}

template <class E>
class GradientCodec {
 public:
  using S = typename E::Scalar;
  using Comm = typename E::Comm;
  virtual ~GradientCodec() = default;
  virtual std::string name() const = 0;
  // Once the buckets are laid out (and again if they change): each bucket's gradient count.
  virtual void start(const std::vector<std::size_t>& /*bucket_elements*/) {}
  // Encodes the bucket and starts its reduction. blocking: the collectives run on this thread and
  // are done on return.
  virtual CodecWork launch(Comm& comm, const CodecBucket<S>& bucket, bool blocking) = 0;
  // After launch's work completed: the average over ranks of every rank's values, into values.
  virtual void decode(Comm& comm, const CodecBucket<S>& bucket) = 0;
  virtual void commit(std::size_t /*bucket*/) {}
  // Error feedback: this rank's share of bucket's gradients not yet sent (empty for a codec that
  // sends everything), in the bucket's layout.
  virtual std::span<const S> residual(std::size_t /*bucket*/) const { return {}; }
  virtual void save_state(StrategyState&) const {}
  virtual void load_state(const StrategyState&) {}
};

// all_reduce(Avg) of the values themselves.
template <class E>
class AverageCodec final : public GradientCodec<E> {
 public:
  using typename GradientCodec<E>::S;
  using typename GradientCodec<E>::Comm;
  std::string name() const override { return "none"; }
  CodecWork launch(Comm& comm, const CodecBucket<S>& b, bool blocking) override {
    return average_over_ranks(comm, b.values, blocking);
  }
  void decode(Comm&, const CodecBucket<S>&) override {}
};

// A 16-bit float W on the wire (Half: IEEE fp16; BHalf: bfloat16): cast down, all_reduce(Avg) in W
// (reduced in float per element and rounded once, comm/reduce.hpp), cast back. Half keeps 11
// significant bits but only |x| < 65504; BHalf keeps float's range with 8 bits (relative error
// <= 2^-9 per rounding), so gradients that overflow fp16 (unscaled losses, large activations)
// still travel as bf16 (PyTorch: bf16_compress_hook).
template <class E, class W>
class CastCodec final : public GradientCodec<E> {
  static_assert(is_16bit_float_v<W>, "CastCodec: the wire type must be Half or BHalf");

 public:
  using typename GradientCodec<E>::S;
  using typename GradientCodec<E>::Comm;
  std::string name() const override { return std::is_same_v<W, Half> ? "fp16" : "bf16"; }
  CodecWork launch(Comm& comm, const CodecBucket<S>& b, bool blocking) override {
    std::vector<W>& cast = wire(b.index);
    cast.resize(b.values.size());
    for (std::size_t i = 0; i < cast.size(); ++i) cast[i] = W(static_cast<float>(b.values[i]));
    return average_over_ranks(comm, std::span<W>(cast), blocking);
  }
  void decode(Comm&, const CodecBucket<S>& b) override {
    const std::vector<W>& cast = wire(b.index);
    for (std::size_t i = 0; i < cast.size(); ++i) b.values[i] = static_cast<S>(static_cast<float>(cast[i]));
  }

 private:
  std::vector<W>& wire(std::size_t bucket) {
    if (wire_.size() <= bucket) wire_.resize(bucket + 1);
    return wire_[bucket];
  }
  std::vector<std::vector<W>> wire_;  // per bucket: kept, so a step allocates nothing
};

template <class E>
using Fp16Codec = CastCodec<E, Half>;
// Needs a communicator that sends BHalf (BHalfCommunicator: every Tessera communicator does).
template <class E>
using Bf16Codec = CastCodec<E, BHalf>;

// Top-k sparsification with error feedback. Over steps, the applied updates plus the residuals
// (averaged over ranks) sum exactly to the true averaged gradients: nothing is lost, only delayed.
template <class E>
class TopKCodec final : public GradientCodec<E> {
 public:
  using typename GradientCodec<E>::S;
  using typename GradientCodec<E>::Comm;

  explicit TopKCodec(double ratio) : ratio_(ratio) {
    TESSERA_CHECK(ratio > 0 && ratio <= 1, ArgumentError, "TopKCodec: ratio=", ratio, " must lie in (0, 1]");
  }
  std::string name() const override { return "topk"; }
  void start(const std::vector<std::size_t>& bucket_elements) override {
    buckets_.resize(bucket_elements.size());
    for (std::size_t k = 0; k < buckets_.size(); ++k) buckets_[k].residual.resize(bucket_elements[k], S(0));
  }

  CodecWork launch(Comm& comm, const CodecBucket<S>& b, bool blocking) override {
    PerBucket& s = buckets_.at(b.index);
    const std::size_t n = b.elements;
    const std::size_t k = std::min(n, static_cast<std::size_t>(std::ceil(ratio_ * static_cast<double>(n))));
    s.residual.resize(n, S(0));
    S* flat = b.values.data();
    for (std::size_t i = 0; i < n; ++i) flat[i] += s.residual[i];  // corrected gradient
    s.order.resize(n);
    for (std::size_t i = 0; i < n; ++i) s.order[i] = static_cast<std::int64_t>(i);
    // The k largest magnitudes, ties broken by index so every run selects the same set. NaN ranks
    // as the largest (and so is sent and shows up in every rank's update) rather than breaking the
    // strict weak order nth_element needs.
    auto magnitude = [&](std::int64_t x) {
      const S v = flat[x];
      return std::isnan(v) ? std::numeric_limits<S>::infinity() : std::abs(v);
    };
    auto larger = [&](std::int64_t x, std::int64_t y) {
      const S ax = magnitude(x), ay = magnitude(y);
      return ax > ay || (ax == ay && x < y);
    };
    std::nth_element(s.order.begin(), s.order.begin() + static_cast<std::ptrdiff_t>(k), s.order.end(), larger);
    // Sent: k (index, value) pairs, plus for the last bucket the flag as a final index with value 0.
    const std::size_t sent = k + (b.has_flag ? 1 : 0);
    s.sent_index.assign(s.order.begin(), s.order.begin() + static_cast<std::ptrdiff_t>(k));
    std::sort(s.sent_index.begin(), s.sent_index.end());
    s.sent_value.resize(sent);
    s.next_residual.assign(flat, flat + n);
    for (std::size_t j = 0; j < k; ++j) {
      const auto i = static_cast<std::size_t>(s.sent_index[j]);
      s.sent_value[j] = flat[i];
      s.next_residual[i] = S(0);  // sent: no error left at this index
    }
    if (b.has_flag) {
      s.sent_index.push_back(flat[n] != S(0) ? 1 : 0);
      s.sent_value[k] = S(0);
    }
    s.all_index.resize(sent * static_cast<std::size_t>(comm.size()));
    s.all_value.resize(sent * static_cast<std::size_t>(comm.size()));
    const std::span<const std::int64_t> sent_index(s.sent_index);
    const std::span<const S> sent_value(s.sent_value);
    if (blocking) {
      comm.all_gather(sent_index, std::span<std::int64_t>(s.all_index));
      comm.all_gather(sent_value, std::span<S>(s.all_value));
      return {};
    }
    return {comm.all_gather_async(sent_index, std::span<std::int64_t>(s.all_index)),
            comm.all_gather_async(sent_value, std::span<S>(s.all_value))};
  }

  // Rank r's block of the gathered lists: its k pairs, then (last bucket) its flag.
  void decode(Comm& comm, const CodecBucket<S>& b) override {
    const PerBucket& s = buckets_.at(b.index);
    S* flat = b.values.data();
    std::fill(b.values.begin(), b.values.end(), S(0));
    const std::size_t per_rank = s.all_index.size() / static_cast<std::size_t>(comm.size());
    const std::size_t k = per_rank - (b.has_flag ? 1 : 0);
    for (std::size_t j = 0; j < s.all_index.size(); ++j) {
      const auto i = static_cast<std::size_t>(s.all_index[j]);
      if (j % per_rank < k) flat[i] += s.all_value[j];
      else flat[b.elements] += static_cast<S>(i);  // a flag, 0 or 1
    }
    const S inv = S(1) / static_cast<S>(comm.size());
    for (S& v : b.values) v *= inv;
  }

  void commit(std::size_t bucket) override { buckets_.at(bucket).residual.swap(buckets_.at(bucket).next_residual); }

  // This rank's share of the gradient not yet sent, per bucket: a resume without it would drop up
  // to 1/ratio steps' worth of small gradients.
  void save_state(StrategyState& state) const override {
    for (std::size_t k = 0; k < buckets_.size(); ++k)
      state.put(state_name(k), std::span<const S>(buckets_[k].residual));
  }
  void load_state(const StrategyState& state) override {
    for (std::size_t k = 0; k < buckets_.size(); ++k) state.get(state_name(k), std::span<S>(buckets_[k].residual));
  }

  std::span<const S> residual(std::size_t bucket) const override { return buckets_.at(bucket).residual; }

 private:
  static std::string state_name(std::size_t bucket) { return "DataParallel.topk_residual.bucket" + std::to_string(bucket); }

  struct PerBucket {
    std::vector<S> residual, next_residual;                   // error feedback (next: once the step succeeds)
    std::vector<std::int64_t> order, sent_index, all_index;   // selection scratch, exchanged indices
    std::vector<S> sent_value, all_value;                     // exchanged values
  };
  double ratio_;
  std::vector<PerBucket> buckets_;
};

}  // namespace tessera
