// DataParallel's protocol over ThreadComm: the timeline of bucket all-reduces, bucket order and
// sizes, the errors every rank raises together (a missing gradient, finish() without backward, a
// parameter used twice), hooks in a different order per rank, micro-steps and no_sync, and launch<E>.
// Kept apart from test_data_parallel.cpp (the equivalence cases) so that neither file is the one
// that the build waits for.
#include <catch2/catch.hpp>

#include "support/text.hpp"
#include "parallel/dp_equivalence.hpp"
#include "tessera/comm/launch.hpp"
#include "tessera/comm/threads.hpp"
#include "tessera/train/timeline.hpp"

#include <mutex>
#include <unistd.h>
#include "tessera/parallel/zero.hpp"

using namespace tessera;

TEST_CASE("Timeline: spans of every rank in one Chrome trace, bucket all-reduces from DataParallel", "[parallel]") {
  const std::string path = "/tmp/tessera_test_trace_" + std::to_string(::getpid()) + ".json";
  ThreadWorld world(2);
  world.run([&](ThreadComm& comm) {
    Timeline timeline(comm);
    auto model = lenet5<CpuThreads64>();
    DataParallel dp(model, comm, {.bucket_bytes = 32 * 1024, .first_bucket_bytes = 4096});
    {
      auto span = timeline.span("backward");
      for (auto it = dp.parameters().parameters.rbegin(); it != dp.parameters().parameters.rend(); ++it)
        it->second->grad_ready();
    }
    dp.finish();
    for (std::size_t k = 0; k < dp.buckets().size(); ++k)
      timeline.add("all_reduce bucket " + std::to_string(k), "communication", dp.buckets()[k].launched_at,
                   dp.buckets()[k].completed_at, Timeline::kCommunication);
    CHECK(timeline.size() == 1 + dp.buckets().size());
    for (const auto& b : dp.buckets()) CHECK(b.completed_at >= b.launched_at);
    timeline.write(comm, path);
  });
  std::FILE* f = std::fopen(path.c_str(), "r");
  REQUIRE(f != nullptr);
  std::string text(1 << 16, '\0');
  text.resize(std::fread(text.data(), 1, text.size(), f));
  std::fclose(f);
  std::remove(path.c_str());
  CHECK(text.rfind("{\"traceEvents\": [", 0) == 0);
  CHECK(text.find("\"name\": \"rank 1\"") != std::string::npos);
  CHECK(text.find("\"name\": \"backward\", \"cat\": \"compute\", \"ph\": \"X\"") != std::string::npos);
  CHECK(text.find("\"pid\": 1, \"tid\": 1}") != std::string::npos);  // rank 1's communication lane
}

TEST_CASE("DataParallel: buckets in reverse parameter order, first bucket small", "[parallel]") {
  ThreadWorld world(1);
  world.run([](ThreadComm& comm) {
    auto model = lenet5<CpuThreads64>();
    DataParallel dp(model, comm, {.bucket_bytes = 100 * 1024, .first_bucket_bytes = 8 * 1024});
    const auto& buckets = dp.buckets();
    const int n = static_cast<int>(dp.parameters().parameters.size());
    REQUIRE(!buckets.empty());
    CHECK(buckets.front().params.front() == n - 1);  // the last layer's bias first
    CHECK(static_cast<std::size_t>(buckets.front().flat.numel()) * sizeof(double) <= 8 * 1024);
    int expected = n - 1, total = 0;
    for (const auto& b : buckets) {
      CHECK((static_cast<std::size_t>(b.flat.numel()) * sizeof(double) <= 100 * 1024 || b.params.size() == 1));
      for (int i : b.params) CHECK(i == expected--);
      total += static_cast<int>(b.params.size());
    }
    CHECK(total == n);
  });
}

