// Conv2d, MaxPool2d, AvgPool2d, GlobalAvgPool: float64 gradient checks against central
// differences, forward/backward against PyTorch (tests/data/conv_pool.safetensors, written by
// tools/reference/gen_conv_pool.py) in float64 and float32, shape errors, allocation-free steps.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "support/gradcheck.hpp"
#include "support/reference.hpp"
#include "tessera/comm/local.hpp"
#include "tessera/core/env.hpp"
#include "tessera/layers/conv2d.hpp"
#include "tessera/layers/pool.hpp"
#include "tessera/io/safetensors.hpp"

namespace {

using namespace tessera;
using testing::check_gradients;
using testing::random_tensor;
using testing::relative_error;
using testing::T64;
using E32 = Env<Cpu, LocalComm, float>;
using E64 = Env<Cpu, LocalComm, double>;

static_assert(Layer<Conv2d<E32>>);
static_assert(Layer<MaxPool2d<E32>>);
static_assert(Layer<AvgPool2d<E32>>);
static_assert(Layer<GlobalAvgPool<E32>>);

const SafetensorsFile& reference() {
  static const SafetensorsFile file = SafetensorsFile::load(TESSERA_REFERENCE_DATA_DIR "/conv_pool.safetensors");
  return file;
}

template <class L>
void zero_grads(L& layer) {
  for (auto& [name, p] : named_tensors(layer).parameters) p->grad.zero();
}

// ---- gradient checks (float64, central differences) ----

TEST_CASE("Conv2d gradients match central differences", "[layers][conv]") {
  Rng rng(11);
  struct Case {
    const char* what;
    Conv2dOptions o;
    Shape x;
  };
  const std::vector<Case> cases = {
      {"3x3 stride 2 padding 1", {3, 4, 3, 3, 2, 2, 1, 1, 1, 1, 1, true}, {2, 3, 7, 6}},
      {"3x3 stride 2 padding 1, one sample", {3, 4, 3, 3, 2, 2, 1, 1, 1, 1, 1, true}, {1, 3, 7, 6}},
      {"3x3 padding 1 no bias", {2, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, false}, {2, 2, 5, 5}},
      {"dilation 2 padding 2", {2, 3, 3, 3, 1, 1, 2, 2, 2, 2, 1, true}, {2, 2, 7, 7}},
      {"groups 2", {4, 6, 3, 3, 1, 1, 1, 1, 1, 1, 2, true}, {2, 4, 5, 5}},
      {"rectangular 3x2 stride 2x1", {2, 3, 3, 2, 2, 1, 1, 0, 1, 1, 1, true}, {2, 2, 6, 5}},
      {"1x1 (pointwise path)", {4, 3, 1, 1, 1, 1, 0, 0, 1, 1, 1, true}, {3, 4, 4, 3}},
      {"1x1 stride 2 no bias", {4, 3, 1, 1, 2, 2, 0, 0, 1, 1, 1, false}, {2, 4, 5, 5}},
  };
  for (const auto& c : cases) {
    // Blocks of one output row (bands) and the automatic choice (whole samples here).
    for (std::int64_t columns : {std::int64_t{1}, std::int64_t{0}}) {
      DYNAMIC_SECTION(c.what << ", block columns " << columns) {
        Conv2d<E64> conv(c.o, rng);
        conv.set_block_columns(columns);
        check_gradients(conv, random_tensor(c.x, rng), rng);
      }
    }
  }
}

TEST_CASE("Pool gradients match central differences", "[layers][pool]") {
  Rng rng(12);
  SECTION("MaxPool2d 3/2/1") {
    MaxPool2d<E64> pool(3, 2, 1);
    check_gradients(pool, random_tensor({2, 3, 7, 6}, rng), rng);
  }
  SECTION("MaxPool2d 2, default stride") {
    MaxPool2d<E64> pool(2);
    check_gradients(pool, random_tensor({2, 2, 6, 5}, rng), rng);
  }
  SECTION("AvgPool2d 3/2/1") {
    AvgPool2d<E64> pool(3, 2, 1);
    check_gradients(pool, random_tensor({2, 3, 7, 6}, rng), rng);
  }
  SECTION("AvgPool2d 2/1/0") {
    AvgPool2d<E64> pool(2, 1, 0);
    check_gradients(pool, random_tensor({2, 2, 4, 5}, rng), rng);
  }
  SECTION("GlobalAvgPool") {
    GlobalAvgPool<E64> pool;
    check_gradients(pool, random_tensor({2, 3, 4, 5}, rng), rng);
  }
}

// ---- reference data from PyTorch ----

struct ConvCase {
  const char* name;
  std::int64_t n, c_in, h, w, c_out, kh, kw, sh, sw, ph, pw, dh, dw, groups;
  bool bias;

