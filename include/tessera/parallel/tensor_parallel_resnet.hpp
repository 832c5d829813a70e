// Channel-parallel convolutions and a tensor-parallel ResNet (bottleneck blocks and classifier
// head split across the ranks of `comm`; every rank sees the same batch).
//
// OutputChannelParallelConv2d: rank r computes output channels [r C_out/p, (r+1) C_out/p), the
//   column-parallel layer of convolutions. Forward needs the whole input (f: identity); backward
//   gives this rank's share of dL/dx, all-reduced (f's backward) unless the caller sums several
//   shares first and reduces once (reduce_input_grad = false).
// InputChannelParallelConv2d: rank r holds input channels [r C_in/p, (r+1) C_in/p) of the weight,
//   convolves its slice of the channels, and the partial outputs are all-reduced (g) - the
//   row-parallel layer. Backward needs no communication: dy is whole on every rank.
//
// TensorParallelBottleneck, from a dense Bottleneck (weights, BN parameters and statistics
// sliced, so it equals the dense block):
//
//   x (N, C, H, W), whole on every rank
//   -> conv1 1x1, output-parallel     (N, planes/p)  -> bn1, relu on the rank's channels
//   -> conv2 3x3, input-parallel      (N, planes) after the all-reduce (g)   [forward collective 1]
//   -> bn2, relu, replicated          (every rank computes the same values and gradients)
//   -> conv3 1x1, output-parallel     (N, 4 planes/p) -> bn3 on the rank's channels
//   shortcut: projection conv + BN output-parallel, or the rank's channels of x
//   -> add, relu on the rank's channels -> all_gather along channels (N, 4 planes)  [forward 2]
//   backward: the rank's channels of dy; conv3's dL/d(its input) all-reduced before bn2 [backward 1];
//   conv1's and the projection's shares of dL/dx summed, then all-reduced once        [backward 2]
//
// So each block costs two collectives forward and two backward; conv weights and BN parameters
// of conv1/bn1, conv2 (by input channel), conv3/bn3 and the projection are 1/p per rank.
//
// TensorParallelResNet: the stem is replicated (its input is the batch and its output gradient
// the all-reduced dL/dx of the first block, both the same on every rank, so its gradients agree
// without communication), every block is a TensorParallelBottleneck, the head is global average
// pooling and a ColumnParallelLinear with gather_output (logits whole on every rank).
//
// Agreement: TensorParallelResNet's constructor checks once (one all_gather of two int64, plus
// the head's ColumnParallelLinear's own check) that every rank splits the same dense model: every
// parameter's and buffer's name, shape and checksum (parallel/agreement.hpp). Ranks built from
// different seeds would otherwise hold slices of different models and replicated stems that
// differ, and train silently on nonsense. The channel-parallel convolutions and the bottleneck,
// building blocks of it, do not check on their own (a ResNet-50 would pay one collective per
// convolution); whoever assembles them elsewhere checks the dense model once, as here.
#pragma once

#include <functional>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "tessera/comm/communicator.hpp"
#include "tessera/comm/local_env.hpp"
#include "tessera/kernels/elementwise.hpp"
#include "tessera/layers/activation.hpp"
#include "tessera/layers/batch_norm.hpp"
#include "tessera/layers/conv2d.hpp"
#include "tessera/layers/pool.hpp"
#include "tessera/models/resnet.hpp"
#include "tessera/parallel/agreement.hpp"
#include "tessera/parallel/tensor_parallel.hpp"

