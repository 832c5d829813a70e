// The backward in two halves (core/concepts.hpp, SplitsBackward): for every layer that has
// parameters, backward_input then backward_weight gives backward's dL/dx and parameter gradients
// bit for bit, and the input half alone touches no parameter gradient. float, the type trained in
// (the halves' code does not depend on it); Conv2d in double too, whose kernels differ by type. Zero-bubble pipeline
// schedules (parallel/pipeline_schedule.hpp) run the two halves apart; this is what makes their
// results those of 1F1B. Linear and the MLP have theirs in test_linear_residual.cpp.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cstring>

#include "support/reference.hpp"
#include "tessera/comm/local.hpp"
#include "tessera/layers/activation.hpp"
#include "tessera/layers/attention.hpp"
#include "tessera/layers/batch_norm.hpp"
#include "tessera/layers/conv2d.hpp"
#include "tessera/layers/dropout.hpp"
#include "tessera/layers/flatten.hpp"
#include "tessera/layers/linear.hpp"
#include "tessera/layers/norm.hpp"
#include "tessera/layers/pool.hpp"
#include "tessera/layers/sequential.hpp"
#include "tessera/models/gpt.hpp"
#include "tessera/models/resnet.hpp"

using namespace tessera;

namespace {

template <class S>
bool split_same_bits(const Tensor<S, Cpu>& a, const Tensor<S, Cpu>& b) {
  return a.shape() == b.shape() && std::memcmp(a.data(), b.data(), a.bytes()) == 0;
}
template <class S>
Tensor<S, Cpu> split_normal(Shape shape, Rng& rng) {
  Tensor<S, Cpu> t(shape);
  for (std::int64_t k = 0; k < t.numel(); ++k) t.data()[k] = static_cast<S>(rng.normal());
  return t;
}
template <class M>
bool split_grads_zero(M& model) {
  auto named = named_tensors(model);
  return std::all_of(named.parameters.begin(), named.parameters.end(), [](const auto& p) {
    const auto& g = p.second->grad;
    return std::all_of(g.begin(), g.end(), [](auto v) { return v == 0; });
  });
}
template <class M>
void split_same_grads(M& whole, M& split) {
  auto a = named_tensors(whole), b = named_tensors(split);
  REQUIRE(a.parameters.size() == b.parameters.size());
  REQUIRE(!a.parameters.empty());
  for (std::size_t k = 0; k < a.parameters.size(); ++k) {
    INFO(a.parameters[k].first);
    CHECK(split_same_bits(a.parameters[k].second->grad, b.parameters[k].second->grad));
  }
}

// Two copies of one layer (make() builds the same one twice), the same forward, then backward on
// one and the two halves on the other. Twice over, so that gradients accumulate on top of the
// first pass's as they do over micro-batches.
template <class L, class Make, class S>
void check_split_backward(Make make, const Tensor<S, Cpu>& x, const Tensor<S, Cpu>& dy) {
  static_assert(SplitsBackward<L>);
  L whole = make(), split = make();
  for (int pass = 0; pass < 2; ++pass) {
    INFO("pass " << pass);
    typename L::Cache c1, c2;
    whole.forward(x, c1);
    split.forward(x, c2);
    const Tensor<S, Cpu>& dx_whole = whole.backward(dy, c1);
    const Tensor<S, Cpu>& dx_split = split.backward_input(dy, c2);
    CHECK(split_same_bits(dx_whole, dx_split));
    if (pass == 0) CHECK(split_grads_zero(split));  // the input half left every weight gradient alone
    split.backward_weight(c2);
    split_same_grads(whole, split);
  }
}

}  // namespace

