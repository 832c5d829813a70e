// Linear, Sequential and Residual: gradient checks, PyTorch reference, shape errors, hooks.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cstring>
#include <tuple>

#include "support/gradcheck.hpp"
#include "support/reference.hpp"
#include "tessera/comm/local.hpp"
#include "tessera/layers/activation.hpp"
#include "tessera/layers/batch_norm.hpp"
#include "tessera/layers/conv2d.hpp"
#include "tessera/layers/flatten.hpp"
#include "tessera/layers/linear.hpp"
#include "tessera/layers/residual.hpp"
#include "tessera/layers/sequential.hpp"
#include "tessera/models/mlp.hpp"
#include "tessera/models/resnet.hpp"
#include "tessera/io/safetensors.hpp"

using namespace tessera;
using E64 = CpuLocal64;

static_assert(Layer<Linear<CpuLocal>>);
static_assert(Layer<Sequential<Linear<CpuLocal>, ReLU<CpuLocal>>>);
static_assert(Layer<BasicBlock<CpuLocal>>);
static_assert(Layer<Bottleneck<CpuLocal>>);

TEST_CASE("Linear and Sequential: float64 gradient check", "[layers]") {
  Rng rng(1);
  Linear<E64> lin(5, 3, rng);
  testing::check_gradients(lin, testing::random_tensor({4, 5}, rng), rng);
  Linear<E64> no_bias(5, 3, rng, /*bias=*/false);
  testing::check_gradients(no_bias, testing::random_tensor({2, 5}, rng), rng);
  Sequential seq{Linear<E64>(5, 4, rng), ReLU<E64>(), Linear<E64>(4, 2, rng)};
  testing::check_gradients(seq, testing::random_tensor({3, 5}, rng), rng);
  auto named = named_tensors(seq);
  REQUIRE(named.parameters.size() == 4);
  CHECK(named.parameters[2].first == "2.weight");
}

TEST_CASE("Residual blocks: float64 gradient check, identity and projection", "[layers]") {
  Rng rng(2);
  BasicBlock<E64> identity(3, 3, 1, rng, false);
  CHECK_FALSE(identity.has_projection());
  testing::check_gradients(identity, testing::random_tensor({2, 3, 5, 5}, rng), rng);
  BasicBlock<E64> projection(2, 4, 2, rng, false);
  CHECK(projection.has_projection());
  testing::check_gradients(projection, testing::random_tensor({2, 2, 6, 6}, rng), rng);
  Bottleneck<E64> bottleneck(4, 2, 2, rng, false);  // 4 -> 2 -> 8 channels, stride on the 3x3
  testing::check_gradients(bottleneck, testing::random_tensor({2, 4, 5, 5}, rng), rng);
  auto named = named_tensors(bottleneck);
  CHECK(named.parameters.front().first == "conv1.weight");
  CHECK(named.parameters.back().first == "downsample.1.bias");
}

TEST_CASE("Residual: zero-initialized last BN makes the block start as relu(shortcut)", "[layers]") {
  Rng rng(3);
  BasicBlock<E64> block(3, 3, 1, rng, /*zero_init_last_bn=*/true);
  auto x = testing::random_tensor({2, 3, 4, 4}, rng);
  BasicBlock<E64>::Cache cache;
  const auto& y = block.forward(x, cache);
  for (std::int64_t i = 0; i < x.numel(); ++i) REQUIRE(y[i] == Approx(std::max(x[i], 0.0)).margin(1e-12));
}

