// LARS and LAMB: first steps computed by hand from the papers' formulas, several steps against
// an independent element-by-element implementation, the bias/BatchNorm exclusion, and state.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "tessera/comm/local.hpp"
#include "tessera/optim/lamb.hpp"
#include "tessera/optim/lars.hpp"

using namespace tessera;
using E64 = CpuLocal64;

namespace {

struct TwoParams {
  Parameter<double, Cpu> weight{Shape{2}, ParamKind::Weight};
  Parameter<double, Cpu> bias{Shape{2}, ParamKind::Bias};
  NamedTensors<CpuLocal64> named() {
    NamedTensors<CpuLocal64> n;
    n.parameter("w", weight);
    n.parameter("b", bias);
    return n;
  }
  void set(std::vector<double> w, std::vector<double> gw, std::vector<double> b, std::vector<double> gb) {
    std::copy(w.begin(), w.end(), weight.value.data());
    std::copy(gw.begin(), gw.end(), weight.grad.data());
    std::copy(b.begin(), b.end(), bias.value.data());
    std::copy(gb.begin(), gb.end(), bias.grad.data());
  }
};

double norm(const std::vector<double>& x) {
  double s = 0;
  for (double v : x) s += v * v;
  return std::sqrt(s);
}

}  // namespace

TEST_CASE("Lars: first step by hand; biases get plain momentum SGD", "[optim]") {
  TwoParams m;
  m.set({3, 4}, {0.6, 0.8}, {1, 2}, {0.5, -0.5});
  Lars<E64> lars(m.named(), {.lr = 0.1, .momentum = 0.9, .weight_decay = 0, .eta = 0.001, .eps = 0});
  lars.step();
  // ||w|| = 5, ||g|| = 1: trust = 0.001 * 5 / 1 = 0.005; v = 0.1 * 0.005 * g.
  CHECK(m.weight.value.data()[0] == Approx(3 - 0.0005 * 0.6).epsilon(1e-15));
  CHECK(m.weight.value.data()[1] == Approx(4 - 0.0005 * 0.8).epsilon(1e-15));
  CHECK(lars.trust_ratios()[0] == Approx(0.005));
  // Bias: trust 1, no decay: b - lr * g.
  CHECK(m.bias.value.data()[0] == Approx(1 - 0.1 * 0.5).epsilon(1e-15));
  CHECK(lars.trust_ratios()[1] == 1.0);
}

TEST_CASE("Lars: several steps with weight decay equal the formula", "[optim]") {
  TwoParams m;
  m.set({0.3, -1.2}, {0.05, 0.2}, {0.1, 0.2}, {0.01, 0.02});
  const double lr = 0.5, mom = 0.9, wd = 1e-3, eta = 0.02, eps = 1e-9;
  Lars<E64> lars(m.named(), {.lr = lr, .momentum = mom, .weight_decay = wd, .eta = eta, .eps = eps});
  std::vector<double> w = {0.3, -1.2}, v = {0, 0};
  for (int step = 0; step < 4; ++step) {
    const std::vector<double> g = {0.05 * (step + 1), 0.2 - 0.03 * step};
    std::copy(g.begin(), g.end(), m.weight.grad.data());
    lars.step();
    const double trust = eta * norm(w) / (norm(g) + wd * norm(w) + eps);
    for (int k = 0; k < 2; ++k) {
      v[k] = mom * v[k] + lr * trust * (g[k] + wd * w[k]);
      w[k] -= v[k];
      CHECK(m.weight.value.data()[k] == Approx(w[k]).epsilon(1e-14));
    }
  }
}

TEST_CASE("Lars: bias and BatchNorm parameters get neither decay nor adaptation unless switched on", "[optim]") {
  for (bool adapt_all : {false, true}) {
    Parameter<double, Cpu> weight{Shape{2}, ParamKind::Weight}, bias{Shape{2}, ParamKind::Bias}, gamma{Shape{2}, ParamKind::Norm};
    NamedTensors<CpuLocal64> named;
    named.parameter("w", weight);
    named.parameter("b", bias);
    named.parameter("bn.weight", gamma);
    for (Parameter<double, Cpu>* p : {&weight, &bias, &gamma}) {
      p->value.data()[0] = 3, p->value.data()[1] = 4;      // ||x|| = 5
      p->grad.data()[0] = 0.6, p->grad.data()[1] = 0.8;    // ||g|| = 1
    }
    const double lr = 0.1, wd = 0.01, eta = 0.001;
    Lars<E64> lars(named, {.lr = lr, .momentum = 0.9, .weight_decay = wd, .eta = eta, .eps = 0,
                           .adapt_norm_and_bias = adapt_all});
    lars.step();
    // Adapted: trust = eta ||x|| / (||g|| + wd ||x||), update lr trust (g + wd x).
    const double trust = eta * 5 / (1 + wd * 5);
    const double adapted0 = 3 - lr * trust * (0.6 + wd * 3);
    const double plain0 = 3 - lr * 0.6;  // trust 1 and no decay: momentum SGD's first step
    CHECK(weight.value.data()[0] == Approx(adapted0).epsilon(1e-14));
    for (Parameter<double, Cpu>* p : {&bias, &gamma})
      CHECK(p->value.data()[0] == Approx(adapt_all ? adapted0 : plain0).epsilon(1e-14));
    CHECK(lars.trust_ratios()[1] == Approx(adapt_all ? trust : 1.0));
    CHECK(lars.trust_ratios()[2] == Approx(adapt_all ? trust : 1.0));
  }
}

