// BatchNorm2d, ReLU, GELU, Dropout, Flatten: float64 gradient checks, PyTorch reference data
// (tests/data/norm_act_loss.safetensors from tools/reference/gen_norm_act_loss.py) in float64 and
// float32, running statistics, modes, shape and argument errors, no allocation in steady state.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numbers>
#include <string>
#include <vector>

#include "support/gradcheck.hpp"
#include "support/reference.hpp"
#include "tessera/comm/local.hpp"
#include "tessera/core/env.hpp"
#include "tessera/layers/activation.hpp"
#include "tessera/layers/batch_norm.hpp"
#include "tessera/layers/dropout.hpp"
#include "tessera/layers/flatten.hpp"
#include "tessera/io/safetensors.hpp"
#include "tessera/kernels/channel_walk.hpp"

using namespace tessera;
using tessera::testing::T64;

namespace {

using E32 = Env<Cpu, LocalComm, float>;
using E64 = Env<Cpu, LocalComm, double>;

static_assert(Layer<BatchNorm2d<E32>>);
static_assert(Layer<ReLU<E32>>);
static_assert(Layer<GELU<E32>>);
static_assert(Layer<LeakyReLU<E32>>);
static_assert(Layer<Dropout<E32>>);
static_assert(Layer<Flatten<E32>>);
static_assert(Layer<BatchNorm2d<E64>>);

const SafetensorsFile& norm_act_reference() {
  static const SafetensorsFile f =
      SafetensorsFile::load(std::string(TESSERA_REFERENCE_DATA_DIR) + "/norm_act_loss.safetensors");
  return f;
}

template <class S>
void norm_act_matches(const Tensor<S>& got, const std::string& name) {
  testing::expect_matches(norm_act_reference(), got, name);
}

template <class S>
Tensor<S> norm_act_load(const std::string& name) {
  return norm_act_reference().tensor<double>(name).cast<S>();
}

std::string norm_fmt_g(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

std::string shape_str(const Shape& s) {
  std::string out;
  for (int i = 0; i < s.rank(); ++i) {
    if (i) out += 'x';
    out += std::to_string(s[i]);
  }
  return out;
}

struct BnCase {
  const char* name;
  Shape shape;
  bool train;
  double eps, momentum;
  std::string config() const {
    return "shape=" + shape_str(shape) + " mode=" + (train ? "train" : "eval") + " eps=" + norm_fmt_g(eps) +
           " momentum=" + norm_fmt_g(momentum);
  }
};

const BnCase kBnCases[] = {
    {"bn_train_4d", {4, 3, 5, 4}, true, 1e-5, 0.1},
    {"bn_train_2d", {6, 5}, true, 1e-3, 0.3},
    {"bn_eval_4d", {3, 4, 3, 3}, false, 1e-5, 0.1},
    {"bn_eval_2d", {5, 3}, false, 1e-2, 0.1},
};

template <class S>
void run_bn_reference(const BnCase& k) {
  using E = Env<Cpu, LocalComm, S>;
  const std::string n = k.name;
  INFO("case " << n << " (" << k.config() << ")");
  REQUIRE(norm_act_reference().metadata().at(n) == k.config());
  BatchNorm2d<E> bn(k.shape[1], k.eps, k.momentum);
  bn.weight().value = norm_act_load<S>(n + ".weight");
  bn.bias().value = norm_act_load<S>(n + ".bias");
  if (!k.train) {
    bn.running_mean() = norm_act_load<S>(n + ".running_mean");
    bn.running_var() = norm_act_load<S>(n + ".running_var");
    bn.set_mode(Mode::Eval);
  }
  const Tensor<S> x = norm_act_load<S>(n + ".x");
  const Tensor<S> g = norm_act_load<S>(n + ".g");
  REQUIRE(x.shape() == k.shape);
  typename BatchNorm2d<E>::Cache cache;
  norm_act_matches(bn.forward(x, cache), n + ".y");
  norm_act_matches(bn.backward(g, cache), n + ".dx");
  norm_act_matches(bn.weight().grad, n + ".dweight");
  norm_act_matches(bn.bias().grad, n + ".dbias");
  if (k.train) {
    norm_act_matches(bn.running_mean(), n + ".running_mean1");
    norm_act_matches(bn.running_var(), n + ".running_var1");
    const Tensor<S> x2 = norm_act_load<S>(n + ".x2");
    typename BatchNorm2d<E>::Cache cache2;
    bn.forward(x2, cache2);
    norm_act_matches(bn.running_mean(), n + ".running_mean2");
    norm_act_matches(bn.running_var(), n + ".running_var2");
  }
}

// x with per-channel means and scales away from 0 and 1.
T64 shifted_input(const Shape& shape, Rng& rng) {
  T64 x = testing::random_tensor(shape, rng);
  const std::int64_t c = shape[1];
  const std::int64_t hw = x.numel() / (shape[0] * c);
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    const std::int64_t ch = (i / hw) % c;
    x[i] = x[i] * (0.5 + 0.4 * static_cast<double>(ch)) + 0.3 * static_cast<double>(ch) - 0.4;
  }
  return x;
}

template <class L>
void randomize_affine(L& bn, Rng& rng) {
  for (auto& v : bn.weight().value) v = rng.uniform(0.5, 1.5);
  for (auto& v : bn.bias().value) v = rng.normal();
}

// Dropout whose forward replays the same mask every call, so central differences see one
// function of x (what check_gradients needs).
struct FixedMaskDropout {
  using Env = E64;
  using Tensor = T64;
  using Cache = Dropout<E64>::Cache;
  Dropout<E64> layer;
  Rng::State state;
  FixedMaskDropout(double p, std::uint64_t seed) : layer(p, seed), state(layer.rng().state()) {}
  const Tensor& forward(const Tensor& x, Cache& c) {
    layer.rng().set_state(state);
    return layer.forward(x, c);
  }
  const Tensor& backward(const Tensor& dy, Cache& c) { return layer.backward(dy, c); }
  void set_mode(Mode m) { layer.set_mode(m); }
  template <class V>
  void visit(V& v, const std::string& prefix) {
    layer.visit(v, prefix);
  }
};

std::size_t system_allocations() { return Cpu::allocator().stats().system_allocations; }

}  // namespace

