// ResNets (He et al. 2016) with torchvision's structure and state_dict keys (BatchNorm's
// num_batches_tracked included, same order and shapes), so a torchvision checkpoint converted by
// tools/convert_torchvision.py loads with load_state_dict (io/state_dict.hpp) one to one:
//   ResNet-18/34 (BasicBlock), ResNet-50/101/152 (Bottleneck, "v1.5": the stride sits on the 3x3
//   convolution, as in torchvision and Goyal et al.), ImageNet stem 7x7/2 conv + 3x3/2 max-pool;
//   CIFAR ResNet-20/56 (6n+2 layers, 16/32/64 channels, 3x3 stem, no max-pool) with option-B
//   (1x1 convolution + BN) projection shortcuts.
// Input channels, class count and image size are free (global average pooling before fc).
// Init: Kaiming-normal (fan_out, ReLU) for convolutions, BN gamma = 1 and beta = 0, fc as
// torch.nn.Linear, drawn in a fixed order (brace initialization) so a seed means the same weights
// on every compiler; with zero_init_residual the last BN of every block starts at gamma = 0, so each
// block starts as the identity (Goyal et al., section 5.1).
//
// Memory format (set_memory_format, core/memory_format.hpp): in channels_last every activation
// is NHWC; the input stays NCHW (as data loaders give it) and is transposed once on entry, and the
// output (N, classes) is the same in both. The fastest format on a GPU (docs/cuda.md).
//
// Shapes, ImageNet ResNet-50 at 224x224: x (N, 3, 224, 224) -> stem (N, 64, 56, 56) -> layer1
// (N, 256, 56, 56) -> layer2 (N, 512, 28, 28) -> layer3 (N, 1024, 14, 14) -> layer4 (N, 2048, 7, 7)
// -> pool (N, 2048) -> fc (N, classes).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "tessera/comm/local_env.hpp"
#include "tessera/core/concepts.hpp"
#include "tessera/core/init.hpp"
#include "tessera/core/memory_format.hpp"
#include "tessera/layers/activation.hpp"
#include "tessera/layers/batch_norm.hpp"
#include "tessera/layers/conv2d.hpp"
#include "tessera/layers/linear.hpp"
#include "tessera/layers/pool.hpp"
#include "tessera/layers/residual.hpp"
#include "tessera/layers/sequential.hpp"