// The block's end in one pass (BatchNorm2d::forward_add_relu: BN, the shortcut's add and the ReLU)
// against the three steps run apart, bit for bit, in train and eval mode, both memory formats,
// float32 (where a different rounding order would show), identity and projection shortcuts.
template <class Block>
void check_fused_block_end(Block block, const Shape& x_shape, Mode mode, MemoryFormat format) {
  using Tensor = typename Block::Tensor;
  Block apart = block;
  block.set_mode(mode);
  apart.set_mode(mode);
  block.set_memory_format(format);
  apart.set_memory_format(format);
  Rng rng(4);
  const Tensor x = testing::random_tensor(x_shape, rng).cast<float>();
  typename Block::Cache c;
  const Tensor& y = block.forward(x, c);
  // Apart: the branch whole (its last BatchNorm writes its own y), the shortcut, add_relu_forward.
  typename Block::Main::Cache mc;
  const Tensor& m = apart.main().forward(x, mc);
  Tensor s = x;
  if (apart.projection() != nullptr) {
    typename ConvBn<CpuLocal>::Cache pc;
    s = apart.projection()->forward(x, pc);
  }
  Tensor want(m.shape());
  add_relu_forward(Cpu{}, m.data(), s.data(), m.numel(), want.data());
  REQUIRE(y.shape() == want.shape());
  std::int64_t differ = 0;
  for (std::int64_t i = 0; i < y.numel(); ++i) differ += y[i] != want[i];
  CHECK(differ == 0);
  // And backward runs from the fused forward's cache, as from the unfused one (the gradient checks
  // above cover its values).
  const Tensor dy = testing::random_tensor(y.shape(), rng).template cast<float>();
  CHECK(block.backward(dy, c).shape() == x.shape());
}

TEST_CASE("Residual: BatchNorm, add and ReLU fused at the block's end equal the three steps bit for bit", "[layers]") {
  for (Mode mode : {Mode::Train, Mode::Eval})
    for (MemoryFormat f : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
      Rng rng(5);
      check_fused_block_end(Bottleneck<CpuLocal>(16, 4, 1, rng, false), {2, 16, 9, 9}, mode, f);
      check_fused_block_end(Bottleneck<CpuLocal>(8, 4, 2, rng, false), {2, 8, 9, 9}, mode, f);
      check_fused_block_end(BasicBlock<CpuLocal>(8, 8, 1, rng, false), {3, 8, 7, 7}, mode, f);
    }
}

TEST_CASE("Linear matches PyTorch (float64 and float32)", "[layers]") {
  auto f = SafetensorsFile::load(TESSERA_REFERENCE_DATA_DIR "/models.safetensors");
  Rng rng(0);
  Linear<E64> lin(5, 4, rng);
  lin.weight().value = f.tensor<double>("linear.weight");
  lin.bias().value = f.tensor<double>("linear.bias");
  Linear<E64>::Cache c;
  const auto x = f.tensor<double>("linear.x");
  const auto& y = lin.forward(x, c);
  const auto& dx = lin.backward(f.tensor<double>("linear.g"), c);
  auto close = [](const Tensor<double>& a, const Tensor<double>& b, double rel) {
    return testing::relative_error(a, b) <= rel;
  };
  CHECK(close(y, f.tensor<double>("linear.y"), 1e-12));
  CHECK(close(dx, f.tensor<double>("linear.dx"), 1e-12));
  CHECK(close(lin.weight().grad, f.tensor<double>("linear.dweight"), 1e-12));
  CHECK(close(lin.bias().grad, f.tensor<double>("linear.dbias"), 1e-12));

  Linear<CpuLocal> lin32(5, 4, rng);
  lin32.weight().value = f.tensor<float>("linear.weight");
  lin32.bias().value = f.tensor<float>("linear.bias");
  Linear<CpuLocal>::Cache c32;
  const auto x32 = f.tensor<float>("linear.x");
  const auto y32 = lin32.forward(x32, c32).cast<double>();
  const double torch_err = f.tensor<double>("linear.torch_f32_err")[0];
  CHECK(testing::relative_error(y32, f.tensor<double>("linear.y")) <= 8 * torch_err + 1e-7);
}