TEST_CASE("BatchNorm2d gradients in train mode (float64)", "[layers][batch_norm]") {
  Rng rng(11);
  SECTION("(N, C, H, W)") {
    BatchNorm2d<E64> bn(3);
    randomize_affine(bn, rng);
    testing::check_gradients(bn, shifted_input({3, 3, 3, 2}, rng), rng);
  }
  SECTION("(N, C) as BatchNorm1d") {
    BatchNorm2d<E64> bn(4, 1e-3, 0.2);
    randomize_affine(bn, rng);
    testing::check_gradients(bn, shifted_input({5, 4}, rng), rng);
  }
  // (Two values per channel would be degenerate: xhat = +-1 whatever x, so dx ~ 0.)
  SECTION("N = 2, three values per channel") {
    BatchNorm2d<E64> bn(2);
    randomize_affine(bn, rng);
    testing::check_gradients(bn, shifted_input({2, 2, 1, 3}, rng), rng);
  }
}

TEST_CASE("BatchNorm2d gradients in eval mode (float64)", "[layers][batch_norm]") {
  Rng rng(12);
  BatchNorm2d<E64> bn(3, 1e-4);
  randomize_affine(bn, rng);
  for (auto& v : bn.running_mean()) v = rng.normal();
  for (auto& v : bn.running_var()) v = rng.uniform(0.3, 2.0);
  bn.set_mode(Mode::Eval);
  testing::check_gradients(bn, shifted_input({2, 3, 2, 3}, rng), rng);
}

TEST_CASE("BatchNorm2d matches PyTorch (float64)", "[layers][batch_norm][reference]") {
  for (const auto& k : kBnCases) run_bn_reference<double>(k);
}

TEST_CASE("BatchNorm2d matches PyTorch (float32)", "[layers][batch_norm][reference]") {
  for (const auto& k : kBnCases) run_bn_reference<float>(k);
}

