// Conv2d, MaxPool2d, AvgPool2d, AdaptiveAvgPool2d, GlobalAvgPool: float64 gradient checks against central
// differences, forward/backward against PyTorch (tests/data/conv_pool.safetensors, written by
// tools/reference/gen_conv_pool.py) in float64 and float32, shape errors, allocation-free steps.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
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
static_assert(Layer<AdaptiveAvgPool2d<E32>>);
static_assert(Layer<GlobalAvgPool<E32>>);

const SafetensorsFile& conv_pool_reference() {
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
      {"Winograd 3x3 padding 1, odd sizes", {3, 4, 3, 3, 1, 1, 1, 1, 1, 1, 1, true}, {2, 3, 7, 5}},
      {"Winograd 3x3 padding 0 no bias", {2, 3, 3, 3, 1, 1, 0, 0, 1, 1, 1, false}, {2, 2, 6, 7}},
      {"Winograd 3x3 padding 2", {2, 2, 3, 3, 1, 1, 2, 2, 1, 1, 1, true}, {1, 2, 4, 5}},
      // 8 channels in and out: a multiple of the float64 vector width with AVX-512 or AVX2, so the
      // channel-blocked Winograd path (kernels/cpu/winograd.hpp) is the one checked.
      {"Winograd 3x3 padding 1, 8 channels", {8, 8, 3, 3, 1, 1, 1, 1, 1, 1, 1, true}, {2, 8, 6, 5}},
      {"Winograd 3x3 padding 0, 8 channels", {8, 16, 3, 3, 1, 1, 0, 0, 1, 1, 1, false}, {1, 8, 7, 6}},
  };
  for (const auto& c : cases) {
    // Blocks of one output row (bands; for Winograd one tile row) and the automatic choice
    // (whole samples here).
    for (std::int64_t columns : {std::int64_t{1}, std::int64_t{0}}) {
      DYNAMIC_SECTION(c.what << ", block columns " << columns) {
        Conv2d<E64> conv(c.o, rng);
        conv.set_block_columns(columns);
        if (std::string(c.what).starts_with("Winograd")) conv.set_algorithm(ConvAlgorithm::Winograd);
        check_gradients(conv, random_tensor(c.x, rng), rng);
      }
    }
  }
}

TEST_CASE("Conv2d picks Winograd only where it applies", "[layers][conv]") {
  Rng rng(16);
  Conv2d<E32> strided(3, 4, 3, rng, 2, 1);
  CHECK_THROWS_AS(strided.set_algorithm(ConvAlgorithm::Winograd), ArgumentError);
  CHECK_THROWS_WITH(strided.set_algorithm(ConvAlgorithm::Winograd),
                    Catch::Matchers::Contains("Conv2d(3, 4, kernel=3, stride=2, padding=1)") &&
                        Catch::Matchers::Contains("stride 1"));
  Conv2d<E32> five(3, 4, 5, rng, 1, 2);
  CHECK_THROWS_AS(five.set_algorithm(ConvAlgorithm::Winograd), ArgumentError);
  Conv2d<E32> wide_pad(3, 4, 3, rng, 1, 3);
  CHECK_THROWS_AS(wide_pad.set_algorithm(ConvAlgorithm::Winograd), ArgumentError);
  // Auto: ResNet-20's 16-channel 28x28 layer at batch 64 takes Winograd; its 1-channel stem, a
  // stride-2 layer and ResNet-50's 512-channel 7x7 layer at batch 1 (too little to save) do not.
  const auto geometry = [](std::int64_t c, std::int64_t k, std::int64_t hw, std::int64_t stride) {
    Conv2dGeometry g;
    g.channels = c, g.out_channels = k, g.height = g.width = hw, g.kernel_h = g.kernel_w = 3;
    g.stride_h = g.stride_w = stride, g.pad_h = g.pad_w = 1;
    g.out_height = g.out_width = conv_output_extent(hw, 3, stride, 1);
    return g;
  };
  CHECK(conv2d_blocking(geometry(16, 16, 28, 1), 64, 4).winograd);
  CHECK_FALSE(conv2d_blocking(geometry(1, 16, 28, 1), 64, 4).winograd);
  CHECK_FALSE(conv2d_blocking(geometry(16, 32, 28, 2), 64, 4).winograd);
  CHECK_FALSE(conv2d_blocking(geometry(512, 512, 7, 1), 1, 4).winograd);
  CHECK_FALSE(conv2d_blocking(geometry(16, 16, 28, 1), 64, 4, 0, ConvAlgorithm::Im2col).winograd);
  CHECK(conv2d_blocking(geometry(1, 16, 28, 1), 64, 4, 0, ConvAlgorithm::Winograd).winograd);
  // The 512-channel 7x7 layer at batch 8 saves enough, but with a backward its dU (36 x 512 x 512
  // floats, one for the team: its two blocks run split by position) passes the bound for that
  // saving where im2col's products run on 16-lane kernels (AVX-512): there only forward-only
  // (Mode::Inference) takes it; without AVX-512 (products at half the rate) training takes it too.
  // At batch 16 the saving pays for the dU everywhere. Forced, at batch 8 it keeps one dU, not two.
  const int threads = Cpu::num_threads();
  Cpu::set_num_threads(2);  // CHECK does not throw: restored below
  const bool with_backward = conv2d_blocking(geometry(512, 512, 7, 1), 8, 4).winograd;
  const Conv2dBlocking b8 = conv2d_blocking(geometry(512, 512, 7, 1), 8, 4, 0, ConvAlgorithm::Winograd);
  const std::int64_t b8_du_bytes = b8.workspace_elements(geometry(512, 512, 7, 1), true) * 4 -
                                   b8.workspace_elements(geometry(512, 512, 7, 1), false) * 4;
  const bool forward_only = conv2d_blocking(geometry(512, 512, 7, 1), 8, 4, 0, ConvAlgorithm::Auto, false, true).winograd;
  const bool forward_only_b1 = conv2d_blocking(geometry(512, 512, 7, 1), 1, 4, 0, ConvAlgorithm::Auto, false, true).winograd;
  const bool with_backward_b16 = conv2d_blocking(geometry(512, 512, 7, 1), 16, 4).winograd;  // a large saving
  const bool with_backward_1024 = conv2d_blocking(geometry(1024, 1024, 7, 1), 32, 4).winograd;  // dU 151 MB
  Cpu::set_num_threads(threads);
  CHECK(with_backward == !cpu_avx512());
  CHECK(b8.winograd_by_position);
  CHECK(b8_du_bytes == (36 * 512 * 512 + 16) * 4);  // one dU, not two
  CHECK(with_backward_b16);
  CHECK_FALSE(with_backward_1024);
  CHECK(forward_only);
  CHECK_FALSE(forward_only_b1);
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

TEST_CASE("Pool options' gradients match central differences", "[layers][pool]") {
  Rng rng(17);
  // 8x8, 3/2/1, ceil: 5x5 windows, the last row and column clipped at the image's end.
  SECTION("MaxPool2d ceil_mode") {
    MaxPool2d<E64> pool(3, 2, 1, true);
    check_gradients(pool, random_tensor({2, 3, 8, 7}, rng), rng);
  }
  SECTION("MaxPool2d ceil_mode, last window dropped (H = 5, 2/2/1)") {
    MaxPool2d<E64> pool(2, 2, 1, true);
    check_gradients(pool, random_tensor({2, 2, 5, 6}, rng), rng);
  }
  SECTION("AvgPool2d ceil_mode") {
    AvgPool2d<E64> pool(3, 2, 1, true);
    check_gradients(pool, random_tensor({2, 3, 8, 7}, rng), rng);
  }
  SECTION("AvgPool2d count_include_pad=false") {
    AvgPool2d<E64> pool({.kernel = 3, .stride = 2, .padding = 1, .count_include_pad = false});
    check_gradients(pool, random_tensor({2, 3, 7, 6}, rng), rng);
  }
  SECTION("AvgPool2d ceil_mode, count_include_pad=false") {
    AvgPool2d<E64> pool(3, 2, 1, true, false);
    check_gradients(pool, random_tensor({2, 3, 8, 7}, rng), rng);
  }
  SECTION("AvgPool2d ceil_mode, last window dropped") {
    AvgPool2d<E64> pool(2, 2, 1, true);
    check_gradients(pool, random_tensor({2, 2, 5, 6}, rng), rng);
  }
  SECTION("AvgPool2d divisor_override") {
    AvgPool2d<E64> pool(3, 2, 1, true, true, 5);
    check_gradients(pool, random_tensor({2, 2, 8, 7}, rng), rng);
  }
  struct Adaptive {
    Shape x;
    std::int64_t oh, ow;
  };
  // Overlapping windows (7 -> 3, 5 -> 2, 4 -> 3), upsampling (2 -> 3), and 1x1.
  for (const Adaptive& c : {Adaptive{{2, 3, 7, 7}, 3, 3}, Adaptive{{2, 2, 5, 4}, 2, 3}, Adaptive{{2, 2, 2, 5}, 3, 2},
                            Adaptive{{1, 2, 4, 4}, 3, 3}, Adaptive{{2, 3, 5, 3}, 1, 1}}) {
    DYNAMIC_SECTION("AdaptiveAvgPool2d " << c.x << " -> " << c.oh << "x" << c.ow) {
      AdaptiveAvgPool2d<E64> pool(c.oh, c.ow);
      check_gradients(pool, random_tensor(c.x, rng), rng);
    }
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
    {"conv_3x3_same", 3, 8, 9, 7, 10, 3, 3, 1, 1, 1, 1, 1, 1, 1, true},
    {"conv_3x3_pad0", 2, 5, 8, 6, 4, 3, 3, 1, 1, 0, 0, 1, 1, 1, false},
    {"conv_3x3_pad2", 2, 4, 5, 6, 3, 3, 3, 1, 1, 2, 2, 1, 1, 1, true},
};

// Compares one of our tensors (any scalar) with PyTorch's float64 result. Float64 must agree to
// rounding; float32 within 8x PyTorch's own float32 error plus a floor of a few float32 ulps.
template <class S>
void conv_pool_matches(const Tensor<S>& ours, const std::string& key) {
  REQUIRE(ours.shape() == conv_pool_reference().tensor<double>(key).shape());
  testing::expect_matches(conv_pool_reference(), ours, key, {.case_ends_at_first_dot = true, .f32_floor = 1e-7});
}

template <class E>
void check_conv_against_torch(const ConvCase& c, std::int64_t block_columns,
                              ConvAlgorithm algorithm = ConvAlgorithm::Auto) {
  using S = typename E::Scalar;
  const auto& f = conv_pool_reference();
  REQUIRE(f.metadata().at(c.name) == c.config());
  const std::string p = std::string(c.name) + ".";
  Rng rng(1);
  Conv2d<E> conv(c.options(), rng);
  conv.set_block_columns(block_columns);
  conv.set_algorithm(algorithm);
  conv.weight().value = f.tensor<S>(p + "weight");
  if (c.bias) conv.bias().value = f.tensor<S>(p + "bias");
  const Tensor<S> x = f.tensor<S>(p + "x");
  const Tensor<S> g = f.tensor<S>(p + "g");
  typename Conv2d<E>::Cache cache;
  conv_pool_matches(conv.forward(x, cache), p + "y");
  const Tensor<S>& dx = conv.backward(g, cache);
  conv_pool_matches(dx, p + "dx");
  conv_pool_matches(conv.weight().grad, p + "dweight");
  if (c.bias) conv_pool_matches(conv.bias().grad, p + "dbias");
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
      if (c.kh == 3 && c.kw == 3 && c.sh == 1 && c.sw == 1 && c.dh == 1 && c.dw == 1 && c.groups == 1) {
        // Both algorithms on the 3x3 stride-1 cases (Auto may pick either); for Winograd the
        // block columns count tiles: 1 gives bands of one tile row.
        for (ConvAlgorithm a : {ConvAlgorithm::Im2col, ConvAlgorithm::Winograd}) {
          const char* name = a == ConvAlgorithm::Winograd ? "Winograd" : "im2col";
          DYNAMIC_SECTION(c.name << " float64 " << name << ", block columns " << columns) {
            check_conv_against_torch<E64>(c, columns, a);
          }
          DYNAMIC_SECTION(c.name << " float32 " << name << ", block columns " << columns) {
            check_conv_against_torch<E32>(c, columns, a);
          }
        }
      }
    }
  }
}

