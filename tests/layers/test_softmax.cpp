// Softmax and LogSoftmax layers, NLLLoss, and CrossEntropyLoss's ignore_index and log-probabilities:
// float64 central-difference checks, PyTorch reference data (tests/data/norm_act_loss.safetensors
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
#include "tessera/io/safetensors.hpp"
#include "tessera/layers/sequential.hpp"
#include "tessera/layers/softmax.hpp"
#include "tessera/losses/cross_entropy.hpp"
#include "tessera/losses/nll.hpp"

using namespace tessera;
using tessera::testing::T64;

static_assert(Layer<Softmax<CpuLocal>>);
static_assert(Layer<LogSoftmax<CpuLocal64>>);

namespace {

using E32 = Env<Cpu, LocalComm, float>;
using E64 = Env<Cpu, LocalComm, double>;

const SafetensorsFile& softmax_reference() {
  static const SafetensorsFile f =
      SafetensorsFile::load(std::string(TESSERA_REFERENCE_DATA_DIR) + "/norm_act_loss.safetensors");
  return f;
}

template <class S>
Tensor<S> softmax_load(const std::string& name) {
  return softmax_reference().tensor<double>(name).cast<S>();
}

std::vector<std::int64_t> softmax_labels(const std::string& name) { return testing::load_labels(softmax_reference(), name); }

using testing::fmt_g;

// The generator's tables, repeated: each case's configuration string must equal the file's.
struct SoftmaxCase {
  const char* name;
  const char* shape;
  int dim;
  double offset;
  std::string config() const {
    return std::string("shape=") + shape + " dim=" + std::to_string(dim) + " offset=" + fmt_g(offset);
  }
};
const SoftmaxCase kSoftmaxCases[] = {
    {"softmax_2d_last", "5x7", -1, 0.0},       {"softmax_3d_middle", "3x4x5", 1, 0.0},
    {"softmax_4d_first", "3x2x3x2", 0, 0.0},   {"softmax_1d", "9", 0, 0.0},
    {"softmax_large", "4x6", 1, 700.0},
};

struct NllCase {
  const char* name;
  std::int64_t n, classes;
  Reduction reduction;
  std::int64_t ignore_index, ignored;
  std::string config() const {
    return "N=" + std::to_string(n) + " C=" + std::to_string(classes) + " reduction=" + to_string(reduction) +
           " ignore_index=" + std::to_string(ignore_index) + " ignored=" + std::to_string(ignored);
  }
};
const NllCase kNllCases[] = {
    {"nll_mean", 7, 5, Reduction::Mean, -100, 0},
    {"nll_sum", 6, 4, Reduction::Sum, -100, 0},
    {"nll_mean_ignore", 9, 6, Reduction::Mean, -100, 3},
    {"nll_sum_ignore_index1", 8, 3, Reduction::Sum, 1, 0},
};

struct CeIgnoreCase {
  const char* name;
  std::int64_t n, classes;
  Reduction reduction;
  double smoothing;
  std::int64_t ignore_index, ignored;
  std::string config() const {
    return "N=" + std::to_string(n) + " C=" + std::to_string(classes) + " reduction=" + to_string(reduction) +
           " label_smoothing=" + fmt_g(smoothing) + " ignore_index=" + std::to_string(ignore_index) +
           " ignored=" + std::to_string(ignored);
  }
};
const CeIgnoreCase kCeIgnoreCases[] = {
    {"ce_ignore_mean", 7, 5, Reduction::Mean, 0.0, -100, 2},
    {"ce_ignore_sum_ls", 6, 4, Reduction::Sum, 0.2, -100, 3},
    {"ce_ignore_mean_ls_index2", 8, 5, Reduction::Mean, 0.1, 2, 0},
    {"ce_ignore_all", 3, 4, Reduction::Mean, 0.0, -100, 3},
};

template <class S, bool Log>
void run_softmax_reference(const SoftmaxCase& k) {
  using E = Env<Cpu, LocalComm, S>;
  const std::string n = std::string(Log ? "log_" : "") + k.name;
  INFO("case " << n << " (" << k.config() << ")");
  REQUIRE(softmax_reference().metadata().at(n) == k.config());
  detail::SoftmaxLayer<E, Log> layer(k.dim);
  typename detail::SoftmaxLayer<E, Log>::Cache c;
  const Tensor<S> x = softmax_load<S>(n + ".x");
  testing::expect_matches(softmax_reference(), layer.forward(x, c), n + ".y");
  testing::expect_matches(softmax_reference(), layer.backward(softmax_load<S>(n + ".g"), c), n + ".dx");
}

template <class S>
void run_nll_reference(const NllCase& k) {
  using E = Env<Cpu, LocalComm, S>;
  const std::string n = k.name;
  INFO("case " << n << " (" << k.config() << ")");
  REQUIRE(softmax_reference().metadata().at(n) == k.config());
  NLLLoss<E> loss(k.reduction, k.ignore_index);
  typename NLLLoss<E>::Cache c;
  const Tensor<S> logp = softmax_load<S>(n + ".log_probs");
  const S value = loss.forward(logp, softmax_labels(n + ".labels"), c);
  testing::expect_matches(softmax_reference(), Tensor<S>({1}, value), n + ".loss");
  testing::expect_matches(softmax_reference(), loss.backward(c), n + ".dlog_probs");
}

template <class S>
void run_ce_ignore_reference(const CeIgnoreCase& k) {
  using E = Env<Cpu, LocalComm, S>;
  const std::string n = k.name;
  INFO("case " << n << " (" << k.config() << ")");
  REQUIRE(softmax_reference().metadata().at(n) == k.config());
  CrossEntropyLoss<E> loss(k.reduction, k.smoothing, k.ignore_index);
  typename CrossEntropyLoss<E>::Cache c;
  const S value = loss.forward(softmax_load<S>(n + ".logits"), softmax_labels(n + ".labels"), c);
  if (k.ignored == k.n && k.reduction == Reduction::Mean) {
    CHECK(std::isnan(value));  // torch: the mean over no rows is 0 / 0
  } else {
    testing::expect_matches(softmax_reference(), Tensor<S>({1}, value), n + ".loss");
  }
  testing::expect_matches(softmax_reference(), c.log_probs, n + ".log_probs");
  testing::expect_matches(softmax_reference(), loss.backward(c), n + ".dlogits");
}

}  // namespace

