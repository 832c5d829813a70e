// Mode::Inference: a Conv2d and the eval BatchNorm2d after it (with the ReLU and the residual add
// that follow) run as one convolution whose blocks finish their output in cache (ConvEpilogue,
// kernels/conv2d_geometry.hpp). Checked against the same layers run one by one in Mode::Eval on
// every forward path of the CPU convolution (bands, whole-sample groups, the 1x1 direct path, the
// one-block team, both Winograd layouts), at 1 and 2 threads, in float64 and float32; then the
// composites (Sequential, Residual, ResNet): the same outputs, backward refused with a message,
// and the same cache usable for training again afterwards. Conv2d's Winograd filter, transformed
// once in Mode::Inference, is checked to follow weights changed behind its back.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "tessera/comm/local.hpp"
#include "tessera/core/env.hpp"
#include "tessera/layers/activation.hpp"
#include "tessera/layers/batch_norm.hpp"
#include "tessera/layers/conv2d.hpp"
#include "tessera/layers/residual.hpp"
#include "tessera/layers/sequential.hpp"
#include "tessera/models/resnet.hpp"
#include "tessera/testing/gradcheck.hpp"

namespace {

using namespace tessera;
using testing::random_tensor;
using E32 = Env<Cpu, LocalComm, float>;
using E64 = Env<Cpu, LocalComm, double>;

struct Threads {  // restored even when a REQUIRE throws
  int before = Cpu::num_threads();
  explicit Threads(int n) { Cpu::set_num_threads(n); }
  ~Threads() { Cpu::set_num_threads(before); }
};

// Running statistics and affine parameters away from their defaults, so that every term of the
// epilogue shows.
template <class E>
void randomize(BatchNorm2d<E>& bn, Rng& rng) {
  for (std::int64_t i = 0; i < bn.num_features(); ++i) {
    bn.weight().value[i] = static_cast<typename E::Scalar>(rng.uniform(0.5, 1.5));
    bn.bias().value[i] = static_cast<typename E::Scalar>(rng.uniform(-0.5, 0.5));
    bn.running_mean()[i] = static_cast<typename E::Scalar>(rng.uniform(-0.3, 0.3));
    bn.running_var()[i] = static_cast<typename E::Scalar>(rng.uniform(0.5, 2.0));
  }
}

template <class S>
double max_relative_difference(const Tensor<S>& a, const Tensor<S>& b) {
  REQUIRE(a.shape() == b.shape());
  double worst = 0, scale = 1e-30;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    worst = std::max(worst, std::abs(double(a[i]) - double(b[i])));
    scale = std::max(scale, std::abs(double(b[i])));
  }
  return worst / scale;
}

struct EpilogueCase {
  const char* path;
  std::int64_t n, c, k, hw, kernel, stride, pad;
  bool bias;
  ConvAlgorithm algorithm;
  std::int64_t block_columns;  // 0: the default blocking
};

// conv.forward_epilogue against conv.forward -> bn.forward (Eval) -> + addend -> ReLU.
template <class E>
void check_epilogue(const EpilogueCase& cc, bool with_addend, bool relu, double tolerance) {
  using S = typename E::Scalar;
  Rng rng(7);
  Conv2d<E> conv(Conv2dOptions{cc.c, cc.k, cc.kernel, cc.kernel, cc.stride, cc.stride, cc.pad, cc.pad, 1, 1, 1,
                               cc.bias},
                 rng);
  conv.set_algorithm(cc.algorithm);
  conv.set_block_columns(cc.block_columns);
  BatchNorm2d<E> bn(cc.k);
  randomize(bn, rng);
  const Tensor<S> x = random_tensor({cc.n, cc.c, cc.hw, cc.hw}, rng).template cast<S>();

  bn.set_mode(Mode::Eval);
  typename Conv2d<E>::Cache conv_cache;
  typename BatchNorm2d<E>::Cache bn_cache;
  Tensor<S> want = bn.forward(conv.forward(x, conv_cache), bn_cache);
  const Tensor<S> addend = random_tensor(want.shape(), rng).template cast<S>();
  for (std::int64_t i = 0; i < want.numel(); ++i) {
    S v = want[i];
    if (with_addend) v = v + addend[i];
    if (relu) v = v < S(0) ? S(0) : v;
    want[i] = v;
  }

  bn.set_mode(Mode::Inference);
  typename Conv2d<E>::Cache fused_cache;
  typename BatchNorm2d<E>::Cache fused_bn_cache;
  Tensor<S> y;
  auto e = bn.inference_epilogue(fused_bn_cache, conv.out_channels());
  e.relu = relu;
  const Tensor<S>& got = conv.forward_epilogue(x, fused_cache, y, e, with_addend ? &addend : nullptr);
  CHECK(&got == &y);
  CHECK(max_relative_difference(got, want) <= tolerance);
  // The fused BatchNorm refuses backward on its cache.
  CHECK_THROWS_WITH(bn.backward(want, fused_bn_cache), Catch::Contains("Mode::Inference"));
}

