// Embedding: a table W (num_embeddings, embedding_dim) looked up by integer ids, as
// torch.nn.Embedding(num_embeddings, embedding_dim, padding_idx):
//
//   ids (*) -> y (*, embedding_dim)      y[..., :] = W[ids[...], :]
//   backward: dW[id, :] += dy[..., :] for every occurrence of id (a repeated id adds up)
//
// W starts N(0, 1) as torch's, drawn from the rng in element order. padding_idx (negative counts
// from the end, as torch's): its row starts at zero and never receives a gradient, so it stays
// what it is set to. There is no dL/d(ids): the ids are not differentiable, so backward returns
// nothing and the chain ends here. Every id is checked against [0, num_embeddings) in forward, and
// an error names its position, e.g. ids[1, 7] = 300 for a (B, T) batch. Not a Layer (its input is
// integer ids, not a tensor of the scalar): models call forward(ids, shape, cache) themselves.
// max_norm, scale_grad_by_freq and sparse gradients are not offered.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "tessera/comm/local_env.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/init.hpp"
#include "tessera/core/parameter.hpp"
#include "tessera/kernels/embedding.hpp"

namespace tessera {

template <class E>
class Embedding {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  struct Cache {
    tessera::Tensor<std::int64_t, D> ids;  // (count) the ids, on the device
    Tensor y;                              // (*, embedding_dim)
    bool forward_done = false;
  };

  Embedding(std::int64_t num_embeddings, std::int64_t embedding_dim, Rng& rng,
            std::optional<std::int64_t> padding_idx = std::nullopt)
      : num_(num_embeddings), dim_(embedding_dim), weight_(checked_weight_shape(num_embeddings, embedding_dim)) {
    if (padding_idx) {
      const std::int64_t p = *padding_idx;
      TESSERA_CHECK(p >= -num_ && p < num_, ArgumentError, "Embedding(", num_, ", ", dim_, "): padding_idx=", p,
                    " must lie in [-", num_, ", ", num_, ")");
      padding_ = p < 0 ? p + num_ : p;
    }
    normal_(weight_.value, 0.0, 1.0, rng);
    if (padding_ >= 0) zero_row(padding_);
  }

  // ids: `shape.numel()` ids on the host, laid out as `shape`; y gets shape (shape..., embedding_dim).
  const Tensor& forward(std::span<const std::int64_t> ids, const Shape& shape, Cache& c) {
    TESSERA_CHECK(static_cast<std::int64_t>(ids.size()) == shape.numel() && shape.rank() < Shape::kMaxRank,
                  ShapeError, name(), ": ", ids.size(), " ids given for the shape ", shape);
    for (std::size_t i = 0; i < ids.size(); ++i)
      TESSERA_CHECK(ids[i] >= 0 && ids[i] < num_, ArgumentError, name(), ": ids",
                    detail::multi_index(static_cast<std::int64_t>(i), shape), " = ", ids[i],
                    " is out of range [0, ", num_, ")");
    const auto count = static_cast<std::int64_t>(ids.size());
    c.ids.resize({count});
    D::copy_to_device(c.ids.data(), ids.data(), ids.size_bytes());
    Shape y_shape = shape;
    y_shape.push_back(dim_);
    c.y.resize(y_shape);
    embedding_forward(D{}, weight_.value.data(), dim_, c.ids.data(), count, c.y.data());
    c.forward_done = true;
    return c.y;
  }
  const Tensor& forward(const tessera::Tensor<std::int64_t, Cpu>& ids, Cache& c) {
    return forward(std::span<const std::int64_t>(ids.data(), static_cast<std::size_t>(ids.numel())), ids.shape(), c);
  }

  // Accumulates dW from dy (*, embedding_dim), the shape forward returned.
  void backward(const Tensor& dy, Cache& c) {
    TESSERA_CHECK(c.forward_done, Error, name(), "::backward called before forward on this cache");
    TESSERA_CHECK(dy.shape() == c.y.shape(), ShapeError, name(), "::backward: dy ", dy.shape(),
                  " does not match the output ", c.y.shape());
    embedding_backward(D{}, dy.data(), c.ids.data(), c.ids.numel(), dim_, padding_, weight_.grad.data());
    weight_.grad_ready();
  }

  template <class V>
  void visit(V& v, const std::string& prefix) {
    v.parameter(prefix + "weight", weight_);
  }
  void set_mode(Mode) {}

  std::int64_t num_embeddings() const { return num_; }
  std::int64_t embedding_dim() const { return dim_; }
  std::optional<std::int64_t> padding_idx() const {
    return padding_ >= 0 ? std::optional<std::int64_t>(padding_) : std::nullopt;
  }
  Parameter<S, D>& weight() { return weight_; }
  std::string name() const { return detail::cat("Embedding(", num_, ", ", dim_, ")"); }

  static Shape checked_weight_shape(std::int64_t num, std::int64_t dim) {
    TESSERA_CHECK(num > 0 && dim > 0, ArgumentError, "Embedding: num_embeddings=", num, " and embedding_dim=", dim,
                  " must be positive");
    return {num, dim};
  }

 private:
  void zero_row(std::int64_t row) {
    tessera::Tensor<S, Cpu> zeros({dim_}, S(0));
    D::copy_to_device(weight_.value.data() + row * dim_, zeros.data(), zeros.bytes());
  }

  std::int64_t num_, dim_;
  std::int64_t padding_ = -1;  // -1: none
  Parameter<S, D> weight_;
};

// The class of any other Env is this one renamed (comm/local_env.hpp).
TESSERA_SAME_CODE_AS_LOCAL(Embedding);
TESSERA_LOCAL_EXTERN(Embedding)

}  // namespace tessera
