// bfloat16 compute (Env<Cpu, Comm, float, BFloat16>): the rounding of one value, gemm_bf16 against a
// float64 product of bfloat16-rounded operands (every transpose, edges of the micro-tiles, alpha,
// beta, strides, inside and outside a parallel region), the fp32 fallback, and Linear and Conv2d of
// a bfloat16 Env against float64 layers fed the same rounded operands, forward and backward.
//
// Where this CPU has no AVX512-BF16, gemm_bf16 is the float gemm: the tests then check that
// fallback instead of the bfloat16 rounding, and say so.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "tessera/tessera.hpp"

using namespace tessera;

namespace {

double bf16_random(std::uint64_t& state) {
  state = state * 6364136223846793005ull + 1442695040888963407ull;
  return static_cast<double>(state >> 11) / static_cast<double>(1ull << 53) * 2.0 - 1.0;
}

float float_of(std::uint32_t u) {
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

// What a bfloat16 product sees of v: v rounded when the kernel runs, v itself on the fallback.
float operand(float v) { return cpu_bf16_active() ? round_to_bf16(v) : v; }

}  // namespace

TEST_CASE("float_to_bf16_bits rounds to nearest even, keeps NaN and overflows to infinity", "[core][bf16]") {
  CHECK(float_to_bf16_bits(1.0f) == 0x3f80);
  CHECK(float_to_bf16_bits(-1.5f) == 0xbfc0);
  CHECK(float_to_bf16_bits(float_of(0x3f808000u)) == 0x3f80);  // 1 + 2^-8: a tie, to the even 1
  CHECK(float_to_bf16_bits(float_of(0x3f818000u)) == 0x3f82);  // 1 + 3 2^-8: a tie, to the even 1 + 2^-6
  CHECK(float_to_bf16_bits(float_of(0x3f808001u)) == 0x3f81);  // just above the tie: up
  CHECK(float_to_bf16_bits(float_of(0x3f807fffu)) == 0x3f80);  // just below: down
  CHECK(float_to_bf16_bits(std::numeric_limits<float>::infinity()) == 0x7f80);
  CHECK(float_to_bf16_bits(std::numeric_limits<float>::max()) == 0x7f80);  // as torch: rounds to inf
  CHECK(float_to_bf16_bits(float_of(0x00000001u)) == 0x0000);              // the smallest subnormal: to 0
  const std::uint16_t nan = float_to_bf16_bits(float_of(0x7f800001u));      // a NaN whose payload is all low
  CHECK((nan & 0x7f80) == 0x7f80);
  CHECK((nan & 0x007f) != 0);
  CHECK(std::isnan(bf16_bits_to_float(nan)));
  CHECK(round_to_bf16(3.14159265f) == 3.140625f);
}

namespace {

// gemm_bf16 against a float64 product of the rounded operands, as the library setting now has it.
void check_gemm_bf16_contract() {
  INFO("bf16 kernel: " << cpu_bf16_kernel());
  struct Case {
    std::int64_t m, n, k;
  };
  // Micro-tiles are 8 x 48 over k pairs, blocks 96 rows x 1536 columns x 256 k: one of each
  // edge, an odd k, k = 1, a block boundary in every dimension, and products above 2^20
  // multiply-adds (split over the team when called outside a parallel region).
  const Case cases[] = {{1, 1, 1}, {7, 50, 3}, {8, 48, 2}, {9, 49, 257}, {97, 1537, 5}, {130, 300, 600}, {3, 17, 1}};
  const double scalars[][2] = {{1, 0}, {0.5, 1}, {-2, 0.25}};
  std::uint64_t state = 7;
  for (const auto& g : cases)
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb)
        for (const auto& s : scalars)
          for (bool inside_team : {false, true}) {
            // Row strides wider than the rows, by 3.
            const std::int64_t lda = (ta ? g.m : g.k) + 3, ldb = (tb ? g.k : g.n) + 3, ldc = g.n + 3;
            std::vector<float> a((ta ? g.k : g.m) * lda), b((tb ? g.n : g.k) * ldb), c0(g.m * ldc);
            for (auto& v : a) v = static_cast<float>(bf16_random(state));
            for (auto& v : b) v = static_cast<float>(bf16_random(state));
            for (auto& v : c0) v = static_cast<float>(bf16_random(state));
            std::vector<float> c = c0;
            const auto alpha = static_cast<float>(s[0]), beta = static_cast<float>(s[1]);
            if (inside_team) {
#pragma omp parallel num_threads(2)
              {
#pragma omp single
                gemm_bf16(Cpu{}, ta, tb, g.m, g.n, g.k, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);
              }
            } else {
              gemm_bf16(Cpu{}, ta, tb, g.m, g.n, g.k, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);
            }
            // Against the float64 sum of the rounded operands' products (exact in float: 8 x 8
            // significant bits), relative to the magnitudes summed; and against the unrounded one.
            double worst = 0, worst_unrounded = 0;
            for (std::int64_t i = 0; i < g.m; ++i)
              for (std::int64_t j = 0; j < g.n; ++j) {
                double sum = 0, exact = 0, scale = 1;
                for (std::int64_t p = 0; p < g.k; ++p) {
                  const float av = ta ? a[p * lda + i] : a[i * lda + p], bv = tb ? b[j * ldb + p] : b[p * ldb + j];
                  sum += static_cast<double>(operand(av)) * operand(bv);
                  exact += static_cast<double>(av) * bv;
                  scale += std::abs(alpha * av * bv);
                }
                const double base = beta * static_cast<double>(c0[i * ldc + j]);
                scale += std::abs(base);
                const double got = c[i * ldc + j];
                worst = std::max(worst, std::abs(got - (alpha * sum + base)) / scale);
                worst_unrounded = std::max(worst_unrounded, std::abs(got - (alpha * exact + base)) / scale);
              }
            INFO(g.m << "x" << g.n << "x" << g.k << " trans " << ta << tb << " alpha " << alpha << " beta " << beta
                     << (inside_team ? " inside a team" : ""));
            CHECK(worst < 2e-5);
            // Rounding to 8 significant bits moves a sum of a few products by ~2^-9 of its terms:
            // the kernel really multiplied bfloat16 values (on the fallback it must not have).
            if (cpu_bf16_active() && g.k >= 2) CHECK(worst_unrounded > 1e-4);
            if (!cpu_bf16_active()) CHECK(worst_unrounded < 2e-5);
            // The padding between rows of C is nobody's: never written.
            for (std::int64_t i = 0; i < g.m; ++i)
              for (std::int64_t j = g.n; j < ldc; ++j) CHECK(c[i * ldc + j] == c0[i * ldc + j]);
          }
}

}  // namespace