TEST_CASE("Conv2d's one-block forward runs as one team", "[layers][conv]") {
  // Layers whose whole batch is one block (ResNet-50's 14x14 and 7x7 layers at batch 1) run in one
  // parallel region: col filled over the team by rows (none on the 1x1 direct path), then each
  // thread's output channels (kernels/cpu/conv2d.hpp); checked at 2 threads against a direct sum
  // in float64 (at 2 threads a batch of 2 or more makes several blocks).
  struct Case {
    std::int64_t n, c, k, hw, kernel, stride, pad;
  };
  const Case cases[] = {{1, 64, 96, 14, 3, 1, 1}, {1, 48, 64, 14, 3, 2, 1}, {1, 40, 72, 7, 3, 1, 1},
                        {1, 96, 128, 14, 1, 2, 0}, {1, 64, 80, 14, 1, 1, 0}};
  struct TwoThreads {  // restored even when a REQUIRE below throws
    int before = Cpu::num_threads();
    TwoThreads() { Cpu::set_num_threads(2); }
    ~TwoThreads() { Cpu::set_num_threads(before); }
  } two_threads;
  for (const auto& c : cases) {
    DYNAMIC_SECTION(c.n << "x" << c.c << "x" << c.hw << "x" << c.hw << " -> " << c.k << ", kernel " << c.kernel
                        << ", stride " << c.stride) {
      Rng rng(31);
      Conv2d<E32> conv(Conv2dOptions{c.c, c.k, c.kernel, c.kernel, c.stride, c.stride, c.pad, c.pad, 1, 1, 1, true},
                       rng);
      conv.set_algorithm(ConvAlgorithm::Im2col);
      const std::int64_t out = conv_output_extent(c.hw, c.kernel, c.stride, c.pad);
      Conv2dGeometry g;
      g.channels = c.c, g.out_channels = c.k, g.height = g.width = c.hw, g.kernel_h = g.kernel_w = c.kernel;
      g.stride_h = g.stride_w = c.stride, g.pad_h = g.pad_w = c.pad, g.out_height = g.out_width = out;
      const Conv2dBlocking b = conv2d_blocking(g, c.n, 4, 0, ConvAlgorithm::Im2col);
      REQUIRE(b.groups(c.n) * b.bands(g) == 1);  // the path under test
      REQUIRE(b.threads == 2);
      const T64 x = random_tensor({c.n, c.c, c.hw, c.hw}, rng);
      Conv2d<E32>::Cache cache;
      const Tensor<float> x32 = x.template cast<float>();
      const Tensor<float>& y = conv.forward(x32, cache);
      const Tensor<float>& w = conv.weight().value;
      const Tensor<float>& bias = conv.bias().value;
      double worst = 0;
      for (std::int64_t n = 0; n < c.n; ++n)
        for (std::int64_t k = 0; k < c.k; ++k)
          for (std::int64_t oh = 0; oh < out; ++oh)
            for (std::int64_t ow = 0; ow < out; ++ow) {
              double sum = bias[k];
              for (std::int64_t ch = 0; ch < c.c; ++ch)
                for (std::int64_t i = 0; i < c.kernel; ++i)
                  for (std::int64_t j = 0; j < c.kernel; ++j) {
                    const std::int64_t ih = oh * c.stride - c.pad + i, iw = ow * c.stride - c.pad + j;
                    if (ih >= 0 && ih < c.hw && iw >= 0 && iw < c.hw)
                      sum += double(w[((k * c.c + ch) * c.kernel + i) * c.kernel + j]) *
                             double(x32[((n * c.c + ch) * c.hw + ih) * c.hw + iw]);
                  }
              worst = std::max(worst, std::abs(y[((n * c.k + k) * out + oh) * out + ow] - sum));
            }
      CHECK(worst <= 1e-4);
    }
  }
}