TEST_CASE("DataParallel: a parameter without gradient is named", "[parallel]") {
  ThreadWorld world(1);
  world.run([](ThreadComm& comm) {
    auto model = lenet5<CpuThreads64>();
    DataParallel dp(model, comm);
    CHECK_THROWS_WITH(dp.finish(), Catch::Contains("finish() without a backward pass"));
    // A backward that skipped "conv2.weight" (as a branch not taken in forward would).
    for (const auto& [name, p] : dp.parameters().parameters)
      if (name != "conv2.weight") p->grad_ready();
    CHECK_THROWS_WITH(dp.finish(), Catch::Contains("no gradient in this step for: conv2.weight"));
    // A whole backward, finish(), then finish() again in the same step: said as a second call
    // (example 04's --trace with memory measurement did it, and the error blamed its data shard).
    for (const auto& [name, p] : dp.parameters().parameters) p->grad_ready();
    dp.finish();
    CHECK_THROWS_WITH(dp.finish(), Catch::Contains("finish() called again with no backward pass since the last "
                                                   "finish(): twice in one step"));
    // And it recovers: a full backward afterwards works.
    for (const auto& [name, p] : dp.parameters().parameters) p->grad_ready();
    CHECK_NOTHROW(dp.finish());
  });
}

namespace {
// Sets every parameter's gradient to value(rank, parameter index), as a backward would.
template <class F>
void fill_grads(DataParallel<CpuThreads64>& dp, F value) {
  const auto& params = dp.parameters().parameters;
  for (std::size_t i = 0; i < params.size(); ++i) params[i].second->grad.fill(value(i));
}
}  // namespace

TEST_CASE("DataParallel: one rank without a gradient makes every rank throw, then both recover", "[parallel]") {
  ThreadWorld world(2);
  std::vector<std::string> errors(2);
  world.run([&](ThreadComm& comm) {
    auto model = lenet5<CpuThreads64>();
    DataParallel dp(model, comm, {.bucket_bytes = 64 * 1024, .first_bucket_bytes = 4096});
    const auto& params = dp.parameters().parameters;
    fill_grads(dp, [&](std::size_t) { return 1.0 + comm.rank(); });
    for (const auto& [name, p] : params)
      if (!(comm.rank() == 1 && name == "conv2.weight")) p->grad_ready();  // rank 1 skips one
    try {
      dp.finish();
    } catch (const ArgumentError& e) {
      errors[comm.rank()] = e.what();
    }
    // Every rank ran the same collectives, so the next step works on both.
    fill_grads(dp, [&](std::size_t i) { return static_cast<double>(i) + 2.0 * comm.rank(); });
    for (auto it = params.rbegin(); it != params.rend(); ++it) it->second->grad_ready();
    dp.finish();
    for (std::size_t i = 0; i < params.size(); ++i)
      REQUIRE(params[i].second->grad.data()[0] == static_cast<double>(i) + 1.0);  // mean of i and i + 2
  });
  CHECK_THAT(errors[1], Catch::Contains("rank 1: no gradient in this step for: conv2.weight"));
  CHECK_THAT(errors[0], Catch::Contains("another rank had a parameter without a gradient"));
}

