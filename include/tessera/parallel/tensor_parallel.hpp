// Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): one layer's weight split across the
// ranks of `comm`, every rank seeing the same batch.
//
// ColumnParallelLinear: W (out, in) split by output rows, rank r holds W_r (out/p, in), b_r.
//   forward   y_r = f(x) W_r^T + b_r            (N, out/p); gather_output: all_gather -> (N, out)
//   backward  dW_r += dy_r^T x, db_r += sum dy_r; dx = sum_r dy_r W_r: all_reduce(sum) = f's backward
// RowParallelLinear: W split by input columns, rank r holds W_r (out, in/p); b is replicated.
//   forward   y = g(x_r W_r^T) + b               g = all_reduce(sum); x_r = columns r of x, or
//                                                 x itself when input_is_parallel (it came split)
//   backward  dW_r += dy^T x_r, db += sum dy; dx_r = dy W_r (no communication: g's backward is
//             the identity); unless input_is_parallel, all_gather the dx_r into dx (N, in)
// f (identity forward, all-reduce backward) and g (all-reduce forward, identity backward) are
// Megatron's conjugate operators. Column then row, with input_is_parallel on the row layer and
// no gather on the column layer, is the tensor-parallel MLP: one all-reduce forward, one
// backward, and the hidden activation (N, hidden/p) never leaves its rank.
//
// Both layers are built from the dense layer's initialization: the full W and b are drawn from
// `rng` exactly as Linear(in, out, rng) draws them and each rank keeps its slice, so a
// tensor-parallel model built with the same seed equals the dense one. Requires out (column) or
// in (row) divisible by the number of ranks. The communicator outlives the layer.
//
// Agreement: each layer's constructor checks (one all_gather of two int64) that every rank builds
// it with the same sizes and options and from the same dense values (one checksum per tensor):
// ranks seeded differently would hold slices of different layers and different replicated biases,
// and train a model that is none of them, silently (parallel/agreement.hpp).
//
// Timeline (set_timeline, on a layer or the MLP block): each collective a layer runs becomes a
// span on the communication lane, named with what it moves and its size ("all_reduce y (row
// layer: g): 2.5 KiB"), so a trace shows where tensor parallelism communicates inside a step.
#pragma once

#include <cstdio>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "tessera/comm/communicator.hpp"
#include "tessera/core/concepts.hpp"
#include "tessera/core/parameter.hpp"
#include "tessera/core/span_sink.hpp"
#include "tessera/kernels/elementwise.hpp"
#include "tessera/kernels/gemm.hpp"
#include "tessera/layers/activation.hpp"
#include "tessera/parallel/strategy.hpp"
#include "tessera/layers/linear.hpp"
#include "tessera/parallel/agreement.hpp"