TEST_CASE("BatchNorm kernels split by (sample, channel) plane agree at 1, 2 and 3 threads", "[layers][batch_norm]") {
  // Above kBatchNormParallelThreshold the planes are dealt to the team in memory order, in runs
  // an idle thread may take over (kernels/cpu/batch_norm.hpp). The elementwise passes must not
  // change at all with the team size; nor the sums over images (one slot per plane, added in
  // sample order), while those over (N, C) inputs are added thread by thread and may change in
  // their last bits; all must equal a serial float64 sum. Shapes: a batch whose planes split
  // mid-sample, a batch of one (the team then splits its channels), and (N, C) with hw 1.
  struct Threads {  // restored even when a REQUIRE below throws
    int before = Cpu::num_threads();
    ~Threads() { Cpu::set_num_threads(before); }
  } restore;
  const BatchNormShape shapes[] = {{5, 7, 700}, {1, 40, 500}, {400, 64, 1}};
  for (const BatchNormShape s : shapes) {
    REQUIRE(s.numel() >= detail::kBatchNormParallelThreshold);
    Rng rng(23);
    std::vector<float> x(s.numel()), dy(s.numel()), gamma(s.c), beta(s.c), mean(s.c), invstd(s.c);
    for (auto& v : x) v = static_cast<float>(rng.normal() + 2.0);
    for (auto& v : dy) v = static_cast<float>(rng.normal());
    for (std::int64_t ch = 0; ch < s.c; ++ch) {
      gamma[ch] = static_cast<float>(rng.uniform(0.5, 1.5)), beta[ch] = static_cast<float>(rng.normal());
      mean[ch] = static_cast<float>(2.0 + 0.1 * rng.normal()), invstd[ch] = static_cast<float>(rng.uniform(0.5, 2.0));
    }
    // No y within 1e-3 of 0: there the ReLU's mask could flip between the kernel's rounding of y
    // (fused multiply-add or not) and the reference's.
    for (std::int64_t i = 0; i < s.numel(); ++i) {
      const std::int64_t ch = (i / s.hw) % s.c;
      const double scale = double(gamma[ch]) * invstd[ch];
      if (std::abs((double(x[i]) - mean[ch]) * scale + beta[ch]) < 1e-3) x[i] += static_cast<float>(0.01 / scale);
    }
    // Serial float64 references: the sums, and with the fused ReLU the sums of dy_bn (dy where
    // y = (x - mean) gamma invstd + beta > 0), each of dy and of dy (x - mean) invstd.
    std::vector<double> want_sum(s.c, 0.0), want_sq(s.c, 0.0), want_dy(s.c, 0.0), want_dxhat(s.c, 0.0);
    std::vector<double> want_relu_dy(s.c, 0.0), want_relu_dxhat(s.c, 0.0);
    for (std::int64_t i = 0; i < s.numel(); ++i) {
      const std::int64_t ch = (i / s.hw) % s.c;
      const double xhat = (double(x[i]) - mean[ch]) * invstd[ch];
      want_sum[ch] += x[i], want_sq[ch] += double(x[i]) * x[i];
      want_dy[ch] += dy[i], want_dxhat[ch] += dy[i] * xhat;
      if (batch_norm_value(x[i], mean[ch], gamma[ch] * invstd[ch], beta[ch]) > 0.f)
        want_relu_dy[ch] += dy[i], want_relu_dxhat[ch] += dy[i] * xhat;
    }
    std::vector<float> y1, dx1, affine1;
    std::vector<double> sums1;
    const bool exact_sums = s.hw >= detail::kBatchNormPlaneSlotsMinHw;
    for (const int threads : {1, 2, 3}) {  // not sections: the 1-thread results are kept for the others
      INFO(s.n << "x" << s.c << "x" << s.hw << " at " << threads << " threads");
      Cpu::set_num_threads(threads);
      std::vector<double> sum(s.c), sq(s.c), sdy(s.c), sdx(s.c), rdy(s.c), rdx(s.c);
      batch_norm_local_stats(Cpu{}, x.data(), s, sum.data(), sq.data());
      batch_norm_backward_local_sums(Cpu{}, dy.data(), x.data(), s, mean.data(), invstd.data(), sdy.data(),
                                     sdx.data());
      batch_norm_backward_local_sums(Cpu{}, dy.data(), x.data(), s, mean.data(), invstd.data(), rdy.data(),
                                     rdx.data(), true, gamma.data(), beta.data());
      for (std::int64_t ch = 0; ch < s.c; ++ch) {
        CHECK(sum[ch] == Approx(want_sum[ch]).epsilon(1e-12));
        CHECK(sq[ch] == Approx(want_sq[ch]).epsilon(1e-12));
        CHECK(sdy[ch] == Approx(want_dy[ch]).epsilon(1e-12).margin(1e-9));
        CHECK(sdx[ch] == Approx(want_dxhat[ch]).epsilon(1e-12).margin(1e-9));
        CHECK(rdy[ch] == Approx(want_relu_dy[ch]).epsilon(1e-12).margin(1e-9));
        CHECK(rdx[ch] == Approx(want_relu_dxhat[ch]).epsilon(1e-12).margin(1e-9));
      }
      std::vector<float> y(s.numel()), dx(s.numel()), affine(s.numel());
      batch_norm_backward_input_affine(Cpu{}, dy.data(), s, invstd.data(), gamma.data(), affine.data(), true,
                                       x.data(), mean.data(), beta.data());
      std::int64_t affine_wrong = 0;  // dx = gamma invstd dy_bn, element by element
      for (std::int64_t i = 0; i < s.numel(); ++i) {
        const std::int64_t ch = (i / s.hw) % s.c;
        const float a = gamma[ch] * invstd[ch];
        affine_wrong += affine[i] != a * relu_pass(batch_norm_value(x[i], mean[ch], a, beta[ch]), dy[i]);
      }
      CHECK(affine_wrong == 0);
      batch_norm_normalize(Cpu{}, x.data(), s, mean.data(), invstd.data(), gamma.data(), beta.data(), y.data(),
                           true);
      batch_norm_backward_input(Cpu{}, dy.data(), x.data(), s, mean.data(), invstd.data(), gamma.data(), sdy.data(),
                                sdx.data(), s.count(), dx.data(), true, beta.data());
      std::vector<double> sums = sum;
      for (const auto* v : {&sq, &sdy, &sdx, &rdy, &rdx}) sums.insert(sums.end(), v->begin(), v->end());
      if (threads == 1) {
        y1 = y, dx1 = dx, affine1 = affine, sums1 = sums;
      } else {
        CHECK(y == y1);
        CHECK(affine == affine1);
        if (exact_sums) {
          CHECK(sums == sums1);
          CHECK(dx == dx1);
        }
        // Otherwise dx depends on sums that may differ in their last bits between team sizes.
        std::int64_t far = 0;
        for (std::int64_t i = 0; i < s.numel(); ++i) far += std::abs(dx[i] - dx1[i]) > 1e-6f * (1 + std::abs(dx1[i]));
        CHECK(far == 0);
      }
    }
  }
}