TEST_CASE("gemm_bf16 is a float-accumulated product of bfloat16-rounded operands", "[core][bf16]") {
  if (!cpu_bf16_active()) WARN("this CPU has no AVX512-BF16: checking the float fallback instead");
  check_gemm_bf16_contract();
}

// oneDNN's matmul (kernels/cpu/onednn_gemm.hpp) under gemm_bf16, forced for every product: the same
// contract, with the same cases (transposes, strides, alpha, beta, inside a team).
TEST_CASE("gemm_bf16 on oneDNN's matmul is the same float-accumulated product", "[core][bf16][onednn]") {
  if (!onednn_built() || !cpu_bf16_active()) {
    if (!onednn_built()) {  // nothing chooses it, and it declines
      CHECK_FALSE(onednn_gemm_chosen(64, 64, 64));
      CHECK_FALSE(onednn_gemm_bf16(false, false, 1, 1, 1, 1.0f, nullptr, 1, nullptr, 1, 0.0f, nullptr, 1));
    }
    WARN("skipped: " << cpu_bf16_kernel());
    return;
  }
  set_cpu_bf16_library(Bf16Library::OneDnn);
  CHECK(cpu_bf16_kernel().starts_with("oneDNN"));
  CHECK(onednn_gemm_chosen(1, 1, 1));
  CHECK_FALSE(onednn_gemm_chosen(0, 5, 5));  // nothing to multiply: gemm_bf16's own handles beta
  check_gemm_bf16_contract();
  // The matmul really ran: gemm_bf16's own kernel sums in another order, so some sums differ in
  // their last bits, and onednn_gemm_bf16 called directly gives gemm_bf16's bits.
  const std::int64_t m = 40, n = 56, k = 300;
  std::uint64_t state = 5;
  std::vector<float> a(m * k), b(k * n), via_gemm(m * n), direct(m * n), own(m * n);
  for (auto& v : a) v = static_cast<float>(bf16_random(state));
  for (auto& v : b) v = static_cast<float>(bf16_random(state));
  gemm_bf16(Cpu{}, false, false, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, via_gemm.data(), n);
  REQUIRE(onednn_gemm_bf16(false, false, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, direct.data(), n));
  set_cpu_bf16_library(Bf16Library::Tessera);
  CHECK_FALSE(onednn_gemm_chosen(m, n, k));
  gemm_bf16(Cpu{}, false, false, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, own.data(), n);
  set_cpu_bf16_library(Bf16Library::Auto);
  CHECK(via_gemm == direct);
  CHECK(via_gemm != own);
}

// Auto's choice for products: oneDNN's matmul only with AMX and for products of at least 2^23
// multiply-adds (below, its fixed cost per call outweighs the tiles); without AMX gemm_bf16's own
// kernel, which measured as fast or faster on Zen 5 (bench/README.md, "bfloat16").
TEST_CASE("oneDNN's share of the bfloat16 products follows the CPU, the size and the setting",
          "[core][bf16][onednn]") {
  CHECK(cpu_bf16_library() == Bf16Library::Auto);
  const bool amx = onednn_built() && onednn_uses_amx();
  CHECK(onednn_gemm_chosen(128, 512, 784) == amx);    // the MLP's first layer, 51 M multiply-adds
  CHECK(onednn_gemm_chosen(256, 256, 128) == amx);    // exactly 2^23
  CHECK_FALSE(onednn_gemm_chosen(255, 256, 128));     // just below
  CHECK_FALSE(onednn_gemm_chosen(128, 10, 256));      // the MLP's last layer
  set_cpu_bf16_library(Bf16Library::Tessera);
  CHECK_FALSE(onednn_gemm_chosen(1024, 1024, 1024));
  set_cpu_bf16_library(Bf16Library::Auto);
  if (amx && cpu_bf16_active()) {
    // On AMX hardware the chosen products run on the tiles and keep the contract.
    INFO("bf16 kernel: " << cpu_bf16_kernel());
    CHECK(cpu_bf16_kernel().find("matmul") != std::string::npos);
    check_gemm_bf16_contract();
  } else {
    WARN("no AMX here (oneDNN: " << (onednn_built() ? onednn_cpu_isa() : std::string("not built"))
                                 << "): the AMX products were not exercised");
  }
}