namespace tessera {

namespace detail {
// The tensors a layer's visit reports, parameters and buffers, in visit order.
template <class S, class D>
struct TensorList {
  std::vector<std::pair<std::string, Tensor<S, D>*>> values;
  void parameter(const std::string& n, Parameter<S, D>& p) { values.emplace_back(n, &p.value); }
  void buffer(const std::string& n, Tensor<S, D>& t) { values.emplace_back(n, &t); }
};
template <class S, class D, class L>
std::vector<std::pair<std::string, Tensor<S, D>*>> tensors_of(L& layer) {
  TensorList<S, D> list;
  layer.visit(list, "");
  return list.values;
}
// Copies slice `part` (of equal slices) along dimension `dim` (0 or 1) of every tensor of `from` into the
// tensors of `to` (same names, the sliced shapes). Vectors (BN, bias) slice along their only dim.
template <class S, class D, class From, class To>
void copy_slices(From& from, To& to, int dim, std::int64_t part) {
  auto src = tensors_of<S, D>(from);
  auto dst = tensors_of<S, D>(to);
  TESSERA_CHECK(src.size() == dst.size(), Error, "copy_slices: layers differ in their tensors");
  for (std::size_t k = 0; k < src.size(); ++k) {
    const Tensor<S, D>& a = *src[k].second;
    Tensor<S, D>& b = *dst[k].second;
    if (a.numel() == b.numel()) {  // not split (e.g. a bias added after the reduce)
      D::copy(b.data(), a.data(), b.bytes());
    } else if (dim == 0 || a.rank() == 1) {  // rows [part n/p, (part+1) n/p): one contiguous block
      D::copy(b.data(), a.data() + part * b.numel(), b.bytes());
    } else {  // dim 1 of (d0, d1, ...): per row, a contiguous run
      const std::int64_t rows = a.dim(0), inner = b.numel() / rows, row = a.numel() / rows;
      copy_2d(D{}, b.data(), inner, a.data() + part * inner, row, inner, rows);
    }
  }
}
// Conv2d's constructor draws an initialization; the split layers overwrite it with the dense
// layer's slice, so the draws come from this throwaway generator.
inline Rng& overwritten_init_rng() {
  thread_local Rng rng(0);
  return rng;
}
}  // namespace detail

template <class E>
class OutputChannelParallelConv2d {
 public:
  using Comm = typename E::Comm;
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  using Cache = typename Conv2d<E>::Cache;

  // The rank's output channels of `dense` (weights copied): a Conv2d of E or of LocalEnv<E>, which
  // a dense model's layers are (comm/local_env.hpp).
  OutputChannelParallelConv2d(Conv2d<LocalEnv<E>>& dense, Comm& comm, bool reduce_input_grad = true)
      : comm_(&comm), reduce_input_grad_(reduce_input_grad), conv_(local_options(dense.options(), comm), detail::overwritten_init_rng()) {
    detail::copy_slices<S, D>(dense, conv_, 0, comm.rank());
  }

  const Tensor& forward(const Tensor& x, Cache& c) { return conv_.forward(x, c); }
  const Tensor& backward(const Tensor& dy, Cache& c) {
    conv_.backward(dy, c);  // into c.dx, which the cache owns
    if (reduce_input_grad_ && c.dx.numel() > 0)
      comm_->all_reduce(std::span<S>(c.dx.data(), static_cast<std::size_t>(c.dx.numel())), ReduceOp::Sum);
    return c.dx;
  }
  template <class V>
  void visit(V& v, const std::string& prefix) {
    conv_.visit(v, prefix);
  }
  void set_mode(Mode m) { conv_.set_mode(m); }
  void set_needs_input_grad(bool needed) { conv_.set_needs_input_grad(needed); }
  Conv2d<E>& local() { return conv_; }

 private:
  static Conv2dOptions local_options(Conv2dOptions o, Comm& comm) {
    TESSERA_CHECK(o.groups == 1, ArgumentError, "OutputChannelParallelConv2d: grouped convolutions are not split");
    o.out_channels = detail::checked_shard(o.out_channels, comm.size(), "OutputChannelParallelConv2d", "out_channels");
    return o;
  }
  Comm* comm_;
  bool reduce_input_grad_;
  Conv2d<E> conv_;
};

template <class E>
class InputChannelParallelConv2d {
 public:
  using Comm = typename E::Comm;
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  using Cache = typename Conv2d<E>::Cache;

  // Input channels of the rank; the input must already be the rank's channels (N, C_in/p, H, W).
  InputChannelParallelConv2d(Conv2d<LocalEnv<E>>& dense, Comm& comm) : comm_(&comm), conv_(local_options(dense.options(), comm), detail::overwritten_init_rng()) {
    TESSERA_CHECK(!dense.options().bias, ArgumentError,
                  "InputChannelParallelConv2d: a bias would be added once per rank; build the dense layer without one");
    detail::copy_slices<S, D>(dense, conv_, 1, comm.rank());
  }