TEMPLATE_TEST_CASE("Conv2d: backward_input then backward_weight equal backward bit for bit", "[layers]", float, double) {
  using E = Env<Cpu, LocalComm, TestType>;
  Rng data(7);
  struct Case {
    const char* what;
    Conv2dOptions o;
    ConvAlgorithm algorithm;
    MemoryFormat format;
    Shape x;
    std::int64_t block_columns = 0;  // 0: the layer's own blocking
  };
  const Case cases[] = {
      {"3x3 pad 1, im2col", {.in_channels = 3, .out_channels = 5, .kernel_h = 3, .kernel_w = 3, .pad_h = 1, .pad_w = 1},
       ConvAlgorithm::Im2col, MemoryFormat::Contiguous, {4, 3, 9, 9}},
      {"3x3 pad 1, Winograd", {.in_channels = 4, .out_channels = 6, .kernel_h = 3, .kernel_w = 3, .pad_h = 1, .pad_w = 1},
       ConvAlgorithm::Winograd, MemoryFormat::Contiguous, {3, 4, 10, 10}},
      {"1x1 stride 2, no bias", {.in_channels = 6, .out_channels = 4, .kernel_h = 1, .kernel_w = 1, .stride_h = 2,
                                 .stride_w = 2, .bias = false},
       ConvAlgorithm::Auto, MemoryFormat::Contiguous, {2, 6, 8, 8}},
      {"grouped, dilated", {.in_channels = 4, .out_channels = 6, .kernel_h = 3, .kernel_w = 3, .pad_h = 2, .pad_w = 2,
                            .dilation_h = 2, .dilation_w = 2, .groups = 2},
       ConvAlgorithm::Auto, MemoryFormat::Contiguous, {2, 4, 7, 7}},
      {"channels_last", {.in_channels = 3, .out_channels = 5, .kernel_h = 3, .kernel_w = 3, .stride_h = 2, .stride_w = 2,
                         .pad_h = 1, .pad_w = 1},
       ConvAlgorithm::Auto, MemoryFormat::ChannelsLast, {2, 3, 9, 9}},
      // A batch large enough that the backward runs its blocks over the OpenMP team.
      {"wide batch", {.in_channels = 8, .out_channels = 16, .kernel_h = 3, .kernel_w = 3, .pad_h = 1, .pad_w = 1},
       ConvAlgorithm::Im2col, MemoryFormat::Contiguous, {16, 8, 16, 16}},
      // Bands of single samples on the direct (1x1) path and Winograd blocks, over the team, an odd
      // batch (shares of unequal size): dw's blocks run on the static split (Winograd's dx blocks
      // then on any thread, detail::stealing_for), so either half alone gives the same bits.
      {"1x1 bands, odd batch", {.in_channels = 16, .out_channels = 24, .kernel_h = 1, .kernel_w = 1},
       ConvAlgorithm::Auto, MemoryFormat::Contiguous, {7, 16, 24, 24}, 96},
      {"3x3 Winograd bands, odd batch", {.in_channels = 16, .out_channels = 16, .kernel_h = 3, .kernel_w = 3,
                                         .pad_h = 1, .pad_w = 1},
       ConvAlgorithm::Winograd, MemoryFormat::Contiguous, {7, 16, 24, 24}, 96},
  };
  for (const Case& k : cases) {
    SECTION(k.what) {
      const auto make = [&] {
        Rng rng(3);
        Conv2d<E> conv(k.o, rng);
        conv.set_algorithm(k.algorithm);
        conv.set_memory_format(k.format);
        if (k.block_columns > 0) conv.set_block_columns(k.block_columns);
        return conv;
      };
      Tensor<TestType, Cpu> x = split_normal<TestType>(k.x, data);
      Conv2d<E> probe = make();
      typename Conv2d<E>::Cache pc;
      const Shape y_shape = probe.forward(x, pc).shape();
      check_split_backward<Conv2d<E>>(make, x, split_normal<TestType>(y_shape, data));
    }
  }
}