// The walk the CUDA BatchNorm kernels' threads take (kernels/cuda/batch_norm.cuh), run here on
// the host: the threads of a block, together, visit every unit of their channel's images once and
// nothing else, for plane lengths shorter and longer than the block, and for every split.
TEST_CASE("ChannelWalk visits each unit of a channel's images exactly once", "[layers][batch_norm]") {
  struct Case {
    std::int64_t n, c, units, threads;
  };
  for (const Case k : {Case{4, 3, 49, 256}, Case{16, 8, 3136, 256}, Case{5, 7, 1, 32}, Case{3, 2, 256, 256},
                       Case{3, 2, 257, 256}, Case{2, 5, 255, 256}, Case{6, 1, 12, 5}, Case{2, 3, 0, 8}}) {
    for (std::int64_t splits = 1; splits <= std::min<std::int64_t>(k.n, 4); ++splits) {
      std::vector<int> seen(static_cast<std::size_t>(k.n * k.c * k.units), 0);
      std::int64_t outside = 0;
      for (std::int64_t ch = 0; ch < k.c; ++ch)
        for (std::int64_t j = 0; j < splits; ++j)
          for (std::int64_t t = 0; t < k.threads; ++t)
            for (detail::ChannelWalk w(k.units, k.c, ch, j * k.n / splits, (j + 1) * k.n / splits, t, k.threads);
                 w.valid(); w.next()) {
              const std::int64_t u = w.unit();
              // Inside x, and in one of this channel's planes.
              if (u < 0 || u >= static_cast<std::int64_t>(seen.size()) || (u / k.units) % k.c != ch) ++outside;
              else ++seen[static_cast<std::size_t>(u)];
            }
      INFO("n " << k.n << " c " << k.c << " units " << k.units << " threads " << k.threads << " splits " << splits);
      CHECK(outside == 0);
      CHECK(std::count(seen.begin(), seen.end(), 1) == static_cast<std::ptrdiff_t>(seen.size()));
    }
  }
}

TEST_CASE("BatchNorm2d running statistics use the unbiased variance", "[layers][batch_norm]") {
  // One channel, values 1..4 at N = 2, H = 1, W = 2: mean 2.5, biased var 1.25, unbiased 5/3.
  BatchNorm2d<E64> bn(1, 1e-5, 0.1);
  const T64 x = T64::from({2, 1, 1, 2}, {1, 2, 3, 4});
  BatchNorm2d<E64>::Cache c;
  const T64& y = bn.forward(x, c);
  CHECK(bn.running_mean()[0] == Approx(0.1 * 2.5).epsilon(1e-14));
  CHECK(bn.running_var()[0] == Approx(0.9 + 0.1 * 5.0 / 3.0).epsilon(1e-14));
  // The normalization itself uses the biased variance.
  CHECK(y[0] == Approx(-1.5 / std::sqrt(1.25 + 1e-5)).epsilon(1e-14));

  SECTION("eval mode normalizes with the running statistics and leaves them alone") {
    bn.set_mode(Mode::Eval);
    BatchNorm2d<E64>::Cache ce;
    const T64& ye = bn.forward(x, ce);
    const double m = bn.running_mean()[0], v = bn.running_var()[0];
    for (std::int64_t i = 0; i < 4; ++i) CHECK(ye[i] == Approx((x[i] - m) / std::sqrt(v + 1e-5)).epsilon(1e-14));
    CHECK(bn.running_mean()[0] == m);
    CHECK(bn.running_var()[0] == v);
  }
}

