// Channels last (core/memory_format.hpp) on the CPU: every layer that reads the format gives, in
// NHWC, the numbers it gives in NCHW (outputs, input gradients, parameter gradients, BatchNorm's
// running statistics), in float64 and float32; float64 gradient checks in NHWC; ResNets whole;
// and the layers that cannot take NHWC refuse it by name. The GPU's NHWC kernels are checked
// against these CPU ones by tests/cuda/layer_equivalence.hpp.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <string>

#include "support/gradcheck.hpp"
#include "tessera/comm/local.hpp"
#include "tessera/core/env.hpp"
#include "tessera/core/memory_format.hpp"
#include "tessera/layers/batch_norm.hpp"
#include "tessera/layers/conv2d.hpp"
#include "tessera/layers/flatten.hpp"
#include "tessera/layers/linear.hpp"
#include "tessera/layers/norm.hpp"
#include "tessera/layers/pool.hpp"
#include "tessera/layers/sequential.hpp"
#include "tessera/models/resnet.hpp"

namespace {

using namespace tessera;
using testing::check_gradients;
using testing::random_tensor;
using E32 = Env<Cpu, LocalComm, float>;
using E64 = Env<Cpu, LocalComm, double>;

template <class S>
Tensor<S> random_of(const Shape& shape, Rng& rng) {
  return random_tensor(shape, rng).cast<S>();
}

// A 4-D tensor NCHW -> NHWC (to_nhwc) or back; other ranks are the same in both formats.
template <class S>
Tensor<S> converted(const Tensor<S>& x, bool to_nhwc) {
  if (x.rank() != 4) return x;
  Tensor<S> y(x.shape());
  const std::int64_t n = x.dim(0), c = x.dim(1), hw = x.dim(2) * x.dim(3);
  if (to_nhwc) nchw_to_nhwc(Cpu{}, n, c, hw, x.data(), y.data());
  else nhwc_to_nchw(Cpu{}, n, c, hw, x.data(), y.data());
  return y;
}

// max |a - b| / max(1, max |b|): the numbers of two formats, compared in NCHW.
template <class S>
double distance(const Tensor<S>& a, const Tensor<S>& b) {
  REQUIRE(a.shape() == b.shape());
  double diff = 0, scale = 1;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    diff = std::max(diff, std::abs(double(a[i]) - double(b[i])));
    scale = std::max(scale, std::abs(double(b[i])));
  }
  return diff / scale;
}

// `layer` run on x in NCHW and a copy of it in NHWC, forward then backward from the same dy (twice,
// in train mode, so that the running statistics move twice): every result within tol.
template <class L>
void check_formats_agree(const L& layer, const Shape& x_shape, Rng& rng, double tol) {
  using S = typename L::Env::Scalar;
  L planar = layer, nhwc = layer;
  nhwc.set_memory_format(MemoryFormat::ChannelsLast);
  for (int step = 0; step < 2; ++step) {
    const Tensor<S> x = random_of<S>(x_shape, rng);
    const Tensor<S> x_nhwc = converted(x, true);
    typename L::Cache cp, cn;
    const Tensor<S>& yp = planar.forward(x, cp);
    const Tensor<S>& yn = nhwc.forward(x_nhwc, cn);
    INFO("step " << step << ", input " << x_shape);
    CHECK(distance(converted(yn, false), yp) <= tol);
    const Tensor<S> dy = random_of<S>(yp.shape(), rng);
    const Tensor<S>& dxp = planar.backward(dy, cp);
    const Tensor<S>& dxn = nhwc.backward(converted(dy, true), cn);
    CHECK(distance(converted(dxn, false), dxp) <= tol);
  }
  auto np = named_tensors(planar), nn = named_tensors(nhwc);
  REQUIRE(np.parameters.size() == nn.parameters.size());
  for (std::size_t i = 0; i < np.parameters.size(); ++i) {
    INFO(np.parameters[i].first);
    CHECK(distance(nn.parameters[i].second->grad, np.parameters[i].second->grad) <= tol);
  }
  for (std::size_t i = 0; i < np.buffers.size(); ++i) {
    INFO(np.buffers[i].first);
    CHECK(distance(*nn.buffers[i].second, *np.buffers[i].second) <= tol);
  }
}

template <class E>
Conv2d<E> conv(Conv2dOptions o, std::uint64_t seed) {
  Rng rng(seed);
  return Conv2d<E>(o, rng);
}

// float64: the same sums in another order; float32: a few ulps of the layer's outputs.
template <class E>
constexpr double kTol = std::is_same_v<typename E::Scalar, double> ? 1e-12 : 2e-5;