  const Tensor& forward(const Tensor& x, Cache& c) {
    conv_.forward(x, c);  // into c.y, which the cache owns
    comm_->all_reduce(std::span<S>(c.y.data(), static_cast<std::size_t>(c.y.numel())), ReduceOp::Sum);  // g
    return c.y;
  }
  const Tensor& backward(const Tensor& dy, Cache& c) { return conv_.backward(dy, c); }
  template <class V>
  void visit(V& v, const std::string& prefix) {
    conv_.visit(v, prefix);
  }
  void set_mode(Mode m) { conv_.set_mode(m); }

 private:
  static Conv2dOptions local_options(Conv2dOptions o, Comm& comm) {
    TESSERA_CHECK(o.groups == 1, ArgumentError, "InputChannelParallelConv2d: grouped convolutions are not split");
    o.in_channels = detail::checked_shard(o.in_channels, comm.size(), "InputChannelParallelConv2d", "in_channels");
    return o;
  }
  Comm* comm_;
  Conv2d<E> conv_;
};

template <class E>
class TensorParallelBottleneck {
 public:
  using Comm = typename E::Comm;
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  using OutConv = OutputChannelParallelConv2d<E>;
  using InConv = InputChannelParallelConv2d<E>;
  struct Cache {
    typename OutConv::Cache conv1, conv3, projection_conv;
    typename InConv::Cache conv2;
    typename BatchNorm2d<E>::Cache bn1, bn2, bn3, projection_bn;
    typename ReLU<E>::Cache relu1, relu2;
    Tensor shortcut, sum, dsum, dy_local, dshortcut, dx, y;
    Tensor gathered;
  };

  // `dense`: a Bottleneck of E, or of LocalEnv<E> (a dense ResNet's blocks: comm/local_env.hpp).
  template <class DenseEnv>
    requires std::is_same_v<LocalEnv<DenseEnv>, LocalEnv<E>>
  TensorParallelBottleneck(Bottleneck<DenseEnv>& dense, Comm& comm)
      : comm_(&comm),
        conv1_(dense.main().template get<0>(), comm, /*reduce_input_grad=*/false),
        bn1_(sliced_bn(dense.main().template get<1>(), comm)),
        conv2_(dense.main().template get<3>(), comm),
        bn2_(dense.main().template get<4>()),
        conv3_(dense.main().template get<6>(), comm, /*reduce_input_grad=*/true),
        bn3_(sliced_bn(dense.main().template get<7>(), comm)),
        out_channels_(dense.main().template get<6>().options().out_channels),
        local_out_(out_channels_ / comm.size()) {
    if (auto* p = dense.projection()) {
      projection_conv_.emplace(p->template get<0>(), comm, /*reduce_input_grad=*/false);
      projection_bn_.emplace(sliced_bn(p->template get<1>(), comm));
    }
  }

  const Tensor& forward(const Tensor& x, Cache& c) {
    const Tensor& h1 = relu1_.forward(bn1_.forward(conv1_.forward(x, c.conv1), c.bn1), c.relu1);
    const Tensor& h2 = relu2_.forward(bn2_.forward(conv2_.forward(h1, c.conv2), c.bn2), c.relu2);
    const Tensor& main = bn3_.forward(conv3_.forward(h2, c.conv3), c.bn3);
    const Tensor* shortcut = nullptr;
    if (projection_conv_) {
      shortcut = &projection_bn_->forward(projection_conv_->forward(x, c.projection_conv), c.projection_bn);
    } else {  // identity: this rank's channels of x
      c.shortcut.resize(main.shape());
      channel_slice(x, c.shortcut);
      shortcut = &c.shortcut;
    }
    c.sum.resize(main.shape());
    add_relu_forward(D{}, main.data(), shortcut->data(), main.numel(), c.sum.data());
    // all_gather of the (N, C/p, H, W) slices, then (p, N, C/p HW) blocks -> (N, C, H, W).
    const std::int64_t n = main.dim(0), plane = main.dim(2) * main.dim(3), p = comm_->size();
    c.gathered.resize({c.sum.numel() * p});
    comm_->all_gather(std::span<const S>(c.sum.data(), static_cast<std::size_t>(c.sum.numel())), c.gathered.span());
    c.y.resize({n, out_channels_, main.dim(2), main.dim(3)});
    detail::blocks_to_rows<D>(c.gathered.data(), p, n, local_out_ * plane, c.y.data());
    return c.y;
  }