TEST_CASE("Conv2d's stride-2 rows match a direct sum on wide images", "[layers][conv]") {
  // im2col copies stride-2 rows by picking even lanes (detail::copy_row_stride2): output widths of
  // one vector plus a tail, two vectors plus a tail, with padding on both sides and without.
  struct Case {
    std::int64_t n, c, k, h, w, kernel, pad;
  };
  const Case cases[] = {{1, 3, 8, 45, 45, 7, 3}, {2, 4, 6, 69, 70, 3, 1}, {2, 5, 4, 66, 33, 1, 0}, {1, 2, 3, 9, 9, 3, 1}};
  for (const auto& c : cases) {
    DYNAMIC_SECTION(c.n << "x" << c.c << "x" << c.h << "x" << c.w << ", kernel " << c.kernel) {
      Rng rng(41);
      Conv2d<E32> conv(Conv2dOptions{c.c, c.k, c.kernel, c.kernel, 2, 2, c.pad, c.pad, 1, 1, 1, true}, rng);
      const Tensor<float> x = random_tensor({c.n, c.c, c.h, c.w}, rng).cast<float>();
      Conv2d<E32>::Cache cache;
      const Tensor<float>& y = conv.forward(x, cache);
      const std::int64_t oh_n = y.dim(2), ow_n = y.dim(3);
      const Tensor<float>& w = conv.weight().value;
      double worst = 0;
      for (std::int64_t n = 0; n < c.n; ++n)
        for (std::int64_t k = 0; k < c.k; ++k)
          for (std::int64_t oh = 0; oh < oh_n; ++oh)
            for (std::int64_t ow = 0; ow < ow_n; ++ow) {
              double sum = conv.bias().value[k];
              for (std::int64_t ch = 0; ch < c.c; ++ch)
                for (std::int64_t i = 0; i < c.kernel; ++i)
                  for (std::int64_t j = 0; j < c.kernel; ++j) {
                    const std::int64_t ih = 2 * oh - c.pad + i, iw = 2 * ow - c.pad + j;
                    if (ih >= 0 && ih < c.h && iw >= 0 && iw < c.w)
                      sum += double(w[((k * c.c + ch) * c.kernel + i) * c.kernel + j]) *
                             double(x[((n * c.c + ch) * c.h + ih) * c.w + iw]);
                  }
              worst = std::max(worst, std::abs(y[((n * c.k + k) * oh_n + oh) * ow_n + ow] - sum));
            }
      CHECK(worst <= 1e-4);
    }
  }
}

TEST_CASE("im2col of short unpadded rows (gathered 8 or 16 columns at a time) matches the plain copy", "[layers][conv]") {
  // float takes detail::ShortRowGather with AVX-512 and detail::ShortRowGatherAvx2 with AVX2 (the
  // kernels-avx2 test runs this case capped at AVX2 on AVX-512 CPUs); double always copies row by
  // row. Output widths 1 to 15 with kernel widths that make 16 columns span up to 32 inputs (8
  // columns up to 16: LeNet-5's 100 columns a sample end with an overlapping chunk), bands of rows,
  // several samples, and a subset of col rows (a team's share). Where 8 columns span more than 16
  // inputs (W' = 2 on a 9-wide plane) or a band has fewer than 8 columns, AVX2 copies row by row.
  // x is sized exactly, so a read past the last sample's plane would be outside the allocation
  // (the sanitizer build's job).
  struct Case {
    std::int64_t samples, c, h, w, kh, kw, oh0, oh1, row_begin, row_end;
  };
  const Case cases[] = {{3, 6, 14, 14, 5, 5, 0, 10, 0, -1},   // LeNet-5's second layer
                        {2, 6, 14, 14, 5, 5, 3, 7, 0, -1},    // a band
                        {1, 6, 14, 14, 5, 5, 0, 10, 37, 101}, // a team's share of the rows
                        {2, 3, 9, 8, 3, 5, 0, 7, 0, -1},      // W' = 4: 16 columns span 28 inputs
                        {2, 2, 5, 5, 5, 5, 0, 1, 0, -1},      // W' = 1
                        {1, 4, 20, 17, 2, 3, 0, 19, 0, -1},   // W' = 15, 19 rows: 18 chunks (run-time count), partial last
                        {5, 1, 8, 7, 1, 2, 0, 8, 0, -1},      // 1x2 on a 7-wide plane
                        {2, 2, 6, 9, 2, 8, 0, 5, 0, -1}};     // W' = 2 on 9: 8 columns span 29 inputs
  for (const auto& c : cases) {
    DYNAMIC_SECTION(c.samples << "x" << c.c << "x" << c.h << "x" << c.w << ", kernel " << c.kh << "x" << c.kw
                               << ", rows " << c.oh0 << "-" << c.oh1) {
      Conv2dGeometry g;
      g.channels = c.c, g.height = c.h, g.width = c.w, g.out_channels = 1, g.kernel_h = c.kh, g.kernel_w = c.kw;
      g.out_height = conv_output_extent(c.h, c.kh, 1, 0), g.out_width = conv_output_extent(c.w, c.kw, 1, 0);
      const std::int64_t cols = c.samples * (c.oh1 - c.oh0) * g.out_width, rows = g.col_rows();
      std::vector<float> x(static_cast<std::size_t>(c.samples * c.c * c.h * c.w));
      std::vector<double> xd(x.size());
      for (std::size_t e = 0; e < x.size(); ++e) xd[e] = x[e] = static_cast<float>(e % 251) - 125.0f;
      std::vector<float> col(static_cast<std::size_t>(rows * cols), -7.0f);
      std::vector<double> cold(col.size(), -7.0);
      im2col(Cpu{}, g, x.data(), c.samples, c.oh0, c.oh1, col.data(), cols, c.row_begin, c.row_end);
      im2col(Cpu{}, g, xd.data(), c.samples, c.oh0, c.oh1, cold.data(), cols, c.row_begin, c.row_end);
      std::int64_t wrong = 0;
      for (std::size_t e = 0; e < col.size(); ++e) wrong += static_cast<double>(col[e]) != cold[e];
      CHECK(wrong == 0);
    }
  }
}