TEST_CASE("Linear over inputs of any rank: float64 gradient check", "[layers]") {
  Rng rng(4);
  Linear<E64> lin(4, 3, rng);
  testing::check_gradients(lin, testing::random_tensor({2, 3, 4}, rng), rng);  // (B, T, in)
  testing::check_gradients(lin, testing::random_tensor({4}, rng), rng);        // a vector
  testing::check_gradients(lin, testing::random_tensor({2, 1, 2, 4}, rng), rng);
  Linear<E64>::Cache c;
  CHECK(lin.forward(testing::random_tensor({2, 5, 4}, rng), c).shape() == Shape{2, 5, 3});
  CHECK(lin.forward(testing::random_tensor({4}, rng), c).shape() == Shape{3});
}

TEST_CASE("Linear over inputs of any rank matches PyTorch (float64 and float32)", "[layers][reference]") {
  const auto f = SafetensorsFile::load(TESSERA_REFERENCE_DATA_DIR "/norm_act_loss.safetensors");
  struct Case {
    const char* name;
    const char* config;
    std::int64_t in, out;
    bool bias;
  };
  const Case cases[] = {{"linear_rank3", "shape=2x3x5 in=5 out=4 bias=1", 5, 4, true},
                        {"linear_rank1", "shape=6 in=6 out=3 bias=1", 6, 3, true},
                        {"linear_rank4_nobias", "shape=2x2x3x4 in=4 out=5 bias=0", 4, 5, false}};
  auto run = [&]<class S>(const Case& k, S) {
    using E = Env<Cpu, LocalComm, S>;
    const std::string n = k.name;
    INFO("case " << n);
    REQUIRE(f.metadata().at(n) == k.config);
    Rng rng(0);
    Linear<E> lin(k.in, k.out, rng, k.bias);
    lin.weight().value = f.tensor<double>(n + ".weight").cast<S>();
    if (k.bias) lin.bias().value = f.tensor<double>(n + ".bias").cast<S>();
    typename Linear<E>::Cache c;
    const Tensor<S> x = f.tensor<double>(n + ".x").cast<S>();
    const Tensor<S>& y = lin.forward(x, c);
    CHECK(y.shape() == f.tensor<double>(n + ".y").shape());
    testing::expect_matches(f, y, n + ".y");
    testing::expect_matches(f, lin.backward(f.tensor<double>(n + ".g").cast<S>(), c), n + ".dx");
    testing::expect_matches(f, lin.weight().grad, n + ".dweight");
    if (k.bias) testing::expect_matches(f, lin.bias().grad, n + ".dbias");
  };
  for (const Case& k : cases) {
    run(k, 0.0);
    run(k, 0.0f);
  }
}

TEST_CASE("Linear: shape errors name the layer and both shapes", "[layers]") {
  Rng rng(0);
  Linear<CpuLocal> lin(5, 4, rng);
  Linear<CpuLocal>::Cache c;
  Tensor<float> bad({3, 6});
  try {
    lin.forward(bad, c);
    FAIL("expected ShapeError");
  } catch (const ShapeError& e) {
    const std::string msg = e.what();
    CHECK_THAT(msg, Catch::Contains("Linear(5, 4)") && Catch::Contains("(*, 5)") && Catch::Contains("(3, 6)"));
  }
  CHECK_THROWS_AS(Linear<CpuLocal>(0, 4, rng), ArgumentError);
}