TEST_CASE("Conv2d: backward_weight without backward_input, and set_needs_input_grad(false)", "[layers]") {
  Rng rng(3), data(4);
  Conv2d<CpuLocal> conv({.in_channels = 2, .out_channels = 3, .kernel_h = 3, .kernel_w = 3}, rng);
  typename Conv2d<CpuLocal>::Cache c;
  const auto x = split_normal<float>({2, 2, 6, 6}, data);
  const auto& y = conv.forward(x, c);
  CHECK_THROWS_WITH(conv.backward_weight(c), Catch::Contains("without backward_input"));
  conv.set_needs_input_grad(false);  // a network's first layer: the W half is the whole work
  const auto dy = split_normal<float>(y.shape(), data);
  CHECK(conv.backward_input(dy, c).numel() == 0);
  conv.backward_weight(c);
  CHECK(std::any_of(conv.weight().grad.begin(), conv.weight().grad.end(), [](float g) { return g != 0; }));
  CHECK_THROWS_AS(conv.backward_input(split_normal<float>({2, 3, 5, 5}, data), c), ShapeError);
}

TEMPLATE_TEST_CASE("Norm layers: backward_input then backward_weight equal backward bit for bit", "[layers]", float) {
  using E = Env<Cpu, LocalComm, TestType>;
  Rng data(11);
  SECTION("BatchNorm2d, train") {
    const auto x = split_normal<TestType>({4, 3, 5, 5}, data);
    check_split_backward<BatchNorm2d<E>>([] { return BatchNorm2d<E>(3); }, x, split_normal<TestType>(x.shape(), data));
  }
  SECTION("BatchNorm2d, eval") {
    const auto x = split_normal<TestType>({4, 3, 5, 5}, data);
    check_split_backward<BatchNorm2d<E>>(
        [] {
          BatchNorm2d<E> bn(3);
          bn.set_mode(Mode::Eval);
          return bn;
        },
        x, split_normal<TestType>(x.shape(), data));
  }
  SECTION("BatchNorm1d-like (N, C)") {
    const auto x = split_normal<TestType>({8, 6}, data);
    check_split_backward<BatchNorm2d<E>>([] { return BatchNorm2d<E>(6); }, x, split_normal<TestType>(x.shape(), data));
  }
  SECTION("LayerNorm over the last dimension") {
    const auto x = split_normal<TestType>({3, 5, 16}, data);
    check_split_backward<LayerNorm<E>>([] { return LayerNorm<E>(Shape{16}); }, x, split_normal<TestType>(x.shape(), data));
  }
  SECTION("LayerNorm without bias, over two dimensions, many rows (the OpenMP team)") {
    const auto x = split_normal<TestType>({64, 8, 40}, data);
    check_split_backward<LayerNorm<E>>([] { return LayerNorm<E>(Shape{8, 40}, std::nullopt, true, false); }, x,
                              split_normal<TestType>(x.shape(), data));
  }
  SECTION("RMSNorm") {
    const auto x = split_normal<TestType>({6, 24}, data);
    check_split_backward<RMSNorm<E>>([] { return RMSNorm<E>(Shape{24}); }, x, split_normal<TestType>(x.shape(), data));
  }
}

TEMPLATE_TEST_CASE("SelfAttention and GPTBlock: backward_input then backward_weight equal backward bit for bit",
                   "[layers]", float) {
  using E = Env<Cpu, LocalComm, TestType>;
  Rng data(13);
  const auto x = split_normal<TestType>({2, 7, 16}, data);
  const auto dy = split_normal<TestType>(x.shape(), data);
  SECTION("SelfAttention") {
    check_split_backward<SelfAttention<E>>(
        [] {
          Rng rng(5);
          return SelfAttention<E>(16, 4, rng);
        },
        x, dy);
  }
  SECTION("GPTBlock") {
    const GPTConfig config{.block_size = 8, .vocab_size = 11, .n_layer = 1, .n_head = 2, .n_embd = 16};
    check_split_backward<GPTBlock<E>>(
        [&] {
          Rng rng(5);
          return GPTBlock<E>(config, rng);
        },
        x, dy);
  }
}