TEST_CASE("BatchNorm2d parameters, buffers, zero_init_weight and gradient accumulation", "[layers][batch_norm]") {
  BatchNorm2d<E32> bn(4);
  auto named = named_tensors(bn, "bn1.");
  REQUIRE(named.parameters.size() == 2);
  CHECK(named.parameters[0].first == "bn1.weight");
  CHECK(named.parameters[1].first == "bn1.bias");
  CHECK(named.parameters[0].second->kind == ParamKind::Norm);
  CHECK(named.parameters[1].second->kind == ParamKind::Norm);
  REQUIRE(named.buffers.size() == 2);
  CHECK(named.buffers[0].first == "bn1.running_mean");
  CHECK(named.buffers[1].first == "bn1.running_var");
  for (int c = 0; c < 4; ++c) {
    CHECK(bn.weight().value[c] == 1.0f);
    CHECK(bn.bias().value[c] == 0.0f);
    CHECK(bn.running_mean()[c] == 0.0f);
    CHECK(bn.running_var()[c] == 1.0f);
  }

  Rng rng(3);
  const Tensor<float> x = testing::random_tensor({2, 4, 3, 3}, rng).cast<float>();
  const Tensor<float> g = testing::random_tensor({2, 4, 3, 3}, rng).cast<float>();

  SECTION("gamma = 0 makes the output beta everywhere") {
    bn.zero_init_weight();
    for (int c = 0; c < 4; ++c) bn.bias().value[c] = static_cast<float>(c);
    BatchNorm2d<E32>::Cache cache;
    const auto& y = bn.forward(x, cache);
    for (std::int64_t i = 0; i < y.numel(); ++i) CHECK(y[i] == static_cast<float>((i / 9) % 4));
  }
  SECTION("backward accumulates into the gradients and fires each hook once") {
    int weight_hooks = 0, bias_hooks = 0;
    bn.weight().on_grad_ready = [&](auto&) { ++weight_hooks; };
    bn.bias().on_grad_ready = [&](auto&) { ++bias_hooks; };
    BatchNorm2d<E32>::Cache cache;
    bn.forward(x, cache);
    bn.backward(g, cache);
    const Tensor<float> once = bn.weight().grad;
    bn.backward(g, cache);
    for (int c = 0; c < 4; ++c) CHECK(bn.weight().grad[c] == Approx(2 * once[c]));
    CHECK(weight_hooks == 2);
    CHECK(bias_hooks == 2);
  }
  SECTION("a steady-state step allocates nothing") {
    BatchNorm2d<E32>::Cache cache;
    bn.forward(x, cache);
    bn.backward(g, cache);
    const auto before = system_allocations();
    bn.forward(x, cache);
    bn.backward(g, cache);
    CHECK(system_allocations() == before);
  }
}

TEST_CASE("BatchNorm2d rejects bad shapes and arguments", "[layers][batch_norm][errors]") {
  BatchNorm2d<E32> bn(3);
  BatchNorm2d<E32>::Cache c;
  CHECK_THROWS_AS(bn.forward(Tensor<float>({2, 4, 3, 3}, 0.f), c), ShapeError);
  CHECK_THROWS_AS(bn.forward(Tensor<float>({2, 3, 3}, 0.f), c), ShapeError);
  CHECK_THROWS_AS(bn.forward(Tensor<float>({3}, 0.f), c), ShapeError);
  CHECK_THROWS_WITH(bn.forward(Tensor<float>({2, 5}, 0.f), c),
                    Catch::Contains("BatchNorm2d(3") && Catch::Contains("(N, 3, H, W)") && Catch::Contains("(2, 5)"));
  // Training needs more than one value per channel (torch raises too); eval does not.
  CHECK_THROWS_AS(bn.forward(Tensor<float>({1, 3, 1, 1}, 0.f), c), ShapeError);
  bn.set_mode(Mode::Eval);
  const Tensor<float> one({1, 3, 1, 1}, 1.f);
  CHECK_NOTHROW(bn.forward(one, c));
  CHECK_THROWS_AS(bn.backward(Tensor<float>({1, 3, 1, 2}, 0.f), c), ShapeError);
  CHECK_THROWS_AS(BatchNorm2d<E32>(0), ArgumentError);
  CHECK_THROWS_AS(BatchNorm2d<E32>(3, -1e-5), ArgumentError);
  CHECK_NOTHROW(BatchNorm2d<E32>(3, 0.0));  // torch accepts eps=0 too
  CHECK_THROWS_AS(BatchNorm2d<E32>(3, 1e-5, 1.5), ArgumentError);
}

