// Tensor parallelism over ThreadComm, 2 and 4 ranks: ColumnParallelLinear (with and without
// gathering the output), RowParallelLinear (split or already-parallel input) and the
// tensor-parallel MLP block equal the dense layers built from the same seed, in forward (y),
// backward (dL/dx) and in every parameter gradient (each rank's slice of the dense gradient).
#include <catch2/catch.hpp>

#include "tessera/comm/local.hpp"
#include "tessera/comm/threads.hpp"
#include "tessera/parallel/tensor_parallel.hpp"

using namespace tessera;
using E = CpuLocal64;
using T = Tensor<double, Cpu>;

namespace {
T random_tensor(Shape shape, std::uint64_t seed) {
  T t(shape);
  Rng rng(seed);
  for (std::int64_t k = 0; k < t.numel(); ++k) t.data()[k] = rng.normal();
  return t;
}
double max_diff(const double* a, const double* b, std::int64_t n) {
  double worst = 0;
  for (std::int64_t k = 0; k < n; ++k) worst = std::max(worst, std::abs(a[k] - b[k]));
  return worst;
}
// Columns [first, first + w) of an (rows, cols) matrix.
std::vector<double> columns(const T& m, std::int64_t first, std::int64_t w) {
  std::vector<double> out;
  for (std::int64_t i = 0; i < m.dim(0); ++i)
    for (std::int64_t j = first; j < first + w; ++j) out.push_back(m.data()[i * m.dim(1) + j]);
  return out;
}
constexpr std::int64_t kN = 5, kIn = 8, kHidden = 12, kOut = 4;
}  // namespace

TEST_CASE("ColumnParallelLinear equals Linear: output, dL/dx, the rank's rows of dW and db", "[parallel]") {
  for (int ranks : {2, 4})
    for (bool gather : {true, false}) {
      DYNAMIC_SECTION(ranks << " ranks, gather_output " << gather) {
        ThreadWorld world(ranks);
        std::vector<double> worst(static_cast<std::size_t>(ranks), 1.0);
        world.run([&](ThreadComm& comm) {
          Rng rng_dense(3), rng_tp(3);
          Linear<E> dense(kIn, kHidden, rng_dense);
          ColumnParallelLinear<E, ThreadComm> tp(kIn, kHidden, rng_tp, comm, gather);
          const T x = random_tensor({kN, kIn}, 1), dy = random_tensor({kN, kHidden}, 2);
          Linear<E>::Cache dc;
          ColumnParallelLinear<E, ThreadComm>::Cache tc;
          const T& y_dense = dense.forward(x, dc);
          const T& y_tp = tp.forward(x, tc);
          const std::int64_t w = kHidden / ranks, first = w * comm.rank();
          double d = 0;
          if (gather) {
            REQUIRE(y_tp.shape() == y_dense.shape());
            d = max_diff(y_tp.data(), y_dense.data(), y_dense.numel());
          } else {
            REQUIRE(y_tp.shape() == Shape{kN, w});
            d = max_diff(y_tp.data(), columns(y_dense, first, w).data(), y_tp.numel());
          }
          const T dy_tp = gather ? dy : [&] {
            T local({kN, w});
            const auto c = columns(dy, first, w);
            std::copy(c.begin(), c.end(), local.data());
            return local;
          }();
          const T& dx_dense = dense.backward(dy, dc);
          const T& dx_tp = tp.backward(dy_tp, tc);
          d = std::max(d, max_diff(dx_tp.data(), dx_dense.data(), dx_dense.numel()));
          d = std::max(d, max_diff(tp.weight().grad.data(), dense.weight().grad.data() + first * kIn, w * kIn));
          worst[comm.rank()] = d;
        });
        for (double d : worst) CHECK(d < 1e-12);
      }
    }
}