TEST_CASE("col2im's sum of a kernel row's taps (stride 1, unpadded) matches the plain loop", "[layers][conv]") {
  // detail::add_shifted_rows: for rows r, dx_row + r dx_step [x] += sum over j of
  // first[r first_step + j ld + x - j] for 0 <= x - j < n, in float with AVX-512 (masked vectors of
  // 16, row by row) or AVX2 (vectors of 8 planned once for all rows, a row not a whole number of
  // vectors ending in one that overlaps the one before; under 8 values the plain loop; over 4
  // vectors or 8 taps row by row with the last values one by one). Output widths 1 to 21 and 38,
  // 1 to 9 taps, 3 rows: input rows of 1 to 46 values. Guard values around each dx row must stay.
  std::int64_t wrong = 0, cases = 0;
  const std::int64_t rows = 3;
  for (std::int64_t taps = 1; taps <= 9; ++taps)
    for (std::int64_t n : {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 38}) {
      const std::int64_t width = n + taps - 1, ld = rows * n + 3, dx_step = width + 4, first_step = n;
      std::vector<float> first(static_cast<std::size_t>(taps * ld));
      for (std::size_t e = 0; e < first.size(); ++e) first[e] = static_cast<float>(e % 13) - 6.0f;
      std::vector<float> dx(static_cast<std::size_t>(rows * dx_step + 2));
      for (std::size_t e = 0; e < dx.size(); ++e) dx[e] = static_cast<float>(e % 5) + 0.5f;
      std::vector<double> want(dx.begin(), dx.end());
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t j = 0; j < taps; ++j)
          for (std::int64_t x = 0; x < n; ++x)
            want[static_cast<std::size_t>(1 + r * dx_step + x + j)] += first[static_cast<std::size_t>(r * first_step + j * ld + x)];
      detail::add_shifted_rows(dx.data() + 1, dx_step, first.data(), first_step, rows, ld, taps, n);
      for (std::size_t e = 0; e < dx.size(); ++e) wrong += static_cast<double>(dx[e]) != want[e];
      ++cases;
    }
  CHECK(cases == 9 * 22);
  CHECK(wrong == 0);
}

TEST_CASE("im2col and col2im of stride-2 convolutions (split into input phases) match their definitions",
          "[layers][conv]") {
  // detail::phase_taps: ResNet's 3x3 and 7x7 stride-2 shapes, odd and even sizes, bands, several
  // samples, a team's share of the col rows, and a width whose band needs several passes over the
  // phase buffer (W' = 150: 27 rows a pass), a last input row no tap reads (2x2 unpadded on 11
  // rows); whole samples in one pass are also checked assigning (detail::phase_assigns: dx not
  // zeroed first). 3x3 unpadded (ceil(W / 2) > W') keeps the per-row
  // path and is checked the same way. 1x1 unpadded takes the subsample path (detail::subsample_taps:
  // rows of W' <= 8 two at a time, wider ones one by one, odd sizes, bands, a share of the rows),
  // whose col2im also assigns: the block's input rows written whole, 0 where no output reads them,
  // every other row untouched. float (AVX-512 split and interleave) and double.
  struct Case {
    std::int64_t samples, c, h, w, kh, kw, pad, oh0, oh1, row_begin, row_end;
    bool phases;
  };
  const Case cases[] = {{2, 3, 14, 14, 3, 3, 1, 0, 7, 0, -1, true},     {1, 2, 13, 11, 3, 3, 1, 0, 7, 0, -1, true},
                        {2, 3, 16, 16, 7, 7, 3, 2, 6, 0, -1, true},     {1, 4, 9, 40, 3, 3, 1, 1, 4, 5, 29, true},
                        {1, 1, 70, 300, 3, 3, 1, 0, 35, 0, -1, true},   {3, 2, 7, 7, 3, 3, 1, 0, 4, 0, -1, true},
                        {1, 2, 10, 10, 2, 2, 0, 0, 5, 0, -1, true},     {2, 2, 11, 12, 5, 4, 2, 1, 5, 3, 40, true},
                        {1, 2, 12, 12, 3, 3, 0, 0, 5, 0, -1, false},    {2, 3, 8, 8, 1, 1, 0, 0, 4, 0, -1, false},
                        {2, 3, 14, 14, 1, 1, 0, 0, 7, 0, -1, false},    {1, 4, 13, 11, 1, 1, 0, 2, 6, 1, 3, false},
                        {3, 2, 56, 56, 1, 1, 0, 0, 28, 0, -1, false},   {1, 2, 16, 16, 1, 1, 0, 1, 8, 0, -1, false},
                        {2, 1, 7, 7, 1, 1, 0, 3, 4, 0, -1, false},      {1, 2, 9, 17, 1, 1, 0, 0, 5, 0, -1, false},
                        {2, 2, 11, 10, 2, 2, 0, 0, 5, 0, -1, true}};
  for (const auto& c : cases) {
    DYNAMIC_SECTION(c.samples << "x" << c.c << "x" << c.h << "x" << c.w << ", kernel " << c.kh << "x" << c.kw
                               << " padding " << c.pad << ", rows " << c.oh0 << "-" << c.oh1) {
      Conv2dGeometry g;
      g.channels = c.c, g.height = c.h, g.width = c.w, g.out_channels = 1, g.kernel_h = c.kh, g.kernel_w = c.kw;
      g.stride_h = g.stride_w = 2, g.pad_h = g.pad_w = c.pad;
      g.out_height = conv_output_extent(c.h, c.kh, 2, c.pad), g.out_width = conv_output_extent(c.w, c.kw, 2, c.pad);
      CHECK(detail::phase_taps(g) == c.phases);
      const bool subsample = c.kh == 1 && c.kw == 1 && c.pad == 0;
      CHECK(detail::subsample_taps(g) == subsample);
      const std::int64_t cols = c.samples * (c.oh1 - c.oh0) * g.out_width, rows = g.col_rows();
      const std::int64_t first = c.row_begin, last = c.row_end < 0 ? rows : c.row_end;
      // The definition: col row (ch, i, j), column (s, oh - oh0, ow) holds x[s, ch, 2 oh - p + i, 2 ow - p + j].
      auto pixel = [&](std::int64_t s, std::int64_t ch, std::int64_t ih, std::int64_t iw) {
        return static_cast<double>(((s * c.c + ch) * c.h + ih) * c.w + iw) * 0.25 - 300.0;
      };
      auto each_entry = [&](auto&& f) {  // f(col index, s, ch, ih, iw, inside the image) over rows [first, last)
        for (std::int64_t r = first; r < last; ++r)
          for (std::int64_t s = 0; s < c.samples; ++s)
            for (std::int64_t oh = c.oh0; oh < c.oh1; ++oh)
              for (std::int64_t ow = 0; ow < g.out_width; ++ow) {
                const std::int64_t ch = r / g.taps(), i = r % g.taps() / c.kw, j = r % c.kw;
                const std::int64_t ih = 2 * oh - c.pad + i, iw = 2 * ow - c.pad + j;
                const std::int64_t at = r * cols + (s * (c.oh1 - c.oh0) + oh - c.oh0) * g.out_width + ow;
                f(at, s, ch, ih, iw, ih >= 0 && ih < c.h && iw >= 0 && iw < c.w);
              }
      };
      auto check = [&](auto scalar) {
        using S = decltype(scalar);
        std::vector<S> x(static_cast<std::size_t>(c.samples * c.c * c.h * c.w));
        for (std::int64_t s = 0; s < c.samples; ++s)
          for (std::int64_t ch = 0; ch < c.c; ++ch)
            for (std::int64_t ih = 0; ih < c.h; ++ih)
              for (std::int64_t iw = 0; iw < c.w; ++iw)
                x[static_cast<std::size_t>(((s * c.c + ch) * c.h + ih) * c.w + iw)] = S(pixel(s, ch, ih, iw));
        std::vector<S> col(static_cast<std::size_t>(rows * cols), S(-7));
        im2col(Cpu{}, g, x.data(), c.samples, c.oh0, c.oh1, col.data(), cols, c.row_begin, c.row_end);
        std::int64_t wrong = 0;
        each_entry([&](std::int64_t at, std::int64_t s, std::int64_t ch, std::int64_t ih, std::int64_t iw, bool inside) {
          wrong += static_cast<double>(col[static_cast<std::size_t>(at)]) != (inside ? pixel(s, ch, ih, iw) : 0.0);
        });
        CHECK(wrong == 0);
        // col2im over all rows: dx[s, ch, ih, iw] += sum of the col entries that came from it.
        std::vector<double> expected(x.size(), 1.0);
        std::vector<S> dx(x.size(), S(1));
        for (std::size_t e = 0; e < col.size(); ++e) col[e] = S(static_cast<double>(e % 61) * 0.5 - 15.0);
        for (std::int64_t r = 0; r < rows; ++r)
          for (std::int64_t s = 0; s < c.samples; ++s)
            for (std::int64_t oh = c.oh0; oh < c.oh1; ++oh)
              for (std::int64_t ow = 0; ow < g.out_width; ++ow) {
                const std::int64_t ch = r / g.taps(), i = r % g.taps() / c.kw, j = r % c.kw;
                const std::int64_t ih = 2 * oh - c.pad + i, iw = 2 * ow - c.pad + j;
                if (ih < 0 || ih >= c.h || iw < 0 || iw >= c.w) continue;
                const std::int64_t at = r * cols + (s * (c.oh1 - c.oh0) + oh - c.oh0) * g.out_width + ow;
                expected[static_cast<std::size_t>(((s * c.c + ch) * c.h + ih) * c.w + iw)] +=
                    static_cast<double>(col[static_cast<std::size_t>(at)]);
              }
        col2im_add(Cpu{}, g, col.data(), cols, c.samples, c.oh0, c.oh1, dx.data());
        double worst = 0;
        for (std::size_t e = 0; e < dx.size(); ++e) worst = std::max(worst, std::abs(static_cast<double>(dx[e]) - expected[e]));
        CHECK(worst <= 1e-3);
        if (!subsample && !(c.phases && detail::phase_assigns(g, c.oh0, c.oh1))) return;
        // Assigning: rows [2 oh0, min(H, 2 oh1)) of each plane (on the phase path: whole samples,
        // all rows) become exactly the sums above less the 1 they started from (0 where no
        // output reads them); the other rows keep their 9.
        std::fill(dx.begin(), dx.end(), S(9));
        col2im_add(Cpu{}, g, col.data(), cols, c.samples, c.oh0, c.oh1, dx.data(), /*assign=*/true);
        std::int64_t wrong_assigned = 0;
        for (std::int64_t s = 0; s < c.samples; ++s)
          for (std::int64_t ch = 0; ch < c.c; ++ch)
            for (std::int64_t ih = 0; ih < c.h; ++ih)
              for (std::int64_t iw = 0; iw < c.w; ++iw) {
                const auto e = static_cast<std::size_t>(((s * c.c + ch) * c.h + ih) * c.w + iw);
                const bool written = !subsample || (ih >= 2 * c.oh0 && ih < 2 * c.oh1);
                wrong_assigned += std::abs(static_cast<double>(dx[e]) - (written ? expected[e] - 1.0 : 9.0)) > 1e-3;
              }
        CHECK(wrong_assigned == 0);
      };
      check(0.0f);
      check(0.0);
    }
  }
}