TEST_CASE("ReLU and GELU gradients (float64)", "[layers][activation]") {
  Rng rng(21);
  T64 x = testing::random_tensor({3, 4, 5}, rng, 2.0);
  for (auto& v : x)
    if (std::abs(v) < 1e-2) v += 0.1;  // keep central differences off ReLU's kink
  SECTION("ReLU") {
    ReLU<E64> relu;
    testing::check_gradients(relu, x, rng);
  }
  SECTION("GELU") {
    GELU<E64> gelu;
    testing::check_gradients(gelu, x, rng);
  }
  SECTION("GELU, tanh form") {
    GELU<E64> gelu({.approximate = GeluApproximate::Tanh});
    testing::check_gradients(gelu, x, rng);
  }
  SECTION("LeakyReLU, default and configured slope") {
    LeakyReLU<E64> leaky;
    testing::check_gradients(leaky, x, rng);
    LeakyReLU<E64> steep({.negative_slope = 0.2});
    testing::check_gradients(steep, x, rng);
  }
}

TEST_CASE("LeakyReLU: PyTorch's default slope 0.01, the slope at x = 0, not in place", "[layers][activation]") {
  LeakyReLU<E32> leaky;
  CHECK(leaky.op().negative_slope == 0.01);  // torch.nn.LeakyReLU(negative_slope=0.01)
  LeakyReLU<E64> layer({.negative_slope = 0.25});
  LeakyReLU<E64>::Cache c;
  const auto x = T64::from({5}, {-4.0, -1.0, 0.0, 0.5, 3.0});
  const auto& y = layer.forward(x, c);
  const double want_y[] = {-1.0, -0.25, 0.0, 0.5, 3.0};
  for (int i = 0; i < 5; ++i) CHECK(y[i] == want_y[i]);
  const auto& dx = layer.backward(T64::from({5}, {1.0, 2.0, 4.0, 8.0, 16.0}), c);
  const double want_dx[] = {0.25, 0.5, 1.0, 8.0, 16.0};  // at x = 0 the slope, as PyTorch (x > 0 is false)
  for (int i = 0; i < 5; ++i) CHECK(dx[i] == want_dx[i]);
  CHECK(x[0] == -4.0);
}

TEST_CASE("LeakyReLU matches PyTorch (float64 and float32)", "[layers][activation][reference]") {
  REQUIRE(norm_act_reference().metadata().at("leaky_relu") == "shape=3x40 negative_slope=0.2");
  SECTION("float64") {
    LeakyReLU<E64> leaky({.negative_slope = 0.2});
    LeakyReLU<E64>::Cache c;
    const T64 x = norm_act_load<double>("leaky_relu.x");
    norm_act_matches(leaky.forward(x, c), "leaky_relu.y");
    norm_act_matches(leaky.backward(norm_act_load<double>("leaky_relu.g"), c), "leaky_relu.dx");
  }
  SECTION("float32") {
    LeakyReLU<E32> leaky({.negative_slope = 0.2});
    LeakyReLU<E32>::Cache c;
    const Tensor<float> x = norm_act_load<float>("leaky_relu.x");
    norm_act_matches(leaky.forward(x, c), "leaky_relu.y");
    norm_act_matches(leaky.backward(norm_act_load<float>("leaky_relu.g"), c), "leaky_relu.dx");
  }
}

TEST_CASE("ReLU forward and backward by hand", "[layers][activation]") {
  ReLU<E32> relu;
  ReLU<E32>::Cache c;
  const auto x = Tensor<float>::from({2, 3}, {-1.f, 0.f, 2.f, 3.f, -0.5f, 1e-30f});
  const auto& y = relu.forward(x, c);
  const float want_y[] = {0.f, 0.f, 2.f, 3.f, 0.f, 1e-30f};
  for (int i = 0; i < 6; ++i) CHECK(y[i] == want_y[i]);
  const auto dy = Tensor<float>::from({2, 3}, {1.f, 2.f, 3.f, 4.f, 5.f, 6.f});
  const auto& dx = relu.backward(dy, c);
  const float want_dx[] = {0.f, 0.f, 3.f, 4.f, 0.f, 6.f};
  for (int i = 0; i < 6; ++i) CHECK(dx[i] == want_dx[i]);
  CHECK(x[0] == -1.f);  // not in place
  CHECK_THROWS_AS(relu.backward(Tensor<float>({3, 2}, 0.f), c), ShapeError);
}