namespace tessera {

namespace detail {
// (p, N, w) blocks, as all_gather lays them out, -> (N, p w) rows; and back.
template <class D, class S>
void blocks_to_rows(const S* blocks, std::int64_t p, std::int64_t n, std::int64_t w, S* rows) {
  for (std::int64_t r = 0; r < p; ++r) copy_2d(D{}, rows + r * w, p * w, blocks + r * n * w, w, w, n);
}
// Columns [r w, (r + 1) w) of (N, p w) rows -> (N, w).
template <class D, class S>
void columns_of(const S* rows, std::int64_t n, std::int64_t total, std::int64_t first, std::int64_t w, S* out) {
  copy_2d(D{}, out, w, rows + first, total, w, n);
}
// Every rank of `comm` splits the same dense layer the same way (checked before anything is
// sliced, so that a split that cannot work fails on every rank alike); returns comm.
template <class Comm, class E>
Comm& agreed_split(Comm& comm, const char* layer, Linear<E>& dense, const char* option, bool value) {
  AgreementRecord record(layer);
  record.add("layer", layer);
  record.add("in_features", dense.weight().value.dim(1));
  record.add("out_features", dense.weight().value.dim(0));
  record.add(option, value);
  const auto named = named_tensors(dense);
  record.add_named_tensors(named, "dense.");
  record.add_checksums(named, "dense ");
  check_agreement(comm, record,
                  "every rank must build the layer with the same sizes and options, from the same seed");
  return comm;
}
// A collective that began at `began` and has just finished, as a span "<what> (<size>)" when a
// timeline records.
inline void record_collective(SpanSink* timeline, const char* what, std::size_t bytes, SpanSink::Clock::time_point began) {
  if (timeline == nullptr) return;
  char size[32];
  std::snprintf(size, sizeof size, ": %.1f KiB", static_cast<double>(bytes) / 1024.0);
  timeline->add(std::string(what) + size, "communication", began, SpanSink::Clock::now(), SpanSink::kCommunication);
}
inline std::int64_t checked_shard(std::int64_t features, int ranks, const char* layer, const char* what) {
  TESSERA_CHECK(features % ranks == 0, ArgumentError, layer, ": ", what, "=", features,
                " does not divide over ", ranks, " ranks");
  return features / ranks;
}
}  // namespace detail

template <class E>
class ColumnParallelLinear {
 public:
  using Comm = typename E::Comm;
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  struct Cache {
    const Tensor* x = nullptr;
    Tensor y_local, y, dy_local, dx;
    Tensor gathered;
  };

  ColumnParallelLinear(std::int64_t in_features, std::int64_t out_features, Rng& rng, Comm& comm,
                       bool gather_output = true, bool bias = true)
      : ColumnParallelLinear(Linear<E>(in_features, out_features, rng, bias), comm, gather_output) {}

  // The rank's rows of an existing dense layer (the same on every rank).
  ColumnParallelLinear(Linear<E> dense, Comm& comm, bool gather_output = true)
      : comm_(&detail::agreed_split(comm, "ColumnParallelLinear", dense, "gather_output", gather_output)),
        in_(dense.weight().value.dim(1)),
        out_(dense.weight().value.dim(0)),
        local_(detail::checked_shard(out_, comm.size(), "ColumnParallelLinear", "out_features")),
        gather_output_(gather_output),
        has_bias_(dense_bias(dense) != nullptr),
        weight_(Shape{local_, in_}) {
    const std::int64_t first = local_ * comm.rank();
    D::copy(weight_.value.data(), dense.weight().value.data() + first * in_, weight_.value.bytes());
    if (has_bias_) {
      bias_ = Parameter<S, D>(Shape{local_}, ParamKind::Bias);
      D::copy(bias_.value.data(), dense_bias(dense)->data() + first, bias_.value.bytes());
    }
  }

  const Tensor& forward(const Tensor& x, Cache& c) {
    TESSERA_CHECK(x.rank() == 2 && x.dim(1) == in_, ShapeError, "ColumnParallelLinear(", in_, ", ", out_,
                  "): expected input (N, ", in_, "), got ", x.shape());
    const auto n = x.dim(0);
    c.x = &x;
    c.y_local.resize({n, local_});
    if (has_bias_) broadcast_rows(D{}, bias_.value.data(), n, local_, c.y_local.data());
    gemm_in<typename E::Compute>(D{}, false, true, n, local_, in_, S(1), x.data(), in_, weight_.value.data(), in_, has_bias_ ? S(1) : S(0),
         c.y_local.data(), local_);
    if (!gather_output_) return c.y_local;
    const auto p = static_cast<std::int64_t>(comm_->size());
    c.gathered.resize({p * n * local_});
    const auto began = SpanSink::Clock::now();
    comm_->all_gather(std::span<const S>(c.y_local.data(), static_cast<std::size_t>(n * local_)), c.gathered.span());
    detail::record_collective(timeline_, "all_gather y (column layer)", c.gathered.bytes(), began);
    c.y.resize({n, out_});
    detail::blocks_to_rows<D>(c.gathered.data(), p, n, local_, c.y.data());
    return c.y;
  }

