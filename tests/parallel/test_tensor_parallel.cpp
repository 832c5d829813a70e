// Tensor parallelism over ThreadComm, 2 and 4 ranks: ColumnParallelLinear (with and without
// gathering the output), RowParallelLinear (split or already-parallel input) and the
// tensor-parallel MLP block equal the dense layers built from the same seed, in forward (y),
// backward (dL/dx) and in every parameter gradient (each rank's slice of the dense gradient).
// The tensor + sequence parallel GPT against the dense one (parallel/tp_gpt_equivalence.hpp).
#include <catch2/catch.hpp>

#include "tessera/comm/local.hpp"
#include "tessera/comm/threads.hpp"
#include "parallel/tp_gpt_equivalence.hpp"
#include "tessera/parallel/tensor_parallel.hpp"

using namespace tessera;
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
          Linear<CpuThreads64> dense(kIn, kHidden, rng_dense);
          ColumnParallelLinear<CpuThreads64> tp(kIn, kHidden, rng_tp, comm, gather);
          const T x = random_tensor({kN, kIn}, 1), dy = random_tensor({kN, kHidden}, 2);
          Linear<CpuThreads64>::Cache dc;
          ColumnParallelLinear<CpuThreads64>::Cache tc;
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
          Linear<CpuThreads64> dense(kHidden, kOut, rng_dense);
          RowParallelLinear<CpuThreads64> tp(kHidden, kOut, rng_tp, comm, parallel_input);
          const T x = random_tensor({kN, kHidden}, 5), dy = random_tensor({kN, kOut}, 6);
          const std::int64_t w = kHidden / ranks, first = w * comm.rank();
          T x_local({kN, w});
          const auto xc = columns(x, first, w);
          std::copy(xc.begin(), xc.end(), x_local.data());
          Linear<CpuThreads64>::Cache dc;
          RowParallelLinear<CpuThreads64>::Cache tc;
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
        Linear<CpuThreads64> fc1(kIn, kHidden, rng_dense);
        Linear<CpuThreads64> fc2(kHidden, kOut, rng_dense);
        ReLU<CpuThreads64> relu;
        TensorParallelMlp<CpuThreads64> tp(kIn, kHidden, kOut, rng_tp, comm);
        const T x = random_tensor({kN, kIn}, 7), dy = random_tensor({kN, kOut}, 8);
        Linear<CpuThreads64>::Cache c1, c2;
        ReLU<CpuThreads64>::Cache cr;
        TensorParallelMlp<CpuThreads64>::Cache tc;
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
    CHECK_THROWS_WITH((ColumnParallelLinear<CpuThreads64>(4, 8, rng, comm)),
                      Catch::Contains("ColumnParallelLinear: out_features=8 does not divide over 3 ranks"));
    CHECK_THROWS_WITH((RowParallelLinear<CpuThreads64>(8, 4, rng, comm)),
                      Catch::Contains("RowParallelLinear: in_features=8 does not divide over 3 ranks"));
  });
}

#include "tessera/losses/cross_entropy.hpp"
#include "tessera/optim/sgd.hpp"
#include "tessera/parallel/tensor_parallel_resnet.hpp"

namespace {
struct ParamList {
  std::vector<std::pair<std::string, Parameter<double, Cpu>*>> all;
  void parameter(const std::string& n, Parameter<double, Cpu>& p) { all.emplace_back(n, &p); }
  void buffer(const std::string&, T&) {}
};
// The part of dense tensor `a` that rank `part` holds as `b`: the whole tensor (replicated), a
// block of leading rows, or (input-channel-parallel conv2 weights) a run of every row.
double slice_diff(const T& a, const T& b, bool along_dim1, std::int64_t part) {
  if (a.numel() == b.numel()) return max_diff(a.data(), b.data(), a.numel());
  if (!along_dim1) return max_diff(a.data() + part * b.numel(), b.data(), b.numel());
  const std::int64_t rows = a.dim(0), inner = b.numel() / rows, row = a.numel() / rows;
  double worst = 0;
  for (std::int64_t i = 0; i < rows; ++i) worst = std::max(worst, max_diff(a.data() + i * row + part * inner, b.data() + i * inner, inner));
  return worst;
}
// Largest difference between every tensor-parallel parameter (value or gradient) and its slice of
// the dense one, matched by name.
template <class Dense, class Parallel>
double parameters_diff(Dense& dense, Parallel& tp, int rank, bool grads) {
  ParamList d, t;
  dense.visit(d, "");
  tp.visit(t, "");
  REQUIRE(d.all.size() == t.all.size());
  double worst = 0;
  for (std::size_t k = 0; k < d.all.size(); ++k) {
    REQUIRE(d.all[k].first == t.all[k].first);
    const bool dim1 = d.all[k].first.find("conv2.weight") != std::string::npos;
    worst = std::max(worst, slice_diff(grads ? d.all[k].second->grad : d.all[k].second->value,
                                       grads ? t.all[k].second->grad : t.all[k].second->value, dim1, rank));
  }
  return worst;
}
}  // namespace