TEST_CASE("Conv2d's inference epilogue equals the eval BatchNorm, add and ReLU on every forward path",
          "[layers][conv][inference]") {
  const EpilogueCase cases[] = {
      {"3x3 bands", 2, 8, 16, 20, 3, 1, 1, false, ConvAlgorithm::Im2col, 64},
      {"3x3 whole-sample groups, conv bias", 6, 16, 24, 5, 3, 1, 1, true, ConvAlgorithm::Im2col, 0},
      {"1x1 direct", 3, 32, 16, 9, 1, 1, 0, false, ConvAlgorithm::Im2col, 0},
      {"1x1 stride 2", 2, 16, 32, 10, 1, 2, 0, true, ConvAlgorithm::Im2col, 0},
      {"one block split over the team", 1, 64, 96, 14, 3, 1, 1, false, ConvAlgorithm::Im2col, 0},
      {"1x1 direct, one block split over the team, conv bias", 1, 256, 128, 14, 1, 1, 0, true, ConvAlgorithm::Im2col,
       0},
      {"7x7 whole-sample groups", 4, 64, 64, 7, 3, 1, 1, false, ConvAlgorithm::Im2col, 0},
      {"Winograd tile vectors", 2, 8, 12, 12, 3, 1, 1, true, ConvAlgorithm::Winograd, 0},
      {"Winograd channel blocks, odd size", 2, 32, 32, 13, 3, 1, 1, false, ConvAlgorithm::Winograd, 0},
  };
  for (const auto& cc : cases)
    for (int threads : {1, 2})
      for (bool with_addend : {false, true})
        for (bool relu : {false, true}) {
          DYNAMIC_SECTION(cc.path << ", " << threads << " thread(s)" << (with_addend ? ", addend" : "")
                                  << (relu ? ", ReLU" : "")) {
            Threads t(threads);
            check_epilogue<E64>(cc, with_addend, relu, 1e-13);
            check_epilogue<E32>(cc, with_addend, relu, 2e-6);
          }
        }
}

// A bfloat16 Env's convolution on oneDNN (kernels/cpu/onednn_conv.hpp) takes the epilogue as one
// pass after the primitive; the reference runs the same primitive unfused.
TEST_CASE("Conv2d's inference epilogue on oneDNN's bfloat16 convolution", "[layers][conv][inference][onednn]") {
  if (!onednn_built() || !cpu_bf16_active()) {
    WARN("skipped: " << cpu_bf16_conv_kernel());
    return;
  }
  set_cpu_bf16_library(Bf16Library::OneDnn);
  const EpilogueCase cases[] = {
      {"3x3, conv bias", 2, 16, 24, 9, 3, 1, 1, true, ConvAlgorithm::Auto, 0},
      {"3x3 stride 2", 3, 8, 16, 12, 3, 2, 1, false, ConvAlgorithm::Auto, 0},
  };
  for (const auto& cc : cases)
    for (bool with_addend : {false, true}) {
      DYNAMIC_SECTION(cc.path << (with_addend ? ", addend" : "")) {
        check_epilogue<CpuLocalBf16>(cc, with_addend, /*relu=*/true, 2e-6);
      }
    }
  set_cpu_bf16_library(Bf16Library::Auto);
}