namespace tessera {

template <class E>
using ConvBn = Sequential<Conv2d<E>, BatchNorm2d<E>>;

namespace detail {
template <class E>
Conv2d<E> he_conv(std::int64_t in, std::int64_t out, std::int64_t kernel, std::int64_t stride, std::int64_t padding,
                  Rng& rng) {
  Conv2d<E> conv(in, out, kernel, rng, stride, padding, /*bias=*/false);
  kaiming_normal_(conv.weight().value, rng, FanMode::FanOut);
  return conv;
}

template <class E>
std::optional<ConvBn<E>> projection(std::int64_t in, std::int64_t out, std::int64_t stride, Rng& rng) {
  if (stride == 1 && in == out) return std::nullopt;
  return ConvBn<E>{he_conv<E>(in, out, 1, stride, 0, rng), BatchNorm2d<E>(out)};
}
}  // namespace detail

// conv3x3 -> BN -> ReLU -> conv3x3 -> BN, joined with the shortcut. expansion = 1.
template <class E>
struct BasicBlock
    : Residual<Sequential<Conv2d<E>, BatchNorm2d<E>, ReLU<E>, Conv2d<E>, BatchNorm2d<E>>, ConvBn<E>> {
  using Main = Sequential<Conv2d<E>, BatchNorm2d<E>, ReLU<E>, Conv2d<E>, BatchNorm2d<E>>;
  using Base = Residual<Main, ConvBn<E>>;
  static constexpr std::int64_t expansion = 1;

  BasicBlock(std::int64_t in, std::int64_t planes, std::int64_t stride, Rng& rng, bool zero_init_last_bn)
      : Base{make_main(in, planes, stride, rng), detail::projection<E>(in, planes, stride, rng)} {
    this->main().set_names({"conv1", "bn1", "relu", "conv2", "bn2"});
    if (zero_init_last_bn) this->main().template get<4>().zero_init_weight();
  }

 private:
  static Main make_main(std::int64_t in, std::int64_t planes, std::int64_t stride, Rng& rng) {
    return Main{detail::he_conv<E>(in, planes, 3, stride, 1, rng), BatchNorm2d<E>(planes), ReLU<E>(),
                detail::he_conv<E>(planes, planes, 3, 1, 1, rng), BatchNorm2d<E>(planes)};
  }
};

// 1x1 reduce -> 3x3 (carries the stride: v1.5) -> 1x1 expand (x4), BN + ReLU between.
template <class E>
struct Bottleneck : Residual<Sequential<Conv2d<E>, BatchNorm2d<E>, ReLU<E>, Conv2d<E>, BatchNorm2d<E>, ReLU<E>,
                                        Conv2d<E>, BatchNorm2d<E>>,
                             ConvBn<E>> {
  using Main = Sequential<Conv2d<E>, BatchNorm2d<E>, ReLU<E>, Conv2d<E>, BatchNorm2d<E>, ReLU<E>, Conv2d<E>,
                          BatchNorm2d<E>>;
  using Base = Residual<Main, ConvBn<E>>;
  static constexpr std::int64_t expansion = 4;

  Bottleneck(std::int64_t in, std::int64_t planes, std::int64_t stride, Rng& rng, bool zero_init_last_bn)
      : Base{make_main(in, planes, stride, rng), detail::projection<E>(in, planes * expansion, stride, rng)} {
    this->main().set_names({"conv1", "bn1", "relu1", "conv2", "bn2", "relu2", "conv3", "bn3"});
    if (zero_init_last_bn) this->main().template get<7>().zero_init_weight();
  }

 private:
  static Main make_main(std::int64_t in, std::int64_t planes, std::int64_t stride, Rng& rng) {
    return Main{detail::he_conv<E>(in, planes, 1, 1, 0, rng), BatchNorm2d<E>(planes), ReLU<E>(),
                detail::he_conv<E>(planes, planes, 3, stride, 1, rng), BatchNorm2d<E>(planes), ReLU<E>(),
                detail::he_conv<E>(planes, planes * expansion, 1, 1, 0, rng), BatchNorm2d<E>(planes * expansion)};
  }
};

struct ResNetOptions {
  std::int64_t in_channels = 3;
  std::int64_t num_classes = 1000;
  bool zero_init_residual = false;
  std::uint64_t seed = 0;
};

// Block: BasicBlock<E> or Bottleneck<E>. `stage_blocks` = blocks per stage, `widths` = planes per
// stage; `imagenet_stem` chooses 7x7/2 + max-pool (ImageNet) or 3x3/1 (CIFAR).
template <class E, template <class> class Block>
class ResNet {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Tensor = tessera::Tensor<S, D>;
  using BlockType = Block<E>;
  struct Cache {
    typename Conv2d<E>::Cache conv1;
    typename BatchNorm2d<E>::Cache bn1;
    typename ReLU<E>::Cache relu;
    typename MaxPool2d<E>::Cache maxpool;
    std::vector<typename BlockType::Cache> blocks;
    typename GlobalAvgPool<E>::Cache avgpool;
    typename Linear<E>::Cache fc;
    Tensor input, dinput;  // channels_last: the input in NHWC, and its gradient back in NCHW
  };

  ResNet(const std::vector<int>& stage_blocks, const std::vector<std::int64_t>& widths, bool imagenet_stem,
         const ResNetOptions& o)
      : ResNet(stage_blocks, widths, imagenet_stem, o, Rng(o.seed)) {}

  const Tensor& forward(const Tensor& x, Cache& c) { return forward_units(x, c, 0, unit_count()); }
  const Tensor& backward(const Tensor& dy, Cache& c) { return backward_units(dy, c, 0, unit_count()); }