TEST_CASE("RowParallelLinear equals Linear: output, dL/dx (gathered or the rank's columns), dW columns, db", "[parallel]") {
  for (int ranks : {2, 4})
    for (bool parallel_input : {false, true}) {
      DYNAMIC_SECTION(ranks << " ranks, input_is_parallel " << parallel_input) {
        ThreadWorld world(ranks);
        std::vector<double> worst(static_cast<std::size_t>(ranks), 1.0);
        world.run([&](ThreadComm& comm) {
          Rng rng_dense(4), rng_tp(4);
          Linear<E> dense(kHidden, kOut, rng_dense);
          RowParallelLinear<E, ThreadComm> tp(kHidden, kOut, rng_tp, comm, parallel_input);
          const T x = random_tensor({kN, kHidden}, 5), dy = random_tensor({kN, kOut}, 6);
          const std::int64_t w = kHidden / ranks, first = w * comm.rank();
          T x_local({kN, w});
          const auto xc = columns(x, first, w);
          std::copy(xc.begin(), xc.end(), x_local.data());
          Linear<E>::Cache dc;
          RowParallelLinear<E, ThreadComm>::Cache tc;
          const T& y_dense = dense.forward(x, dc);
          const T& y_tp = tp.forward(parallel_input ? x_local : x, tc);
          double d = max_diff(y_tp.data(), y_dense.data(), y_dense.numel());
          const T& dx_dense = dense.backward(dy, dc);
          const T& dx_tp = tp.backward(dy, tc);
          if (parallel_input) {
            REQUIRE(dx_tp.shape() == Shape{kN, w});
            d = std::max(d, max_diff(dx_tp.data(), columns(dx_dense, first, w).data(), dx_tp.numel()));
          } else {
            REQUIRE(dx_tp.shape() == dx_dense.shape());
            d = std::max(d, max_diff(dx_tp.data(), dx_dense.data(), dx_dense.numel()));
          }
          d = std::max(d, max_diff(tp.weight().grad.data(), columns(dense.weight().grad, first, w).data(), kOut * w));
          worst[comm.rank()] = d;
        });
        for (double d : worst) CHECK(d < 1e-12);
      }
    }
}

TEST_CASE("TensorParallelMlp equals Linear -> ReLU -> Linear, with one all-reduce each way", "[parallel]") {
  for (int ranks : {2, 4}) {
    DYNAMIC_SECTION(ranks << " ranks") {
      ThreadWorld world(ranks);
      std::vector<double> worst(static_cast<std::size_t>(ranks), 1.0);
      world.run([&](ThreadComm& comm) {
        Rng rng_dense(9), rng_tp(9);
        Linear<E> fc1(kIn, kHidden, rng_dense);
        Linear<E> fc2(kHidden, kOut, rng_dense);
        ReLU<E> relu;
        TensorParallelMlp<E, ThreadComm> tp(kIn, kHidden, kOut, rng_tp, comm);
        const T x = random_tensor({kN, kIn}, 7), dy = random_tensor({kN, kOut}, 8);
        Linear<E>::Cache c1, c2;
        ReLU<E>::Cache cr;
        TensorParallelMlp<E, ThreadComm>::Cache tc;
        const T& y_dense = fc2.forward(relu.forward(fc1.forward(x, c1), cr), c2);
        const T& y_tp = tp.forward(x, tc);
        double d = max_diff(y_tp.data(), y_dense.data(), y_dense.numel());
        const T& dx_dense = fc1.backward(relu.backward(fc2.backward(dy, c2), cr), c1);
        const T& dx_tp = tp.backward(dy, tc);
        d = std::max(d, max_diff(dx_tp.data(), dx_dense.data(), dx_dense.numel()));
        // Gradients by name: "0.weight" rows and "2.weight" columns of this rank.
        struct Grads {
          std::vector<std::pair<std::string, Parameter<double, Cpu>*>> all;
          void parameter(const std::string& n, Parameter<double, Cpu>& p) { all.emplace_back(n, &p); }
          void buffer(const std::string&, T&) {}
        } g;
        tp.visit(g, "");
        const std::int64_t w = kHidden / ranks, first = w * comm.rank();
        REQUIRE(g.all.size() == 4);
        d = std::max(d, max_diff(g.all[0].second->grad.data(), fc1.weight().grad.data() + first * kIn, w * kIn));
        d = std::max(d, max_diff(g.all[2].second->grad.data(), columns(fc2.weight().grad, first, w).data(), kOut * w));
        worst[comm.rank()] = d;
      });
      for (double d : worst) CHECK(d < 1e-12);
    }
  }
}

TEST_CASE("Tensor-parallel layers name a split that does not divide", "[parallel]") {
  ThreadWorld world(3);
  world.run([](ThreadComm& comm) {
    Rng rng(1);
    CHECK_THROWS_WITH((ColumnParallelLinear<E, ThreadComm>(4, 8, rng, comm)),
                      Catch::Contains("ColumnParallelLinear: out_features=8 does not divide over 3 ranks"));
    CHECK_THROWS_WITH((RowParallelLinear<E, ThreadComm>(8, 4, rng, comm)),
                      Catch::Contains("RowParallelLinear: in_features=8 does not divide over 3 ranks"));
  });
}