TEMPLATE_TEST_CASE("Channels last: Conv2d gives NCHW's numbers", "[layers][memory-format]", E64, E32) {
  Rng rng(1);
  const double tol = kTol<TestType>;
  check_formats_agree(conv<TestType>({3, 8, 3, 3, 1, 1, 1, 1}, 2), {2, 3, 7, 6}, rng, tol);
  check_formats_agree(conv<TestType>({6, 4, 1, 1, 2, 2, 0, 0, 1, 1, 1, false}, 3), {2, 6, 9, 8}, rng, tol);
  check_formats_agree(conv<TestType>({3, 6, 7, 7, 2, 2, 3, 3}, 4), {2, 3, 16, 15}, rng, tol);
  check_formats_agree(conv<TestType>({4, 6, 3, 3, 1, 1, 1, 1, 1, 1, 2}, 5), {1, 4, 5, 5}, rng, tol);  // groups
}

TEMPLATE_TEST_CASE("Channels last: BatchNorm2d, alone and fused with a ReLU, gives NCHW's numbers",
                   "[layers][memory-format]", E64, E32) {
  using E = TestType;
  Rng rng(6);
  const double tol = kTol<E>;
  BatchNorm2d<E> bn(5);
  check_formats_agree(bn, {3, 5, 4, 3}, rng, tol);
  // Large enough for the threaded row sums (more than 2^14 values).
  check_formats_agree(bn, {4, 5, 30, 31}, rng, tol);
  Sequential<Conv2d<E>, BatchNorm2d<E>, ReLU<E>> conv_bn_relu{conv<E>({3, 5, 3, 3, 1, 1, 1, 1}, 7), BatchNorm2d<E>(5),
                                                              ReLU<E>()};
  check_formats_agree(conv_bn_relu, {2, 3, 6, 6}, rng, tol);
  bn.set_mode(Mode::Eval);
  check_formats_agree(bn, {3, 5, 4, 3}, rng, tol);
  conv_bn_relu.set_mode(Mode::Eval);
  check_formats_agree(conv_bn_relu, {2, 3, 6, 6}, rng, tol);
}

TEMPLATE_TEST_CASE("Channels last: the pooling layers and Flatten give NCHW's numbers", "[layers][memory-format]", E64,
                   E32) {
  using E = TestType;
  Rng rng(8);
  const double tol = kTol<E>;
  check_formats_agree(MaxPool2d<E>(3, 2, 1), {2, 5, 9, 8}, rng, tol);
  check_formats_agree(MaxPool2d<E>(2), {2, 3, 6, 7}, rng, tol);
  check_formats_agree(MaxPool2d<E>(3, 2, 1, /*ceil_mode=*/true), {1, 4, 8, 7}, rng, tol);
  check_formats_agree(AvgPool2d<E>(3, 2, 1), {2, 5, 9, 8}, rng, tol);
  check_formats_agree(AvgPool2d<E>({.kernel = 3, .stride = 2, .padding = 1, .ceil_mode = true,
                                    .count_include_pad = false}),
                      {2, 3, 8, 7}, rng, tol);
  check_formats_agree(AdaptiveAvgPool2d<E>(3, 2), {2, 4, 7, 5}, rng, tol);
  check_formats_agree(AdaptiveAvgPool2d<E>(1), {2, 4, 7, 5}, rng, tol);
  check_formats_agree(GlobalAvgPool<E>(), {3, 6, 5, 4}, rng, tol);
  check_formats_agree(Flatten<E>(), {2, 3, 4, 5}, rng, tol);
}

TEST_CASE("Channels last: float64 gradient checks in NHWC", "[layers][memory-format]") {
  Rng rng(10);
  auto c = conv<E64>({3, 4, 3, 3, 2, 2, 1, 1}, 11);
  c.set_memory_format(MemoryFormat::ChannelsLast);
  check_gradients(c, random_tensor({2, 3, 6, 5}, rng), rng);
  Sequential<BatchNorm2d<E64>, ReLU<E64>> bn_relu{BatchNorm2d<E64>(3), ReLU<E64>()};
  bn_relu.set_memory_format(MemoryFormat::ChannelsLast);
  check_gradients(bn_relu, random_tensor({2, 3, 4, 5}, rng), rng);
  MaxPool2d<E64> max_pool(3, 2, 1);
  max_pool.set_memory_format(MemoryFormat::ChannelsLast);
  check_gradients(max_pool, random_tensor({2, 3, 7, 6}, rng), rng);
  AvgPool2d<E64> avg_pool({.kernel = 3, .stride = 2, .padding = 1, .count_include_pad = false});
  avg_pool.set_memory_format(MemoryFormat::ChannelsLast);
  check_gradients(avg_pool, random_tensor({2, 3, 7, 6}, rng), rng);
  GlobalAvgPool<E64> global;
  global.set_memory_format(MemoryFormat::ChannelsLast);
  check_gradients(global, random_tensor({2, 3, 4, 5}, rng), rng);
}

