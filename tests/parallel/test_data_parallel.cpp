// DataParallel over ThreadComm: equivalence with one process (LeNet-5, float64 and float32, 2 and
// 4 ranks), gradient accumulation, bucket layout, and the unused-parameter error. MPI and Gloo run
// the same equivalence as multi-process programs (tests/parallel/dp_main.cpp).
#include <catch2/catch.hpp>

#include "support/text.hpp"
#include "parallel/dp_equivalence.hpp"
#include "tessera/comm/launch.hpp"
#include "tessera/comm/threads.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/data/synthetic.hpp"
#include "tessera/models/mlp.hpp"
#include "tessera/train/timeline.hpp"

#include <cmath>
#include <cstdio>
#include <mutex>
#include <unistd.h>
#include "tessera/parallel/zero.hpp"

using namespace tessera;

namespace {
template <class S>
void run_equivalence(int ranks, testing::DpCase c) {
  ThreadWorld world(ranks);
  std::vector<std::vector<std::string>> failures(static_cast<std::size_t>(ranks));
  world.run([&](ThreadComm& comm) { failures[comm.rank()] = testing::dp_equivalence<S>(comm, c); });
  for (const auto& f : failures) {
    INFO(testing::joined(f));
    CHECK(f.empty());
  }
}
}  // namespace

TEST_CASE("DataParallel: N ranks x batch b equal one process on batch N x b (float64)", "[parallel]") {
  for (int ranks : {2, 4}) {
    DYNAMIC_SECTION(ranks << " ranks") { run_equivalence<double>(ranks, {.per_rank_batch = 6, .steps = 3}); }
  }
}

TEST_CASE("DataParallel: float32 agrees with one process to ~1e-5", "[parallel]") {
  run_equivalence<float>(2, {.per_rank_batch = 8, .steps = 3, .tolerance = 1e-5});
}

TEST_CASE("DataParallel: bfloat16 compute (CpuThreadsBf16) agrees with one process of CpuLocalBf16", "[parallel][bf16]") {
  // Each rank's loss gradient is 2x the one-process one (batch b, not 2b), which bfloat16 rounds
  // exactly like the unscaled one: the two differ by float summation order, and later steps by
  // the rare operand that then rounds the other way (2^-8 of it), hence 1e-4.
  ThreadWorld world(2);
  std::vector<std::vector<std::string>> failures(2);
  world.run([&](ThreadComm& comm) {
    failures[comm.rank()] = testing::dp_equivalence<float, ThreadComm, testing::MakeLenet, void (*)(void*, void*),
                                                    BFloat16>(comm, {.per_rank_batch = 8, .steps = 3, .tolerance = 1e-4});
  });
  for (const auto& f : failures) {
    INFO(testing::joined(f));
    CHECK(f.empty());
  }
}

TEST_CASE("DataParallel: k accumulated micro-steps equal one step on the k-times batch", "[parallel]") {
  run_equivalence<double>(2, {.per_rank_batch = 8, .steps = 2, .micro_steps = 4});
  run_equivalence<double>(1, {.per_rank_batch = 6, .steps = 2, .micro_steps = 3});
  run_equivalence<double>(2, {.per_rank_batch = 8, .steps = 2, .micro_steps = 4, .average_micro_steps = true});
}

TEST_CASE("DataParallel + SyncBatchNorm: ResNet-20 on N ranks equals one process, BN statistics included", "[parallel]") {
  for (int ranks : {2, 4}) {
    DYNAMIC_SECTION(ranks << " ranks") {
      ThreadWorld world(ranks);
      std::vector<std::vector<std::string>> failures(static_cast<std::size_t>(ranks));
      world.run([&](ThreadComm& comm) {
        failures[comm.rank()] = testing::dp_equivalence_resnet20_sync_bn<double>(comm, {.per_rank_batch = 4, .steps = 2});
      });
      for (const auto& f : failures) {
        INFO(testing::joined(f));
        CHECK(f.empty());
      }
    }
  }
}