TEST_CASE("Conv2d Winograd F(4x4, 3x3) agrees with im2col on ResNet's shapes", "[layers][conv]") {
  // Larger than the reference cases: several vectors of tiles per block (28x28: 49 tiles a sample),
  // bands, whole-sample groups with a short last group, odd widths, more channels than
  // kWinogradMinChannels; float32 against the im2col result in float64. Two threads: the cases
  // marked true have one block per thread and few tiles against many channels, so they run split
  // by position (kernels/cpu/winograd.hpp; whole samples, blocks of 2 and 1 samples, two bands of
  // one sample, K != C, and padding 0, whose dx pass has more tiles than its forward).
  struct Threads {  // restored even when a REQUIRE below throws
    int before = Cpu::num_threads();
    ~Threads() { Cpu::set_num_threads(before); }
  } restore;
  Cpu::set_num_threads(2);
  struct Case {
    std::int64_t n, c, k, h, w, pad, block_tiles;
    bool by_position = false;
  };
  // Channel counts that are multiples of 16 run the channel-blocked path (kernels/cpu/winograd.hpp)
  // in float, the others the tile-vector path.
  const Case cases[] = {{3, 16, 16, 28, 28, 1, 0}, {5, 32, 24, 14, 14, 1, 0}, {4, 64, 64, 7, 7, 1, 0, true},
                        {2, 8, 12, 13, 11, 1, 9},  {3, 9, 8, 30, 5, 1, 40},   {2, 8, 8, 9, 33, 0, 0},
                        {2, 8, 8, 6, 17, 2, 3},    {3, 8, 8, 10, 4, 1, 0},   {2, 8, 9, 9, 22, 1, 0},
                        {2, 16, 32, 13, 11, 1, 9}, {3, 32, 16, 30, 5, 1, 40}, {2, 16, 16, 9, 33, 0, 0},
                        {2, 16, 48, 6, 17, 2, 3},  {3, 16, 16, 10, 4, 1, 0}, {5, 16, 16, 3, 3, 1, 0, true},
                        {3, 64, 64, 7, 7, 1, 0, true}, {1, 64, 64, 14, 14, 1, 8, true}, {2, 32, 48, 7, 7, 1, 0, true},
                        {2, 64, 64, 6, 6, 0, 0, true}};
  for (const auto& c : cases) {
    DYNAMIC_SECTION(c.n << "x" << c.c << "x" << c.h << "x" << c.w << " -> " << c.k << ", padding " << c.pad
                        << ", block tiles " << c.block_tiles) {
      Rng rng(21);
      const Conv2dOptions o{c.c, c.k, 3, 3, 1, 1, c.pad, c.pad, 1, 1, 1, true};
      Conv2d<E64> reference_conv(o, rng);
      Conv2d<E32> winograd(o, rng);
      reference_conv.set_algorithm(ConvAlgorithm::Im2col);
      winograd.set_algorithm(ConvAlgorithm::Winograd);
      winograd.set_block_columns(c.block_tiles);
      Conv2dGeometry geom;
      geom.channels = c.c, geom.out_channels = c.k, geom.height = c.h, geom.width = c.w, geom.kernel_h = geom.kernel_w = 3;
      geom.pad_h = geom.pad_w = c.pad;
      geom.out_height = conv_output_extent(c.h, 3, 1, c.pad), geom.out_width = conv_output_extent(c.w, 3, 1, c.pad);
      CHECK(conv2d_blocking(geom, c.n, 4, c.block_tiles, ConvAlgorithm::Winograd).winograd_by_position == c.by_position);
      winograd.weight().value = reference_conv.weight().value.template cast<float>();
      winograd.bias().value = reference_conv.bias().value.template cast<float>();
      const T64 x = random_tensor({c.n, c.c, c.h, c.w}, rng);
      Conv2d<E64>::Cache rc;
      Conv2d<E32>::Cache wc;
      const T64& y = reference_conv.forward(x, rc);
      const T64 g = random_tensor(y.shape(), rng);
      zero_grads(reference_conv);
      zero_grads(winograd);
      const T64& dx = reference_conv.backward(g, rc);
      const Tensor<float> x32 = x.template cast<float>(), g32 = g.template cast<float>();  // forward keeps &x32
      const Tensor<float>& y32 = winograd.forward(x32, wc);
      CHECK(relative_error(y32.template cast<double>(), y) <= 2e-6);
      const Tensor<float>& dx32 = winograd.backward(g32, wc);
      CHECK(relative_error(dx32.template cast<double>(), dx) <= 2e-6);
      CHECK(relative_error(winograd.weight().grad.template cast<double>(), reference_conv.weight().grad) <= 2e-6);
      CHECK(relative_error(winograd.bias().grad.template cast<double>(), reference_conv.bias().grad) <= 2e-6);
    }
  }
}

struct PoolCase {
  const char* name;
  const char* kind;  // "max", "avg", "gap"
  std::int64_t n, c, h, w, kernel, stride, padding;
  bool ceil_mode = false, count_include_pad = true;
  std::optional<std::int64_t> divisor_override = std::nullopt;

  std::string config() const {
    std::string s = detail::cat(kind, " N=", n, " C=", c, " H=", h, " W=", w, " kernel=", kernel,
                                " stride=", stride, " padding=", padding);
    if (ceil_mode) s += " ceil_mode=1";
    if (!count_include_pad) s += " count_include_pad=0";
    if (divisor_override) s += detail::cat(" divisor_override=", *divisor_override);
    return s;
  }
};