TEST_CASE("ReLU lets NaN through like torch.relu, and its gradient too", "[layers][activation]") {
  // torch.relu(nan) = nan and threshold_backward passes dy where the output is nan: a diverging
  // run shows NaN in its loss instead of being silently clamped to zero.
  ReLU<E32> relu;
  ReLU<E32>::Cache c;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const auto x = Tensor<float>::from({3}, {nan, -nan, -2.f});
  const auto& y = relu.forward(x, c);
  CHECK(std::isnan(y[0]));
  CHECK(std::isnan(y[1]));
  CHECK(y[2] == 0.f);
  const auto& dx = relu.backward(Tensor<float>::from({3}, {5.f, 6.f, 7.f}), c);
  CHECK(dx[0] == 5.f);
  CHECK(dx[1] == 6.f);
  CHECK(dx[2] == 0.f);
}

TEST_CASE("ReLU and GELU on a large tensor (parallel path) equal the serial formula", "[layers][activation]") {
  Rng rng(5);
  const Tensor<float> x = testing::random_tensor({4, 64, 32, 32}, rng, 3.0).cast<float>();
  GELU<E32> gelu;
  GELU<E32>::Cache c;
  const auto& y = gelu.forward(x, c);
  const auto& dx = gelu.backward(x, c);
  std::int64_t bad = 0;
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    const double v = x[i];
    const double want = 0.5 * v * (1 + std::erf(v / std::sqrt(2.0)));
    const double dwant = v * (0.5 * (1 + std::erf(v / std::sqrt(2.0))) + v * std::exp(-0.5 * v * v) / std::sqrt(2 * std::numbers::pi));
    bad += std::abs(y[i] - want) > 1e-6 * (1 + std::abs(want)) || std::abs(dx[i] - dwant) > 1e-5 * (1 + std::abs(dwant));
  }
  CHECK(bad == 0);
  ReLU<E32> relu;
  ReLU<E32>::Cache rc;
  const auto& r = relu.forward(x, rc);
  for (std::int64_t i = 0; i < x.numel(); ++i) bad += r[i] != std::max(x[i], 0.f);
  CHECK(bad == 0);
}

TEST_CASE("GELU matches PyTorch (float64 and float32)", "[layers][activation][reference]") {
  REQUIRE(norm_act_reference().metadata().at("gelu") == "shape=4x50");
  {
    GELU<E64> gelu;
    GELU<E64>::Cache c;
    const T64 x = norm_act_load<double>("gelu.x");
    norm_act_matches(gelu.forward(x, c), "gelu.y");
    norm_act_matches(gelu.backward(norm_act_load<double>("gelu.g"), c), "gelu.dx");
  }
  {
    GELU<E32> gelu;
    GELU<E32>::Cache c;
    const Tensor<float> x = norm_act_load<float>("gelu.x");
    norm_act_matches(gelu.forward(x, c), "gelu.y");
    norm_act_matches(gelu.backward(norm_act_load<float>("gelu.g"), c), "gelu.dx");
  }
}

TEST_CASE("GELU with approximate=tanh matches PyTorch (float64 and float32)", "[layers][activation][reference]") {
  REQUIRE(norm_act_reference().metadata().at("gelu_tanh") == "shape=4x50 approximate=tanh");
  {
    GELU<E64> gelu({.approximate = GeluApproximate::Tanh});
    GELU<E64>::Cache c;
    const T64 x = norm_act_load<double>("gelu_tanh.x");
    norm_act_matches(gelu.forward(x, c), "gelu_tanh.y");
    norm_act_matches(gelu.backward(norm_act_load<double>("gelu_tanh.g"), c), "gelu_tanh.dx");
  }
  {
    GELU<E32> gelu({.approximate = GeluApproximate::Tanh});
    GELU<E32>::Cache c;
    const Tensor<float> x = norm_act_load<float>("gelu_tanh.x");
    norm_act_matches(gelu.forward(x, c), "gelu_tanh.y");
    norm_act_matches(gelu.backward(norm_act_load<float>("gelu_tanh.g"), c), "gelu_tanh.dx");
  }
  // The two forms differ by up to ~1e-3 around |x| = 2: the option really switches the formula.
  GELU<E64> exact, tanh_form({.approximate = GeluApproximate::Tanh});
  GELU<E64>::Cache ce, ct;
  const T64 x = T64::from({1}, {2.0});
  CHECK(std::abs(exact.forward(x, ce)[0] - tanh_form.forward(x, ct)[0]) > 1e-5);
}