// Each thread keeps its own primitives and buffers: two threads multiplying at once, each its own
// shapes and the same one, get what one thread alone gets.
TEST_CASE("gemm_bf16 on oneDNN from two threads at once", "[core][bf16][onednn]") {
  if (!onednn_built() || !cpu_bf16_active()) {
    WARN("skipped: " << cpu_bf16_kernel());
    return;
  }
  set_cpu_bf16_library(Bf16Library::OneDnn);
  const std::int64_t m = 64, n = 96, k = 200;
  std::uint64_t state = 17;
  std::vector<float> a(m * k), b(k * n), alone(m * n);
  for (auto& v : a) v = static_cast<float>(bf16_random(state));
  for (auto& v : b) v = static_cast<float>(bf16_random(state));
  // a is (m, k) and b (n, k), both row-major: a b^T (m, n) and b a^T (n, m).
  auto ab = [&](float* c) { gemm_bf16(Cpu{}, false, true, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, c, n); };
  auto ba = [&](float* c) { gemm_bf16(Cpu{}, false, true, n, m, k, 1.0f, b.data(), k, a.data(), k, 0.0f, c, m); };
  std::vector<float> alone_other(n * m);
  ab(alone.data());
  ba(alone_other.data());
  std::vector<float> c0(m * n), c1(m * n), c2(n * m);
  auto worker = [&](std::vector<float>* c, bool other_shape) {
    for (int round = 0; round < 20; ++round) {
      if (other_shape) ba(c->data());
      else ab(c->data());
    }
  };
  std::thread t0(worker, &c0, false), t1(worker, &c1, false), t2(worker, &c2, true);
  t0.join();
  t1.join();
  t2.join();
  set_cpu_bf16_library(Bf16Library::Auto);
  CHECK(c0 == alone);
  CHECK(c1 == alone);
  CHECK(c2 == alone_other);
}


TEST_CASE("gemm_bf16 turned off is exactly the float gemm", "[core][bf16]") {
  const std::int64_t m = 33, n = 70, k = 65;
  std::uint64_t state = 3;
  std::vector<float> a(m * k), b(k * n), want(m * n), got(m * n);
  for (auto& v : a) v = static_cast<float>(bf16_random(state));
  for (auto& v : b) v = static_cast<float>(bf16_random(state));
  gemm(Cpu{}, false, false, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, want.data(), n);
  set_cpu_bf16_enabled(false);
  CHECK_FALSE(cpu_bf16_active());
  CHECK(cpu_bf16_kernel().starts_with("float gemm"));
  gemm_bf16(Cpu{}, false, false, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, got.data(), n);
  set_cpu_bf16_enabled(true);
  CHECK(got == want);
  CHECK(cpu_bf16_active() == (cpu_has_avx512_bf16() && detail::cpu_bf16_pays_here()));
}

// Whether bfloat16 compute pays on this CPU (TESSERA_CPU_BF16, gemm_bf16.hpp). The unit tests run
// with TESSERA_CPU_BF16=on (tests/meson.build), so the bfloat16 kernels are checked on every CPU
// with AVX512-BF16, also where auto would compute in float; `kernels-bf16-auto` runs the [bf16]
// cases again under auto.
TEST_CASE("bfloat16 compute follows TESSERA_CPU_BF16 and, under auto, this CPU's measured rates", "[core][bf16]") {
  CHECK(parse_cpu_bf16_setting("auto", "X") == CpuBf16Setting::Auto);
  CHECK(parse_cpu_bf16_setting("", "X") == CpuBf16Setting::Auto);
  CHECK(parse_cpu_bf16_setting("on", "X") == CpuBf16Setting::On);
  CHECK(parse_cpu_bf16_setting("off", "X") == CpuBf16Setting::Off);
  CHECK_THROWS_WITH(parse_cpu_bf16_setting("yes", "TESSERA_CPU_BF16"),
                    Catch::Contains("TESSERA_CPU_BF16='yes'") && Catch::Contains("auto"));
  // Auto: AMX always; otherwise VDPBF16PS must do at least 1.25x FMA's multiply-adds per second.
  CHECK(cpu_bf16_pays(CpuBf16Setting::Auto, true, 0.5));
  CHECK(cpu_bf16_pays(CpuBf16Setting::Auto, false, 2.0));
  CHECK(cpu_bf16_pays(CpuBf16Setting::Auto, false, kBf16MinDotSpeedup));
  CHECK_FALSE(cpu_bf16_pays(CpuBf16Setting::Auto, false, 0.52));
  CHECK_FALSE(cpu_bf16_pays(CpuBf16Setting::Auto, false, 1.1));
  CHECK(cpu_bf16_pays(CpuBf16Setting::On, false, 0.5));
  CHECK_FALSE(cpu_bf16_pays(CpuBf16Setting::Off, true, 2.0));
  const char* value = std::getenv("TESSERA_CPU_BF16");
  const CpuBf16Setting setting = parse_cpu_bf16_setting(value ? value : "", "TESSERA_CPU_BF16");
  CHECK(cpu_bf16_setting() == setting);
  if (!cpu_has_avx512_bf16()) {
    CHECK_FALSE(cpu_bf16_active());
    CHECK(detail::cpu_bf16_dot_speedup_measured() == 0.0);
    WARN("this CPU has no AVX512-BF16: " << cpu_bf16_kernel());
    return;
  }
  // The probe measures an instruction rate: a ratio between a quarter and four on any CPU (one
  // VDPBF16PS does two multiply-adds a lane, an FMA one; both issue one or two a cycle).
  const double speedup = detail::cpu_bf16_dot_speedup_measured();
  CHECK(speedup > 0.25);
  CHECK(speedup < 4.0);
  CHECK(detail::cpu_bf16_pays_here() == cpu_bf16_pays(setting, onednn_uses_amx(), speedup));
  CHECK(cpu_bf16_active() == detail::cpu_bf16_pays_here());
  if (!cpu_bf16_active()) CHECK(cpu_bf16_kernel().starts_with("float gemm ("));
  WARN("VDPBF16PS multiply-adds per second over FMA's here: " << speedup << "; TESSERA_CPU_BF16="
                                                               << (value ? value : "(unset)") << ": " << cpu_bf16_kernel());
}