TEST_CASE("Linear reading a flattened input equals Flatten then Linear bit for bit; the MLP flattens so", "[layers]") {
  Rng data(12);
  Tensor<float> x(Shape{3, 2, 2, 5}), dy(Shape{3, 4});
  for (auto& v : x) v = static_cast<float>(data.normal());
  for (auto& v : dy) v = static_cast<float>(data.normal());
  const auto bits = [](const Tensor<float>& a, const Tensor<float>& b) {
    return a.shape() == b.shape() && std::memcmp(a.data(), b.data(), a.bytes()) == 0;
  };
  Rng r1(3), r2(3);
  Flatten<CpuLocal> flatten;
  Linear<CpuLocal> after_flatten(20, 4, r1), flattening(20, 4, r2);
  flattening.set_flattens_input(true);
  Flatten<CpuLocal>::Cache cf;
  Linear<CpuLocal>::Cache c1, c2;
  const Tensor<float>& y1 = after_flatten.forward(flatten.forward(x, cf), c1);
  const Tensor<float>& y2 = flattening.forward(x, c2);
  CHECK(y2.shape() == Shape{3, 4});
  CHECK(bits(y1, y2));
  const Tensor<float>& dx1 = flatten.backward(after_flatten.backward(dy, c1), cf);
  const Tensor<float>& dx2 = flattening.backward(dy, c2);
  CHECK(dx2.shape() == x.shape());  // dL/dx in x's shape, as Flatten's backward gives it
  CHECK(bits(dx1, dx2));
  CHECK(bits(after_flatten.weight().grad, flattening.weight().grad));
  CHECK(bits(after_flatten.bias().grad, flattening.bias().grad));
  // A sample of the wrong size, and a lone vector (no batch dimension), are refused by name.
  CHECK_THROWS_WITH(flattening.forward(Tensor<float>(Shape{3, 21}), c2),
                    Catch::Contains("Linear(20, 4) on a flattened input") && Catch::Contains("(3, 21)"));
  CHECK_THROWS_AS(flattening.forward(Tensor<float>(Shape{20}), c2), ShapeError);
  // The MLP's first layer flattens: an (N, 1, 28, 28)-like batch and its flat copy train alike.
  Mlp<CpuLocal> from_image(20, {6}, 4, 5), from_flat(20, {6}, 4, 5);
  Mlp<CpuLocal>::Cache m1, m2;
  Tensor<float> flat = x;
  flat.reshape({3, 20});
  CHECK(bits(from_image.forward(x, m1), from_flat.forward(flat, m2)));
  from_image.backward(dy, m1);
  from_flat.backward(dy, m2);
  auto a = named_tensors(from_image), b = named_tensors(from_flat);
  for (std::size_t k = 0; k < a.parameters.size(); ++k) CHECK(bits(a.parameters[k].second->grad, b.parameters[k].second->grad));
  CHECK_THROWS_AS(from_image.forward(Tensor<float>(Shape{20}), m1), ShapeError);
}

TEST_CASE("Backward calls each parameter's gradient-ready hook once, last layer first", "[layers]") {
  Rng rng(4);
  Sequential seq{Linear<CpuLocal>(3, 4, rng), ReLU<CpuLocal>(), Linear<CpuLocal>(4, 2, rng)};
  auto named = named_tensors(seq);
  std::vector<std::string> order;
  for (auto& [name, p] : named.parameters) {
    p->on_grad_ready = [&order, n = name](Parameter<float, Cpu>&) { order.push_back(n); };
  }
  decltype(seq)::Cache cache;
  Tensor<float> x({2, 3}, 0.5f);
  const auto& y = seq.forward(x, cache);
  seq.backward(Tensor<float>(y.shape(), 1.0f), cache);
  CHECK(order == std::vector<std::string>{"2.weight", "2.bias", "0.weight", "0.bias"});
}