TEST_CASE("Softmax and LogSoftmax gradients along every dimension (float64)", "[layers][softmax]") {
  Rng rng(61);
  const T64 x = testing::random_tensor({2, 3, 4}, rng, 2.0);
  for (int dim : {0, 1, 2, -1, -3}) {
    INFO("dim " << dim);
    Softmax<E64> softmax(dim);
    testing::check_gradients(softmax, x, rng);
    LogSoftmax<E64> log_softmax(dim);
    testing::check_gradients(log_softmax, x, rng);
  }
  Softmax<E64> vector(0);
  testing::check_gradients(vector, testing::random_tensor({7}, rng), rng);
}

TEST_CASE("Softmax and LogSoftmax match PyTorch (float64 and float32)", "[layers][softmax][reference]") {
  for (const auto& k : kSoftmaxCases) {
    run_softmax_reference<double, false>(k);
    run_softmax_reference<float, false>(k);
    run_softmax_reference<double, true>(k);
    run_softmax_reference<float, true>(k);
  }
}

TEST_CASE("Softmax by hand: rows sum to 1, large logits stay finite, NaN spreads over its row",
          "[layers][softmax]") {
  Softmax<E64> softmax(1);
  Softmax<E64>::Cache c;
  const T64 x = T64::from({2, 3}, {1000.0, 1000.0, 1000.0, 0.0, std::log(2.0), std::nan("")});
  const T64& y = softmax.forward(x, c);
  for (int j = 0; j < 3; ++j) CHECK(y.at(0, j) == Approx(1.0 / 3).epsilon(1e-15));
  for (int j = 0; j < 3; ++j) CHECK(std::isnan(y.at(1, j)));  // torch.softmax does the same
  LogSoftmax<E64> log_softmax(-1);
  LogSoftmax<E64>::Cache lc;
  const T64 z = T64::from({1, 2}, {0.0, std::log(3.0)});
  const T64& lp = log_softmax.forward(z, lc);
  CHECK(lp[0] == Approx(std::log(0.25)).epsilon(1e-15));
  CHECK(lp[1] == Approx(std::log(0.75)).epsilon(1e-15));
}

TEST_CASE("Softmax and LogSoftmax reject a dim out of range, naming the layer", "[layers][softmax][errors]") {
  Softmax<E64> softmax(2);
  Softmax<E64>::Cache c;
  CHECK_THROWS_WITH(softmax.forward(T64({3, 4}), c),
                    Catch::Contains("Softmax(dim=2)") && Catch::Contains("(3, 4)") && Catch::Contains("dim 2"));
  LogSoftmax<E64> log_softmax(-3);
  LogSoftmax<E64>::Cache lc;
  CHECK_THROWS_AS(log_softmax.forward(T64({3, 4}), lc), ShapeError);
  CHECK_THROWS_WITH(log_softmax.backward(T64({3, 4}), lc), Catch::Contains("before forward"));
  LogSoftmax<E64> ok(1);
  ok.forward(T64({3, 4}, 0.0), lc);
  CHECK_THROWS_WITH(ok.backward(T64({4, 3}), lc), Catch::Contains("LogSoftmax(dim=1)") && Catch::Contains("(4, 3)"));
}