TEST_CASE("DataParallel with per-rank BatchNorm differs from one process (why SyncBatchNorm exists)", "[parallel]") {
  ThreadWorld world(2);
  std::vector<std::vector<std::string>> failures(2);
  world.run([&](ThreadComm& comm) {
    failures[comm.rank()] = testing::dp_equivalence<double>(comm, {.per_rank_batch = 4, .steps = 2},
                                                            testing::MakeResnet20{});
  });
  for (const auto& f : failures) {
    // Statistics over 4 images are not those over 8: the parameters move apart from one process,
    // yet stay identical across ranks (the gradients are still averaged).
    INFO(testing::joined(f));
    CHECK(testing::joined(f).find("parameters differ from one process") != std::string::npos);
    CHECK(testing::joined(f).find("differ across ranks") == std::string::npos);
  }
}

TEST_CASE("ZeRO-1 (SGD and Adam) and local SGD with period 1 equal one process", "[parallel]") {
  using testing::Strategy;
  for (Strategy strategy : {Strategy::Zero1Sgd, Strategy::Zero1Adam, Strategy::LocalSgdPeriod1})
    for (int ranks : {2, 3}) {
      DYNAMIC_SECTION("strategy " << static_cast<int>(strategy) << ", " << ranks << " ranks") {
        ThreadWorld world(ranks);
        std::vector<std::vector<std::string>> failures(static_cast<std::size_t>(ranks));
        world.run([&](ThreadComm& comm) {
          failures[comm.rank()] = testing::strategy_equivalence<double>(comm, strategy, {.per_rank_batch = 4, .steps = 3});
        });
        for (const auto& f : failures) {
          INFO(testing::joined(f));
          CHECK(f.empty());
        }
      }
    }
}

TEST_CASE("ZeRO-1: each rank keeps optimizer state for its shard only", "[parallel]") {
  ThreadWorld world(4);
  world.run([](ThreadComm& comm) {
    auto model = lenet5<CpuThreads64>();
    const auto total = count_parameters(named_tensors(model));
    Zero1 zero(model, comm);
    std::int64_t mine = 0;
    for (const auto& [name, p] : zero.shard_parameters().parameters) mine += p->value.numel();
    const auto padding = comm.rank() == 3 ? static_cast<std::int64_t>((4 - total % 4) % 4) : std::int64_t{0};
    CHECK(mine == (static_cast<std::int64_t>(total) + 3) / 4 - padding);
  });
}

TEST_CASE("ZeRO-1: values loaded into the model after construction are what the step updates", "[parallel]") {
  ThreadWorld world(2);
  world.run([](ThreadComm& comm) {
    auto model = lenet5<CpuThreads64>();
    Zero1 zero(model, comm);
    Sgd<CpuThreads64> sgd(zero.shard_parameters(), {.lr = 0.5});
    const auto named = named_tensors(model);
    for (auto& [name, p] : named.parameters) {  // "load a checkpoint": every value 1, gradient 2
      p->value.fill(1.0);
      p->grad.fill(2.0);
    }
    zero.step(sgd);
    for (auto& [name, p] : named.parameters)
      for (std::int64_t k = 0; k < p->value.numel(); ++k) REQUIRE(p->value.data()[k] == 1.0 - 0.5 * 2.0);
  });
}

TEST_CASE("DataParallel fp16 compression: close to exact, not equal", "[parallel]") {
  // Half has an 11-bit significand: gradients carry ~5e-4 relative error, parameters after three
  // steps of lr 0.05 far less.
  run_equivalence<double>(2, {.per_rank_batch = 6, .steps = 3, .tolerance = 1e-3,
                              .compression = GradientCompression::Fp16});
  ThreadWorld world(2);
  std::vector<std::vector<std::string>> exact(2);
  world.run([&](ThreadComm& comm) {
    exact[comm.rank()] = testing::dp_equivalence<double>(
        comm, {.per_rank_batch = 6, .steps = 3, .tolerance = 1e-12, .compression = GradientCompression::Fp16});
  });
  CHECK(!exact[0].empty());  // it really went through half precision
}

