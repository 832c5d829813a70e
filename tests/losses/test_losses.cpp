// CrossEntropyLoss (with and without label smoothing), count_correct and MseLoss: central-difference
// checks of d loss / d input in float64, PyTorch reference data (tests/data/norm_act_loss.safetensors
// from tools/reference/gen_norm_act_loss.py) in float64 and float32, stability, errors.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "support/gradcheck.hpp"
#include "support/reference.hpp"
#include "tessera/comm/local.hpp"
#include "tessera/core/env.hpp"
#include "tessera/losses/cross_entropy.hpp"
#include "tessera/losses/mse.hpp"
#include "tessera/io/safetensors.hpp"

using namespace tessera;
using tessera::testing::T64;

namespace {

using E32 = Env<Cpu, LocalComm, float>;
using E64 = Env<Cpu, LocalComm, double>;

const SafetensorsFile& losses_reference() {
  static const SafetensorsFile f =
      SafetensorsFile::load(std::string(TESSERA_REFERENCE_DATA_DIR) + "/norm_act_loss.safetensors");
  return f;
}

template <class S>
void losses_matches(const Tensor<S>& got, const std::string& name) {
  testing::expect_matches(losses_reference(), got, name);
}

template <class S>
Tensor<S> losses_load(const std::string& name) {
  return losses_reference().tensor<double>(name).cast<S>();
}

std::vector<std::int64_t> losses_labels(const std::string& name) { return testing::load_labels(losses_reference(), name); }

using testing::fmt_g;

struct CeCase {
  const char* name;
  std::int64_t n, classes;
  Reduction reduction;
  double smoothing, offset;
  std::string config() const {
    return "N=" + std::to_string(n) + " C=" + std::to_string(classes) + " reduction=" + to_string(reduction) +
           " label_smoothing=" + fmt_g(smoothing) + " offset=" + fmt_g(offset);
  }
};

const CeCase kCeCases[] = {
    {"ce_mean", 7, 5, Reduction::Mean, 0.0, 0.0},
    {"ce_sum", 7, 5, Reduction::Sum, 0.0, 0.0},
    {"ce_mean_ls", 7, 5, Reduction::Mean, 0.1, 0.0},
    {"ce_sum_ls", 6, 11, Reduction::Sum, 0.25, 0.0},
    {"ce_mean_large_logits", 4, 6, Reduction::Mean, 0.1, 800.0},
};

struct MseCase {
  const char* name;
  const char* shape;
  Reduction reduction;
};

const MseCase kMseCases[] = {
    {"mse_mean", "3x4x5", Reduction::Mean},
    {"mse_sum", "6x7", Reduction::Sum},
};

template <class S>
void run_ce_reference(const CeCase& k) {
  using E = Env<Cpu, LocalComm, S>;
  const std::string n = k.name;
  INFO("case " << n << " (" << k.config() << ")");
  REQUIRE(losses_reference().metadata().at(n) == k.config());
  CrossEntropyLoss<E> loss(k.reduction, k.smoothing);
  typename CrossEntropyLoss<E>::Cache c;
  const Tensor<S> logits = losses_load<S>(n + ".logits");
  const std::vector<std::int64_t> labels = losses_labels(n + ".labels");
  REQUIRE(logits.shape() == Shape{k.n, k.classes});
  const S value = loss.forward(logits, labels, c);
  losses_matches(Tensor<S>({1}, value), n + ".loss");
  losses_matches(loss.backward(c), n + ".dlogits");
}

template <class S>
void run_mse_reference(const MseCase& k) {
  using E = Env<Cpu, LocalComm, S>;
  const std::string n = k.name;
  INFO("case " << n);
  REQUIRE(losses_reference().metadata().at(n) == std::string("shape=") + k.shape + " reduction=" + to_string(k.reduction));
  MseLoss<E> loss(k.reduction);
  typename MseLoss<E>::Cache c;
  const S value = loss.forward(losses_load<S>(n + ".y"), losses_load<S>(n + ".target"), c);
  losses_matches(Tensor<S>({1}, value), n + ".loss");
  losses_matches(loss.backward(c), n + ".dy");
}

std::size_t losses_system_allocations() { return Cpu::allocator().stats().system_allocations; }

}  // namespace