TEST_CASE("LogSoftmax + NLLLoss equals CrossEntropyLoss, value and gradient", "[losses][nll]") {
  Rng rng(62);
  const T64 logits = testing::random_tensor({6, 5}, rng, 3.0);
  const std::vector<std::int64_t> labels = {3, -100, 4, 0, 1, -100};
  for (Reduction r : {Reduction::Mean, Reduction::Sum}) {
    INFO("reduction " << to_string(r));
    LogSoftmax<E64> log_softmax(1);
    LogSoftmax<E64>::Cache lc;
    NLLLoss<E64> nll(r);
    NLLLoss<E64>::Cache nc;
    const double two_step = nll.forward(log_softmax.forward(logits, lc), labels, nc);
    const T64 two_step_grad = log_softmax.backward(nll.backward(nc), lc);
    CrossEntropyLoss<E64> ce(r);
    CrossEntropyLoss<E64>::Cache cc;
    CHECK(ce.forward(logits, labels, cc) == Approx(two_step).epsilon(1e-14));
    CHECK(testing::relative_error(ce.backward(cc), two_step_grad) < 1e-14);
    CHECK(testing::relative_error(cc.log_probs, lc.y) == 0.0);
  }
}

TEST_CASE("NLLLoss and CrossEntropyLoss with ignore_index: gradients by central differences (float64)",
          "[losses][nll]") {
  Rng rng(63);
  const std::vector<std::int64_t> labels = {2, -100, 0, 4, -100, 1};
  const T64 logits = testing::random_tensor({6, 5}, rng, 2.0);
  for (Reduction r : {Reduction::Mean, Reduction::Sum}) {
    INFO("reduction " << to_string(r));
    NLLLoss<E64> nll(r);
    NLLLoss<E64>::Cache nc;
    nll.forward(logits, labels, nc);  // any (N, C) scores work for the gradient check
    testing::check_loss_gradient(logits, nll.backward(nc), [&](const T64& z) {
      NLLLoss<E64>::Cache fresh;
      return nll.forward(z, labels, fresh);
    });
    for (double smoothing : {0.0, 0.3}) {
      INFO("label_smoothing " << smoothing);
      CrossEntropyLoss<E64> ce(r, smoothing);
      CrossEntropyLoss<E64>::Cache cc;
      ce.forward(logits, labels, cc);
      testing::check_loss_gradient(logits, ce.backward(cc), [&](const T64& z) {
        CrossEntropyLoss<E64>::Cache fresh;
        return ce.forward(z, labels, fresh);
      });
    }
  }
}

TEST_CASE("NLLLoss matches PyTorch (float64 and float32)", "[losses][nll][reference]") {
  for (const auto& k : kNllCases) {
    run_nll_reference<double>(k);
    run_nll_reference<float>(k);
  }
}

TEST_CASE("CrossEntropyLoss with ignore_index and its log-probabilities match PyTorch (float64 and float32)",
          "[losses][cross_entropy][reference]") {
  for (const auto& k : kCeIgnoreCases) {
    run_ce_ignore_reference<double>(k);
    run_ce_ignore_reference<float>(k);
  }
}

TEST_CASE("NLLLoss rejects bad shapes and labels, naming the loss and the label", "[losses][nll][errors]") {
  NLLLoss<E64> nll;
  NLLLoss<E64>::Cache c;
  const std::vector<std::int64_t> two = {0, 1};
  CHECK_THROWS_WITH(nll.forward(T64({2, 3, 4}), two, c),
                    Catch::Contains("NLLLoss(reduction=mean, ignore_index=-100)") && Catch::Contains("(2, 3, 4)"));
  CHECK_THROWS_AS(nll.forward(T64({3, 3}), two, c), ShapeError);
  const std::vector<std::int64_t> bad = {0, 3};
  CHECK_THROWS_WITH(nll.forward(T64({2, 3}), bad, c), Catch::Contains("labels[1] = 3"));
  const std::vector<std::int64_t> ignored_elsewhere = {0, -100};
  NLLLoss<E64> other(Reduction::Mean, 2);
  CHECK_THROWS_AS(other.forward(T64({2, 3}), ignored_elsewhere, c), ArgumentError);
  NLLLoss<E64>::Cache fresh;
  CHECK_THROWS_WITH(nll.backward(fresh), Catch::Contains("before forward"));
}