TEST_CASE("Per-micro-batch caches: two forwards in flight, backwards in any order", "[layers]") {
  Rng rng(5);
  BasicBlock<E64> block(2, 2, 1, rng, false);
  auto xa = testing::random_tensor({2, 2, 4, 4}, rng), xb = testing::random_tensor({2, 2, 4, 4}, rng);
  auto g = testing::random_tensor({2, 2, 4, 4}, rng);
  auto grads_of = [&](auto run) {
    auto named = named_tensors(block);
    for (auto& [n, p] : named.parameters) p->grad.zero();
    run();
    std::vector<Tensor<double>> out;
    for (auto& [n, p] : named.parameters) out.push_back(p->grad);
    return out;
  };
  // Reference: forward a, backward a, forward b, backward b.
  Tensor<double> dxa_ref, dxb_ref;
  auto sequential = grads_of([&] {
    BasicBlock<E64>::Cache ca, cb;
    block.forward(xa, ca);
    dxa_ref = block.backward(g, ca);
    block.forward(xb, cb);
    dxb_ref = block.backward(g, cb);
  });
  // Interleaved like a pipeline stage: forward a, forward b, backward b, backward a.
  Tensor<double> dxa, dxb;
  auto interleaved = grads_of([&] {
    BasicBlock<E64>::Cache ca, cb;
    block.forward(xa, ca);
    block.forward(xb, cb);
    dxb = block.backward(g, cb);
    dxa = block.backward(g, ca);
  });
  CHECK(testing::relative_error(dxa, dxa_ref) < 1e-12);
  CHECK(testing::relative_error(dxb, dxb_ref) < 1e-12);
  for (std::size_t i = 0; i < sequential.size(); ++i) CHECK(testing::relative_error(interleaved[i], sequential[i]) < 1e-12);
}

// Activation memory (core/concepts.hpp): Sequential releases what no backward reads, recomputes a
// ReLU after a BatchNorm, and frees gradients once consumed; the results must be bit for bit those
// of the same layers run one by one with every buffer kept.
TEST_CASE("Sequential: released and recomputed activations give bit-identical gradients", "[layers]") {
  Rng rng(9);
  Sequential seq{Conv2d<E64>(2, 3, 3, rng, 1, 1), BatchNorm2d<E64>(3), ReLU<E64>(), Conv2d<E64>(3, 4, 3, rng, 1, 1),
                 BatchNorm2d<E64>(4), ReLU<E64>(), Conv2d<E64>(4, 2, 1, rng)};
  auto manual = seq;  // the same parameters, run layer by layer below
  const auto x = testing::random_tensor({2, 2, 5, 5}, rng);
  const auto dy = testing::random_tensor({2, 2, 5, 5}, rng);

  decltype(seq)::Cache cache;
  const auto& y = seq.forward(x, cache);
  // Dead after the next forward: BatchNorm outputs (the ReLU reads only its own output) and the
  // ReLUs' outputs (recomputed); kept: the convolutions' outputs, which BatchNorm reads back.
  CHECK(output_released(std::get<1>(cache)));
  CHECK(output_released(std::get<2>(cache)));
  CHECK(output_released(std::get<4>(cache)));
  CHECK(output_released(std::get<5>(cache)));
  CHECK_FALSE(output_released(std::get<0>(cache)));
  CHECK_FALSE(output_released(std::get<3>(cache)));
  const Tensor<double> y_seq = y;
  const Tensor<double> dx_seq = seq.backward(dy, cache);
  CHECK(std::get<3>(cache).dx.empty());  // consumed by the ReLU before it
  CHECK(output_released(std::get<3>(cache)));
  CHECK_FALSE(output_released(std::get<6>(cache)));  // the Sequential's own output outlives backward

  std::tuple<Conv2d<E64>::Cache, BatchNorm2d<E64>::Cache, ReLU<E64>::Cache, Conv2d<E64>::Cache,
             BatchNorm2d<E64>::Cache, ReLU<E64>::Cache, Conv2d<E64>::Cache>
      c;
  const auto& h1 = manual.get<2>().forward(manual.get<1>().forward(manual.get<0>().forward(x, std::get<0>(c)), std::get<1>(c)),
                                           std::get<2>(c));
  const auto& h2 = manual.get<5>().forward(manual.get<4>().forward(manual.get<3>().forward(h1, std::get<3>(c)), std::get<4>(c)),
                                           std::get<5>(c));
  const auto& y_manual = manual.get<6>().forward(h2, std::get<6>(c));
  CHECK(std::equal(y_manual.begin(), y_manual.end(), y_seq.begin(), y_seq.end()));
  const auto& g2 = manual.get<3>().backward(
      manual.get<4>().backward(manual.get<5>().backward(manual.get<6>().backward(dy, std::get<6>(c)), std::get<5>(c)),
                               std::get<4>(c)),
      std::get<3>(c));
  const auto& dx_manual = manual.get<0>().backward(
      manual.get<1>().backward(manual.get<2>().backward(g2, std::get<2>(c)), std::get<1>(c)), std::get<0>(c));
  CHECK(std::equal(dx_manual.begin(), dx_manual.end(), dx_seq.begin(), dx_seq.end()));
  auto a = named_tensors(seq), b = named_tensors(manual);
  REQUIRE(a.parameters.size() == b.parameters.size());
  for (std::size_t i = 0; i < a.parameters.size(); ++i) {
    const auto& ga = a.parameters[i].second->grad;
    const auto& gb = b.parameters[i].second->grad;
    INFO(a.parameters[i].first);
    CHECK(std::equal(ga.begin(), ga.end(), gb.begin(), gb.end()));
  }

  // A second step on the same cache: released buffers are allocated again, recomputation repeats.
  seq.forward(x, cache);
  const Tensor<double> dx_again = seq.backward(dy, cache);
  CHECK(std::equal(dx_again.begin(), dx_again.end(), dx_seq.begin(), dx_seq.end()));
}