  const Tensor& backward(const Tensor& dy, Cache& c) {
    TESSERA_CHECK(c.x != nullptr, Error, "ColumnParallelLinear::backward called before forward on this cache");
    const Tensor& x = *c.x;
    const auto n = x.dim(0);
    const Tensor* dy_local = &dy;
    if (gather_output_) {
      TESSERA_CHECK(dy.rank() == 2 && dy.dim(0) == n && dy.dim(1) == out_, ShapeError, "ColumnParallelLinear::backward: dy ",
                    dy.shape(), " is not (", n, ", ", out_, ")");
      c.dy_local.resize({n, local_});
      detail::columns_of<D>(dy.data(), n, out_, local_ * comm_->rank(), local_, c.dy_local.data());
      dy_local = &c.dy_local;
    } else {
      TESSERA_CHECK(dy.shape() == c.y_local.shape(), ShapeError, "ColumnParallelLinear::backward: dy ", dy.shape(),
                    " does not match this rank's output ", c.y_local.shape());
    }
    detail::linear_parameter_grads<typename E::Compute>(dy_local->data(), x.data(), n, local_, in_, weight_, has_bias_ ? &bias_ : nullptr);
    if (!needs_input_grad_) return c.dx;  // the first layer: nobody consumes dL/dx, skip f's all-reduce
    // f's backward: each rank has its output slice's share of dL/dx; the sum is dL/dx.
    c.dx.resize({n, in_});
    gemm_in<typename E::Compute>(D{}, false, false, n, in_, local_, S(1), dy_local->data(), local_, weight_.value.data(), in_, S(0), c.dx.data(), in_);
    const auto began = SpanSink::Clock::now();
    comm_->all_reduce(std::span<S>(c.dx.data(), static_cast<std::size_t>(c.dx.numel())), ReduceOp::Sum);
    detail::record_collective(timeline_, "all_reduce dx (column layer: f's backward)", c.dx.bytes(), began);
    return c.dx;
  }

  template <class V>
  void visit(V& v, const std::string& prefix) {
    v.parameter(prefix + "weight", weight_);
    if (has_bias_) v.parameter(prefix + "bias", bias_);
  }
  void set_mode(Mode) {}
  void set_needs_input_grad(bool needed) { needs_input_grad_ = needed; }
  // Records this layer's collectives into `timeline` from now on (nullptr: stop).
  void set_timeline(SpanSink* timeline) { timeline_ = timeline; }
  Parameter<S, D>& weight() { return weight_; }
  std::int64_t local_out_features() const { return local_; }

 private:
  static const Tensor* dense_bias(Linear<E>& dense) {
    struct Find {
      const Tensor* bias = nullptr;
      void parameter(const std::string& name, Parameter<S, D>& p) {
        if (name == "bias") bias = &p.value;
      }
      void buffer(const std::string&, Tensor&) {}
    } find;
    dense.visit(find, "");
    return find.bias;
  }
  template <class>
  friend class RowParallelLinear;

  Comm* comm_;
  std::int64_t in_, out_, local_;
  bool gather_output_, has_bias_;
  bool needs_input_grad_ = true;
  SpanSink* timeline_ = nullptr;
  Parameter<S, D> weight_;
  Parameter<S, D> bias_{Shape{0}, ParamKind::Bias};
};

template <class E>
class RowParallelLinear {
 public:
  using Comm = typename E::Comm;
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  struct Cache {
    const Tensor* x = nullptr;  // this rank's input columns (N, in/p)
    Tensor x_local, y, dx_local, dx;
    Tensor gathered;
  };

  RowParallelLinear(std::int64_t in_features, std::int64_t out_features, Rng& rng, Comm& comm,
                    bool input_is_parallel = false, bool bias = true)
      : RowParallelLinear(Linear<E>(in_features, out_features, rng, bias), comm, input_is_parallel) {}