  std::string config() const {
    return detail::cat("N=", n, " C_in=", c_in, " H=", h, " W=", w, " C_out=", c_out, " kernel=", kh, "x", kw,
                       " stride=", sh, "x", sw, " padding=", ph, "x", pw, " dilation=", dh, "x", dw, " groups=", groups,
                       " bias=", bias ? 1 : 0);
  }
  Conv2dOptions options() const { return {c_in, c_out, kh, kw, sh, sw, ph, pw, dh, dw, groups, bias}; }
};

const ConvCase kConvCases[] = {
    {"conv_groups_dilation", 2, 4, 7, 7, 6, 3, 3, 1, 1, 2, 2, 2, 2, 2, true},
    {"conv_stem", 2, 3, 16, 16, 8, 7, 7, 2, 2, 3, 3, 1, 1, 1, false},
    {"conv_1x1", 3, 8, 5, 5, 6, 1, 1, 1, 1, 0, 0, 1, 1, 1, true},
    {"conv_1x1_stride2", 2, 6, 7, 7, 4, 1, 1, 2, 2, 0, 0, 1, 1, 1, false},
    {"conv_rect", 3, 3, 9, 8, 4, 3, 2, 2, 1, 1, 0, 1, 1, 1, true},
};

// Compares one of our tensors (any scalar) with PyTorch's float64 result. Float64 must agree to
// rounding; float32 within 8x PyTorch's own float32 error plus a floor of a few float32 ulps.
template <class S>
void expect_matches(const Tensor<S>& ours, const std::string& key) {
  REQUIRE(ours.shape() == reference().tensor<double>(key).shape());
  testing::expect_matches(reference(), ours, key, {.case_ends_at_first_dot = true, .f32_floor = 1e-7});
}

template <class E>
void check_conv_against_torch(const ConvCase& c, std::int64_t block_columns) {
  using S = typename E::Scalar;
  const auto& f = reference();
  REQUIRE(f.metadata().at(c.name) == c.config());
  const std::string p = std::string(c.name) + ".";
  Rng rng(1);
  Conv2d<E> conv(c.options(), rng);
  conv.set_block_columns(block_columns);
  conv.weight().value = f.tensor<S>(p + "weight");
  if (c.bias) conv.bias().value = f.tensor<S>(p + "bias");
  const Tensor<S> x = f.tensor<S>(p + "x");
  const Tensor<S> g = f.tensor<S>(p + "g");
  typename Conv2d<E>::Cache cache;
  expect_matches(conv.forward(x, cache), p + "y");
  const Tensor<S>& dx = conv.backward(g, cache);
  expect_matches(dx, p + "dx");
  expect_matches(conv.weight().grad, p + "dweight");
  if (c.bias) expect_matches(conv.bias().grad, p + "dbias");
}

TEST_CASE("Conv2d matches PyTorch", "[layers][conv][reference]") {
  for (const auto& c : kConvCases) {
    // Block sizes that exercise every way of cutting the work: 1: bands of one output row;
    // 40: bands of several rows with a shorter last band (8x8 and 7x7 outputs), one sample per
    // block on 5x8 outputs; 60: two samples per block plus a lone one for conv_1x1 (N = 3);
    // 0: the automatic choice (groups of whole samples on these small images).
    for (std::int64_t columns : {std::int64_t{1}, std::int64_t{40}, std::int64_t{60}, std::int64_t{0}}) {
      DYNAMIC_SECTION(c.name << " float64, block columns " << columns) { check_conv_against_torch<E64>(c, columns); }
      DYNAMIC_SECTION(c.name << " float32, block columns " << columns) { check_conv_against_torch<E32>(c, columns); }
    }
  }
}

struct PoolCase {
  const char* name;
  const char* kind;  // "max", "avg", "gap"
  std::int64_t n, c, h, w, kernel, stride, padding;