TEMPLATE_TEST_CASE("Sequential: backward_input then backward_weight equal backward bit for bit, and release what "
                   "backward releases",
                   "[layers]", float) {
  using E = Env<Cpu, LocalComm, TestType>;
  // A small LeNet: a convolution, a BatchNorm fused with its ReLU, pooling, a Dropout that hands its
  // gradient on in eval, Linear layers. Every rule of Sequential's backward is exercised.
  using Net = Sequential<Conv2d<E>, BatchNorm2d<E>, ReLU<E>, MaxPool2d<E>, Flatten<E>, Linear<E>, ReLU<E>,
                         Dropout<E>, Linear<E>>;
  const auto make = [] {
    Rng rng(9);
    return Net(Conv2d<E>({.in_channels = 2, .out_channels = 4, .kernel_h = 3, .kernel_w = 3, .pad_h = 1, .pad_w = 1}, rng),
               BatchNorm2d<E>(4), ReLU<E>(), MaxPool2d<E>(2, 2), Flatten<E>(), Linear<E>(4 * 4 * 4, 10, rng), ReLU<E>(),
               Dropout<E>(0.25, 17), Linear<E>(10, 3, rng));
  };
  Rng data(15);
  const auto x = split_normal<TestType>({5, 2, 8, 8}, data);
  const auto dy = split_normal<TestType>({5, 3}, data);
  SECTION("train (Dropout applied)") { check_split_backward<Net>(make, x, dy); }
  SECTION("eval (Dropout hands the gradient on)") {
    check_split_backward<Net>(
        [&] {
          Net n = make();
          n.set_mode(Mode::Eval);
          return n;
        },
        x, dy);
  }
  SECTION("units: the layers [begin, end) alone, and the buffers released after the weight half") {
    Net whole = make(), split = make();
    typename Net::Cache c1, c2;
    const auto& h1 = whole.forward_units(x, c1, 0, 5);
    const auto& h2 = split.forward_units(x, c2, 0, 5);
    REQUIRE(split_same_bits(h1, h2));
    const auto& y1 = whole.forward_units(h1, c1, 5, 9);
    split.forward_units(h2, c2, 5, 9);
    whole.backward_units(dy, c1, 5, 9);
    split.backward_units_input(dy, c2, 5, 9);
    CHECK(std::get<8>(c2).dy != nullptr);   // the last Linear's dy is held for its weight half
    CHECK(std::get<6>(c2).dx.numel() > 0);  // the ReLU's gradient is the middle Linear's dy: kept
    split.backward_units_weight(c2, 5, 9);
    split_same_grads(whole, split);
    CHECK(std::get<8>(c2).dy == nullptr);
    // What backward released, the weight half released too (the ReLU's output and gradient).
    CHECK(std::get<6>(c1).dx.numel() == std::get<6>(c2).dx.numel());
    CHECK(std::get<6>(c1).y.numel() == std::get<6>(c2).y.numel());
    CHECK(std::get<6>(c2).dx.numel() == 0);
    (void)y1;
  }
}