// y from a copy of conv in Mode::Eval: the convolution of conv's current weights, computed afresh.
template <class E>
Tensor<typename E::Scalar> eval_output(const Conv2d<E>& conv, const Tensor<typename E::Scalar>& x) {
  Conv2d<E> fresh = conv;
  fresh.set_mode(Mode::Eval);
  typename Conv2d<E>::Cache cache;
  return fresh.forward(x, cache);
}

template <class E>
void check_kept_winograd_filter(std::int64_t c, std::int64_t k, std::int64_t hw) {
  using S = typename E::Scalar;
  Rng rng(11);
  Conv2d<E> conv(c, k, 3, rng, 1, 1, true);
  conv.set_algorithm(ConvAlgorithm::Winograd);
  const Tensor<S> x = random_tensor({2, c, hw, hw}, rng).template cast<S>();
  const Tensor<S> want = eval_output(conv, x);
  Tensor<S>& w = conv.weight().value;  // held since before the mode, as a caller may
  conv.set_mode(Mode::Inference);
  typename Conv2d<E>::Cache cache;
  // The filter transformed on the first forward, kept for the second: the eval output, bit for bit.
  CHECK(max_relative_difference(conv.forward(x, cache), want) == 0);
  const Tensor<S> second = conv.forward(x, cache);
  CHECK(max_relative_difference(second, want) == 0);
  // A weight changed in place, still in Mode::Inference: the output follows it. One near the end:
  // a large layer's fingerprint is summed in shares over the team, this one in the last share.
  w[w.numel() - 5] = w[w.numel() - 5] + S(0.25);
  const Tensor<S> changed = eval_output(conv, x);
  CHECK(max_relative_difference(changed, want) > 1e-3);
  CHECK(max_relative_difference(conv.forward(x, cache), changed) == 0);
  // Two different weights exchanged (the same values, in other places): it follows that too.
  REQUIRE(w[0] != w[c * 9]);
  std::swap(w[0], w[c * 9]);
  const Tensor<S> swapped = eval_output(conv, x);
  CHECK(max_relative_difference(swapped, changed) > 1e-3);
  CHECK(max_relative_difference(conv.forward(x, cache), swapped) == 0);
  // The fused epilogue path takes the same filter.
  BatchNorm2d<E> bn(k);
  randomize(bn, rng);
  bn.set_mode(Mode::Inference);
  typename BatchNorm2d<E>::Cache bn_cache;
  Tensor<S> fused;
  conv.forward_epilogue(x, cache, fused, bn.inference_epilogue(bn_cache, k));
  bn.set_mode(Mode::Eval);
  typename BatchNorm2d<E>::Cache eval_bn_cache;
  CHECK(max_relative_difference(fused, bn.forward(swapped, eval_bn_cache)) <= 1e-6);
}

TEST_CASE("Conv2d in Mode::Inference transforms its Winograd filter once, and again when the weights change",
          "[layers][conv][inference]") {
  for (int threads : {1, 2}) {
    Threads t(threads);
    DYNAMIC_SECTION("tile vectors, " << threads << " thread(s)") {
      check_kept_winograd_filter<E64>(8, 12, 12);
      check_kept_winograd_filter<E32>(8, 12, 12);
    }
    DYNAMIC_SECTION("channel blocks, " << threads << " thread(s)") {
      check_kept_winograd_filter<E64>(32, 32, 13);
      check_kept_winograd_filter<E32>(32, 32, 13);
    }
    DYNAMIC_SECTION("36,864 weights, a fingerprint in shares, " << threads << " thread(s)") {
      check_kept_winograd_filter<E64>(64, 64, 6);
      check_kept_winograd_filter<E32>(64, 64, 6);
    }
  }
}