namespace {

template <class S>
void copy_rounded(const Tensor<float>& from, Tensor<S>& to) {
  to.resize(from.shape());
  for (std::int64_t i = 0; i < from.numel(); ++i) to.data()[i] = static_cast<S>(operand(from.data()[i]));
}

Tensor<float> random_float(Shape shape, std::uint64_t& state) {
  Tensor<float> t(shape);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data()[i] = static_cast<float>(bf16_random(state));
  return t;
}

// A bfloat16 Env's Conv2d and a float32 twin with the same weights, both on `algorithm`.
struct ConvTwins {
  Conv2d<CpuLocalBf16> bf16;
  Conv2d<CpuLocal> plain;
  ConvTwins(const Conv2dOptions& o, ConvAlgorithm algorithm, Rng& rng) : bf16(o, rng), plain(o, rng) {
    plain.weight().value = bf16.weight().value;
    plain.bias().value = bf16.bias().value;
    bf16.set_algorithm(algorithm);
    plain.set_algorithm(algorithm);
  }
};

// max |got - want| / (1 + max |want|) over the elements.
double relative_gap(const Tensor<float>& got, const Tensor<double>& want) {
  REQUIRE(got.shape() == want.shape());
  double gap = 0, scale = 1;
  for (std::int64_t i = 0; i < got.numel(); ++i) {
    gap = std::max(gap, std::abs(got.data()[i] - want.data()[i]));
    scale = std::max(scale, std::abs(want.data()[i]));
  }
  return gap / scale;
}

// A layer of CpuLocalBf16 against its float64 twin with the same weights and rounded operands:
// forward y = f(round(x), round(w)); backward dx and dw from round(dy) with round(w), round(x).
// (The bias is added in float, never rounded.) The layers' products round their operands, so
// the float64 twin sees the rounded values and must agree to float accumulation.
template <class Layer32, class Layer64>
void check_against_rounded_twin(Layer32& layer, Layer64& twin, Shape x_shape, std::uint64_t& state) {
  copy_rounded(layer.weight().value, twin.weight().value);
  for (std::int64_t i = 0; i < layer.bias().value.numel(); ++i) twin.bias().value.data()[i] = layer.bias().value.data()[i];
  const Tensor<float> x = random_float(x_shape, state);
  Tensor<double> x64;
  copy_rounded(x, x64);
  typename Layer32::Cache c;
  typename Layer64::Cache c64;
  const Tensor<float>& y = layer.forward(x, c);
  const Tensor<double>& y64 = twin.forward(x64, c64);
  CHECK(relative_gap(y, y64) < 1e-5);
  const Tensor<float> dy = random_float(y.shape(), state);
  Tensor<double> dy64;
  copy_rounded(dy, dy64);
  layer.weight().grad.fill(0.0f);
  twin.weight().grad.fill(0.0);
  const Tensor<float>& dx = layer.backward(dy, c);
  const Tensor<double>& dx64 = twin.backward(dy64, c64);
  CHECK(relative_gap(dx, dx64) < 1e-5);
  CHECK(relative_gap(layer.weight().grad, twin.weight().grad) < 1e-5);
  // And the plain float layer differs by bfloat16's rounding: the policy is really in effect.
  if (cpu_bf16_active()) {
    Tensor<double> unrounded_w;
    unrounded_w.resize(layer.weight().value.shape());
    for (std::int64_t i = 0; i < unrounded_w.numel(); ++i) unrounded_w.data()[i] = layer.weight().value.data()[i];
    twin.weight().value = unrounded_w;
    Tensor<double> x_exact(x.shape());
    for (std::int64_t i = 0; i < x.numel(); ++i) x_exact.data()[i] = x.data()[i];
    typename Layer64::Cache exact_cache;
    CHECK(relative_gap(y, twin.forward(x_exact, exact_cache)) > 1e-4);
  }
}

}  // namespace