const PoolCase kPoolCases[] = {
    {"maxpool_3_2_1", "max", 2, 3, 9, 9, 3, 2, 1},   {"maxpool_2_2_0", "max", 2, 2, 6, 7, 2, 2, 0},
    {"avgpool_3_2_1", "avg", 2, 3, 9, 8, 3, 2, 1},   {"avgpool_2_2_0", "avg", 2, 2, 6, 6, 2, 2, 0},
    {"global_avg_pool", "gap", 2, 5, 4, 3, 0, 0, 0},
    {"maxpool_3_2_1_ceil", "max", 2, 3, 8, 8, 3, 2, 1, true},
    {"maxpool_2_2_0_ceil", "max", 2, 2, 5, 7, 2, 2, 0, true},
    {"maxpool_2_2_1_ceil_drop", "max", 2, 2, 5, 6, 2, 2, 1, true},
    {"avgpool_3_2_1_ceil", "avg", 2, 3, 8, 9, 3, 2, 1, true},
    {"avgpool_3_2_1_exclude_pad", "avg", 2, 3, 9, 8, 3, 2, 1, false, false},
    {"avgpool_3_2_1_ceil_exclude_pad", "avg", 2, 3, 8, 7, 3, 2, 1, true, false},
    {"avgpool_2_2_1_ceil_drop", "avg", 2, 2, 5, 6, 2, 2, 1, true},
    {"avgpool_3_2_1_ceil_divisor", "avg", 2, 2, 8, 7, 3, 2, 1, true, true, 5},
};

struct AdaptiveCase {
  const char* name;
  std::int64_t n, c, h, w, out_h, out_w;

  std::string config() const {
    return detail::cat("adaptive N=", n, " C=", c, " H=", h, " W=", w, " output=", out_h, "x", out_w);
  }
};

const AdaptiveCase kAdaptiveCases[] = {
    {"adaptive_7_to_3", 2, 3, 7, 7, 3, 3},
    {"adaptive_5x4_to_2x3", 2, 2, 5, 4, 2, 3},
    {"adaptive_2x5_to_3x2", 2, 2, 2, 5, 3, 2},
    {"adaptive_5x3_to_1", 2, 3, 5, 3, 1, 1},
};

template <class L, class Case>
void check_pool_layer(L& pool, const Case& c) {
  using S = typename L::Env::Scalar;
  const auto& f = conv_pool_reference();
  const std::string p = std::string(c.name) + ".";
  const Tensor<S> x = f.tensor<S>(p + "x");
  typename L::Cache cache;
  conv_pool_matches(pool.forward(x, cache), p + "y");
  conv_pool_matches(pool.backward(f.tensor<S>(p + "g"), cache), p + "dx");
}