TEST_CASE("DataParallel: finish() without backward, and a parameter used twice, are errors on every rank", "[parallel]") {
  ThreadWorld world(2);
  std::vector<std::string> no_backward(2), twice(2);
  world.run([&](ThreadComm& comm) {
    auto model = lenet5<CpuThreads64>();
    DataParallel dp(model, comm);
    try {
      dp.finish();
    } catch (const ArgumentError& e) {
      no_backward[comm.rank()] = e.what();
    }
    const auto& params = dp.parameters().parameters;
    for (const auto& [name, p] : params) p->grad_ready();
    params[0].second->grad_ready();  // a layer applied twice in forward reports twice
    try {
      dp.finish();
    } catch (const ArgumentError& e) {
      twice[comm.rank()] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    CHECK_THAT(no_backward[r], Catch::Contains("finish() without a backward pass"));
    CHECK_THAT(twice[r], Catch::Contains("two gradients in one backward (used twice in forward) for: conv1.weight"));
  }
}

TEST_CASE("DataParallel: hooks in a different order on each rank, buckets still go out in one order", "[parallel]") {
  ThreadWorld world(2);
  world.run([&](ThreadComm& comm) {
    auto model = lenet5<CpuThreads64>();
    // Small buckets, so most of the ten parameters get their own bucket.
    DataParallel dp(model, comm, {.bucket_bytes = 1024, .first_bucket_bytes = 1024});
    REQUIRE(dp.buckets().size() >= 6);
    const auto& params = dp.parameters().parameters;
    for (int step = 0; step < 3; ++step) {
      fill_grads(dp, [&](std::size_t i) { return static_cast<double>(i * 10 + step) + 4.0 * comm.rank(); });
      // Rank 0 reports first-layer-first (the order buckets are *not* in), rank 1 last-layer-first.
      if (comm.rank() == 0)
        for (const auto& [name, p] : params) p->grad_ready();
      else
        for (auto it = params.rbegin(); it != params.rend(); ++it) it->second->grad_ready();
      dp.finish();
      for (std::size_t i = 0; i < params.size(); ++i) {
        const auto& g = params[i].second->grad;
        for (std::int64_t k = 0; k < g.numel(); ++k) REQUIRE(g.data()[k] == static_cast<double>(i * 10 + step) + 2.0);
      }
    }
  });
}

namespace {
// Three micro-steps under no_sync() that accumulate 1 + 2 + 3 (+ 10 per micro-step on rank 1) into
// every gradient, then finish() (inside the guard or after it), on 2 thread ranks; returns the
// first gradient element of every parameter on every rank.
std::vector<double> accumulate_three_micro_steps(DataParallelOptions options, bool finish_inside_guard) {
  std::vector<double> firsts;
  std::mutex mutex;
  ThreadWorld world(2);
  world.run([&](ThreadComm& comm) {
    auto model = lenet5<CpuThreads64>();
    DataParallel dp(model, comm, options);
    const auto& params = dp.parameters().parameters;
    {
      auto guard = dp.no_sync();
      fill_grads(dp, [](std::size_t) { return 0.0; });
      for (int micro = 1; micro <= 3; ++micro) {
        for (const auto& [name, p] : params) {
          for (std::int64_t k = 0; k < p->grad.numel(); ++k) p->grad.data()[k] += micro + 10.0 * comm.rank();
          p->grad_ready();
        }
        for (const auto& b : dp.buckets()) REQUIRE(!b.launched);  // nothing is sent inside no_sync
      }
      if (finish_inside_guard) dp.finish();
    }
    if (!finish_inside_guard) dp.finish();
    std::lock_guard lock(mutex);
    for (const auto& [name, p] : params) firsts.push_back(p->grad.data()[0]);
  });
  return firsts;
}
}  // namespace

TEST_CASE("DataParallel: micro-steps add up as in DDP; nothing is sent inside no_sync", "[parallel]") {
  // Summed over micro-steps (6 + 30 r), averaged over ranks: 21.
  for (const double g : accumulate_three_micro_steps({.bucket_bytes = 4096, .first_bucket_bytes = 1024}, false))
    REQUIRE(g == 21.0);
}

TEST_CASE("DataParallel: average_micro_steps divides by the micro-steps; finish() inside the guard", "[parallel]") {
  // Mean over micro-steps (2 + 10 r), then over ranks: 7.
  for (const double g : accumulate_three_micro_steps(
           {.bucket_bytes = 4096, .first_bucket_bytes = 1024, .average_micro_steps = true}, true))
    REQUIRE(g == 7.0);
}

namespace {
// Trains LeNet-5 data-parallel on 2 thread ranks for 3 steps and returns rank 0's parameters;
// with call_finish false the loop never calls dp.finish() and relies on the optimizer's step.
std::vector<double> train_two_ranks(bool call_finish) {
  std::vector<double> out;
  launch<CpuThreads64>(
      [&](ThreadComm& comm) {
        const testing::DpData<double> data(2 * 4 * 3);
        auto model = lenet5<CpuThreads64>(1, 28, 10, comm.rank() == 0 ? 7 : 8);
        DataParallel dp(model, comm, {.first_bucket_bytes = 4096});
        Sgd<CpuThreads64> sgd(dp.parameters(), {.lr = 0.05, .momentum = 0.9});
        for (int step = 0; step < 3; ++step) {
          sgd.zero_grad();
          testing::forward_backward<double>(model, data, step * 8 + comm.rank() * 4, 4);
          if (call_finish) dp.finish();
          sgd.step();
        }
        if (comm.rank() == 0)
          for (const auto& [name, p] : dp.parameters().parameters)
            out.insert(out.end(), p->value.data(), p->value.data() + p->value.numel());
      },
      {.ranks = 2});
  return out;
}
}  // namespace

TEST_CASE("DataParallel: the optimizer's step finishes the all-reduce a forgotten finish() left open", "[parallel]") {
  const auto with_finish = train_two_ranks(true);
  const auto without = train_two_ranks(false);
  REQUIRE(with_finish.size() == without.size());
  CHECK(with_finish == without);  // bit for bit: the same all-reduces, started by the step instead
}

TEST_CASE("DataParallel: an optimizer step inside no_sync() is an error naming the strategy", "[parallel]") {
  launch<CpuThreads64>(
      [](ThreadComm& comm) {
        const testing::DpData<double> data(4);
        auto model = lenet5<CpuThreads64>();
        DataParallel dp(model, comm);
        Sgd<CpuThreads64> sgd(dp.parameters(), {.lr = 0.05});
        auto guard = dp.no_sync();
        testing::forward_backward<double>(model, data, comm.rank() * 2, 2);
        CHECK_THROWS_WITH(sgd.step(), Catch::Contains("DataParallel on rank") &&
                                          Catch::Contains("optimizer step inside no_sync()"));
      },
      {.ranks = 2});
}

TEST_CASE("Zero1: stepping the shard's optimizer directly is an error, zero.step(optimizer) is the way", "[parallel]") {
  launch<CpuThreads64>(
      [](ThreadComm& comm) {
        auto model = lenet5<CpuThreads64>();
        Zero1 zero(model, comm);
        Sgd<CpuThreads64> sgd(zero.shard_parameters(), {.lr = 0.05});
        CHECK_THROWS_WITH(sgd.step(), Catch::Contains("Zero1 on rank") && Catch::Contains("zero.step(optimizer)"));
        zero.step(sgd);  // the supported call still works after the refused one
      },
      {.ranks = 2});
}

TEST_CASE("launch<E>: one rank for LocalComm, options.ranks threads for ThreadComm, errors rethrown", "[parallel]") {
  int local_calls = 0;
  launch<CpuLocal>([&](LocalComm& comm) {
    CHECK(comm.size() == 1);
    ++local_calls;
  });
  CHECK(local_calls == 1);
  std::vector<int> seen(3, 0);
  launch<CpuThreads>(
      [&](ThreadComm& comm) {
        REQUIRE(comm.size() == 3);
        seen[static_cast<std::size_t>(comm.rank())] += 1;
      },
      {.ranks = 3});
  CHECK(seen == std::vector<int>{1, 1, 1});
  CHECK_THROWS_WITH(launch<CpuThreads>(
                        [](ThreadComm& comm) {
                          if (comm.rank() == 1) throw ArgumentError("rank 1 failed on purpose");
                          comm.barrier();
                        },
                        {.ranks = 2}),
                    Catch::Contains("rank 1 failed on purpose"));
  CHECK_THROWS_WITH(launch<CpuThreads>([](ThreadComm&) {}, {.ranks = -1}), Catch::Contains("ranks=-1 must be >= 0"));
}

// The Env travels with the parameter list: named_tensors deduces it from the model.
static_assert(std::is_same_v<decltype(named_tensors(std::declval<decltype(lenet5<CpuThreads64>())&>())),
                             NamedTensors<CpuThreads64>>);