TEST_CASE("TensorParallelBottleneck equals the dense bottleneck: output, dL/dx, every gradient", "[parallel]") {
  for (int ranks : {2, 4})
    for (bool projection : {false, true}) {
      DYNAMIC_SECTION(ranks << " ranks, " << (projection ? "projection, stride 2" : "identity shortcut")) {
        ThreadWorld world(ranks);
        std::vector<double> worst(static_cast<std::size_t>(ranks), 1.0);
        world.run([&](ThreadComm& comm) {
          Rng rng(21);
          const std::int64_t in = projection ? 8 : 16, planes = 4, stride = projection ? 2 : 1;
          Bottleneck<CpuThreads64> dense(in, planes, stride, rng, /*zero_init_last_bn=*/false);
          TensorParallelBottleneck<CpuThreads64> tp(dense, comm);
          const T x = random_tensor({3, in, 6, 6}, 22);
          Bottleneck<CpuThreads64>::Cache dc{};
          TensorParallelBottleneck<CpuThreads64>::Cache tc{};
          const T& y_dense = dense.forward(x, dc);
          const T& y_tp = tp.forward(x, tc);
          REQUIRE(y_tp.shape() == y_dense.shape());
          double d = max_diff(y_tp.data(), y_dense.data(), y_dense.numel());
          const T dy = random_tensor(y_dense.shape(), 23);
          const T& dx_dense = dense.backward(dy, dc);
          const T& dx_tp = tp.backward(dy, tc);
          d = std::max(d, max_diff(dx_tp.data(), dx_dense.data(), dx_dense.numel()));
          d = std::max(d, parameters_diff(dense, tp, comm.rank(), /*grads=*/true));
          worst[comm.rank()] = d;
        });
        for (double d : worst) CHECK(d < 1e-11);
      }
    }
}

TEST_CASE("TensorParallelResNet equals the dense bottleneck ResNet through SGD steps", "[parallel]") {
  for (int ranks : {2, 4}) {
    DYNAMIC_SECTION(ranks << " ranks") {
      ThreadWorld world(ranks);
      std::vector<double> worst(static_cast<std::size_t>(ranks), 1.0);
      world.run([&](ThreadComm& comm) {
        // ImageNet stem (7x7/2 conv, max-pool), two bottleneck stages, 8 classes.
        auto make = [] { return ResNet<CpuThreads64, Bottleneck>({1, 1}, {4, 8}, true, {.in_channels = 1, .num_classes = 8, .seed = 3}); };
        auto dense = make();
        auto to_split = make();
        TensorParallelResNet<CpuThreads64> tp(to_split, comm);
        auto dense_params = named_tensors(dense);
        auto tp_params = named_tensors(tp);
        Sgd<CpuThreads64> sgd_dense(dense_params, {.lr = 0.1, .momentum = 0.9});
        Sgd<CpuThreads64> sgd_tp(tp_params, {.lr = 0.1, .momentum = 0.9});
        CrossEntropyLoss<CpuThreads64> loss;
        double d = 0;
        for (int step = 0; step < 3; ++step) {
          const T x = random_tensor({4, 1, 16, 16}, 30 + static_cast<std::uint64_t>(step));
          const std::vector<std::int64_t> y = {1, 7, 3, 0};
          sgd_dense.zero_grad();
          sgd_tp.zero_grad();
          decltype(dense)::Cache dc{};
          TensorParallelResNet<CpuThreads64>::Cache tc{};
          CrossEntropyLoss<CpuThreads64>::Cache lc_dense, lc_tp;
          const double l_dense = loss.forward(dense.forward(x, dc), y, lc_dense);
          const double l_tp = loss.forward(tp.forward(x, tc), y, lc_tp);
          d = std::max(d, std::abs(l_dense - l_tp));
          dense.backward(loss.backward(lc_dense), dc);
          tp.backward(loss.backward(lc_tp), tc);
          d = std::max(d, parameters_diff(dense, tp, comm.rank(), /*grads=*/true));
          sgd_dense.step();
          sgd_tp.step();
          d = std::max(d, parameters_diff(dense, tp, comm.rank(), /*grads=*/false));
        }
        worst[comm.rank()] = d;
      });
      for (double d : worst) CHECK(d < 1e-11);
    }
  }
}

#include "tessera/parallel/data_parallel.hpp"

