// ParameterServer (BSP / SSP / asynchronous) and Hogwild on ThreadComm ranks: synchronous mode
// equals one process, staleness bounds hold and are recorded, budgets stop the workers, a dead or
// hung worker stops the servers with a named error, server state checkpoints and resumes.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "support/text.hpp"
#include "parallel/ps_equivalence.hpp"
#include "tessera/comm/threads.hpp"
#include "tessera/models/mlp.hpp"
#include "tessera/parallel/hogwild.hpp"
#include "tessera/train/checkpoint.hpp"

using namespace tessera;

namespace {
template <class Check>
void on_threads(int ranks, Check check) {
  ThreadWorld world(ranks);
  std::vector<std::vector<std::string>> failures(static_cast<std::size_t>(ranks));
  world.run([&](ThreadComm& comm) { failures[static_cast<std::size_t>(comm.rank())] = check(comm); });
  for (const auto& f : failures) {
    INFO(testing::joined(f));
    CHECK(f.empty());
  }
}
}  // namespace

TEST_CASE("ParameterServer with staleness bound 0 equals one process (float64)", "[parallel][parameter_server]") {
  for (const auto& [ranks, servers] : {std::pair{2, 1}, std::pair{3, 1}, std::pair{4, 2}}) {
    DYNAMIC_SECTION(ranks << " ranks, " << servers << " servers") {
      on_threads(ranks, [servers = servers](ThreadComm& comm) {
        return testing::ps_equivalence<double>(comm, {.num_servers = servers, .steps = 3});
      });
    }
  }
}

TEST_CASE("ParameterServer: SSP and asynchronous modes record every gradient within the bound",
          "[parallel][parameter_server]") {
  for (int bound : {1, 3, ParameterServerOptions::kAsynchronous}) {
    DYNAMIC_SECTION("staleness bound " << bound) {
      on_threads(4, [&](ThreadComm& comm) {
        return testing::ps_staleness_bound<double>(
            comm, {.num_servers = 1, .per_worker_batch = 2, .steps = 6, .staleness_bound = bound});
      });
    }
  }
}

TEST_CASE("ParameterServer: a straggler makes the others' gradients fresh and its own stale (asynchronous)",
          "[parallel][parameter_server]") {
  // 1 server, 2 workers; worker rank 2 sleeps 20 ms a step. Asynchronously, rank 1 runs ahead:
  // its gradients meet few foreign updates, the straggler's meet many.
  ThreadWorld world(3);
  std::vector<std::int64_t> steps_done(3, 0);
  StalenessStats stats;
  world.run([&](ThreadComm& comm) {
    using E = CpuThreads64;
    Mlp<E> model(4, {8}, 3, 5);
    ParameterServer ps(model, comm, {.staleness_bound = ParameterServerOptions::kAsynchronous});
    if (ps.is_server()) {
      Sgd<E> sgd(ps.server_parameters(), {.lr = 0.01});
      ps.serve(sgd, /*max_gradients=*/24);
    } else {
      ps.pull();
      auto params = named_tensors(model);
      Rng rng(static_cast<std::uint64_t>(comm.rank()));
      for (int step = 0; step < 1000; ++step) {  // bounded; the budget stops it far sooner
        if (comm.rank() == 2) std::this_thread::sleep_for(std::chrono::milliseconds(20));
        for (auto& [name, p] : params.parameters)
          for (auto& g : p->grad) g = rng.normal();
        ++steps_done[static_cast<std::size_t>(comm.rank())];
        if (!ps.push_pull()) break;
      }
      ps.done();
    }
    ps.gather_parameters();
    const StalenessStats s = ps.gather_staleness();
    if (comm.rank() == 0) stats = s;
  });
  INFO("fast worker steps " << steps_done[1] << ", straggler steps " << steps_done[2]);
  CHECK(steps_done[1] + steps_done[2] >= 24);
  CHECK(steps_done[1] + steps_done[2] < 24 + 2);  // the budget stops both within one step
  CHECK(steps_done[1] > 2 * steps_done[2]);
  CHECK(stats.applied == steps_done[1] + steps_done[2]);
  CHECK(stats.max >= 2);  // the straggler's gradients were computed on old parameters
}

TEST_CASE("ParameterServer: a dead worker stops the servers with an error naming it", "[parallel][parameter_server]") {
  ThreadWorld world(3);
  std::string server_error;
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(world.run([&](ThreadComm& comm) {
    using E = CpuThreads64;
    Mlp<E> model(4, {8}, 3, 5);
    ParameterServer ps(model, comm, {.staleness_bound = 1});
    if (ps.is_server()) {
      Sgd<E> sgd(ps.server_parameters(), {.lr = 0.01});
      try {
        ps.serve(sgd);
      } catch (const CommError& e) {
        server_error = e.what();
        throw;
      }
      return;
    }
    ps.pull();
    for (int step = 0; step < 50; ++step) {
      if (comm.rank() == 2 && step == 3) throw std::runtime_error("worker rank 2 crashed");
      ps.push_pull();
    }
    ps.done();
  }), Catch::Contains("worker rank 2 crashed"));
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30));
  INFO("server: " << server_error);
  CHECK_THAT(server_error, Catch::Contains("rank 2"));
}