  const Tensor& backward(const Tensor& dy, Cache& c) {
    TESSERA_CHECK(dy.shape() == c.y.shape(), ShapeError, "TensorParallelBottleneck::backward: dy ", dy.shape(),
                  " does not match the output ", c.y.shape());
    const std::int64_t n = dy.dim(0), plane = dy.dim(2) * dy.dim(3);
    c.dy_local.resize(c.sum.shape());
    detail::columns_of<D>(dy.data(), n, out_channels_ * plane, comm_->rank() * local_out_ * plane, local_out_ * plane,
                       c.dy_local.data());
    c.dsum.resize(c.sum.shape());
    relu_backward(D{}, c.dy_local.data(), c.sum.data(), c.dsum.numel(), c.dsum.data());
    const Tensor& dh2 = conv3_.backward(bn3_.backward(c.dsum, c.bn3), c.conv3);  // all-reduced inside (f)
    const Tensor& dh1 = conv2_.backward(bn2_.backward(relu2_.backward(dh2, c.relu2), c.bn2), c.conv2);
    const Tensor& dx_main = conv1_.backward(bn1_.backward(relu1_.backward(dh1, c.relu1), c.bn1), c.conv1);
    c.dx.resize(dx_main.shape());
    D::copy(c.dx.data(), dx_main.data(), dx_main.bytes());
    if (projection_conv_) {
      const Tensor& ds = projection_conv_->backward(projection_bn_->backward(c.dsum, c.projection_bn), c.projection_conv);
      add(D{}, c.dx.data(), ds.data(), ds.numel(), c.dx.data());
    } else {  // the identity's gradient lands on this rank's channels only
      const std::int64_t first = comm_->rank() * local_out_ * plane, row = out_channels_ * plane;
      accumulate_2d(D{}, c.dx.data() + first, row, c.dsum.data(), local_out_ * plane, local_out_ * plane, n);
    }
    // One all-reduce for both branches' shares of dL/dx.
    comm_->all_reduce(std::span<S>(c.dx.data(), static_cast<std::size_t>(c.dx.numel())), ReduceOp::Sum);
    return c.dx;
  }

  template <class V>
  void visit(V& v, const std::string& prefix) {
    conv1_.visit(v, prefix + "conv1.");
    bn1_.visit(v, prefix + "bn1.");
    conv2_.visit(v, prefix + "conv2.");
    bn2_.visit(v, prefix + "bn2.");
    conv3_.visit(v, prefix + "conv3.");
    bn3_.visit(v, prefix + "bn3.");
    if (projection_conv_) {
      projection_conv_->visit(v, prefix + "downsample.0.");
      projection_bn_->visit(v, prefix + "downsample.1.");
    }
  }
  void set_mode(Mode m) {
    for (auto* bn : {&bn1_, &bn2_, &bn3_}) bn->set_mode(m);
    if (projection_bn_) projection_bn_->set_mode(m);
  }

 private:
  static BatchNorm2d<E> sliced_bn(BatchNorm2d<LocalEnv<E>>& dense, Comm& comm) {
    BatchNorm2d<E> local(detail::checked_shard(dense.num_features(), comm.size(), "TensorParallelBottleneck", "channels"),
                         dense.eps(), dense.momentum());
    detail::copy_slices<S, D>(dense, local, 0, comm.rank());
    return local;
  }
  void channel_slice(const Tensor& x, Tensor& out) const {
    const std::int64_t n = x.dim(0), plane = x.dim(2) * x.dim(3);
    detail::columns_of<D>(x.data(), n, x.dim(1) * plane, comm_->rank() * local_out_ * plane, local_out_ * plane, out.data());
  }