TEST_CASE("Linear with bfloat16 compute equals float64 on bfloat16-rounded operands", "[layers][bf16]") {
  INFO("bf16 kernel: " << cpu_bf16_kernel());
  std::uint64_t state = 11;
  Rng rng(5);
  for (bool enabled : {true, false}) {  // and the float fallback
    INFO("bf16 enabled: " << enabled);
    set_cpu_bf16_enabled(enabled);
    Linear<CpuLocalBf16> layer(300, 70, rng);
    Linear<CpuLocal64> twin(300, 70, rng);
    check_against_rounded_twin(layer, twin, Shape{33, 300}, state);
  }
  set_cpu_bf16_enabled(true);
}

// Linear of a bfloat16 Env whose three products run on oneDNN's matmul (dW's with beta = 1).
TEST_CASE("Linear with bfloat16 compute on oneDNN equals float64 on bfloat16-rounded operands",
          "[layers][bf16][onednn]") {
  if (!onednn_built() || !cpu_bf16_active()) {
    WARN("skipped: " << cpu_bf16_kernel());
    return;
  }
  set_cpu_bf16_library(Bf16Library::OneDnn);
  std::uint64_t state = 29;
  Rng rng(12);
  Linear<CpuLocalBf16> layer(300, 70, rng);
  Linear<CpuLocal64> twin(300, 70, rng);
  check_against_rounded_twin(layer, twin, Shape{4, 9, 300}, state);  // (B, T, in): 36 rows
  set_cpu_bf16_library(Bf16Library::Auto);
}

TEST_CASE("Conv2d with bfloat16 compute equals float64 on bfloat16-rounded operands", "[layers][bf16]") {
  INFO("bf16 kernel: " << cpu_bf16_kernel());
  std::uint64_t state = 13;
  Rng rng(6);
  struct Case {
    const char* what;
    Conv2dOptions o;
    Shape x;
  };
  const Case cases[] = {
      {"3x3 stride 2 padding 1 (im2col)", {16, 24, 3, 3, 2, 2, 1, 1, 1, 1, 1, true}, {3, 16, 15, 14}},
      {"1x1 (pointwise, no im2col)", {32, 16, 1, 1, 1, 1, 0, 0, 1, 1, 1, true}, {2, 32, 9, 9}},
      {"7x7 stride 2 (a ResNet stem)", {3, 8, 7, 7, 2, 2, 3, 3, 1, 1, 1, false}, {2, 3, 32, 32}},
  };
  for (const auto& c : cases) {
    for (bool enabled : {true, false}) {  // and the float fallback
      DYNAMIC_SECTION(c.what << (enabled ? "" : ", bf16 turned off")) {
        set_cpu_bf16_enabled(enabled);
        Conv2d<CpuLocalBf16> layer(c.o, rng);
        Conv2d<CpuLocal64> twin(c.o, rng);
        layer.set_algorithm(ConvAlgorithm::Im2col);
        twin.set_algorithm(ConvAlgorithm::Im2col);
        check_against_rounded_twin(layer, twin, c.x, state);
        set_cpu_bf16_enabled(true);
      }
    }
  }
}

TEST_CASE("Conv2d with bfloat16 compute: Winograd stays float", "[layers][bf16]") {
  // Auto picks Winograd with bfloat16 where it picks it in float (conv2d_geometry.hpp: float
  // Winograd beats bfloat16 im2col); it runs in float and gives exactly the float layer's result.
  // ResNet-20's first stage: 16 -> 16 channels, 3x3, 28x28.
  const Conv2dGeometry g{.channels = 16, .height = 28, .width = 28, .out_channels = 16, .kernel_h = 3, .kernel_w = 3,
                         .pad_h = 1, .pad_w = 1, .out_height = 28, .out_width = 28};
  CHECK(conv2d_blocking(g, 64, 4).winograd);
  CHECK(conv2d_blocking(g, 64, 4, 0, ConvAlgorithm::Auto, /*bf16=*/true).winograd);
  CHECK(conv2d_blocking(g, 64, 4, 0, ConvAlgorithm::Winograd, /*bf16=*/true).winograd);
  const Conv2dGeometry strided{.channels = 16, .height = 28, .width = 28, .out_channels = 32, .kernel_h = 3,
                               .kernel_w = 3, .stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1,
                               .out_height = 14, .out_width = 14};
  CHECK_FALSE(conv2d_blocking(strided, 64, 4, 0, ConvAlgorithm::Auto, /*bf16=*/true).winograd);
  Rng rng(8);
  ConvTwins twins({16, 16, 3, 3, 1, 1, 1, 1, 1, 1, 1, true}, ConvAlgorithm::Winograd, rng);
  auto& layer = twins.bf16;
  auto& plain = twins.plain;
  std::uint64_t state = 17;
  const Tensor<float> x = random_float({2, 16, 12, 12}, state);
  Conv2d<CpuLocalBf16>::Cache c1;
  Conv2d<CpuLocal>::Cache c2;
  const Tensor<float>& y1 = layer.forward(x, c1);
  const Tensor<float>& y2 = plain.forward(x, c2);
  REQUIRE(y1.shape() == y2.shape());
  CHECK(std::equal(y1.data(), y1.data() + y1.numel(), y2.data()));
}