// The model takes NCHW input in both formats and gives the same logits and gradients.
template <class Model>
void check_model_formats_agree(Model planar, const Shape& x_shape, double tol) {
  using S = typename Model::Env::Scalar;
  Model nhwc = planar;
  nhwc.set_memory_format(MemoryFormat::ChannelsLast);
  REQUIRE(nhwc.memory_format() == MemoryFormat::ChannelsLast);
  Rng rng(12);
  for (int step = 0; step < 2; ++step) {
    const Tensor<S> x = random_of<S>(x_shape, rng);
    typename Model::Cache cp, cn;
    const Tensor<S>& yp = planar.forward(x, cp);
    const Tensor<S>& yn = nhwc.forward(x, cn);
    CHECK(distance(yn, yp) <= tol);
    const Tensor<S> dy = random_of<S>(yp.shape(), rng);
    planar.backward(dy, cp);
    nhwc.backward(dy, cn);
  }
  auto np = named_tensors(planar), nn = named_tensors(nhwc);
  for (std::size_t i = 0; i < np.parameters.size(); ++i) {
    INFO(np.parameters[i].first);
    CHECK(distance(nn.parameters[i].second->grad, np.parameters[i].second->grad) <= tol);
  }
  for (std::size_t i = 0; i < np.buffers.size(); ++i) {
    INFO(np.buffers[i].first);
    CHECK(distance(*nn.buffers[i].second, *np.buffers[i].second) <= tol);
  }
  // Inference (the convolutions' fused epilogues) and its residual addends.
  planar.set_mode(Mode::Inference);
  nhwc.set_mode(Mode::Inference);
  Rng xr(13);
  const Tensor<S> x = random_of<S>(x_shape, xr);
  typename Model::Cache cp, cn;
  CHECK(distance(nhwc.forward(x, cn), planar.forward(x, cp)) <= tol);
}

TEST_CASE("Channels last: ResNets give NCHW's logits, gradients and statistics", "[layers][memory-format][models]") {
  check_model_formats_agree(cifar_resnet<E64>(8, {.in_channels = 3, .num_classes = 5}), {2, 3, 8, 8}, 1e-11);
  // Bottleneck blocks, the ImageNet stem (7x7/2 and the 3x3/2 max-pool), projections.
  check_model_formats_agree(ResNet<E64, Bottleneck>({1, 1}, {4, 8}, true, {.in_channels = 3, .num_classes = 4}),
                            {2, 3, 32, 32}, 1e-11);
  check_model_formats_agree(ResNet<E32, Bottleneck>({1, 1}, {4, 8}, true, {.in_channels = 3, .num_classes = 4}),
                            {2, 3, 32, 32}, 1e-4);
}

TEST_CASE("Channels last is refused by layers that work on NCHW only, by name", "[layers][memory-format]") {
  Rng rng(14);
  Sequential<Conv2d<E32>, LayerNorm<E32>> with_norm{conv<E32>({3, 4, 3, 3, 1, 1, 1, 1}, 15), LayerNorm<E32>(4)};
  CHECK_THROWS_WITH(with_norm.set_memory_format(MemoryFormat::ChannelsLast),
                    Catch::Contains("Sequential::set_memory_format(channels_last)") &&
                        Catch::Contains("contiguous (NCHW) data only"));
  with_norm.set_memory_format(MemoryFormat::Contiguous);  // always allowed
  Linear<E32> fc(5, 3, rng);
  fc.set_memory_format(MemoryFormat::ChannelsLast);
  Linear<E32>::Cache c;
  CHECK_NOTHROW(fc.forward(Tensor<float>({2, 5}, 1.0f), c));
  CHECK_THROWS_WITH(fc.forward(Tensor<float>({2, 3, 4, 5}, 1.0f), c), Catch::Contains("channels_last"));
  CHECK(parse_memory_format("channels_last") == MemoryFormat::ChannelsLast);
  CHECK(parse_memory_format("contiguous") == MemoryFormat::Contiguous);
  CHECK_THROWS_WITH(parse_memory_format("nhwc", "--memory-format"),
                    Catch::Contains("--memory-format") && Catch::Contains("'nhwc'"));
}

TEST_CASE("NCHW <-> NHWC conversions are each other's inverse and move the right elements", "[layers][memory-format]") {
  Rng rng(16);
  const Tensor<float> x = random_of<float>({3, 37, 5, 7}, rng);  // odd sizes: partial tiles
  Tensor<float> y(x.shape()), back(x.shape());
  nchw_to_nhwc(Cpu{}, 3, 37, 35, x.data(), y.data());
  CHECK(y[((2 * 5 + 4) * 7 + 6) * 37 + 36] == x[((2 * 37 + 36) * 5 + 4) * 7 + 6]);
  CHECK(y[((1 * 5 + 0) * 7 + 3) * 37 + 5] == x[((1 * 37 + 5) * 5 + 0) * 7 + 3]);
  nhwc_to_nchw(Cpu{}, 3, 37, 35, y.data(), back.data());
  CHECK(distance(back, x) == 0.0);
}

}  // namespace