  Comm* comm_;
  OutConv conv1_;
  BatchNorm2d<E> bn1_;
  ReLU<E> relu1_;
  InConv conv2_;
  BatchNorm2d<E> bn2_;
  ReLU<E> relu2_;
  OutConv conv3_;
  BatchNorm2d<E> bn3_;
  std::optional<OutConv> projection_conv_;
  std::optional<BatchNorm2d<E>> projection_bn_;
  std::int64_t out_channels_, local_out_;
};

template <class E>
class TensorParallelResNet {
 public:
  using Comm = typename E::Comm;
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  using Block = TensorParallelBottleneck<E>;
  struct Cache {
    typename Conv2d<E>::Cache conv1;
    typename BatchNorm2d<E>::Cache bn1;
    typename ReLU<E>::Cache relu;
    typename MaxPool2d<E>::Cache maxpool;
    std::vector<typename Block::Cache> blocks;
    typename GlobalAvgPool<E>::Cache avgpool;
    typename ColumnParallelLinear<E>::Cache fc;
  };

  // Splits `dense` (its values at this moment); `dense` may be destroyed afterwards.
  TensorParallelResNet(ResNet<E, Bottleneck>& dense, Comm& comm)
      : agreed_(agree(dense, comm)),
        conv1_(dense.stem_conv()), bn1_(dense.stem_bn()), fc_(dense.fc(), comm, /*gather_output=*/true),
        block_names_(dense.block_names()), name_(dense.name() + ", tensor-parallel over " + std::to_string(comm.size())) {
    if (auto* pool = dense.stem_pool()) maxpool_.emplace(*pool);
    for (auto& b : dense.blocks()) blocks_.emplace_back(b, comm);
  }

  const Tensor& forward(const Tensor& x, Cache& c) {
    if (c.blocks.size() != blocks_.size()) c.blocks.resize(blocks_.size());
    const Tensor* h = &relu_.forward(bn1_.forward(conv1_.forward(x, c.conv1), c.bn1), c.relu);
    if (maxpool_) h = &maxpool_->forward(*h, c.maxpool);
    for (std::size_t i = 0; i < blocks_.size(); ++i) h = &blocks_[i].forward(*h, c.blocks[i]);
    return fc_.forward(avgpool_.forward(*h, c.avgpool), c.fc);
  }
  const Tensor& backward(const Tensor& dy, Cache& c) {
    const Tensor* g = &avgpool_.backward(fc_.backward(dy, c.fc), c.avgpool);
    for (std::size_t i = blocks_.size(); i-- > 0;) g = &blocks_[i].backward(*g, c.blocks[i]);
    if (maxpool_) g = &maxpool_->backward(*g, c.maxpool);
    return conv1_.backward(bn1_.backward(relu_.backward(*g, c.relu), c.bn1), c.conv1);
  }
  template <class V>
  void visit(V& v, const std::string& prefix) {
    conv1_.visit(v, prefix + "conv1.");
    bn1_.visit(v, prefix + "bn1.");
    for (std::size_t i = 0; i < blocks_.size(); ++i) blocks_[i].visit(v, prefix + block_names_[i]);
    fc_.visit(v, prefix + "fc.");
  }
  void set_mode(Mode m) {
    bn1_.set_mode(m);
    for (auto& b : blocks_) b.set_mode(m);
  }
  const std::string& name() const { return name_; }

 private:
  // Before any slicing (which can throw): every rank splits the same dense model.
  static bool agree(ResNet<E, Bottleneck>& dense, Comm& comm) {
    AgreementRecord record("TensorParallelResNet");
    record.add("layer", "TensorParallelResNet");
    record.add("blocks", dense.blocks().size());
    const auto named = named_tensors(dense);
    record.add_named_tensors(named, "dense.");
    record.add_checksums(named, "dense ");
    check_agreement(comm, record, "every rank must split the same dense model: same architecture, same seed");
    return true;
  }

  bool agreed_;
  Conv2d<E> conv1_;
  BatchNorm2d<E> bn1_;
  ReLU<E> relu_;
  std::optional<MaxPool2d<E>> maxpool_;
  std::vector<Block> blocks_;
  GlobalAvgPool<E> avgpool_;
  ColumnParallelLinear<E> fc_;
  std::vector<std::string> block_names_;
  std::string name_;
};

}  // namespace tessera