// Where bfloat16 compute is off (turned off, or TESSERA_CPU_BF16=auto on a CPU whose VDPBF16PS is
// slower than float), a bfloat16 Env's im2col convolution is float32's, bit for bit: the same
// kernels (the unpacked product with AVX-512), not gemm_bf16's float fallback, which is another
// product and ran LeNet-5 slower than float32 (bench/README.md, "bfloat16 where VDPBF16PS is slow").
TEST_CASE("Conv2d of a bfloat16 Env with bfloat16 compute off is float32's, to the bit", "[layers][bf16]") {
  Rng rng(21);
  // LeNet-5's second convolution.
  ConvTwins twins({6, 16, 5, 5, 1, 1, 0, 0, 1, 1, 1, true}, ConvAlgorithm::Im2col, rng);
  auto& layer = twins.bf16;
  auto& plain = twins.plain;
  std::uint64_t state = 23;
  const Tensor<float> x = random_float({4, 6, 14, 14}, state);
  set_cpu_bf16_enabled(false);
  Conv2d<CpuLocalBf16>::Cache c1;
  Conv2d<CpuLocal>::Cache c2;
  const Tensor<float> y1 = layer.forward(x, c1);
  const Tensor<float> y2 = plain.forward(x, c2);
  const Tensor<float> dy = random_float(y1.shape(), state);
  layer.weight().grad.fill(0.0f);
  plain.weight().grad.fill(0.0f);
  const Tensor<float> dx1 = layer.backward(dy, c1);
  const Tensor<float> dx2 = plain.backward(dy, c2);
  set_cpu_bf16_enabled(true);
  REQUIRE(y1.shape() == y2.shape());
  CHECK(std::equal(y1.data(), y1.data() + y1.numel(), y2.data()));
  REQUIRE(dx1.shape() == dx2.shape());
  CHECK(std::equal(dx1.data(), dx1.data() + dx1.numel(), dx2.data()));
  const Tensor<float>& dw1 = layer.weight().grad;
  const Tensor<float>& dw2 = plain.weight().grad;
  CHECK(std::equal(dw1.data(), dw1.data() + dw1.numel(), dw2.data()));
}

// The run-time choice of the AVX-512 and AVX2 kernels (kernels/cpu/capability.hpp). The
// `kernels-portable` meson test runs the convolution, pooling and bfloat16 cases again with
// TESSERA_CPU_CAPABILITY=default, and `kernels-avx2` the convolution cases with =avx2: there this
// case checks that the cap took, and the others that the portable loops (or the AVX2 kernels)
// give the answers the widest kernels give in the ordinary run.
TEST_CASE("The CPU capability follows the CPU and TESSERA_CPU_CAPABILITY", "[core][capability]") {
  CHECK(parse_cpu_capability("default", "X") == CpuCapability::Default);
  CHECK(parse_cpu_capability("avx2", "X") == CpuCapability::Avx2);
  CHECK(parse_cpu_capability("avx512", "X") == CpuCapability::Avx512);
  CHECK_THROWS_WITH(parse_cpu_capability("avx9", "TESSERA_CPU_CAPABILITY"),
                    Catch::Contains("TESSERA_CPU_CAPABILITY='avx9'") && Catch::Contains("default") &&
                        Catch::Contains("avx2"));
  CHECK(std::string(cpu_capability_name(CpuCapability::Avx512)) == "avx512");
  CHECK(std::string(cpu_capability_name(CpuCapability::Avx2)) == "avx2");
  const char* cap = std::getenv("TESSERA_CPU_CAPABILITY");
  const std::string asked = cap ? cap : "";
  if (asked == "default") {
    CHECK(cpu_capability() == CpuCapability::Default);
    CHECK_FALSE(cpu_avx512());
    CHECK_FALSE(cpu_avx2());
    CHECK_FALSE(cpu_has_avx512_bf16());  // the bfloat16 kernel is AVX-512 too
  } else if (asked == "avx2") {
    // Capped: AVX2 where the CPU has at least that, else what it has.
    CHECK(cpu_capability() == std::min(CpuCapability::Avx2, cpu_capability_supported()));
    CHECK_FALSE(cpu_avx512());
    CHECK_FALSE(cpu_has_avx512_bf16());
  } else {
    CHECK(cpu_capability() == cpu_capability_supported());
  }
  WARN("this CPU supports " << cpu_capability_name(cpu_capability_supported()) << "; the kernels run "
                            << cpu_capability_name(cpu_capability()));
}