  // Pipeline units: 0 is the stem (conv1, bn1, relu, max-pool), 1..B the blocks, B + 1 the head
  // (global average pool, fc).
  std::size_t unit_count() const { return blocks_.size() + 2; }
  const Tensor& forward_units(const Tensor& x, Cache& c, std::size_t begin, std::size_t end) {
    if (c.blocks.size() != blocks_.size()) c.blocks.resize(blocks_.size());  // first forward on this cache only
    const Tensor* h = &x;
    for (std::size_t u = begin; u < end; ++u) {
      if (u == 0) {
        TESSERA_CHECK(x.rank() == 4 && x.dim(1) == in_channels_, ShapeError, name_, ": expected input (N, ",
                      in_channels_, ", H, W), got ", x.shape());
        if (memory_format() == MemoryFormat::ChannelsLast) {
          c.input.resize(x.shape());
          nchw_to_nhwc(D{}, x.dim(0), x.dim(1), x.dim(2) * x.dim(3), x.data(), c.input.data());
          h = &c.input;
        }
        // BatchNorm and ReLU fused (layers/batch_norm.hpp): bn1's own output is never formed;
        // forward only, into conv1's epilogue as well (layers/sequential.hpp).
        if (mode_ == Mode::Inference) {
          auto e = bn1_.inference_epilogue(c.bn1, conv1_.out_channels());
          e.relu = true;
          c.relu.x = nullptr;
          h = &conv1_.forward_epilogue(*h, c.conv1, c.relu.y, e);
        } else {
          h = &bn1_.forward_relu(conv1_.forward(*h, c.conv1), c.bn1, c.relu);
        }
        if (maxpool_) {
          // The max-pool's backward reads only its argmax, and the fused backward of bn1 and the
          // ReLU reads conv1's output: the ReLU's output (the largest activation of the network)
          // dies here.
          h = &maxpool_->forward(*h, c.maxpool);
          release_output(relu_, c.relu);
        }
      } else if (u <= blocks_.size()) {
        h = &blocks_[u - 1].forward(*h, c.blocks[u - 1]);
      } else {
        h = &fc_.forward(avgpool_.forward(*h, c.avgpool), c.fc);
      }
    }
    return *h;
  }
  const Tensor& backward_units(const Tensor& dy, Cache& c, std::size_t begin, std::size_t end) {
    return backward_units_impl(dy, c, begin, end, /*input_only=*/false);
  }
  // The same backward in two halves, for zero-bubble pipeline schedules (parallel/pipeline_schedule.hpp):
  // the input half runs each unit's backward_input (the blocks', fc's, conv1's and bn1's) and
  // releases the gradients between units, which no weight half reads (a block's reads its own ds,
  // fc's the stage's dy); the weight half runs the units' backward_weight from the last to the
  // first and then releases each unit's output as backward does. Together backward_units' bits.
  // dy must stay alive until the weight half.
  const Tensor& backward_units_input(const Tensor& dy, Cache& c, std::size_t begin, std::size_t end) {
    return backward_units_impl(dy, c, begin, end, /*input_only=*/true);
  }
  void backward_units_weight(Cache& c, std::size_t begin, std::size_t end) {
    for (std::size_t u = end; u-- > begin;) {
      if (u == blocks_.size() + 1) {
        fc_.backward_weight(c.fc);
      } else if (u >= 1) {
        blocks_[u - 1].backward_weight(c.blocks[u - 1]);
      } else {
        bn1_.backward_weight(c.bn1);
        conv1_.backward_weight(c.conv1);
        release_stem(c);
      }
      if (u + 1 < end) release_unit_output(u, c);
    }
  }
  // Frees unit u's output once the unit after it and unit u itself have run backward.
  void release_unit_output(std::size_t u, Cache& c) {
    if (u == 0) {
      if (maxpool_) release_output(*maxpool_, c.maxpool);
      else release_output(relu_, c.relu);
    } else if (u <= blocks_.size()) {
      release_output(blocks_[u - 1], c.blocks[u - 1]);
    }
  }
  // Frees the input gradient unit u returned, once unit u - 1 has consumed it.
  void release_unit_input_grad(std::size_t u, Cache& c) {
    if (u == blocks_.size() + 1) release_input_grad(avgpool_, c.avgpool);
    else if (u >= 1) release_input_grad(blocks_[u - 1], c.blocks[u - 1]);
  }
  template <class V>
  void visit_units(V& v, const std::string& prefix, std::size_t begin, std::size_t end) {
    for (std::size_t u = begin; u < end; ++u) {
      if (u == 0) {
        conv1_.visit(v, prefix + "conv1.");
        bn1_.visit(v, prefix + "bn1.");
      } else if (u <= blocks_.size()) {
        blocks_[u - 1].visit(v, prefix + block_names_[u - 1]);
      } else {
        fc_.visit(v, prefix + "fc.");
      }
    }
  }
  std::string unit_name(std::size_t u) const {
    if (u == 0) return "stem";
    if (u <= blocks_.size()) return block_names_[u - 1].substr(0, block_names_[u - 1].size() - 1);
    return "head";
  }