  // The rank's columns of an existing dense layer (the same on every rank); its bias, if any, is
  // replicated.
  RowParallelLinear(Linear<E> dense, Comm& comm, bool input_is_parallel = false)
      : comm_(&detail::agreed_split(comm, "RowParallelLinear", dense, "input_is_parallel", input_is_parallel)),
        in_(dense.weight().value.dim(1)),
        out_(dense.weight().value.dim(0)),
        local_(detail::checked_shard(in_, comm.size(), "RowParallelLinear", "in_features")),
        input_is_parallel_(input_is_parallel),
        has_bias_(ColumnParallelLinear<E>::dense_bias(dense) != nullptr),
        weight_(Shape{out_, local_}) {
    const std::int64_t first = local_ * comm.rank();
    detail::columns_of<D>(dense.weight().value.data(), out_, in_, first, local_, weight_.value.data());
    if (has_bias_) {
      bias_ = Parameter<S, D>(Shape{out_}, ParamKind::Bias);
      D::copy(bias_.value.data(), ColumnParallelLinear<E>::dense_bias(dense)->data(), bias_.value.bytes());
    }
  }

  const Tensor& forward(const Tensor& x, Cache& c) {
    const std::int64_t expected = input_is_parallel_ ? local_ : in_;
    TESSERA_CHECK(x.rank() == 2 && x.dim(1) == expected, ShapeError, "RowParallelLinear(", in_, ", ", out_, ")",
                  input_is_parallel_ ? " with input_is_parallel" : "", ": expected input (N, ", expected, "), got ",
                  x.shape());
    const auto n = x.dim(0);
    if (input_is_parallel_) {
      c.x = &x;
    } else {  // split: keep this rank's columns (no communication)
      c.x_local.resize({n, local_});
      detail::columns_of<D>(x.data(), n, in_, local_ * comm_->rank(), local_, c.x_local.data());
      c.x = &c.x_local;
    }
    c.y.resize({n, out_});
    gemm_in<typename E::Compute>(D{}, false, true, n, out_, local_, S(1), c.x->data(), local_, weight_.value.data(), local_, S(0), c.y.data(), out_);
    const auto began = SpanSink::Clock::now();
    comm_->all_reduce(std::span<S>(c.y.data(), static_cast<std::size_t>(c.y.numel())), ReduceOp::Sum);  // g
    detail::record_collective(timeline_, "all_reduce y (row layer: g)", c.y.bytes(), began);
    if (has_bias_)  // after the sum: the bias is added once, not p times
      add_broadcast_rows(D{}, bias_.value.data(), n, out_, c.y.data());
    return c.y;
  }

  const Tensor& backward(const Tensor& dy, Cache& c) {
    TESSERA_CHECK(c.x != nullptr, Error, "RowParallelLinear::backward called before forward on this cache");
    TESSERA_CHECK(dy.shape() == c.y.shape(), ShapeError, "RowParallelLinear::backward: dy ", dy.shape(),
                  " does not match output ", c.y.shape());
    const auto n = dy.dim(0);
    detail::linear_parameter_grads<typename E::Compute>(dy.data(), c.x->data(), n, out_, local_, weight_, has_bias_ ? &bias_ : nullptr);
    c.dx_local.resize({n, local_});
    gemm_in<typename E::Compute>(D{}, false, false, n, local_, out_, S(1), dy.data(), out_, weight_.value.data(), local_, S(0), c.dx_local.data(), local_);
    if (input_is_parallel_) return c.dx_local;
    const auto p = static_cast<std::int64_t>(comm_->size());
    c.gathered.resize({p * n * local_});
    const auto began = SpanSink::Clock::now();
    comm_->all_gather(std::span<const S>(c.dx_local.data(), static_cast<std::size_t>(n * local_)), c.gathered.span());
    detail::record_collective(timeline_, "all_gather dx (row layer)", c.gathered.bytes(), began);
    c.dx.resize({n, in_});
    detail::blocks_to_rows<D>(c.gathered.data(), p, n, local_, c.dx.data());
    return c.dx;
  }