  std::string config() const {
    return detail::cat(kind, " N=", n, " C=", c, " H=", h, " W=", w, " kernel=", kernel, " stride=", stride,
                       " padding=", padding);
  }
};

const PoolCase kPoolCases[] = {
    {"maxpool_3_2_1", "max", 2, 3, 9, 9, 3, 2, 1},   {"maxpool_2_2_0", "max", 2, 2, 6, 7, 2, 2, 0},
    {"avgpool_3_2_1", "avg", 2, 3, 9, 8, 3, 2, 1},   {"avgpool_2_2_0", "avg", 2, 2, 6, 6, 2, 2, 0},
    {"global_avg_pool", "gap", 2, 5, 4, 3, 0, 0, 0},
};

template <class L>
void check_pool_layer(L& pool, const PoolCase& c) {
  using S = typename L::Env::Scalar;
  const auto& f = reference();
  const std::string p = std::string(c.name) + ".";
  const Tensor<S> x = f.tensor<S>(p + "x");
  typename L::Cache cache;
  expect_matches(pool.forward(x, cache), p + "y");
  expect_matches(pool.backward(f.tensor<S>(p + "g"), cache), p + "dx");
}

template <class E>
void check_pool_against_torch(const PoolCase& c) {
  REQUIRE(reference().metadata().at(c.name) == c.config());
  const std::string kind = c.kind;
  if (kind == "max") {
    MaxPool2d<E> pool(c.kernel, c.stride, c.padding);
    check_pool_layer(pool, c);
  } else if (kind == "avg") {
    AvgPool2d<E> pool(c.kernel, c.stride, c.padding);
    check_pool_layer(pool, c);
  } else {
    GlobalAvgPool<E> pool;
    check_pool_layer(pool, c);
  }
}

TEST_CASE("Pools match PyTorch", "[layers][pool][reference]") {
  for (const auto& c : kPoolCases) {
    DYNAMIC_SECTION(c.name << " float64") { check_pool_against_torch<E64>(c); }
    DYNAMIC_SECTION(c.name << " float32") { check_pool_against_torch<E32>(c); }
  }
}

// ---- behaviour ----

TEST_CASE("MaxPool2d breaks ties and propagates NaN like PyTorch", "[layers][pool]") {
  // Expected argmax indices from torch.nn.functional.max_pool2d(..., return_indices=True).
  auto argmax_of = [](MaxPool2d<E64>& pool, const T64& x) {
    MaxPool2d<E64>::Cache cache;
    pool.forward(x, cache);
    return std::vector<std::int32_t>(cache.argmax.begin(), cache.argmax.end());
  };
  SECTION("ties go to the first element of the clipped window") {
    MaxPool2d<E64> pool(3, 2, 1);
    CHECK(argmax_of(pool, T64({1, 1, 3, 3}, 0.0)) == std::vector<std::int32_t>{0, 1, 3, 4});
    MaxPool2d<E64> plain(2, 2, 0);
    CHECK(argmax_of(plain, T64({1, 1, 4, 4}, 0.0)) == std::vector<std::int32_t>{0, 2, 8, 10});
  }
  SECTION("a NaN wins, the last NaN of a window most of all") {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const T64 x = T64::from({1, 1, 3, 3}, {1, nan, 3, nan, 0, 5, 7, 8, 9});
    MaxPool2d<E64> pool(2, 1, 0);
    MaxPool2d<E64>::Cache cache;
    const T64& y = pool.forward(x, cache);
    CHECK(std::isnan(y[0]));
    CHECK(std::isnan(y[1]));
    CHECK(std::isnan(y[2]));
    CHECK(y[3] == 9.0);
    CHECK(std::vector<std::int32_t>(cache.argmax.begin(), cache.argmax.end()) == std::vector<std::int32_t>{3, 1, 3, 8});
  }
}

TEST_CASE("Conv2d accumulates parameter gradients and can skip dx", "[layers][conv]") {
  Rng rng(13);
  Conv2d<E64> conv(3, 4, 3, rng, 2, 1);
  const T64 x = random_tensor({2, 3, 8, 8}, rng);
  Conv2d<E64>::Cache cache;
  const T64 g = random_tensor(conv.forward(x, cache).shape(), rng);
  zero_grads(conv);
  const T64 dx = conv.backward(g, cache);
  const T64 dw_once = conv.weight().grad, db_once = conv.bias().grad;
  conv.backward(g, cache);
  for (std::int64_t i = 0; i < dw_once.numel(); ++i) CHECK(conv.weight().grad[i] == Approx(2 * dw_once[i]));
  for (std::int64_t i = 0; i < db_once.numel(); ++i) CHECK(conv.bias().grad[i] == Approx(2 * db_once[i]));

  conv.set_needs_input_grad(false);
  zero_grads(conv);
  Conv2d<E64>::Cache fresh;
  conv.forward(x, fresh);
  CHECK(conv.backward(g, fresh).empty());  // dx left untouched
  CHECK(relative_error(conv.weight().grad, dw_once) <= 1e-14);
  CHECK(dx.shape() == x.shape());
}

TEST_CASE("Conv2d initializes like PyTorch and names its parameters", "[layers][conv]") {
  Rng rng(14);
  Conv2d<E32> conv(Conv2dOptions{.in_channels = 4, .out_channels = 8, .kernel_h = 3, .kernel_w = 3, .groups = 2}, rng);
  CHECK(conv.weight().value.shape() == Shape{8, 2, 3, 3});
  CHECK(conv.bias().value.shape() == Shape{8});
  const double bound = 1.0 / std::sqrt(2.0 * 3 * 3);  // fan_in = C_in / groups * kh * kw
  for (float v : conv.weight().value) CHECK(std::abs(v) <= bound);
  for (float v : conv.bias().value) CHECK(std::abs(v) <= bound);
  auto named = named_tensors(conv, "conv1.");
  REQUIRE(named.parameters.size() == 2);
  CHECK(named.parameters[0].first == "conv1.weight");
  CHECK(named.parameters[1].first == "conv1.bias");
  Conv2d<E32> no_bias(3, 64, 7, rng, 2, 3, false);
  CHECK(named_tensors(no_bias).parameters.size() == 1);
}

TEST_CASE("Conv2d and pools reject bad shapes and arguments", "[layers][conv][pool]") {
  Rng rng(15);
  Conv2d<E32> stem(3, 64, 7, rng, 2, 3, false);
  Conv2d<E32>::Cache cache;
  using Catch::Matchers::Contains;
  SECTION("wrong channel count") {
    const Tensor<float> x({2, 4, 32, 32}, 0.f);
    CHECK_THROWS_AS(stem.forward(x, cache), ShapeError);
    CHECK_THROWS_WITH(stem.forward(x, cache), Contains("Conv2d(3, 64, kernel=7, stride=2, padding=3, bias=false)") &&
                                                  Contains("(N, 3, H, W)") && Contains("(2, 4, 32, 32)"));
  }
  SECTION("wrong rank") {
    const Tensor<float> x({3, 32, 32}, 0.f);
    CHECK_THROWS_WITH(stem.forward(x, cache), Contains("(N, 3, H, W)") && Contains("(3, 32, 32)"));
  }
  SECTION("image smaller than the kernel") {
    Conv2d<E32> conv(3, 8, 5, rng);
    Conv2d<E32>::Cache c;
    const Tensor<float> x({1, 3, 4, 9}, 0.f);
    CHECK_THROWS_AS(conv.forward(x, c), ShapeError);
    CHECK_THROWS_WITH(conv.forward(x, c), Contains("Conv2d(3, 8, kernel=5") && Contains("(1, 3, 4, 9)") &&
                                              Contains("(N, 3, H, W) with H >= 5 and W >= 5"));
  }
  SECTION("dy of the wrong shape") {
    const Tensor<float> x({1, 3, 16, 16}, 0.f);
    stem.forward(x, cache);
    const Tensor<float> dy({1, 64, 7, 8}, 0.f);
    CHECK_THROWS_WITH(stem.backward(dy, cache), Contains("(1, 64, 7, 8)") && Contains("(1, 64, 8, 8)"));
  }
  SECTION("channels not divisible by groups") {
    CHECK_THROWS_AS(Conv2d<E32>(Conv2dOptions{.in_channels = 4, .out_channels = 6, .kernel_h = 3, .kernel_w = 3,
                                              .groups = 4},
                                rng),
                    ArgumentError);
    CHECK_THROWS_AS(Conv2d<E32>(6, 4, 3, rng, 1, 0, true, 1, 4), ArgumentError);
    CHECK_THROWS_AS(Conv2d<E32>(3, 4, 0, rng), ArgumentError);
  }
  SECTION("pools") {
    MaxPool2d<E32> pool(3, 2, 1);
    MaxPool2d<E32>::Cache pc;
    const Tensor<float> flat({2, 16}, 0.f);
    CHECK_THROWS_WITH(pool.forward(flat, pc), Contains("MaxPool2d(kernel=3, stride=2, padding=1)") &&
                                                  Contains("(N, C, H, W)") && Contains("(2, 16)"));
    AvgPool2d<E32> avg(4);
    AvgPool2d<E32>::Cache ac;
    const Tensor<float> tiny({1, 2, 3, 3}, 0.f);
    CHECK_THROWS_WITH(avg.forward(tiny, ac), Contains("(1, 2, 3, 3)") && Contains("H >= 4"));
    CHECK_THROWS_AS(MaxPool2d<E32>(3, 2, 2), ArgumentError);  // padding > kernel / 2
    GlobalAvgPool<E32> gap;
    GlobalAvgPool<E32>::Cache gc;
    CHECK_THROWS_AS(gap.forward(flat, gc), ShapeError);
  }
}

TEST_CASE("Conv2d and pools allocate nothing after the first step", "[layers][conv][pool]") {
  Rng rng(16);
  Conv2d<E32> conv(3, 8, 3, rng, 1, 1);
  MaxPool2d<E32> pool(3, 2, 1);
  Conv2d<E32> pointwise(8, 4, 1, rng);
  GlobalAvgPool<E32> gap;
  Conv2d<E32>::Cache c1, c3;
  MaxPool2d<E32>::Cache c2;
  GlobalAvgPool<E32>::Cache c4;
  Tensor<float> x({4, 3, 12, 12}, 0.5f);
  Tensor<float> dy;
  auto step = [&] {
    const auto& y = gap.forward(pointwise.forward(pool.forward(conv.forward(x, c1), c2), c3), c4);
    dy.resize(y.shape());
    dy.fill(1.f);
    conv.backward(pool.backward(pointwise.backward(gap.backward(dy, c4), c3), c2), c1);
  };
  step();
  const auto before = Cpu::allocator().stats();
  step();
  const auto after = Cpu::allocator().stats();
  CHECK(after.system_allocations == before.system_allocations);
  CHECK(after.cache_hits == before.cache_hits);
}

}  // namespace