TEST_CASE("Hybrid: 2 data-parallel replicas x 2 tensor-parallel ranks equal one process on the global batch", "[parallel]") {
  ThreadWorld world(4);
  std::vector<double> worst(4, 1.0);
  world.run([&](ThreadComm& comm) {
    // rank = replica x 2 + tensor rank: the tensor group shares a batch, the data group shares a
    // weight slice.
    const int replica = comm.rank() / 2, tp_rank = comm.rank() % 2;
    ThreadComm tp_comm = comm.split(replica, tp_rank);
    ThreadComm dp_comm = comm.split(tp_rank, replica);
    Rng rng_tp(41), rng_dense(41);
    TensorParallelMlp<CpuThreads64> tp(kIn, kHidden, kOut, rng_tp, tp_comm);
    Linear<CpuThreads64> fc1(kIn, kHidden, rng_dense), fc2(kHidden, kOut, rng_dense);
    ReLU<CpuThreads64> relu;
    DataParallel dp(tp, dp_comm);  // averages each slice over the replicas only
    auto tp_params = named_tensors(tp);
    Sgd<CpuThreads64> sgd_tp(tp_params, {.lr = 0.1, .momentum = 0.9});
    // The dense reference trains on the global batch of 2 x kN rows; the weights are compared
    // (they carry every step's effect, biases included).
    Sgd<CpuThreads64> sgd_dense(named_tensors(fc1), {.lr = 0.1, .momentum = 0.9});
    Sgd<CpuThreads64> sgd_dense2(named_tensors(fc2), {.lr = 0.1, .momentum = 0.9});
    double d = 0;
    for (int step = 0; step < 3; ++step) {
      const T x = random_tensor({2 * kN, kIn}, 50 + static_cast<std::uint64_t>(step));
      const T dy_global = random_tensor({2 * kN, kOut}, 60 + static_cast<std::uint64_t>(step));
      // Dense: a loss whose gradient is dy_global / (2 kN) summed over the global batch; each
      // replica's half then carries dy / kN for the mean over its kN rows, averaged over 2.
      sgd_dense.zero_grad();
      sgd_dense2.zero_grad();
      Linear<CpuThreads64>::Cache c1, c2;
      ReLU<CpuThreads64>::Cache cr;
      fc2.forward(relu.forward(fc1.forward(x, c1), cr), c2);
      T dy_dense({2 * kN, kOut});
      for (std::int64_t k = 0; k < dy_dense.numel(); ++k) dy_dense.data()[k] = dy_global.data()[k] / (2.0 * kN);
      fc1.backward(relu.backward(fc2.backward(dy_dense, c2), cr), c1);
      sgd_dense.step();
      sgd_dense2.step();
      // Tensor x data: this replica's rows.
      sgd_tp.zero_grad();
      T x_mine({kN, kIn}), dy_mine({kN, kOut});
      std::copy_n(x.data() + replica * kN * kIn, kN * kIn, x_mine.data());
      for (std::int64_t k = 0; k < dy_mine.numel(); ++k) dy_mine.data()[k] = dy_global.data()[replica * kN * kOut + k] / kN;
      TensorParallelMlp<CpuThreads64>::Cache tc;
      tp.forward(x_mine, tc);
      tp.backward(dy_mine, tc);
      dp.finish();
      sgd_tp.step();
      const std::int64_t w = kHidden / 2, first = w * tp_rank;
      d = std::max(d, max_diff(tp_params.parameters[0].second->value.data(), fc1.weight().value.data() + first * kIn, w * kIn));
      d = std::max(d, max_diff(tp_params.parameters[2].second->value.data(),
                               columns(fc2.weight().value, first, w).data(), kOut * w));
    }
    worst[comm.rank()] = d;
  });
  for (double d : worst) CHECK(d < 1e-12);
}

TEST_CASE("TensorParallelGPT (tensor + sequence parallel) equals the dense GPT on 2, 3 and 4 thread ranks, "
          "dropout too (float32)",
          "[parallel][gpt]") {
  for (int ranks : {2, 3, 4})
   for (double dropout : {0.0, 0.2}) {
    DYNAMIC_SECTION(ranks << " ranks, dropout " << dropout) {
      ThreadWorld world(ranks);
      std::vector<std::vector<std::string>> failures(static_cast<std::size_t>(ranks));
      std::vector<testing::TpGptReport> reports(static_cast<std::size_t>(ranks));
      world.run([&](ThreadComm& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        testing::TpGptCase k;
        k.config.dropout = dropout;
        failures[r] = testing::tp_gpt_equivalence<float>(comm, k, &reports[r]);
      });
      for (const auto& rank_failures : failures)
        for (const auto& f : rank_failures) FAIL_CHECK(f);
      for (const auto& r : reports) {
        INFO("largest relative difference " << r.worst << "; bytes moved " << r.moved_bytes << ", formula "
                                            << r.formula_bytes);
        CHECK(r.compared > 100);  // logits and every gradient and parameter, per step
        CHECK(r.moved_bytes == r.formula_bytes);
        CHECK(r.formula_bytes > 0);
      }
    }
  }
}