TEST_CASE("CrossEntropyLoss gradient by central differences (float64)", "[losses][cross_entropy]") {
  Rng rng(51);
  const std::vector<std::int64_t> labels = {3, 0, 4, 4, 1, 2};
  const T64 logits = testing::random_tensor({6, 5}, rng, 2.0);
  for (Reduction r : {Reduction::Mean, Reduction::Sum}) {
    for (double smoothing : {0.0, 0.1, 1.0}) {
      INFO("reduction " << to_string(r) << ", label_smoothing " << smoothing);
      CrossEntropyLoss<E64> loss(r, smoothing);
      CrossEntropyLoss<E64>::Cache c;
      loss.forward(logits, labels, c);
      const T64 analytic = loss.backward(c);
      testing::check_loss_gradient(logits, analytic, [&](const T64& z) {
        CrossEntropyLoss<E64>::Cache fresh;
        return loss.forward(z, labels, fresh);
      });
    }
  }
}

TEST_CASE("CrossEntropyLoss by hand: uniform logits, probabilities, Mean vs Sum", "[losses][cross_entropy]") {
  const std::vector<std::int64_t> labels = {1, 0};
  const T64 zeros({2, 4}, 0.0);
  CrossEntropyLoss<E64> mean;
  CrossEntropyLoss<E64>::Cache c;
  CHECK(mean.forward(zeros, labels, c) == Approx(std::log(4.0)).epsilon(1e-15));
  for (std::int64_t i = 0; i < 8; ++i) CHECK(c.log_probs[i] == Approx(std::log(0.25)).epsilon(1e-15));
  const T64& g = mean.backward(c);
  CHECK(g.at(0, 1) == Approx((0.25 - 1.0) / 2).epsilon(1e-15));
  CHECK(g.at(0, 0) == Approx(0.25 / 2).epsilon(1e-15));
  CrossEntropyLoss<E64> sum(Reduction::Sum);
  CrossEntropyLoss<E64>::Cache cs;
  CHECK(sum.forward(zeros, labels, cs) == Approx(2 * std::log(4.0)).epsilon(1e-15));
  // Smoothing eps = 1 makes the target uniform: for uniform logits the loss is still log C, and
  // the gradient vanishes.
  CrossEntropyLoss<E64> smooth(Reduction::Mean, 1.0);
  CrossEntropyLoss<E64>::Cache cl;
  CHECK(smooth.forward(zeros, labels, cl) == Approx(std::log(4.0)).epsilon(1e-15));
  for (double v : smooth.backward(cl)) CHECK(std::abs(v) < 1e-16);
}

TEST_CASE("CrossEntropyLoss matches PyTorch (float64)", "[losses][cross_entropy][reference]") {
  for (const auto& k : kCeCases) run_ce_reference<double>(k);
}

TEST_CASE("CrossEntropyLoss matches PyTorch (float32)", "[losses][cross_entropy][reference]") {
  for (const auto& k : kCeCases) run_ce_reference<float>(k);
}

TEST_CASE("CrossEntropyLoss is stable for huge logits in float32", "[losses][cross_entropy]") {
  // exp(1e4) overflows float; the max-subtracted log-sum-exp must not.
  const auto logits = Tensor<float>::from({2, 3}, {1e4f, 1e4f - 2.f, -1e4f, -5e3f, -5e3f, -5e3f});
  const std::vector<std::int64_t> labels = {1, 2};
  CrossEntropyLoss<E32> loss;
  CrossEntropyLoss<E32>::Cache c;
  const float value = loss.forward(logits, labels, c);
  const double row0 = 2.0 + std::log(1.0 + std::exp(-2.0));  // -log softmax at the second logit
  const double row1 = std::log(3.0);
  CHECK(value == Approx((row0 + row1) / 2).epsilon(1e-6));
  for (float v : loss.backward(c)) CHECK(std::isfinite(v));
}

TEST_CASE("CrossEntropyLoss rejects bad labels and shapes", "[losses][cross_entropy][errors]") {
  CrossEntropyLoss<E32> loss;
  CrossEntropyLoss<E32>::Cache c;
  const Tensor<float> logits({3, 4}, 0.f);
  const std::vector<std::int64_t> out_of_range = {0, 3, 7};
  CHECK_THROWS_AS(loss.forward(logits, out_of_range, c), ArgumentError);
  CHECK_THROWS_WITH(loss.forward(logits, out_of_range, c),
                    Catch::Contains("labels[2] = 7") && Catch::Contains("[0, 4)"));
  const std::vector<std::int64_t> negative = {0, -1, 2};
  CHECK_THROWS_WITH(loss.forward(logits, negative, c), Catch::Contains("labels[1] = -1"));
  const std::vector<std::int64_t> too_few = {0, 1};
  CHECK_THROWS_AS(loss.forward(logits, too_few, c), ShapeError);
  const std::vector<std::int64_t> ok = {0, 1, 2};
  CHECK_THROWS_AS(loss.forward(Tensor<float>({3, 4, 1}, 0.f), ok, c), ShapeError);
  CHECK_THROWS_AS(loss.forward(Tensor<float>({3, 0}, 0.f), ok, c), ShapeError);
  CHECK_THROWS_AS(CrossEntropyLoss<E32>(Reduction::Mean, -0.1), ArgumentError);
  CHECK_THROWS_AS(CrossEntropyLoss<E32>(Reduction::Mean, 1.5), ArgumentError);
  CHECK_NOTHROW(loss.forward(logits, ok, c));
}