  void set_mode(Mode mode) {
    mode_ = mode;
    conv1_.set_mode(mode);
    bn1_.set_mode(mode);
    relu_.set_mode(mode);
    if (maxpool_) maxpool_->set_mode(mode);
    for (auto& b : blocks_) b.set_mode(mode);
    avgpool_.set_mode(mode);
    fc_.set_mode(mode);
  }
  void set_needs_input_grad(bool needed) { conv1_.set_needs_input_grad(needed); }
  // Every layer's layout of 4-D activations (see the top); Contiguous by default.
  void set_memory_format(MemoryFormat f) {
    conv1_.set_memory_format(f);
    bn1_.set_memory_format(f);
    if (maxpool_) maxpool_->set_memory_format(f);
    for (auto& b : blocks_) b.set_memory_format(f);
    avgpool_.set_memory_format(f);
  }
  MemoryFormat memory_format() const { return conv1_.memory_format(); }

  template <class V>
  void visit(V& v, const std::string& prefix) {
    visit_units(v, prefix, 0, unit_count());
  }

  const std::string& name() const { return name_; }
  std::vector<BlockType>& blocks() { return blocks_; }
  // The stem and head layers (for building split or converted versions of the model).
  Conv2d<E>& stem_conv() { return conv1_; }
  BatchNorm2d<E>& stem_bn() { return bn1_; }
  MaxPool2d<E>* stem_pool() { return maxpool_ ? &*maxpool_ : nullptr; }
  Linear<E>& fc() { return fc_; }
  const std::vector<std::string>& block_names() const { return block_names_; }

 private:
  // input_only: the units' input halves (backward_units_input).
  const Tensor& backward_units_impl(const Tensor& dy, Cache& c, std::size_t begin, std::size_t end, bool input_only) {
    check_backward_allowed(mode_, name_);
    // Each gradient is released once the unit before has consumed it (core/concepts.hpp).
    const Tensor* g = &dy;
    // Between two blocks of this call (a whole backward), the later block forms the earlier one's
    // ds with its own dL/dx sum (Residual::backward_chained): one pass over the activation less
    // per join. g_is_ds: g is already the next block's ds.
    bool g_is_ds = false;
    for (std::size_t u = end; u-- > begin;) {
      if (u == blocks_.size() + 1) {
        const Tensor& dpooled = backward_or_input(fc_, *g, c.fc, input_only);
        g = &avgpool_.backward(dpooled, c.avgpool);
        release_input_grad(fc_, c.fc);
      } else if (u >= 1 && input_only) {
        g = &blocks_[u - 1].backward_input(*g, c.blocks[u - 1]);
      } else if (u >= 1) {
        const bool chain = u >= 2 && u - 1 >= begin;  // unit u - 1, a block, runs next in this call
        g = &blocks_[u - 1].backward_chained(*g, c.blocks[u - 1], g_is_ds, chain ? &c.blocks[u - 2].y : nullptr);
        g_is_ds = chain;
      } else {
        if (maxpool_) g = &maxpool_->backward(*g, c.maxpool);
        const Tensor& dconv = input_only ? bn1_.backward_relu_input(*g, c.bn1) : bn1_.backward_relu(*g, c.bn1);
        if (maxpool_) release_input_grad(*maxpool_, c.maxpool);
        g = &backward_or_input(conv1_, dconv, c.conv1, input_only);
        if (memory_format() == MemoryFormat::ChannelsLast && g->rank() == 4) {  // dL/dx asked for: back to NCHW
          c.dinput.resize(g->shape());
          nhwc_to_nchw(D{}, g->dim(0), g->dim(1), g->dim(2) * g->dim(3), g->data(), c.dinput.data());
          g = &c.dinput;
        }
        if (!input_only) release_stem(c);  // conv1's weight half reads bn1's dL/dx
      }
      if (u + 1 < end) {  // *g's producer and the consumer of unit u's output ran in this call:
        release_unit_input_grad(u + 1, c);  // both are dead now (unit u's output: once its weight half ran)
        if (!input_only) release_unit_output(u, c);
      }
    }
    return *g;
  }
  // The stem's buffers, dead once conv1 has run its backward (whole or both halves).
  void release_stem(Cache& c) {
    release_input_grad(bn1_, c.bn1);
    release_output(conv1_, c.conv1);
    if (maxpool_) release_output(relu_, c.relu);  // else the stem's output: released by the caller's unit walk
  }
  ResNet(const std::vector<int>& stage_blocks, const std::vector<std::int64_t>& widths, bool imagenet_stem,
         const ResNetOptions& o, Rng rng)
      : in_channels_(check_options(stage_blocks, widths, o)),
        conv1_(detail::he_conv<E>(o.in_channels, widths.at(0), imagenet_stem ? 7 : 3,
                                  imagenet_stem ? 2 : 1, imagenet_stem ? 3 : 1, rng)),
        bn1_(widths.at(0)),
        fc_(widths.back() * BlockType::expansion, o.num_classes, rng) {
    if (imagenet_stem) maxpool_.emplace(3, 2, 1);
    std::int64_t in = widths[0];
    for (std::size_t s = 0; s < widths.size(); ++s) {
      for (int b = 0; b < stage_blocks[s]; ++b) {
        const std::int64_t stride = (s > 0 && b == 0) ? 2 : 1;
        blocks_.emplace_back(in, widths[s], stride, rng, o.zero_init_residual);
        block_names_.push_back("layer" + std::to_string(s + 1) + "." + std::to_string(b) + ".");
        in = widths[s] * BlockType::expansion;
      }
    }
    conv1_.set_needs_input_grad(false);
    int depth = 2;
    for (int n : stage_blocks) depth += n * (BlockType::expansion == 4 ? 3 : 2);
    name_ = std::string(imagenet_stem ? "ResNet-" : "CIFAR ResNet-") + std::to_string(depth);
  }

