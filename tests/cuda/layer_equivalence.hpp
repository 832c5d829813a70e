// CPU-vs-CUDA equivalence: every case builds the same layer (same seed: parameters are drawn on
// the host, so both devices start from identical values), runs forward on the same seeded input
// and backward on the same seeded dy, and returns every output, input gradient and parameter
// gradient as host doubles. Optimizer cases run three steps on fixed gradients and return the
// parameters (and state). The same template runs on Env<Cpu, ...> (layer_equivalence_main.cpp)
// and on Env<Cuda, ...> (layer_equivalence_cuda.cpp, which links the CUDA kernels: a unit compiled
// by nvcc would leave Eigen's gemm out, so each device has a unit of its own); main compares them
// case by case.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/core/init.hpp"
#include "tessera/core/memory_format.hpp"
#include "tessera/core/parameter.hpp"
#include "tessera/layers/activation.hpp"
#include "tessera/layers/attention.hpp"
#include "tessera/layers/batch_norm.hpp"
#include "tessera/layers/conv2d.hpp"
#include "tessera/layers/embedding.hpp"
#include "tessera/layers/flatten.hpp"
#include "tessera/layers/linear.hpp"
#include "tessera/layers/norm.hpp"
#include "tessera/layers/pool.hpp"
#include "tessera/layers/softmax.hpp"
#include "tessera/losses/cross_entropy.hpp"
#include "tessera/losses/mse.hpp"
#include "tessera/losses/nll.hpp"
#include "tessera/models/gpt.hpp"
#include "tessera/models/mlp.hpp"
#include "tessera/models/resnet.hpp"
#include "tessera/optim/adam.hpp"
#include "tessera/optim/lamb.hpp"
#include "tessera/optim/lars.hpp"
#include "tessera/optim/sgd.hpp"