// BatchNorm2d-ReLU fusion (layers/batch_norm.hpp): one call over the pair, or the pair cut between
// two calls as a pipeline stage boundary would cut it (each half then runs unfused), in training
// and in eval mode, gives bit for bit the numbers of the layers run one by one.
TEST_CASE("Sequential: fused BatchNorm-ReLU equals the layers one by one, whole or cut between them", "[layers]") {
  for (const Mode mode : {Mode::Train, Mode::Eval}) {
    INFO((mode == Mode::Train ? "train" : "eval"));
    Rng rng(21);
    Sequential seq{Conv2d<E64>(2, 3, 3, rng, 1, 1), BatchNorm2d<E64>(3), ReLU<E64>(), Conv2d<E64>(3, 2, 1, rng)};
    // Running statistics away from (0, 1), so that eval mode's mask differs from training's.
    seq.get<1>().running_mean().fill(0.3);
    seq.get<1>().running_var().fill(2.0);
    seq.set_mode(mode);
    auto cut = seq, manual = seq;
    const auto x = testing::random_tensor({2, 2, 4, 4}, rng);
    const auto dy = testing::random_tensor({2, 2, 4, 4}, rng);

    decltype(seq)::Cache whole_cache, cut_cache;
    const Tensor<double> y_whole = seq.forward(x, whole_cache);
    const Tensor<double> dx_whole = seq.backward(dy, whole_cache);
    const auto& h = cut.forward_units(x, cut_cache, 0, 2);  // conv, BatchNorm | ReLU, conv
    const Tensor<double> y_cut = cut.forward_units(h, cut_cache, 2, 4);
    const auto& dh = cut.backward_units(dy, cut_cache, 2, 4);
    const Tensor<double> dx_cut = cut.backward_units(dh, cut_cache, 0, 2);

    std::tuple<Conv2d<E64>::Cache, BatchNorm2d<E64>::Cache, ReLU<E64>::Cache, Conv2d<E64>::Cache> c;
    const auto& y_manual = manual.get<3>().forward(
        manual.get<2>().forward(manual.get<1>().forward(manual.get<0>().forward(x, std::get<0>(c)), std::get<1>(c)),
                                std::get<2>(c)),
        std::get<3>(c));
    CHECK(std::equal(y_manual.begin(), y_manual.end(), y_whole.begin(), y_whole.end()));
    CHECK(std::equal(y_manual.begin(), y_manual.end(), y_cut.begin(), y_cut.end()));
    const auto& dx_manual = manual.get<0>().backward(
        manual.get<1>().backward(manual.get<2>().backward(manual.get<3>().backward(dy, std::get<3>(c)), std::get<2>(c)),
                                 std::get<1>(c)),
        std::get<0>(c));
    CHECK(std::equal(dx_manual.begin(), dx_manual.end(), dx_whole.begin(), dx_whole.end()));
    CHECK(std::equal(dx_manual.begin(), dx_manual.end(), dx_cut.begin(), dx_cut.end()));
    auto a = named_tensors(seq), b = named_tensors(cut), m = named_tensors(manual);
    for (std::size_t i = 0; i < m.parameters.size(); ++i) {
      INFO(m.parameters[i].first);
      const auto& gm = m.parameters[i].second->grad;
      CHECK(std::equal(gm.begin(), gm.end(), a.parameters[i].second->grad.begin(), a.parameters[i].second->grad.end()));
      CHECK(std::equal(gm.begin(), gm.end(), b.parameters[i].second->grad.begin(), b.parameters[i].second->grad.end()));
    }
    // The mask really cut something: some of the ReLU's inputs were negative, some positive.
    const auto& relu_out = std::get<2>(c).y;
    CHECK(std::count(relu_out.begin(), relu_out.end(), 0.0) > 0);
    CHECK(std::count(relu_out.begin(), relu_out.end(), 0.0) < relu_out.numel());
  }
}