// oneDNN's bfloat16 convolutions (kernels/cpu/onednn_conv.hpp), forced for every layer: the same
// rounded-operand contract as Tessera's own kernels, forward and both gradients, over strides,
// padding, dilation, groups, bias and a Winograd-shaped layer. Where the build has no oneDNN or the
// CPU no AVX512-BF16, this checks that nothing would choose it, and says that it skipped.
TEST_CASE("Conv2d with bfloat16 compute on oneDNN equals float64 on bfloat16-rounded operands",
          "[layers][bf16][onednn]") {
  const Conv2dGeometry g{.channels = 16, .height = 14, .width = 14, .out_channels = 16, .kernel_h = 3, .kernel_w = 3,
                         .pad_h = 1, .pad_w = 1, .out_height = 14, .out_width = 14};
  if (!onednn_built() || !cpu_bf16_active()) {
    CHECK_FALSE(onednn_conv_chosen(g, false));
    if (!onednn_built()) CHECK_THROWS_WITH(OneDnnConv(g, 8, true, false), Catch::Contains("libdnnl-dev"));
    WARN("skipped: " << cpu_bf16_conv_kernel());
    return;
  }
  INFO("oneDNN: " << cpu_bf16_conv_kernel());
  std::uint64_t state = 19;
  Rng rng(9);
  struct Case {
    const char* what;
    Conv2dOptions o;
    Shape x;
  };
  const Case cases[] = {
      {"3x3 stride 2 padding 1, bias", {16, 24, 3, 3, 2, 2, 1, 1, 1, 1, 1, true}, {3, 16, 15, 14}},
      {"1x1, bias", {32, 16, 1, 1, 1, 1, 0, 0, 1, 1, 1, true}, {2, 32, 9, 9}},
      {"7x7 stride 2 (a ResNet stem)", {3, 8, 7, 7, 2, 2, 3, 3, 1, 1, 1, false}, {2, 3, 32, 32}},
      {"3x3 stride 1 (Winograd's shape)", {16, 16, 3, 3, 1, 1, 1, 1, 1, 1, 1, false}, {2, 16, 13, 13}},
      {"3x5 dilation 2, groups 2, uneven padding", {8, 12, 3, 5, 1, 2, 2, 1, 2, 2, 2, true}, {2, 8, 11, 12}},
  };
  set_cpu_bf16_library(Bf16Library::OneDnn);
  for (const auto& c : cases) {
    DYNAMIC_SECTION(c.what) {
      Conv2d<CpuLocalBf16> layer(c.o, rng);
      Conv2d<CpuLocal64> twin(c.o, rng);
      twin.set_algorithm(ConvAlgorithm::Im2col);
      check_against_rounded_twin(layer, twin, c.x, state);
    }
  }
  set_cpu_bf16_library(Bf16Library::Auto);
}

// Replicas on threads (CpuThreadsBf16's ranks): each copy of a layer builds its own primitives
// (OneDnnConvSlot), and each thread converts in its own scratch. Two copies running at once give
// what the original gives alone, bit for bit.
TEST_CASE("Conv2d on oneDNN: copies of a layer on two threads at once", "[layers][bf16][onednn]") {
  if (!onednn_built() || !cpu_bf16_active()) {
    WARN("skipped: " << cpu_bf16_conv_kernel());
    return;
  }
  set_cpu_bf16_library(Bf16Library::OneDnn);
  Rng rng(14);
  std::uint64_t state = 31;
  Conv2d<CpuLocalBf16> layer(Conv2dOptions{8, 16, 3, 3, 2, 2, 1, 1, 1, 1, 1, true}, rng);
  const Tensor<float> x = random_float(Shape{2, 8, 12, 12}, state);
  Conv2d<CpuLocalBf16>::Cache c;
  const Tensor<float> y = layer.forward(x, c);
  const Tensor<float> dy = random_float(y.shape(), state);
  layer.weight().grad.fill(0.0f);
  const Tensor<float> dx = layer.backward(dy, c);
  const Tensor<float> dw = layer.weight().grad;
  struct Result {
    Tensor<float> y, dx, dw;
  };
  Result got[2];
  auto replica = [&](Result* r) {
    Conv2d<CpuLocalBf16> copy = layer;
    for (int round = 0; round < 10; ++round) {
      Conv2d<CpuLocalBf16>::Cache cc;
      r->y = copy.forward(x, cc);
      copy.weight().grad.fill(0.0f);
      r->dx = copy.backward(dy, cc);
      r->dw = copy.weight().grad;
    }
  };
  std::thread t0(replica, &got[0]), t1(replica, &got[1]);
  t0.join();
  t1.join();
  set_cpu_bf16_library(Bf16Library::Auto);
  auto same = [](const Tensor<float>& p, const Tensor<float>& q) {
    return p.shape() == q.shape() && std::equal(p.data(), p.data() + p.numel(), q.data());
  };
  for (const Result& r : got) {
    CHECK(same(r.y, y));
    CHECK(same(r.dx, dx));
    CHECK(same(r.dw, dw));
  }
}