namespace tessera::testing {

using Outputs = std::map<std::string, std::vector<double>>;

// The cases whose results bfloat16 products change (Linear, Conv2d and the models built of them),
// each with the largest distance allowed between CudaLocalBf16 and the CPU's float32 result:
// max |gpu - cpu| over an output, divided by that output's largest |cpu|, the parameter gradients
// (and optimizer values) taken as one output, since a tensor of small, cancelling sums (a bias's
// gradient) measured on its own scale says nothing about the products that fed it.
// Where the bounds come from: bfloat16 keeps 8 significant bits, so each rounded operand is off by
// at most 2^-8 of itself, and the cuDNN outputs are rounded once more; CpuLocalBf16, which rounds
// the same operands but not the outputs, measured (same seeds, 2026-12-03) 2.8e-3 to 3.7e-3 for the
// single layers, 3.3e-3 for mlp and self_attention, 5.6e-3 self_attention_tiles, 3.3e-3 and 4.2e-3
// for gpt and gpt_dropout, 9.9e-3 for the ResNet in inference and 1.7e-2 for resnet_basic_blocks
// (training BatchNorm over 8 values per channel in its last stage divides the rounding by a
// small deviation). The bounds are about three times those, for the outputs' own rounding.
// resnet_bottleneck_imagenet_stem is not here: its batch of 2 leaves 2 values per channel for the
// last BatchNorm, whose gradients turn any rounding into noise (0.23 on the CPU's bf16 path); its
// bfloat16 products are the layers' checked above.
struct Bf16Case {
  std::string_view name;
  double bound;
};
inline constexpr Bf16Case kBf16Cases[] = {
    {"linear", 1e-2}, {"linear_no_bias", 1e-2}, {"linear_rank3", 1e-2}, {"conv2d_3x3", 1e-2},
    {"conv2d_strided_grouped_dilated", 1.2e-2}, {"conv2d_1x1_no_bias", 1e-2}, {"mlp", 1e-2},
    {"self_attention", 1e-2}, {"self_attention_tiles", 2e-2}, {"gpt", 1.2e-2}, {"gpt_dropout", 1.5e-2},
    {"resnet_bottleneck_inference", 3e-2}, {"resnet_basic_blocks", 5e-2},
    // bfloat16 in NHWC: the same roundings, so the same bounds.
    {"conv2d_3x3:channels_last", 1e-2}, {"conv2d_1x1_no_bias:channels_last", 1e-2},
    {"resnet_bottleneck_inference:channels_last", 3e-2}, {"resnet_basic_blocks:channels_last", 5e-2},
};

// Every case, in the order they run. The Dropout layer is not here: its masks come from different
// random streams on the two devices (tests/cuda/layer_equivalence_cuda.cpp checks its
// distribution). Keyed dropout (DropoutKey: the GPT's and attention's) is: its masks are functions
// of position, the same on both devices.
inline constexpr std::string_view kEquivalenceCases[] = {
    "linear", "linear_no_bias", "relu", "gelu", "gelu_tanh", "leaky_relu", "flatten", "conv2d_3x3", "conv2d_strided_grouped_dilated",
    "conv2d_1x1_no_bias", "batch_norm_train", "batch_norm_eval", "batch_norm_2d_input", "max_pool", "avg_pool",
    "global_avg_pool", "max_pool_ceil", "avg_pool_ceil_exclude_pad", "avg_pool_divisor_override",
    "adaptive_avg_pool", "adaptive_avg_pool_upsample", "mlp", "resnet_basic_blocks", "resnet_bottleneck_imagenet_stem", "resnet_bottleneck_inference", "cross_entropy",
    "cross_entropy_smoothing", "cross_entropy_ignore", "nll", "softmax_channels", "log_softmax_last",
    "linear_rank3", "mse", "sgd_nesterov", "adam", "adamw_amsgrad", "lars", "lamb",
    "layer_norm", "layer_norm_no_bias", "rms_norm", "embedding", "sdpa_cross", "sdpa_causal_cached",
    "self_attention", "self_attention_tiles", "gpt", "cross_entropy_btv", "sdpa_dropout", "gpt_dropout",
    // Channels last (core/memory_format.hpp): the layer in NHWC on both devices, so the GPU's NHWC
    // kernels (cuDNN with NHWC descriptors and filters, the row-wise BatchNorm passes, the pooling
    // kernels in memory order) are checked against the CPU's NHWC reference, which
    // tests/layers/test_memory_format.cpp checks against NCHW.
    "conv2d_3x3:channels_last", "conv2d_strided_grouped_dilated:channels_last", "conv2d_1x1_no_bias:channels_last",
    "batch_norm_train:channels_last", "batch_norm_eval:channels_last", "max_pool:channels_last",
    "avg_pool:channels_last", "global_avg_pool:channels_last", "max_pool_ceil:channels_last",
    "avg_pool_ceil_exclude_pad:channels_last", "avg_pool_divisor_override:channels_last",
    "adaptive_avg_pool:channels_last", "flatten:channels_last", "resnet_basic_blocks:channels_last",
    "resnet_bottleneck_imagenet_stem:channels_last", "resnet_bottleneck_inference:channels_last",
};

// The memory format the case being run puts its layer in (a ":channels_last" suffix on its name).
inline MemoryFormat& case_memory_format() {
  static MemoryFormat format = MemoryFormat::Contiguous;
  return format;
}
template <class L>
void apply_case_memory_format(L& layer) {
  if constexpr (requires { layer.set_memory_format(MemoryFormat::ChannelsLast); })
    layer.set_memory_format(case_memory_format());
}

template <class S, class D>
std::vector<double> host_values(const Tensor<S, D>& t) {
  const Tensor<S, Cpu> h = to_host(t);
  return std::vector<double>(h.begin(), h.end());
}

template <class S, class D>
Tensor<S, D> seeded(const Shape& shape, Rng& rng, double scale = 1.0) {
  Tensor<S, Cpu> h(shape);
  normal_(h, 0.0, scale, rng);
  return to_device<D>(h);
}

// Forward and backward of one layer on a seeded input of shape `in`.
template <class L>
Outputs layer_outputs(L& layer, const Shape& in, std::uint64_t seed) {
  using E = typename L::Env;
  using S = typename E::Scalar;
  using D = typename E::Device;
  Rng rng(seed);
  const auto x = seeded<S, D>(in, rng);
  apply_case_memory_format(layer);
  typename L::Cache cache{};
  const auto& y = layer.forward(x, cache);
  const auto dy = seeded<S, D>(y.shape(), rng);
  const auto& dx = layer.backward(dy, cache);
  Outputs out{{"y", host_values(y)}, {"dx", host_values(dx)}};
  for (auto& [name, p] : named_tensors(layer).parameters) out["grad." + name] = host_values(p->grad);
  return out;
}

template <class E, class Optimizer, class Options>
Outputs optimizer_outputs(Options options) {
  using S = typename E::Scalar;
  using D = typename E::Device;
  Rng init(7);
  Linear<E> layer(5, 4, init);
  auto named = named_tensors(layer);
  Optimizer optimizer(named, options);
  Rng rng(11);
  for (int step = 0; step < 3; ++step) {
    for (auto& [name, p] : named.parameters) p->grad = seeded<S, D>(p->value.shape(), rng);
    optimizer.step();
  }
  Outputs out;
  for (auto& [name, p] : named.parameters) out["value." + name] = host_values(p->value);
  return out;
}

template <class E>
Outputs loss_outputs(std::string_view name) {
  using S = typename E::Scalar;
  using D = typename E::Device;
  Rng rng(5);
  if (name == "mse") {
    MseLoss<E> loss;
    typename MseLoss<E>::Cache cache;
    const auto y = seeded<S, D>({6, 3}, rng), t = seeded<S, D>({6, 3}, rng);
    const double value = loss.forward(y, t, cache);
    return {{"loss", {value}}, {"dy", host_values(loss.backward(cache))}};
  }
  const auto logits = seeded<S, D>({7, 300}, rng, 3.0);  // 300 classes: more than one block's threads
  if (name == "nll") {  // on log-probabilities from the device's own log-softmax, two rows ignored
    LogSoftmax<E> log_softmax(1);
    typename LogSoftmax<E>::Cache lc;
    NLLLoss<E> loss(Reduction::Mean);
    typename NLLLoss<E>::Cache cache;
    const std::vector<std::int64_t> labels{0, -100, 17, 150, -100, 3, 256};
    const double value = loss.forward(log_softmax.forward(logits, lc), labels, cache);
    return {{"loss", {value}}, {"dlogits", host_values(log_softmax.backward(loss.backward(cache), lc))}};
  }
  const bool ignore = name == "cross_entropy_ignore";
  CrossEntropyLoss<E> loss(ignore ? Reduction::Sum : Reduction::Mean, name == "cross_entropy" ? 0.0 : 0.1);
  typename CrossEntropyLoss<E>::Cache cache;
  std::vector<std::int64_t> labels{0, 299, 17, 150, 3, 3, 256};
  if (ignore) labels[1] = labels[4] = -100;
  const double value = loss.forward(logits, labels, cache);
  return {{"loss", {value}}, {"dlogits", host_values(loss.backward(cache))},
          {"log_probs", host_values(cache.log_probs)},
          {"correct", {static_cast<double>(count_correct(logits, labels))}}};
}

// The transformer cases whose inputs are not one tensor: token ids (Embedding, GPT), three
// tensors (attention), (B, T, V) logits with ignored positions.
template <class E>
Outputs transformer_outputs(std::string_view name) {
  using S = typename E::Scalar;
  using D = typename E::Device;
  Rng init(3), rng(31);
  const std::vector<std::int64_t> ids = {3, 0, 7, 3, 9, 2, 2, 5, 1, 8, 3, 6};  // (2, 6), repeats
  if (name == "embedding") {
    Embedding<E> emb(10, 70, init, /*padding_idx=*/2);
    typename Embedding<E>::Cache c;
    const auto& y = emb.forward(ids, Shape{2, 6}, c);
    emb.backward(seeded<S, D>(y.shape(), rng), c);
    return {{"y", host_values(y)}, {"grad.weight", host_values(emb.weight().grad)}};
  }
  if (name == "gpt_dropout") {  // a training step's masks at all four sites, at a batch offset
    GPT<E> model({.block_size = 8, .vocab_size = 10, .n_layer = 2, .n_head = 2, .n_embd = 16, .dropout = 0.2}, init);
    model.hold_dropout_key(0xd20b, 3);
    typename GPT<E>::Cache c;
    const auto& logits = model.forward(ids, 2, 6, c);
    model.backward(seeded<S, D>(logits.shape(), rng), c);
    Outputs out{{"logits", host_values(logits)}};
    for (auto& [key, p] : named_tensors(model).parameters) out["grad." + key] = host_values(p->grad);
    return out;
  }
  if (name == "gpt") {
    GPT<E> model({.block_size = 8, .vocab_size = 10, .n_layer = 2, .n_head = 2, .n_embd = 16}, init);
    typename GPT<E>::Cache c;
    const auto& logits = model.forward(ids, 2, 6, c);
    model.backward(seeded<S, D>(logits.shape(), rng), c);
    Outputs out{{"logits", host_values(logits)}};
    for (auto& [key, p] : named_tensors(model).parameters) out["grad." + key] = host_values(p->grad);
    typename GPT<E>::KVState kv;  // the key/value-cache path: the last 2 positions after the first 4
    typename GPT<E>::Cache cc;
    model.forward_cached(std::vector<std::int64_t>{3, 0, 7, 3, 9, 2, 2, 5}, 2, 4, kv, cc);
    out["cached_logits"] = host_values(model.forward_cached(std::vector<std::int64_t>{9, 2, 1, 8}, 2, 2, kv, cc));
    return out;
  }
  if (name == "cross_entropy_btv") {
    CrossEntropyLoss<E> loss(Reduction::Mean, 0.0, /*ignore_index=*/-1);
    typename CrossEntropyLoss<E>::Cache c;
    const auto logits = seeded<S, D>({2, 6, 300}, rng, 3.0);
    std::vector<std::int64_t> labels = {0, 299, -1, 150, 3, 3, 256, -1, 7, 8, 9, 10};
    const double value = loss.forward(logits, labels, c);
    return {{"loss", {value}}, {"dlogits", host_values(loss.backward(c))}};
  }
  // Attention: cross (T 7, S 70 keys: more than the CPU's 64-key tile) or causal with a
  // key/value cache's offset (T 5 new queries after 45 cached keys).
  const bool cached = name == "sdpa_causal_cached";
  AttentionDims n{2, 3, cached ? 5 : 7, cached ? 50 : 70, 8, 6, cached ? 45 : 0};
  if (name == "sdpa_dropout") n.dropout = {.p = 0.3, .key = 99, .batch_offset = 1, .head_offset = 2};
  const auto q = seeded<S, D>({n.batch, n.heads, n.queries, n.head_dim}, rng);
  const auto k = seeded<S, D>({n.batch, n.heads, n.keys, n.head_dim}, rng);
  const auto v = seeded<S, D>({n.batch, n.heads, n.keys, n.value_dim}, rng);
  const auto dout = seeded<S, D>({n.batch, n.heads, n.queries, n.value_dim}, rng);
  Tensor<S, D> out({n.batch, n.heads, n.queries, n.value_dim}), lse({n.batch, n.heads, n.queries});
  Tensor<S, D> dq(q.shape()), dk(k.shape()), dv(v.shape());
  const auto ql = AttentionLayout::contiguous(n.heads, n.queries, n.head_dim);
  const auto kl = AttentionLayout::contiguous(n.heads, n.keys, n.head_dim);
  const auto vl = AttentionLayout::contiguous(n.heads, n.keys, n.value_dim);
  const auto ol = AttentionLayout::contiguous(n.heads, n.queries, n.value_dim);
  attention_forward(D{}, n, q.data(), ql, k.data(), kl, v.data(), vl, 0.3, cached, out.data(), ol, lse.data());
  attention_backward(D{}, n, q.data(), ql, k.data(), kl, v.data(), vl, out.data(), dout.data(), ol, lse.data(), 0.3,
                     cached, dq.data(), ql, dk.data(), kl, dv.data(), vl);
  return {{"out", host_values(out)}, {"lse", host_values(lse)}, {"dq", host_values(dq)}, {"dk", host_values(dk)},
          {"dv", host_values(dv)}};
}

template <class E>
Outputs run_case(std::string_view name);

template <class E>
Outputs run_equivalence_case(std::string_view name) {
  constexpr std::string_view kChannelsLast = ":channels_last";
  const bool nhwc = name.ends_with(kChannelsLast);
  case_memory_format() = nhwc ? MemoryFormat::ChannelsLast : MemoryFormat::Contiguous;
  struct Reset {
    ~Reset() { case_memory_format() = MemoryFormat::Contiguous; }
  } reset;
  return run_case<E>(nhwc ? name.substr(0, name.size() - kChannelsLast.size()) : name);
}

template <class E>
Outputs run_case(std::string_view name) {
  Rng init(3);
  if (name == "embedding" || name.starts_with("gpt") || name == "cross_entropy_btv" || name.starts_with("sdpa"))
    return transformer_outputs<E>(name);
  if (name == "layer_norm" || name == "layer_norm_no_bias") {  // rows of 300: more than one block's threads
    LayerNorm<E> layer(Shape{300}, 1e-5, true, name == "layer_norm");
    return layer_outputs(layer, {2, 5, 300}, 26);
  }
  if (name == "rms_norm") {
    RMSNorm<E> layer(Shape{4, 30}, 1e-6);
    return layer_outputs(layer, {3, 4, 30}, 27);
  }
  if (name == "self_attention" || name == "self_attention_tiles") {
    const bool tiles = name == "self_attention_tiles";  // 70 positions: two CPU tiles
    SelfAttention<E> layer(16, tiles ? 2 : 4, init, /*causal=*/true);
    return layer_outputs(layer, {2, tiles ? 70 : 9, 16}, 28);
  }
  if (name == "linear" || name == "linear_no_bias") {
    Linear<E> layer(37, 19, init, name == "linear");
    return layer_outputs(layer, {9, 37}, 1);
  }
  if (name == "linear_rank3") {  // (B, T, in): the leading dimensions are rows
    Linear<E> layer(37, 19, init);
    return layer_outputs(layer, {2, 5, 37}, 1);
  }
  if (name == "softmax_channels") {  // along dim 1 of (N, C, H, W): strided rows
    Softmax<E> layer(1);
    return layer_outputs(layer, {3, 5, 4, 6}, 24);
  }
  if (name == "log_softmax_last") {  // rows longer than a block
    LogSoftmax<E> layer(-1);
    return layer_outputs(layer, {6, 300}, 25);
  }
  if (name == "relu") {
    ReLU<E> layer;
    return layer_outputs(layer, {4, 1000}, 2);
  }
  if (name == "gelu") {
    GELU<E> layer;
    return layer_outputs(layer, {4, 1000}, 2);
  }
  if (name == "gelu_tanh") {  // a stateful kernel-provider op (GeluOp's approximation)
    GELU<E> layer({.approximate = GeluApproximate::Tanh});
    return layer_outputs(layer, {4, 1000}, 2);
  }
  if (name == "leaky_relu") {  // a stateful per-element op through the generic map kernels
    LeakyReLU<E> layer({.negative_slope = 0.2});
    return layer_outputs(layer, {4, 1000}, 2);
  }
  if (name == "flatten") {
    Flatten<E> layer;
    return layer_outputs(layer, {3, 2, 4, 5}, 4);
  }
  if (name == "conv2d_3x3") {
    Conv2d<E> layer(4, 6, 3, init, 1, 1);
    return layer_outputs(layer, {2, 4, 9, 9}, 12);
  }
  if (name == "conv2d_strided_grouped_dilated") {
    Conv2d<E> layer(Conv2dOptions{.in_channels = 4, .out_channels = 6, .kernel_h = 3, .kernel_w = 3, .stride_h = 2,
                                  .stride_w = 2, .pad_h = 2, .pad_w = 2, .dilation_h = 2, .dilation_w = 2, .groups = 2},
                    init);
    return layer_outputs(layer, {3, 4, 11, 10}, 13);
  }
  if (name == "conv2d_1x1_no_bias") {
    Conv2d<E> layer(8, 16, 1, init, 1, 0, false);
    return layer_outputs(layer, {2, 8, 7, 7}, 14);
  }
  if (name == "batch_norm_train" || name == "batch_norm_eval" || name == "batch_norm_2d_input") {
    BatchNorm2d<E> layer(5);
    if (name == "batch_norm_eval") {
      // Running statistics from one training pass, then an eval-mode forward and backward.
      typename BatchNorm2d<E>::Cache warmup;
      Rng rng(15);
      layer.forward(seeded<typename E::Scalar, typename E::Device>({4, 5, 3, 3}, rng, 2.0), warmup);
      layer.set_mode(Mode::Eval);
    }
    Outputs out = layer_outputs(layer, name == "batch_norm_2d_input" ? Shape{16, 5} : Shape{4, 5, 6, 6}, 16);
    out["running_mean"] = host_values(layer.running_mean());
    out["running_var"] = host_values(layer.running_var());
    return out;
  }
  if (name == "max_pool") {
    MaxPool2d<E> layer(3, 2, 1);
    return layer_outputs(layer, {2, 3, 9, 8}, 17);
  }
  if (name == "avg_pool") {
    AvgPool2d<E> layer(3, 2, 1);
    return layer_outputs(layer, {2, 3, 9, 8}, 18);
  }
  if (name == "global_avg_pool") {
    GlobalAvgPool<E> layer;
    return layer_outputs(layer, {3, 4, 5, 7}, 19);
  }
  if (name == "max_pool_ceil") {
    MaxPool2d<E> layer(3, 2, 1, true);
    return layer_outputs(layer, {2, 3, 8, 9}, 17);
  }
  if (name == "avg_pool_ceil_exclude_pad") {
    AvgPool2d<E> layer({.kernel = 3, .stride = 2, .padding = 1, .ceil_mode = true, .count_include_pad = false});
    return layer_outputs(layer, {2, 3, 8, 9}, 18);
  }
  if (name == "avg_pool_divisor_override") {
    AvgPool2d<E> layer({.kernel = 2, .stride = 2, .padding = 1, .ceil_mode = true, .divisor_override = 3});
    return layer_outputs(layer, {2, 3, 5, 6}, 18);
  }
  if (name == "adaptive_avg_pool") {
    AdaptiveAvgPool2d<E> layer(3, 2);
    return layer_outputs(layer, {2, 4, 7, 5}, 19);
  }
  if (name == "adaptive_avg_pool_upsample") {
    AdaptiveAvgPool2d<E> layer(5, 3);
    return layer_outputs(layer, {2, 4, 3, 2}, 19);
  }
  if (name == "resnet_basic_blocks") {
    ResNet<E, BasicBlock> model({1, 1}, {8, 16}, false, ResNetOptions{.in_channels = 3, .num_classes = 10, .seed = 20});
    return layer_outputs(model, {2, 3, 12, 12}, 21);
  }
  if (name == "resnet_bottleneck_imagenet_stem") {
    ResNet<E, Bottleneck> model({1, 1}, {4, 8}, true, ResNetOptions{.in_channels = 3, .num_classes = 7, .seed = 22});
    return layer_outputs(model, {2, 3, 32, 32}, 23);
  }
  if (name == "resnet_bottleneck_inference") {
    // Mode::Inference after one training forward (running statistics away from 0 and 1): the
    // convolutions fused with the BatchNorm, ReLU and residual add (CPU: in each block's epilogue;
    // CUDA: cuDNN, then the BatchNorm and add kernels in place).
    using S = typename E::Scalar;
    using D = typename E::Device;
    ResNet<E, Bottleneck> model({1, 1}, {4, 8}, true, ResNetOptions{.in_channels = 3, .num_classes = 7, .seed = 24});
    apply_case_memory_format(model);
    Rng rng(25);
    const auto x = seeded<S, D>({2, 3, 32, 32}, rng);
    typename ResNet<E, Bottleneck>::Cache cache;
    model.forward(x, cache);
    model.set_mode(Mode::Inference);
    return {{"y", host_values(model.forward(x, cache))}};
  }
  if (name == "mlp") {
    Mlp<E> model(3 * 8 * 8, {64, 32}, 10, 9);
    return layer_outputs(model, {5, 3, 8, 8}, 6);
  }
  if (name == "cross_entropy" || name == "cross_entropy_smoothing" || name == "cross_entropy_ignore" ||
      name == "nll" || name == "mse")
    return loss_outputs<E>(name);
  if (name == "sgd_nesterov")
    return optimizer_outputs<E, Sgd<E>>(SgdOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-2, .nesterov = true});
  if (name == "adam") return optimizer_outputs<E, Adam<E>>(AdamOptions{.lr = 1e-2, .weight_decay = 1e-2});
  if (name == "adamw_amsgrad")
    return optimizer_outputs<E, AdamW<E>>(AdamWOptions{.lr = 1e-2, .weight_decay = 0.1, .amsgrad = true});
  if (name == "lars")
    return optimizer_outputs<E, Lars<E>>(LarsOptions{.lr = 0.5, .momentum = 0.9, .weight_decay = 1e-3});
  if (name == "lamb") return optimizer_outputs<E, Lamb<E>>(LambOptions{.lr = 1e-2, .weight_decay = 1e-2});
  throw ArgumentError(detail::cat("no equivalence case '", name, "'"));
}

// The two halves, defined in their own translation units.
Outputs cpu_equivalence_case(std::string_view name);
Outputs cuda_equivalence_case(std::string_view name);
Outputs cuda_equivalence_case_bf16(std::string_view name);  // on CudaLocalBf16
std::string cuda_dropout_check();  // each: empty when right, else what is wrong
std::string cuda_mixed_precision_check();
std::string cuda_steady_state_allocation_check();
int cuda_device_count();
void cuda_set_cudnn_benchmark(bool on);  // Cuda::set_cudnn_benchmark, for the host half

}  // namespace tessera::testing