TEST_CASE("DataParallel bf16 compression: close to exact, not equal", "[parallel]") {
  // bfloat16 keeps 8 significant bits: gradients carry up to 2^-9 relative error per rounding,
  // 8 times fp16's. Parameters after three steps of lr 0.05 differ by 9.1e-5 (fp16: 7e-6).
  run_equivalence<double>(2, {.per_rank_batch = 6, .steps = 3, .tolerance = 1e-3,
                              .compression = GradientCompression::Bf16});
  ThreadWorld world(2);
  std::vector<std::vector<std::string>> exact(2), as_fp16(2), fp16(2);
  world.run([&](ThreadComm& comm) {
    exact[comm.rank()] = testing::dp_equivalence<double>(
        comm, {.per_rank_batch = 6, .steps = 3, .tolerance = 1e-12, .compression = GradientCompression::Bf16});
    // Coarser than fp16: a tolerance that fp16 meets (2e-5) bf16 does not.
    as_fp16[comm.rank()] = testing::dp_equivalence<double>(
        comm, {.per_rank_batch = 6, .steps = 3, .tolerance = 2e-5, .compression = GradientCompression::Bf16});
    fp16[comm.rank()] = testing::dp_equivalence<double>(
        comm, {.per_rank_batch = 6, .steps = 3, .tolerance = 2e-5, .compression = GradientCompression::Fp16});
  });
  CHECK(!exact[0].empty());  // it really went through bfloat16
  CHECK(!as_fp16[0].empty());
  INFO(testing::joined(fp16[0]));
  CHECK(fp16[0].empty());
}

TEST_CASE("Bf16Codec keeps gradients past fp16's range that Fp16Codec turns to infinity", "[parallel]") {
  // Rank r sends {1e5 (r + 1), 3, -2^-20}: averages 1.5e5, 3, -2^-20 (below fp16's smallest normal).
  ThreadWorld world(2);
  std::vector<std::vector<double>> bf16(2), fp16(2);
  world.run([&](ThreadComm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    auto reduce = [&](GradientCodec<CpuThreads64>&& codec) {
      std::vector<double> values = {1e5 * (comm.rank() + 1), 3.0, -std::ldexp(1.0, -20)};
      const CodecBucket<double> bucket{0, std::span<double>(values), values.size(), false};
      codec.start({values.size()});
      codec.launch(comm, bucket, true);
      codec.decode(comm, bucket);
      return values;
    };
    bf16[r] = reduce(Bf16Codec<CpuThreads64>());
    fp16[r] = reduce(Fp16Codec<CpuThreads64>());
  });
  for (std::size_t r = 0; r < 2; ++r) {
    INFO("rank " << r);
    CHECK(bf16[r][0] == Approx(1.5e5).epsilon(1.0 / 256));
    CHECK(bf16[r][1] == 3.0);
    CHECK(bf16[r][2] == -std::ldexp(1.0, -20));  // a power of two: exact in bf16
    CHECK(std::isinf(fp16[r][0]));
    CHECK(fp16[r][1] == 3.0);
  }
  CHECK(Bf16Codec<CpuThreads64>().name() == "bf16");
  CHECK(gradient_compression_from_string("bf16") == GradientCompression::Bf16);
  CHECK_THROWS_WITH(gradient_compression_from_string("int8"), Catch::Contains("'int8' is not one of none, fp16, bf16, topk"));
}