TEST_CASE("Conv2d on oneDNN: the layer runs its primitive, accumulates dW and follows batch and size",
          "[layers][bf16][onednn]") {
  if (!onednn_built() || !cpu_bf16_active()) {
    WARN("skipped: " << cpu_bf16_conv_kernel());
    return;
  }
  set_cpu_bf16_library(Bf16Library::OneDnn);
  Rng rng(10);
  std::uint64_t state = 23;
  const Conv2dOptions o{8, 16, 3, 3, 2, 2, 1, 1, 1, 1, 1, true};
  Conv2d<CpuLocalBf16> layer(o, rng);
  for (const Shape& shape : {Shape{2, 8, 12, 12}, Shape{3, 8, 12, 12}, Shape{3, 8, 9, 10}, Shape{2, 8, 12, 12}}) {
    INFO("x " << shape);
    const Tensor<float> x = random_float(shape, state);
    Conv2d<CpuLocalBf16>::Cache c;
    const Tensor<float> y = layer.forward(x, c);
    // The layer's output is the primitive's, bit for bit: Conv2d really delegated.
    Conv2dGeometry g{.channels = 8, .height = shape[2], .width = shape[3], .out_channels = 16, .kernel_h = 3,
                     .kernel_w = 3, .stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1,
                     .out_height = y.dim(2), .out_width = y.dim(3)};
    OneDnnConv direct(g, shape[0], true, true);
    Tensor<float> y_direct(y.shape());
    direct.forward(x.data(), layer.weight().value.data(), layer.bias().value.data(), y_direct.data());
    CHECK(std::equal(y.data(), y.data() + y.numel(), y_direct.data()));
    CHECK_FALSE(direct.implementation().empty());
    // dW accumulates: twice the same backward is twice the gradient; dx is assigned each time.
    const Tensor<float> dy = random_float(y.shape(), state);
    layer.weight().grad.fill(0.0f);
    const Tensor<float> dx1 = layer.backward(dy, c);
    const Tensor<float> once = layer.weight().grad;
    const Tensor<float>& dx2 = layer.backward(dy, c);
    CHECK(std::equal(dx1.data(), dx1.data() + dx1.numel(), dx2.data()));
    double gap = 0, scale = 0;
    for (std::int64_t i = 0; i < once.numel(); ++i) {
      gap = std::max(gap, std::abs(static_cast<double>(layer.weight().grad[i]) - 2.0 * once[i]));
      scale = std::max(scale, std::abs(static_cast<double>(once[i])));
    }
    CHECK(gap <= 1e-6 * scale);
  }
  set_cpu_bf16_library(Bf16Library::Auto);
}

// Auto's choice (bench/README.md, "bfloat16", has the per-layer timings behind it): never a layer
// with one input channel; with AMX every other; with AVX512-BF16 alone the spatial kernels, except
// Winograd's layers of at least 64 channels whose 4x4 tiles cover the output exactly; none when the
// setting is Tessera or bfloat16 is off.
TEST_CASE("oneDNN's share of a bfloat16 network follows the CPU and the setting", "[core][bf16][onednn]") {
  auto conv = [](std::int64_t c, std::int64_t k, std::int64_t size, std::int64_t kernel, std::int64_t stride) {
    const std::int64_t out = (size + 2 * (kernel / 2) - kernel) / stride + 1;
    return Conv2dGeometry{.channels = c, .height = size, .width = size, .out_channels = k, .kernel_h = kernel,
                          .kernel_w = kernel, .stride_h = stride, .stride_w = stride, .pad_h = kernel / 2,
                          .pad_w = kernel / 2, .out_height = out, .out_width = out};
  };
  const Conv2dGeometry pointwise = conv(256, 1024, 14, 1, 1), strided = conv(128, 128, 56, 3, 2);
  const Conv2dGeometry stem = conv(3, 64, 224, 7, 2), grey = conv(1, 16, 28, 3, 1);
  const Conv2dGeometry wide = conv(64, 64, 56, 3, 1), deep = conv(512, 512, 7, 3, 1), mid = conv(256, 256, 14, 3, 1);
  const bool on = onednn_built() && cpu_bf16_active();
  INFO("bfloat16 convolutions: " << cpu_bf16_conv_kernel());
  CHECK(cpu_bf16_library() == Bf16Library::Auto);
  CHECK(onednn_conv_chosen(strided, false) == on);
  CHECK(onednn_conv_chosen(stem, false) == on);
  CHECK_FALSE(onednn_conv_chosen(grey, false));                               // one input channel: Tessera's
  CHECK(onednn_conv_chosen(deep, true) == on);                                // 7x7: the tiles overhang
  CHECK(onednn_conv_chosen(mid, true) == on);                                 // 14x14: the tiles overhang
  CHECK(onednn_conv_chosen(pointwise, false) == (on && onednn_uses_amx()));  // 1x1: Tessera's without AMX
  CHECK(onednn_conv_chosen(conv(256, 512, 56, 1, 2), false) == (on && onednn_uses_amx()));  // strided too
  CHECK(onednn_conv_chosen(wide, true) == (on && onednn_uses_amx()));        // 56x56: 14 whole tiles a row
  CHECK(onednn_conv_chosen(conv(16, 16, 28, 3, 1), true) == on);               // but too few channels
  CHECK(onednn_conv_chosen(wide, false) == on);  // where Tessera's Auto runs im2col, not Winograd
  set_cpu_bf16_library(Bf16Library::Tessera);
  CHECK_FALSE(onednn_conv_chosen(strided, false));
  set_cpu_bf16_library(Bf16Library::Auto);
  set_cpu_bf16_enabled(false);
  CHECK_FALSE(onednn_conv_chosen(strided, false));  // bfloat16 off: the float path, no oneDNN
  set_cpu_bf16_enabled(true);
  if (!onednn_built()) {
    CHECK_THROWS_WITH(set_cpu_bf16_library(Bf16Library::OneDnn), Catch::Contains("libdnnl-dev"));
    WARN("this build has no oneDNN");
  } else if (onednn_uses_amx()) {
    set_cpu_bf16_library(Bf16Library::OneDnn);
    OneDnnConv amx(strided, 8, true, false);
    CHECK(amx.implementation().find("amx") != std::string::npos);
    set_cpu_bf16_library(Bf16Library::Auto);
  } else {
    WARN("no AMX on this CPU (oneDNN runs " << onednn_cpu_isa() << "): the AMX kernels were not exercised");
  }
}