TEST_CASE("Sequential in Mode::Inference fuses Conv2d-BatchNorm2d(-ReLU) and refuses backward",
          "[layers][inference]") {
  using Net = Sequential<Conv2d<E64>, BatchNorm2d<E64>, ReLU<E64>, Conv2d<E64>, BatchNorm2d<E64>>;
  Rng rng(3);
  Net net{Conv2d<E64>(3, 8, 3, rng, 1, 1, false), BatchNorm2d<E64>(8), ReLU<E64>(), Conv2d<E64>(8, 6, 1, rng),
          BatchNorm2d<E64>(6)};
  randomize(net.get<1>(), rng);
  randomize(net.get<4>(), rng);
  const Tensor<double> x = random_tensor({3, 3, 10, 10}, rng);

  Net::Cache cache;
  net.set_mode(Mode::Train);  // the cache first serves a training step, then inference, then training
  net.forward(x, cache);
  net.set_mode(Mode::Eval);
  Net::Cache eval_cache;
  const Tensor<double> want = net.forward(x, eval_cache);
  net.set_mode(Mode::Inference);
  CHECK(max_relative_difference(net.forward(x, cache), want) <= 1e-14);
  // Pipeline units that split a pair: the BatchNorm at the start of a range runs on its own.
  const Tensor<double> head = net.forward_units(x, cache, 0, 1);
  CHECK(max_relative_difference(net.forward_units(head, cache, 1, 5), want) <= 1e-14);
  const Tensor<double> dy(want.shape(), 1.0);
  CHECK_THROWS_WITH(net.backward(dy, cache), Catch::Contains("Mode::Inference"));
  CHECK_THROWS_WITH(net.backward_units(dy, cache, 0, 5), Catch::Contains("Mode::Inference"));

  // Mode changed after an inference forward: the fused BatchNorm's cache still refuses.
  net.forward(x, cache);
  net.set_mode(Mode::Eval);
  CHECK_THROWS_WITH(net.backward(dy, cache), Catch::Contains("Mode::Inference"));

  // Back to training on the same cache: the same gradients as on a fresh one.
  net.set_mode(Mode::Train);
  const Tensor<double> y_train = net.forward(x, cache);
  const Tensor<double> dx = net.backward(dy, cache);
  Net::Cache fresh;
  CHECK(max_relative_difference(net.forward(x, fresh), y_train) == 0);
  CHECK(max_relative_difference(net.backward(dy, fresh), dx) == 0);
}

TEST_CASE("ResNets in Mode::Inference give their eval outputs", "[models][inference]") {
  SECTION("CIFAR ResNet-8, float64: identity and projection shortcuts") {
    auto net = cifar_resnet<E64>(8, {.in_channels = 2, .num_classes = 5, .seed = 4});
    Rng rng(5);
    const Tensor<double> x = random_tensor({3, 2, 12, 12}, rng);
    decltype(net)::Cache cache;
    for (int step = 0; step < 2; ++step) net.forward(x, cache);  // running statistics away from 0 and 1
    net.set_mode(Mode::Eval);
    const Tensor<double> want = net.forward(x, cache);
    net.set_mode(Mode::Inference);
    CHECK(max_relative_difference(net.forward(x, cache), want) <= 1e-13);
    const Tensor<double> dy(want.shape(), 1.0);
    CHECK_THROWS_WITH(net.backward(dy, cache), Catch::Contains("Mode::Inference"));
    // A block on its own: Residual refuses too.
    auto& block = net.blocks()[1];
    decltype(net)::BlockType::Cache block_cache;
    const Tensor<double> h = random_tensor({3, 16, 12, 12}, rng);
    const Tensor<double> out = block.forward(h, block_cache);
    CHECK_THROWS_WITH(block.backward(out, block_cache), Catch::Contains("Mode::Inference"));
  }
  SECTION("ResNet-50 bottlenecks, float32, 2 threads") {
    Threads t(2);
    auto net = resnet50<E32>({.num_classes = 10, .seed = 2});
    Rng rng(6);
    const Tensor<float> x = random_tensor({2, 3, 64, 64}, rng).cast<float>();
    decltype(net)::Cache cache;
    net.forward(x, cache);
    net.set_mode(Mode::Eval);
    const Tensor<float> want = net.forward(x, cache);
    net.set_mode(Mode::Inference);
    CHECK(max_relative_difference(net.forward(x, cache), want) <= 1e-5);
    // A steady inference forward allocates nothing.
    const auto before = Cpu::allocator().stats();
    net.forward(x, cache);
    const auto after = Cpu::allocator().stats();
    CHECK(after.system_allocations == before.system_allocations);
  }
}

}  // namespace