// The backward in two halves (zero-bubble pipelines run the weight gradients later): I then W
// gives backward's dL/dx and parameter gradients bit for bit, for Linear and for the MLP's units.
TEMPLATE_TEST_CASE("Linear and MLP: backward_input then backward_weight equal backward bit for bit", "[layers]", float, double) {
  using E = Env<Cpu, LocalComm, TestType>;
  Rng data(31);
  Tensor<TestType, Cpu> x(Shape{6, 20}), dy(Shape{6, 12});
  for (std::int64_t k = 0; k < x.numel(); ++k) x.data()[k] = static_cast<TestType>(data.normal());
  for (std::int64_t k = 0; k < dy.numel(); ++k) dy.data()[k] = static_cast<TestType>(data.normal());
  const auto bits = [](const Tensor<TestType, Cpu>& a, const Tensor<TestType, Cpu>& b) {
    return a.shape() == b.shape() && std::memcmp(a.data(), b.data(), a.bytes()) == 0;
  };
  {
    Rng r1(5), r2(5);
    Linear<E> whole(20, 12, r1), split(20, 12, r2);
    typename Linear<E>::Cache c1, c2;
    whole.forward(x, c1);
    split.forward(x, c2);
    const auto& dx_whole = whole.backward(dy, c1);
    const auto& dx_split = split.backward_input(dy, c2);
    CHECK(bits(dx_whole, dx_split));
    CHECK(std::all_of(split.weight().grad.data(), split.weight().grad.data() + split.weight().grad.numel(),
                      [](TestType g) { return g == 0; }));  // nothing yet
    split.backward_weight(c2);
    CHECK(bits(whole.weight().grad, split.weight().grad));
    CHECK(bits(whole.bias().grad, split.bias().grad));
    CHECK_THROWS_WITH(split.backward_weight(c2), Catch::Contains("without backward_input"));
  }
  {
    Mlp<E> whole(20, {16, 14}, 12, 9), split(20, {16, 14}, 12, 9);
    typename Mlp<E>::Cache c1, c2;
    whole.forward(x, c1);
    split.forward(x, c2);
    whole.backward_units(dy, c1, 1, 3);
    split.backward_units_input(dy, c2, 1, 3);
    split.backward_units_weight(c2, 1, 3);
    auto a = named_tensors(whole), b = named_tensors(split);
    for (std::size_t k = 0; k < a.parameters.size(); ++k) {
      INFO(a.parameters[k].first);
      CHECK(bits(a.parameters[k].second->grad, b.parameters[k].second->grad));
    }
  }
}