TEST_CASE("ParameterServer: a hung worker is declared dead after worker_timeout", "[parallel][parameter_server]") {
  ThreadWorld world(2);
  std::string server_error;
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS(world.run([&](ThreadComm& comm) {
    using E = CpuThreads64;
    Mlp<E> model(4, {8}, 3, 5);
    ParameterServer ps(model, comm, {.worker_timeout = std::chrono::milliseconds(300)});
    if (ps.is_server()) {
      Sgd<E> sgd(ps.server_parameters(), {.lr = 0.01});
      try {
        ps.serve(sgd);
      } catch (const CommError& e) {
        server_error = e.what();
        throw;
      }
      return;
    }
    ps.pull();
    ps.push_pull();
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // hangs, then finds the job stopped
    ps.push_pull();
  }));
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30));
  INFO("server: " << server_error);
  CHECK_THAT(server_error, Catch::Contains("worker rank 1 sent nothing") && Catch::Contains("worker_timeout 0.3 s"));
}

TEST_CASE("ParameterServer: ranks launched with different settings are refused on every rank",
          "[parallel][parameter_server][errors]") {
  ThreadWorld world(3);
  std::vector<std::string> errors(3);
  world.run([&](ThreadComm& comm) {
    Mlp<CpuThreads64> model(4, {8}, 3, 5);
    try {
      ParameterServer ps(model, comm, {.staleness_bound = comm.rank() == 2 ? 2 : 0});
    } catch (const ArgumentError& e) {
      errors[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  for (const auto& e : errors) CHECK_THAT(e, Catch::Contains("different settings: staleness_bound"));
  Mlp<CpuThreads64> model(4, {8}, 3, 5);
  ThreadWorld one(1);
  one.run([&](ThreadComm& comm) {
    CHECK_THROWS_WITH(ParameterServer(model, comm), Catch::Contains("at least one worker"));
  });
}

TEST_CASE("ParameterServer: server state checkpoints between sessions and resumes exactly",
          "[parallel][parameter_server]") {
  // Two sessions of 2 steps with a checkpoint between them (servers saved, new objects, weights
  // from another seed, then loaded) end where 4 uninterrupted steps end.
  const testing::PsCase c{.num_servers = 2, .per_worker_batch = 4, .steps = 4};
  const testing::DpData<double> data(4 * 2 * 4);
  const SgdOptions options{.lr = 0.05, .momentum = 0.9, .weight_decay = 5e-4};
  std::vector<double> straight;
  {
    ThreadWorld world(4);
    world.run([&](ThreadComm& comm) {
      std::vector<double> v;
      testing::ps_train<double>(comm, c, data, options, nullptr, &v);
      if (comm.rank() == 0) straight = v;
    });
  }
  const std::string dir = "/tmp/tessera_ps_ckpt_" + std::to_string(::getpid());
  std::vector<double> resumed;
  for (int session = 0; session < 2; ++session) {
    ThreadWorld world(4);
    world.run([&](ThreadComm& comm) {
      using E = CpuThreads64;
      auto model = testing::MakeLenet::make<E>(session == 0 ? 7 : 55);
      ParameterServer ps(model, comm, {.num_servers = 2});
      const std::string path = dir + "_server" + std::to_string(comm.rank()) + ".safetensors";
      if (ps.is_server()) {
        Sgd<E> sgd(ps.server_parameters(), options);
        if (session == 1) load_checkpoint(path, ps, sgd);
        ps.serve(sgd);
        if (session == 0) save_checkpoint(path, ps, sgd, TrainState{});
      } else {
        auto params = named_tensors(model);
        ps.pull();
        for (int step = 2 * session; step < 2 * session + 2; ++step) {
          for (auto& [name, p] : params.parameters) p->grad.zero();
          testing::forward_backward<double>(model, data, step * 8 + ps.worker_index() * 4, 4);
          ps.push_pull();
        }
        ps.done();
      }
      ps.gather_parameters();
      if (session == 1) {
        const StalenessStats s = ps.gather_staleness();
        CHECK(s.applied == 8);  // 2 sessions x 2 steps x 2 workers: the record was restored too
        CHECK(ps.version() == (ps.is_server() ? 4 : 0));
      }
      if (session == 1 && comm.rank() == 3)
        for (auto& [name, p] : named_tensors(model).parameters)
          resumed.insert(resumed.end(), p->value.data(), p->value.data() + p->value.numel());
    });
  }
  for (int s = 0; s < 4; ++s) std::remove((dir + "_server" + std::to_string(s) + ".safetensors").c_str());
  REQUIRE(resumed.size() == straight.size());
  double worst = 0;
  for (std::size_t k = 0; k < straight.size(); ++k) worst = std::max(worst, std::abs(resumed[k] - straight[k]));
  CHECK(worst < 1e-13);
}

TEST_CASE("Hogwild: one rank is plain SGD; several ranks train without locks", "[parallel][hogwild]") {
  // Least squares on y = x A: every rank fits the same linear map on its own samples.
  using E = CpuThreads64;
  auto loss_and_grad = [](Mlp<E>& model, const Tensor<double>& x, const Tensor<double>& y) {
    typename Mlp<E>::Cache cache;
    const auto& out = model.forward(x, cache);
    Tensor<double> dy(out.shape());
    double loss = 0;
    for (std::int64_t i = 0; i < out.numel(); ++i) {
      dy[i] = (out[i] - y[i]) / static_cast<double>(out.numel());
      loss += 0.5 * (out[i] - y[i]) * (out[i] - y[i]) / static_cast<double>(out.numel());
    }
    model.backward(dy, cache);
    return loss;
  };
  auto make_data = [](std::uint64_t seed, Tensor<double>& x, Tensor<double>& y) {
    Rng rng(seed);
    x = Tensor<double>({16, 4});
    y = Tensor<double>({16, 2});
    for (auto& v : x) v = rng.normal();
    for (std::int64_t i = 0; i < 16; ++i) {
      y.at(i, 0) = x.at(i, 0) - 2 * x.at(i, 1) + 0.5 * x.at(i, 3);
      y.at(i, 1) = 3 * x.at(i, 2) - x.at(i, 0);
    }
  };
  SECTION("one rank equals torch.optim.SGD(lr, weight_decay)") {
    HogwildStore<double> store;
    Mlp<CpuLocal64> reference(4, {}, 2, 9);
    auto reference_params = named_tensors(reference);
    Sgd<CpuLocal64> sgd(reference_params, {.lr = 0.1, .weight_decay = 0.01});
    ThreadWorld world(1);
    world.run([&](ThreadComm& comm) {
      Mlp<E> model(4, {}, 2, 9);
      Hogwild hogwild(model, comm, store, {.lr = 0.1, .weight_decay = 0.01});
      Tensor<double> x, y;
      make_data(1, x, y);
      for (int step = 0; step < 5; ++step) {
        hogwild.pull();
        for (auto& [n, p] : named_tensors(model).parameters) p->grad.zero();
        loss_and_grad(model, x, y);
        hogwild.step();
        sgd.zero_grad();
        typename Mlp<CpuLocal64>::Cache cache;
        const auto& out = reference.forward(x, cache);
        Tensor<double> dy(out.shape());
        for (std::int64_t i = 0; i < out.numel(); ++i) dy[i] = (out[i] - y[i]) / static_cast<double>(out.numel());
        reference.backward(dy, cache);
        sgd.step();
      }
      hogwild.gather_parameters();
      auto mine = named_tensors(model).parameters;
      for (std::size_t i = 0; i < mine.size(); ++i)
        for (std::int64_t k = 0; k < mine[i].second->value.numel(); ++k)
          CHECK(mine[i].second->value[k] == reference_params.parameters[i].second->value[k]);
      CHECK(hogwild.staleness().max == 0);
    });
  }
  SECTION("four ranks reduce the loss") {
    HogwildStore<double> store;
    std::vector<double> first(4), last(4);
    std::vector<std::int64_t> applied(4);
    ThreadWorld world(4);
    world.run([&](ThreadComm& comm) {
      Mlp<E> model(4, {}, 2, 100 + static_cast<std::uint64_t>(comm.rank()));  // the store takes rank 0's
      Hogwild hogwild(model, comm, store, {.lr = 0.2});
      Tensor<double> x, y;
      make_data(10 + static_cast<std::uint64_t>(comm.rank()), x, y);
      const auto r = static_cast<std::size_t>(comm.rank());
      hogwild.pull();
      first[r] = loss_and_grad(model, x, y);  // rank 0's initial parameters on this rank's data
      comm.barrier();
      for (int step = 0; step < 200; ++step) {
        hogwild.pull();
        for (auto& [n, p] : named_tensors(model).parameters) p->grad.zero();
        loss_and_grad(model, x, y);
        hogwild.step();
      }
      hogwild.gather_parameters();
      last[r] = loss_and_grad(model, x, y);
      applied[r] = hogwild.staleness().applied;
    });
    CHECK(store.updates() == 800);
    for (int r = 0; r < 4; ++r) {
      INFO("rank " << r << ": loss " << first[r] << " -> " << last[r]);
      CHECK(last[r] < 1e-3 * first[r]);
      CHECK(applied[r] == 200);
    }
  }
}