  template <class V>
  void visit(V& v, const std::string& prefix) {
    v.parameter(prefix + "weight", weight_);
    if (has_bias_) v.parameter(prefix + "bias", bias_);
  }
  void set_mode(Mode) {}
  // Records this layer's collectives into `timeline` from now on (nullptr: stop).
  void set_timeline(SpanSink* timeline) { timeline_ = timeline; }
  Parameter<S, D>& weight() { return weight_; }

 private:
  Comm* comm_;
  std::int64_t in_, out_, local_;
  bool input_is_parallel_, has_bias_;
  SpanSink* timeline_ = nullptr;
  Parameter<S, D> weight_;
  Parameter<S, D> bias_{Shape{0}, ParamKind::Bias};
};

// The tensor-parallel MLP block: Linear(in, hidden) -> ReLU -> Linear(hidden, out) with the hidden
// layer split over the ranks. One all-reduce in forward (the row layer's g), one in backward (the
// column layer's f). Equal to the dense block built from the same rng.
template <class E>
class TensorParallelMlp {
 public:
  using Comm = typename E::Comm;
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  struct Cache {
    typename ColumnParallelLinear<E>::Cache column;
    typename ReLU<E>::Cache relu;
    typename RowParallelLinear<E>::Cache row;
  };

  TensorParallelMlp(std::int64_t in, std::int64_t hidden, std::int64_t out, Rng& rng, Comm& comm)
      : column_(in, hidden, rng, comm, /*gather_output=*/false), row_(hidden, out, rng, comm, /*input_is_parallel=*/true) {}

  const Tensor& forward(const Tensor& x, Cache& c) {
    return row_.forward(relu_.forward(column_.forward(x, c.column), c.relu), c.row);
  }
  const Tensor& backward(const Tensor& dy, Cache& c) {
    return column_.backward(relu_.backward(row_.backward(dy, c.row), c.relu), c.column);
  }
  template <class V>
  void visit(V& v, const std::string& prefix) {
    column_.visit(v, prefix + "0.");
    row_.visit(v, prefix + "2.");
  }
  void set_mode(Mode mode) {
    column_.set_mode(mode);
    row_.set_mode(mode);
  }
  // As the first layer of a network: no dL/dx, and so no backward all-reduce.
  void set_needs_input_grad(bool needed) { column_.set_needs_input_grad(needed); }
  // Records both layers' collectives into `timeline` from now on (nullptr: stop).
  void set_timeline(SpanSink* timeline) {
    column_.set_timeline(timeline);
    row_.set_timeline(timeline);
  }

 private:
  ColumnParallelLinear<E> column_;
  ReLU<E> relu_;
  RowParallelLinear<E> row_;
};

// Tensor parallelism in the strategy protocol (parallel/strategy.hpp). The split layers above
// communicate inside forward and backward themselves, so a step needs no hook from it; what the
// Trainer needs to know is that the T ranks of `group` see every sample (sample_copies: the
// epoch's figures count each sample once) and where the split layers record their collectives
// (set_timeline reaches every layer given). Stacks with DataParallel and a Pipeline (3-D).
//
//   TensorParallel<E> tensor(tensor_group, block1, block2);
//   Trainer trainer(model, sgd, stack(dp, pipe, tensor), schedule, options);
template <class E>
class TensorParallel : public StrategyBase<E> {
 public:
  template <class C, class... Layers>
  explicit TensorParallel(C& group, Layers&... layers)
      : ranks_(group.size()), set_timelines_{[&layers](SpanSink* t) { layers.set_timeline(t); }...} {}
  std::string name() const { return "TensorParallel(" + std::to_string(ranks_) + " ranks)"; }
  int sample_copies() const { return ranks_; }
  void set_timeline(SpanSink* timeline) {
    for (auto& set : set_timelines_) set(timeline);
  }

 private:
  int ranks_;
  std::vector<std::function<void(SpanSink*)>> set_timelines_;
};

}  // namespace tessera