TEMPLATE_TEST_CASE("Residual blocks and ResNet units: backward_input then backward_weight equal backward bit for bit",
                   "[layers][models]", float) {
  using E = Env<Cpu, LocalComm, TestType>;
  Rng data(17);
  SECTION("BasicBlock with a projection (stride 2)") {
    const auto x = split_normal<TestType>({2, 4, 8, 8}, data);
    check_split_backward<BasicBlock<E>>(
        [] {
          Rng rng(3);
          return BasicBlock<E>(4, 8, 2, rng, false);
        },
        x, split_normal<TestType>({2, 8, 4, 4}, data));
  }
  SECTION("Bottleneck, identity shortcut") {
    const auto x = split_normal<TestType>({2, 16, 6, 6}, data);
    check_split_backward<Bottleneck<E>>(
        [] {
          Rng rng(3);
          return Bottleneck<E>(16, 4, 1, rng, false);
        },
        x, split_normal<TestType>({2, 16, 6, 6}, data));
  }
  SECTION("ResNet-20 units, the stem and the head included, as two pipeline stages") {
    auto whole = resnet20<E>({.in_channels = 1, .num_classes = 10, .seed = 5});
    auto split = resnet20<E>({.in_channels = 1, .num_classes = 10, .seed = 5});
    const auto x = split_normal<TestType>({4, 1, 12, 12}, data);
    const auto dy = split_normal<TestType>({4, 10}, data);
    typename decltype(whole)::Cache a1, a2, b1, b2;
    const std::size_t cut = 5, units = whole.unit_count();
    const auto& h1 = whole.forward_units(x, a1, 0, cut);
    const auto& h2 = split.forward_units(x, a2, 0, cut);
    REQUIRE(split_same_bits(h1, h2));
    whole.forward_units(h1, b1, cut, units);
    split.forward_units(h2, b2, cut, units);
    const auto& g1 = whole.backward_units(dy, b1, cut, units);
    const auto& g2 = split.backward_units_input(dy, b2, cut, units);
    CHECK(split_same_bits(g1, g2));
    CHECK(split_grads_zero(split));
    split.backward_units_weight(b2, cut, units);
    whole.backward_units(g1, a1, 0, cut);
    split.backward_units_input(g2, a2, 0, cut);
    split.backward_units_weight(a2, 0, cut);
    split_same_grads(whole, split);
  }
}

TEST_CASE("GPT units: backward_units_input then backward_units_weight equal backward_units bit for bit", "[models]") {
  const GPTConfig config{.block_size = 8, .vocab_size = 13, .n_layer = 3, .n_head = 2, .n_embd = 16, .dropout = 0.1};
  Rng r1(21), r2(21), data(22);
  GPT<CpuLocal> whole(config, r1), split(config, r2);
  const std::int64_t batch = 2, t = 6;
  Tensor<std::int64_t, Cpu> idx({batch, t});
  for (std::int64_t k = 0; k < idx.numel(); ++k) idx.data()[k] = static_cast<std::int64_t>(data.next_u64() % 13);
  const auto dlogits = split_normal<float>({batch, t, config.vocab_size}, data);
  // A pipeline's cut: the embeddings and block 0 on one stage, the rest with the head (which then
  // reads the tied wte too) on another; and the whole model as one stage.
  for (const auto& [first_end, what] : {std::pair<std::size_t, const char*>{2, "two stages"}, {5, "one stage"}}) {
    SECTION(what) {
      typename GPT<CpuLocal>::Cache c1, c2;
      const auto& a1 = whole.forward_units(idx, c1, 0, first_end);
      const auto& a2 = split.forward_units(idx, c2, 0, first_end);
      REQUIRE(split_same_bits(a1, a2));
      if (first_end == 5) {
        whole.backward_units(dlogits, c1, 0, 5);
        split.backward_units_input(dlogits, c2, 0, 5);
        CHECK(split_grads_zero(split));
        split.backward_units_weight(c2, 0, 5);
      } else {
        typename GPT<CpuLocal>::Cache d1, d2;
        whole.forward_units(a1, d1, first_end, 5);
        split.forward_units(a2, d2, first_end, 5);
        const auto& g1 = whole.backward_units(dlogits, d1, first_end, 5);
        const auto& g2 = split.backward_units_input(dlogits, d2, first_end, 5);
        CHECK(split_same_bits(g1, g2));
        split.backward_units_weight(d2, first_end, 5);
        whole.backward_units(g1, c1, 0, first_end);
        split.backward_units_input(g2, c2, 0, first_end);
        split.backward_units_weight(c2, 0, first_end);
        CHECK_THROWS_WITH(split.backward_units_weight(c2, 0, first_end), Catch::Contains("had no backward_units_input"));
      }
      split_same_grads(whole, split);
    }
  }
}