template <class E>
void check_pool_against_torch(const PoolCase& c) {
  REQUIRE(conv_pool_reference().metadata().at(c.name) == c.config());
  const std::string kind = c.kind;
  if (kind == "max") {
    MaxPool2d<E> pool(c.kernel, c.stride, c.padding, c.ceil_mode);
    check_pool_layer(pool, c);
  } else if (kind == "avg") {
    AvgPool2d<E> pool(c.kernel, c.stride, c.padding, c.ceil_mode, c.count_include_pad, c.divisor_override);
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

template <class E>
void check_adaptive_against_torch(const AdaptiveCase& c) {
  REQUIRE(conv_pool_reference().metadata().at(c.name) == c.config());
  AdaptiveAvgPool2d<E> pool(c.out_h, c.out_w);
  check_pool_layer(pool, c);
}

TEST_CASE("AdaptiveAvgPool2d matches PyTorch", "[layers][pool][reference]") {
  for (const auto& c : kAdaptiveCases) {
    DYNAMIC_SECTION(c.name << " float64") { check_adaptive_against_torch<E64>(c); }
    DYNAMIC_SECTION(c.name << " float32") { check_adaptive_against_torch<E32>(c); }
  }
}

TEST_CASE("Pool options: shapes, names and the fast path", "[layers][pool]") {
  Rng rng(18);
  auto out_shape = [](auto& pool, const Shape& shape) {
    typename std::remove_reference_t<decltype(pool)>::Cache cache;
    return pool.forward(T64(shape, 1.0), cache).shape();
  };
  SECTION("ceil_mode output sizes (values from torch)") {
    MaxPool2d<E64> ceil(3, 2, 1, true), floor(3, 2, 1);
    CHECK(out_shape(ceil, {1, 1, 8, 9}) == Shape{1, 1, 5, 5});
    CHECK(out_shape(floor, {1, 1, 8, 9}) == Shape{1, 1, 4, 5});
    MaxPool2d<E64> drop(2, 2, 1, true);  // H = 5: a 4th window would start in the right padding
    CHECK(out_shape(drop, {1, 1, 5, 6}) == Shape{1, 1, 3, 4});
    MaxPool2d<E64> tiny(2, 2, 0, true);  // a 1x1 image still gives one (clipped) window, as in torch
    CHECK(out_shape(tiny, {1, 1, 1, 1}) == Shape{1, 1, 1, 1});
    AdaptiveAvgPool2d<E64> one(1);
    CHECK(out_shape(one, {2, 3, 5, 4}) == Shape{2, 3, 1, 1});
  }
  SECTION("divisors of clipped ceil-mode windows (torch: avg_pool2d(ones(1, 1, 6, 6), 3, 2, 1, ceil_mode=True))") {
    AvgPool2d<E64> pool(3, 2, 1, true);
    AvgPool2d<E64>::Cache cache;
    const T64& y = pool.forward(T64({1, 1, 6, 6}, 1.0), cache);
    const std::vector<double> expected = {4. / 9, 6. / 9, 6. / 9, 2. / 6, 6. / 9, 1, 1, 3. / 6,
                                          6. / 9, 1,      1,      3. / 6, 2. / 6, 3. / 6, 3. / 6, 1. / 4};
    REQUIRE(y.numel() == 16);
    for (std::int64_t i = 0; i < 16; ++i) CHECK(y[i] == Approx(expected[static_cast<std::size_t>(i)]));
    AvgPool2d<E64> exclude(3, 2, 1, true, false);
    AvgPool2d<E64>::Cache c2;
    for (double v : exclude.forward(T64({1, 1, 6, 6}, 1.0), c2)) CHECK(v == Approx(1.0));
  }
  SECTION("the generic divisor path agrees with the k^2 fast path where both apply") {
    // Without padding or ceil mode count_include_pad changes nothing, but takes the per-window path.
    const T64 x = random_tensor({2, 3, 7, 9}, rng);
    AvgPool2d<E64> fast(3, 2, 0), generic(3, 2, 0, false, false), override9(3, 2, 0, false, true, 9);
    AvgPool2d<E64>::Cache cf, cg, co;
    const T64 yf = fast.forward(x, cf);
    CHECK(relative_error(generic.forward(x, cg), yf) <= 1e-15);
    CHECK(relative_error(override9.forward(x, co), yf) <= 1e-15);
    const T64 g = random_tensor(yf.shape(), rng);
    const T64 df = fast.backward(g, cf);
    CHECK(relative_error(generic.backward(g, cg), df) <= 1e-15);
    CHECK(relative_error(override9.backward(g, co), df) <= 1e-15);
  }
  SECTION("AdaptiveAvgPool2d(1) is GlobalAvgPool with (N, C, 1, 1) output") {
    const T64 x = random_tensor({2, 3, 5, 4}, rng);
    AdaptiveAvgPool2d<E64> adaptive(1);
    GlobalAvgPool<E64> global;
    AdaptiveAvgPool2d<E64>::Cache ca;
    GlobalAvgPool<E64>::Cache cg;
    const T64& ya = adaptive.forward(x, ca);
    const T64& yg = global.forward(x, cg);
    REQUIRE(ya.numel() == yg.numel());
    for (std::int64_t i = 0; i < ya.numel(); ++i) CHECK(ya[i] == yg[i]);
  }
  SECTION("names show the non-default options") {
    CHECK(MaxPool2d<E32>(3, 2, 1).name() == "MaxPool2d(kernel=3, stride=2, padding=1)");
    CHECK(MaxPool2d<E32>({.kernel = 3, .stride = 2, .padding = 1, .ceil_mode = true}).name() ==
          "MaxPool2d(kernel=3, stride=2, padding=1, ceil_mode=true)");
    CHECK(AvgPool2d<E32>(2).name() == "AvgPool2d(kernel=2, stride=2, padding=0)");
    CHECK(AvgPool2d<E32>({.kernel = 3, .padding = 1, .ceil_mode = true, .count_include_pad = false,
                          .divisor_override = 4})
              .name() == "AvgPool2d(kernel=3, stride=3, padding=1, ceil_mode=true, count_include_pad=false, "
                         "divisor_override=4)");
    CHECK(AdaptiveAvgPool2d<E32>(7).name() == "AdaptiveAvgPool2d(output_size=7)");
    CHECK(AdaptiveAvgPool2d<E32>(3, 2).name() == "AdaptiveAvgPool2d(output_size=(3, 2))");
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
  SECTION("2x2 windows of stride 2 (their own unrolled kernel) follow the same rules") {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    // Windows {1, nan | nan, 0}, {3, 4 | 5, 9}, {2, 2 | 2, 2}: the last NaN, the max, the first tie.
    const T64 x = T64::from({1, 1, 2, 6}, {1, nan, 3, 4, 2, 2, nan, 0, 5, 9, 2, 2});
    MaxPool2d<E64> pool(2, 2, 0);
    MaxPool2d<E64>::Cache cache;
    const T64& y = pool.forward(x, cache);
    CHECK(std::isnan(y[0]));
    CHECK(y[1] == 9.0);
    CHECK(y[2] == 2.0);
    CHECK(std::vector<std::int32_t>(cache.argmax.begin(), cache.argmax.end()) == std::vector<std::int32_t>{6, 9, 4});
  }
  SECTION("float32 2x2 windows, every width up to 34 (the vector path and the loop), ties and NaNs") {
    // Values from a set of 5 (many ties) with NaNs; the expected max and argmax by the rule itself.
    Rng rng(5);
    for (std::int64_t width = 2; width <= 34; ++width) {
      const std::int64_t height = 4;
      Tensor<float> x({2, 1, height, width});
      for (std::int64_t i = 0; i < x.numel(); ++i) {
        const auto r = static_cast<int>(rng.uniform() * 6);
        x[i] = r == 5 ? std::numeric_limits<float>::quiet_NaN() : static_cast<float>(r);
      }
      MaxPool2d<E32> pool(2, 2, 0);
      MaxPool2d<E32>::Cache cache;
      const Tensor<float>& y = pool.forward(x, cache);
      const std::int64_t oh_count = height / 2, ow_count = width / 2;
      for (std::int64_t p = 0; p < 2; ++p)
        for (std::int64_t oh = 0; oh < oh_count; ++oh)
          for (std::int64_t ow = 0; ow < ow_count; ++ow) {
            const std::int64_t taps[4] = {2 * oh * width + 2 * ow, 2 * oh * width + 2 * ow + 1,
                                          (2 * oh + 1) * width + 2 * ow, (2 * oh + 1) * width + 2 * ow + 1};
            float best = x[p * height * width + taps[0]];
            std::int64_t at = taps[0];
            for (int t = 1; t < 4; ++t) {
              const float v = x[p * height * width + taps[t]];
              if (v > best || std::isnan(v)) best = v, at = taps[t];
            }
            const std::int64_t o = (p * oh_count + oh) * ow_count + ow;
            INFO("width " << width << " plane " << p << " window (" << oh << ", " << ow << ")");
            CHECK(cache.argmax[o] == at);
            CHECK((std::isnan(best) ? std::isnan(y[o]) : y[o] == best));
          }
    }
  }
  SECTION("float32 3x3 windows of stride 2 (ResNet's stem, their own kernel): widths 3 to 40, padding, ceil mode") {
    // Each window scanned in row-major order over its clipped extent, the maximum starting at -inf
    // on the window's first element: PyTorch's rule, written out. Values from a set of 4 with NaNs
    // and -infs, so ties, NaNs and all -inf windows reach every column, the padded edges included.
    Rng rng(6);
    for (std::int64_t width = 3; width <= 40; ++width)
      for (const std::int64_t pad : {0, 1})
        for (const bool ceil_mode : {false, true}) {
          const std::int64_t height = 5 + width % 4;
          Tensor<float> x({2, 1, height, width});
          for (std::int64_t i = 0; i < x.numel(); ++i) {
            const auto r = static_cast<int>(rng.uniform() * 6);
            x[i] = r == 4   ? std::numeric_limits<float>::quiet_NaN()
                   : r == 5 ? -std::numeric_limits<float>::infinity()
                            : static_cast<float>(r);
          }
          MaxPool2d<E32> pool({.kernel = 3, .stride = 2, .padding = pad, .ceil_mode = ceil_mode});
          MaxPool2d<E32>::Cache cache;
          const Tensor<float>& y = pool.forward(x, cache);
          const std::int64_t oh_count = y.dim(2), ow_count = y.dim(3);
          for (std::int64_t p = 0; p < 2; ++p)
            for (std::int64_t oh = 0; oh < oh_count; ++oh)
              for (std::int64_t ow = 0; ow < ow_count; ++ow) {
                const std::int64_t h0 = std::max<std::int64_t>(2 * oh - pad, 0), h1 = std::min(2 * oh - pad + 3, height);
                const std::int64_t w0 = std::max<std::int64_t>(2 * ow - pad, 0), w1 = std::min(2 * ow - pad + 3, width);
                float best = -std::numeric_limits<float>::infinity();
                std::int64_t at = h0 * width + w0;
                for (std::int64_t h = h0; h < h1; ++h)
                  for (std::int64_t w = w0; w < w1; ++w) {
                    const float v = x[p * height * width + h * width + w];
                    if (v > best || std::isnan(v)) best = v, at = h * width + w;
                  }
                const std::int64_t o = (p * oh_count + oh) * ow_count + ow;
                INFO("width " << width << " pad " << pad << " ceil " << ceil_mode << " plane " << p << " window (" << oh
                              << ", " << ow << ")");
                CHECK(cache.argmax[o] == at);
                CHECK((std::isnan(best) ? std::isnan(y[o]) : y[o] == best));
              }
        }
  }
}

TEST_CASE("MaxPool2d in Mode::Inference keeps no argmax, gives the same bits, and refuses backward",
          "[layers][pool][inference]") {
  // Every kernel path (ResNet's 3x3 stride 2 with padding and ceil mode, LeNet's 2x2, the generic
  // loop, channels last), on values with ties, NaNs, -inf and both zeros: Mode::Inference's values
  // are Mode::Train's bit for bit, NaN payloads included.
  struct Case {
    std::int64_t kernel, stride, pad;
    bool ceil_mode;
    MemoryFormat format;
  };
  const Case cases[] = {{3, 2, 1, false, MemoryFormat::Contiguous}, {3, 2, 1, true, MemoryFormat::Contiguous},
                        {3, 2, 0, false, MemoryFormat::Contiguous}, {2, 2, 0, false, MemoryFormat::Contiguous},
                        {3, 1, 1, false, MemoryFormat::Contiguous}, {2, 2, 0, true, MemoryFormat::Contiguous},
                        {3, 2, 1, false, MemoryFormat::ChannelsLast}};
  Rng rng(21);
  for (const Case& k : cases)
    for (std::int64_t width : {5, 16, 29, 33}) {
      Tensor<float> x({2, 3, 7, width});
      for (std::int64_t i = 0; i < x.numel(); ++i) {
        const auto r = static_cast<int>(rng.uniform() * 8);
        x[i] = r == 5   ? std::numeric_limits<float>::quiet_NaN()
               : r == 6 ? -std::numeric_limits<float>::infinity()
               : r == 7 ? -0.0f
                        : static_cast<float>(r % 3);
      }
      MaxPool2d<E32> train({.kernel = k.kernel, .stride = k.stride, .padding = k.pad, .ceil_mode = k.ceil_mode});
      train.set_memory_format(k.format);
      MaxPool2d<E32> inference = train;
      inference.set_mode(Mode::Inference);
      MaxPool2d<E32>::Cache train_cache, inference_cache;
      const Tensor<float>& want = train.forward(x, train_cache);
      const Tensor<float>& got = inference.forward(x, inference_cache);
      INFO("kernel " << k.kernel << " stride " << k.stride << " pad " << k.pad << " ceil " << k.ceil_mode << " "
                     << to_string(k.format) << " width " << width);
      REQUIRE(got.shape() == want.shape());
      CHECK(inference_cache.argmax.numel() == 0);
      CHECK(std::memcmp(got.data(), want.data(), sizeof(float) * static_cast<std::size_t>(want.numel())) == 0);
      CHECK_THROWS_WITH(inference.backward(want, inference_cache), Catch::Contains("Mode::Inference"));
      // Back in Mode::Train the same layer keeps its argmax again and differentiates.
      inference.set_mode(Mode::Train);
      MaxPool2d<E32>::Cache again;
      inference.forward(x, again);
      CHECK(again.argmax.numel() == want.numel());
      CHECK_NOTHROW(inference.backward(want, again));
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

TEST_CASE("Conv2d's weight gradient from per-thread accumulators equals one thread's", "[layers][conv]") {
  // With sample groups split over the team, each thread but the first sums its blocks' dw into a
  // private accumulator, and the team then adds them into the gradient, each thread its share in
  // runs of 2048 (kernels/cpu/conv2d.hpp, conv2d_backward). 32 -> 48 3x3: 13,824 weights, so at 3
  // threads every share spans several runs and two accumulators are added; the gradient starts
  // non-zero (it accumulates). Float64 against 1 thread (sums in another order: 1e-13).
  struct Threads {  // restored even when a REQUIRE below throws
    int before = Cpu::num_threads();
    ~Threads() { Cpu::set_num_threads(before); }
  } restore;
  Rng rng(17);
  Conv2d<E64> conv(32, 48, 3, rng, 1, 1);
  conv.set_algorithm(ConvAlgorithm::Im2col);
  conv.set_block_columns(36);  // one 6x6 sample per block: 6 groups
  const T64 x = random_tensor({6, 32, 6, 6}, rng);
  const T64 dy = random_tensor({6, 48, 6, 6}, rng);
  const T64 prior = random_tensor(conv.weight().grad.shape(), rng);
  Conv2dGeometry g;
  g.channels = 32, g.out_channels = 48, g.height = g.width = 6, g.kernel_h = g.kernel_w = 3;
  g.stride_h = g.stride_w = 1, g.pad_h = g.pad_w = 1, g.out_height = g.out_width = 6;
  const auto weight_grad = [&](int threads) {
    Cpu::set_num_threads(threads);
    REQUIRE(conv2d_blocking(g, 6, 8, 36, ConvAlgorithm::Im2col).parallel_backward == (threads > 1));
    Conv2d<E64>::Cache cache;
    conv.forward(x, cache);
    conv.weight().grad = prior;
    conv.backward(dy, cache);
    return conv.weight().grad;
  };
  const T64 want = weight_grad(1);
  REQUIRE(relative_error(want, prior) > 1e-3);  // the blocks' sums were added
  for (int threads : {2, 3}) {
    DYNAMIC_SECTION(threads << " threads") { CHECK(relative_error(weight_grad(threads), want) <= 1e-13); }
  }
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
  SECTION("pool options") {
    // ceil mode lowers the least input size to kernel - 2 padding - (stride - 1).
    MaxPool2d<E32> ceil(4, 2, 0, true);
    MaxPool2d<E32>::Cache pc;
    const Tensor<float> two({1, 1, 2, 5}, 0.f);
    CHECK_THROWS_AS(ceil.forward(two, pc), ShapeError);
    CHECK_THROWS_WITH(ceil.forward(two, pc), Contains("MaxPool2d(kernel=4, stride=2, padding=0, ceil_mode=true)") &&
                                                 Contains("(1, 1, 2, 5)") && Contains("H >= 3"));
    CHECK_NOTHROW(ceil.forward(Tensor<float>({1, 1, 3, 3}, 0.f), pc));
    CHECK_THROWS_AS(AvgPool2d<E32>(3, 1, 1, false, true, 0), ArgumentError);  // torch: divisor must be not zero
    CHECK_THROWS_WITH(AvgPool2d<E32>(3, 1, 1, false, true, 0), Contains("AvgPool2d(") && Contains("divisor_override"));
    CHECK_THROWS_AS(AvgPool2d<E32>({.kernel = 2, .padding = 2, .ceil_mode = true}), ArgumentError);
  }
  SECTION("AdaptiveAvgPool2d") {
    CHECK_THROWS_AS(AdaptiveAvgPool2d<E32>(0), ArgumentError);
    CHECK_THROWS_WITH(AdaptiveAvgPool2d<E32>(3, -1), Contains("AdaptiveAvgPool2d(output_size=(3, -1))") &&
                                                         Contains("positive"));
    AdaptiveAvgPool2d<E32> pool(2, 3);
    AdaptiveAvgPool2d<E32>::Cache ac;
    CHECK_THROWS_AS(pool.forward(Tensor<float>({2, 16}, 0.f), ac), ShapeError);
    CHECK_THROWS_WITH(pool.forward(Tensor<float>({3, 5, 5}, 0.f), ac),
                      Contains("AdaptiveAvgPool2d(output_size=(2, 3))") && Contains("(N, C, H, W)") &&
                          Contains("(3, 5, 5)"));
    CHECK_THROWS_AS(pool.forward(Tensor<float>({1, 2, 0, 4}, 0.f), ac), ShapeError);
    CHECK_THROWS_WITH(pool.backward(Tensor<float>({1, 2, 2, 3}, 0.f), ac), Contains("before forward"));
    pool.forward(Tensor<float>({1, 2, 4, 4}, 0.f), ac);
    CHECK_THROWS_WITH(pool.backward(Tensor<float>({1, 2, 3, 2}, 0.f), ac),
                      Contains("(1, 2, 3, 2)") && Contains("(1, 2, 2, 3)"));
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

TEST_CASE("Pools with options allocate nothing after the first step", "[layers][pool]") {
  AvgPool2d<E32> avg(3, 2, 1, true, false);
  AdaptiveAvgPool2d<E32> adaptive(3, 2);
  AvgPool2d<E32>::Cache c1;
  AdaptiveAvgPool2d<E32>::Cache c2;
  Tensor<float> x({2, 3, 12, 11}, 0.5f);
  Tensor<float> dy;
  auto step = [&] {
    const auto& y = adaptive.forward(avg.forward(x, c1), c2);
    dy.resize(y.shape());
    dy.fill(1.f);
    avg.backward(adaptive.backward(dy, c2), c1);
  };
  step();
  const auto before = Cpu::allocator().stats();
  step();
  const auto after = Cpu::allocator().stats();
  CHECK(after.system_allocations == before.system_allocations);
  CHECK(after.cache_hits == before.cache_hits);
}

}  // namespace