  static std::int64_t check_options(const std::vector<int>& stage_blocks, const std::vector<std::int64_t>& widths,
                                    const ResNetOptions& o) {
    TESSERA_CHECK(stage_blocks.size() == widths.size() && !widths.empty(), ArgumentError,
                  "ResNet: one block count per stage width is required");
    TESSERA_CHECK(o.num_classes > 0 && o.in_channels > 0, ArgumentError, "ResNet: num_classes=", o.num_classes,
                  " and in_channels=", o.in_channels, " must be positive");
    return o.in_channels;
  }

  std::int64_t in_channels_;
  std::string name_;
  Conv2d<E> conv1_;
  BatchNorm2d<E> bn1_;
  ReLU<E> relu_;
  std::optional<MaxPool2d<E>> maxpool_;
  std::vector<BlockType> blocks_;
  std::vector<std::string> block_names_;
  GlobalAvgPool<E> avgpool_;
  Linear<E> fc_;
  Mode mode_ = Mode::Train;
};

template <class E>
ResNet<E, BasicBlock> resnet18(const ResNetOptions& o = {}) {
  return ResNet<E, BasicBlock>({2, 2, 2, 2}, {64, 128, 256, 512}, true, o);
}
template <class E>
ResNet<E, BasicBlock> resnet34(const ResNetOptions& o = {}) {
  return ResNet<E, BasicBlock>({3, 4, 6, 3}, {64, 128, 256, 512}, true, o);
}
template <class E>
ResNet<E, Bottleneck> resnet50(const ResNetOptions& o = {}) {
  return ResNet<E, Bottleneck>({3, 4, 6, 3}, {64, 128, 256, 512}, true, o);
}
template <class E>
ResNet<E, Bottleneck> resnet101(const ResNetOptions& o = {}) {
  return ResNet<E, Bottleneck>({3, 4, 23, 3}, {64, 128, 256, 512}, true, o);
}
template <class E>
ResNet<E, Bottleneck> resnet152(const ResNetOptions& o = {}) {
  return ResNet<E, Bottleneck>({3, 8, 36, 3}, {64, 128, 256, 512}, true, o);
}
// CIFAR ResNet-(6n+2): n blocks per stage, widths 16/32/64.
template <class E>
ResNet<E, BasicBlock> cifar_resnet(int depth, const ResNetOptions& o = {.in_channels = 3, .num_classes = 10}) {
  TESSERA_CHECK(depth >= 8 && (depth - 2) % 6 == 0, ArgumentError, "cifar_resnet: depth ", depth,
                " is not of the form 6n+2 (20, 32, 44, 56, 110)");
  const int n = (depth - 2) / 6;
  return ResNet<E, BasicBlock>({n, n, n}, {16, 32, 64}, false, o);
}
template <class E>
ResNet<E, BasicBlock> resnet20(const ResNetOptions& o = {.in_channels = 3, .num_classes = 10}) {
  return cifar_resnet<E>(20, o);
}
template <class E>
ResNet<E, BasicBlock> resnet56(const ResNetOptions& o = {.in_channels = 3, .num_classes = 10}) {
  return cifar_resnet<E>(56, o);
}

// The class of any other Env is this one renamed (comm/local_env.hpp).
TESSERA_SAME_CODE_AS_LOCAL_WITH(ResNet, template <class> class, Block);
TESSERA_LOCAL_EXTERN_FLOAT(ResNet, BasicBlock)
TESSERA_LOCAL_EXTERN_FLOAT(ResNet, Bottleneck)

}  // namespace tessera