TEST_CASE("Lamb: first step by hand; biases get Adam", "[optim]") {
  TwoParams m;
  m.set({3, 4}, {0.6, 0.8}, {1, 2}, {0.5, -0.5});
  Lamb<E64> lamb(m.named(), {.lr = 0.01, .eps = 0});
  lamb.step();
  // m_hat = g, v_hat = g^2: r = sign(g) = (1, 1), ||r|| = sqrt(2), trust = 5 / sqrt(2).
  const double step = 0.01 * 5 / std::sqrt(2.0);
  CHECK(m.weight.value.data()[0] == Approx(3 - step).epsilon(1e-14));
  CHECK(m.weight.value.data()[1] == Approx(4 - step).epsilon(1e-14));
  // Bias: Adam's first step moves each element by lr * sign(g).
  CHECK(m.bias.value.data()[0] == Approx(1 - 0.01).epsilon(1e-14));
  CHECK(m.bias.value.data()[1] == Approx(2 + 0.01).epsilon(1e-14));
}

TEST_CASE("Lamb: several steps with weight decay equal the formula; switch includes biases", "[optim]") {
  for (bool include_bias : {false, true}) {
    TwoParams m;
    m.set({0.3, -1.2}, {0, 0}, {0.1, 0.2}, {0, 0});
    const double lr = 0.02, b1 = 0.9, b2 = 0.99, eps = 1e-6, wd = 0.01;
    Lamb<E64> lamb(m.named(),
                   {.lr = lr, .beta1 = b1, .beta2 = b2, .eps = eps, .weight_decay = wd, .adapt_norm_and_bias = include_bias});
    std::vector<double> w = {0.3, -1.2}, b = {0.1, 0.2}, mw(2), vw(2), mb(2), vb(2);
    auto reference = [&](std::vector<double>& x, std::vector<double>& mm, std::vector<double>& vv,
                         const std::vector<double>& g, int t, bool adapt) {
      std::vector<double> r(2);
      for (int k = 0; k < 2; ++k) {
        mm[k] = b1 * mm[k] + (1 - b1) * g[k];
        vv[k] = b2 * vv[k] + (1 - b2) * g[k] * g[k];
        r[k] = (mm[k] / (1 - std::pow(b1, t))) / (std::sqrt(vv[k] / (1 - std::pow(b2, t))) + eps) + (adapt ? wd * x[k] : 0);
      }
      const double trust = adapt && norm(x) > 0 && norm(r) > 0 ? norm(x) / norm(r) : 1.0;
      for (int k = 0; k < 2; ++k) x[k] -= lr * trust * r[k];
    };
    for (int t = 1; t <= 4; ++t) {
      const std::vector<double> gw = {0.05 * t, 0.2 - 0.03 * t}, gb = {0.01 * t, -0.02};
      std::copy(gw.begin(), gw.end(), m.weight.grad.data());
      std::copy(gb.begin(), gb.end(), m.bias.grad.data());
      lamb.step();
      reference(w, mw, vw, gw, t, true);
      reference(b, mb, vb, gb, t, include_bias);
      for (int k = 0; k < 2; ++k) {
        CHECK(m.weight.value.data()[k] == Approx(w[k]).epsilon(1e-13));
        CHECK(m.bias.value.data()[k] == Approx(b[k]).epsilon(1e-13));
      }
    }
  }
}

TEST_CASE("Lars and Lamb: bad options are rejected, state is visited by name", "[optim]") {
  TwoParams m;
  CHECK_THROWS_AS(Lars<E64>(m.named(), {}), ArgumentError);  // lr is required
  CHECK_THROWS_AS(Lars<E64>(m.named(), {.lr = 0.1, .eta = 0}), ArgumentError);
  CHECK_THROWS_AS(Lamb<E64>(m.named(), {.lr = 0.1, .beta1 = 1.0}), ArgumentError);
  struct Names {
    std::vector<std::string> names;
    void buffer(const std::string& n, Tensor<double, Cpu>&) { names.push_back(n); }
    void integer(const std::string& n, std::int64_t&) { names.push_back(n); }
  } visitor;
  Lamb<E64> lamb(m.named(), {.lr = 0.1});
  lamb.visit_state(visitor);
  CHECK(visitor.names == std::vector<std::string>{"optim.exp_avg.w", "optim.exp_avg_sq.w", "optim.exp_avg.b",
                                                  "optim.exp_avg_sq.b", "optim.step"});
}