TEST_CASE("Dropout gradient with a fixed mask (float64)", "[layers][dropout]") {
  Rng rng(31);
  FixedMaskDropout d(0.4, 99);
  const T64 x = testing::random_tensor({4, 6, 3}, rng);
  testing::check_gradients(d, x, rng);

  // dx is exactly dy * mask, and the mask is keep / (1 - p).
  Dropout<E64> drop(0.4, 99);
  Dropout<E64>::Cache c;
  const T64& y = drop.forward(x, c);
  const T64 g = testing::random_tensor(x.shape(), rng);
  const T64& dx = drop.backward(g, c);
  REQUIRE(c.applied);
  int kept = 0;
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    const double m = c.mask[i];
    CHECK((m == 0.0 || m == 1.0 / 0.6));
    CHECK(y[i] == x[i] * m);
    CHECK(dx[i] == g[i] * m);
    kept += m != 0.0;
  }
  CHECK(kept > 0);
  CHECK(kept < x.numel());
}

TEST_CASE("Dropout statistics, modes, seeding and arguments", "[layers][dropout]") {
  const Tensor<float> x({100, 1000}, 1.f);
  Dropout<E32> drop(0.3, 7);
  Dropout<E32>::Cache c;
  const auto& y = drop.forward(x, c);
  double zeros = 0, sum = 0;
  for (std::int64_t i = 0; i < y.numel(); ++i) {
    zeros += y[i] == 0.f;
    sum += y[i];
  }
  // 100000 Bernoulli draws: the standard deviation of the dropped fraction is 0.0014.
  CHECK(zeros / 1e5 == Approx(0.3).margin(0.01));
  CHECK(sum / 1e5 == Approx(1.0).margin(0.02));

  SECTION("the same seed (or a restored rng state) gives the same mask; the next call another") {
    Dropout<E32> again(0.3, 7);
    Dropout<E32>::Cache c2;
    const auto& y2 = again.forward(x, c2);
    std::int64_t differ = 0;
    for (std::int64_t i = 0; i < y.numel(); ++i) differ += y[i] != y2[i];
    CHECK(differ == 0);

    const Rng::State saved = again.rng().state();
    Dropout<E32>::Cache c3, c4;
    const Tensor<float> y3 = again.forward(x, c3);
    again.rng().set_state(saved);
    const Tensor<float>& y4 = again.forward(x, c4);
    differ = 0;
    std::int64_t from_first = 0;
    for (std::int64_t i = 0; i < y.numel(); ++i) {
      differ += y3[i] != y4[i];
      from_first += y3[i] != y[i];
    }
    CHECK(differ == 0);
    CHECK(from_first > 0);
  }
  SECTION("eval mode is the identity and returns the input itself") {
    drop.set_mode(Mode::Eval);
    Dropout<E32>::Cache ce;
    CHECK(&drop.forward(x, ce) == &x);
    const Tensor<float> g({100, 1000}, 2.f);
    CHECK(&drop.backward(g, ce) == &g);
  }
  SECTION("p outside [0, 1) is an ArgumentError") {
    CHECK_THROWS_AS(Dropout<E32>(1.0, 0), ArgumentError);
    CHECK_THROWS_AS(Dropout<E32>(-0.1, 0), ArgumentError);
    CHECK_THROWS_AS(Dropout<E32>(std::nan(""), 0), ArgumentError);
    CHECK_NOTHROW(Dropout<E32>(0.0, 0));
  }
  SECTION("backward checks the shape of dy") {
    CHECK_THROWS_AS(drop.backward(Tensor<float>({1000, 100}, 0.f), c), ShapeError);
  }
}

TEST_CASE("Flatten", "[layers][flatten]") {
  Rng rng(41);
  SECTION("gradient (float64)") {
    Flatten<E64> flat;
    testing::check_gradients(flat, testing::random_tensor({2, 3, 2, 2}, rng), rng);
  }
  SECTION("shapes and order") {
    Flatten<E32> flat;
    Flatten<E32>::Cache c;
    Tensor<float> x({2, 3, 4, 5});
    for (std::int64_t i = 0; i < x.numel(); ++i) x[i] = static_cast<float>(i);
    const auto& y = flat.forward(x, c);
    REQUIRE(y.shape() == Shape{2, 60});
    for (std::int64_t i = 0; i < x.numel(); ++i) CHECK(y[i] == x[i]);
    const auto& dx = flat.backward(y, c);
    REQUIRE(dx.shape() == x.shape());
    CHECK_THROWS_AS(flat.backward(Tensor<float>({2, 59}), c), ShapeError);
    CHECK_THROWS_AS(flat.forward(Tensor<float>({7}), c), ShapeError);
  }
  SECTION("a rank-2 input passes through") {
    Flatten<E32> flat;
    Flatten<E32>::Cache c;
    const Tensor<float> x({3, 4}, 1.f);
    CHECK(&flat.forward(x, c) == &x);
  }
}