TEST_CASE("CrossEntropyLoss steady state allocates nothing", "[losses][cross_entropy]") {
  Rng rng(3);
  const Tensor<float> logits = testing::random_tensor({32, 10}, rng).cast<float>();
  std::vector<std::int64_t> labels(32);
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int64_t>(i % 10);
  CrossEntropyLoss<E32> loss(Reduction::Mean, 0.1);
  CrossEntropyLoss<E32>::Cache c;
  loss.forward(logits, labels, c);
  loss.backward(c);
  const auto before = losses_system_allocations();
  const std::int64_t* label_storage = c.labels.data();
  loss.forward(logits, labels, c);
  loss.backward(c);
  CHECK(losses_system_allocations() == before);
  CHECK(c.labels.data() == label_storage);  // the labels' buffer is reused, not reallocated
}

TEST_CASE("count_correct counts top-1 hits, first maximum on ties", "[losses][metrics]") {
  const auto logits = Tensor<float>::from({4, 3}, {0.1f, 0.9f, 0.0f,    // argmax 1
                                                   2.0f, 2.0f, 1.0f,    // tie: argmax 0
                                                   -1.f, -3.f, -0.5f,   // argmax 2
                                                   5.0f, 4.0f, 3.0f});  // argmax 0
  const std::vector<std::int64_t> labels = {1, 1, 2, 2};
  CHECK(count_correct(logits, labels) == 2);
  const std::vector<std::int64_t> all = {1, 0, 2, 0};
  CHECK(count_correct(logits, all) == 4);
  const std::vector<std::int64_t> short_labels = {1};
  CHECK_THROWS_AS(count_correct(logits, short_labels), ShapeError);
}

TEST_CASE("MseLoss gradient by central differences (float64)", "[losses][mse]") {
  Rng rng(61);
  const T64 y = testing::random_tensor({3, 2, 4}, rng);
  const T64 target = testing::random_tensor({3, 2, 4}, rng);
  for (Reduction r : {Reduction::Mean, Reduction::Sum}) {
    INFO("reduction " << to_string(r));
    MseLoss<E64> loss(r);
    MseLoss<E64>::Cache c;
    loss.forward(y, target, c);
    const T64 analytic = loss.backward(c);
    testing::check_loss_gradient(y, analytic, [&](const T64& z) {
      MseLoss<E64>::Cache fresh;
      return loss.forward(z, target, fresh);
    });
  }
}

TEST_CASE("MseLoss by hand and errors", "[losses][mse]") {
  const auto y = Tensor<double>::from({2, 2}, {1, 2, 3, 4});
  const auto t = Tensor<double>::from({2, 2}, {1, 0, 3, 7});
  MseLoss<E64> mean;
  MseLoss<E64>::Cache c;
  CHECK(mean.forward(y, t, c) == Approx((4.0 + 9.0) / 4).epsilon(1e-15));
  const T64& g = mean.backward(c);
  CHECK(g[1] == Approx(2.0 * 2 / 4));
  CHECK(g[3] == Approx(2.0 * -3 / 4));
  MseLoss<E64> sum(Reduction::Sum);
  CHECK(sum.forward(y, t, c) == Approx(13.0).epsilon(1e-15));
  CHECK_THROWS_AS(mean.forward(y, Tensor<double>({4}, 0.0), c), ShapeError);
  CHECK_THROWS_WITH(mean.forward(y, Tensor<double>({2, 3}, 0.0), c),
                    Catch::Contains("(2, 2)") && Catch::Contains("(2, 3)"));
  // No elements: the mean is NaN and the sum 0, as torch.nn.MSELoss gives.
  const Tensor<double> none({0, 2});
  CHECK(std::isnan(mean.forward(none, none, c)));
  CHECK(mean.backward(c).numel() == 0);
  CHECK(sum.forward(none, none, c) == 0.0);
}

TEST_CASE("MseLoss matches PyTorch (float64 and float32)", "[losses][mse][reference]") {
  for (const auto& k : kMseCases) {
    run_mse_reference<double>(k);
    run_mse_reference<float>(k);
  }
}