TEST_CASE("DataParallel top-k: error feedback keeps applied updates + residual = true gradients", "[parallel]") {
  for (int ranks : {1, 2, 3}) {
    DYNAMIC_SECTION(ranks << " ranks") {
      ThreadWorld world(ranks);
      std::vector<double> worst(static_cast<std::size_t>(ranks), 1.0);
      std::vector<double> sent_fraction(static_cast<std::size_t>(ranks), 0.0);
      world.run([&](ThreadComm& comm) {
        auto model = lenet5<CpuThreads64>();
        DataParallel dp(
            model, comm, {.first_bucket_bytes = 4096, .compression = GradientCompression::TopK, .topk_ratio = 0.05});
        const auto& params = dp.parameters().parameters;
        std::vector<std::vector<double>> applied_sum(params.size()), true_sum(params.size());
        Rng rng(11 + static_cast<std::uint64_t>(comm.rank()));
        for (int step = 0; step < 5; ++step) {
          for (std::size_t i = 0; i < params.size(); ++i) {
            auto& g = params[i].second->grad;
            true_sum[i].resize(static_cast<std::size_t>(g.numel()), 0.0);
            std::vector<double> mine(static_cast<std::size_t>(g.numel()));
            for (auto& v : mine) v = rng.normal();
            std::copy(mine.begin(), mine.end(), g.data());
            // The true averaged gradient of this step, summed over steps.
            comm.all_reduce(std::span<double>(mine), ReduceOp::Avg);
            for (std::size_t k = 0; k < mine.size(); ++k) true_sum[i][k] += mine[k];
          }
          for (auto it = params.rbegin(); it != params.rend(); ++it) it->second->grad_ready();
          dp.finish();
          std::int64_t nonzero = 0, total = 0;
          for (std::size_t i = 0; i < params.size(); ++i) {
            const auto& g = params[i].second->grad;
            applied_sum[i].resize(static_cast<std::size_t>(g.numel()), 0.0);
            for (std::int64_t k = 0; k < g.numel(); ++k) {
              applied_sum[i][static_cast<std::size_t>(k)] += g.data()[k];
              nonzero += g.data()[k] != 0.0;
            }
            total += g.numel();
          }
          sent_fraction[comm.rank()] = static_cast<double>(nonzero) / static_cast<double>(total);
        }
        double w = 0;
        for (std::size_t i = 0; i < params.size(); ++i) {
          auto residual = dp.residual_of(i);
          comm.all_reduce(std::span<double>(residual), ReduceOp::Avg);
          for (std::size_t k = 0; k < residual.size(); ++k)
            w = std::max(w, std::abs(applied_sum[i][k] + residual[k] - true_sum[i][k]));
        }
        worst[comm.rank()] = w;
      });
      for (int r = 0; r < ranks; ++r) {
        CHECK(worst[r] < 1e-11);
        CHECK(sent_fraction[r] <= 0.05 * ranks + 0.01);  // only the top 5% per rank were applied
        CHECK(sent_fraction[r] > 0.0);
      }
    }
  }
}

TEST_CASE("DataParallel: a data set that does not divide evenly trains to the end on every rank", "[parallel]") {
  // 103 samples, 4 ranks, batch 8: padding (or drop_tail) gives every rank the same number of
  // batches and the same last-batch size, so no rank waits for a gradient that never comes.
  for (const bool drop_tail : {false, true}) {
    const SyntheticImages data(103, 1, 28, 28, 10, 3);
    ThreadWorld world(4);
    std::vector<std::int64_t> steps(4, 0), last_batch(4, 0);
    world.run([&](ThreadComm& comm) {
      auto model = lenet5<CpuThreads>();
      DataParallel dp(model, comm);
      Sgd<CpuThreads> sgd(dp.parameters(), {.lr = 0.01});
      DataLoader<float> loader(data, {.batch_size = 8, .seed = 1, .rank = comm.rank(), .world_size = 4,
                                      .drop_tail = drop_tail});
      CrossEntropyLoss<CpuThreads> loss;
      CrossEntropyLoss<CpuThreads>::Cache loss_cache;
      decltype(model)::Cache cache{};
      Batch<float> batch;
      loader.start_epoch(0);
      while (loader.next(batch)) {
        sgd.zero_grad();
        loss.forward(model.forward(batch.images, cache), batch.labels, loss_cache);
        model.backward(loss.backward(loss_cache), cache);
        dp.finish();
        sgd.step();
        ++steps[comm.rank()];
        last_batch[comm.rank()] = static_cast<std::int64_t>(batch.labels.size());
      }
    });
    for (int r = 1; r < 4; ++r) {
      CHECK(steps[r] == steps[0]);
      CHECK(last_batch[r] == last_batch[0]);
    }
    CHECK(steps[0] == 4);  // 26 samples per rank (25 with drop_tail) in batches of 8
    CHECK(last_batch[0] == (drop_tail ? 1 : 2));
  }
}

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
