// DataParallel over ThreadComm: equivalence with one process (LeNet-5, float64 and float32, 2 and
// 4 ranks; ResNet-20 with SyncBatchNorm; ZeRO-1 and local SGD), gradient accumulation, compressed
// all-reduces and uneven data sets. MPI and Gloo run the same equivalence as multi-process programs
// (tests/parallel/dp_main.cpp); the bucket protocol and its errors are in test_ddp_protocol.cpp.
#include <catch2/catch.hpp>

#include "support/text.hpp"
#include "parallel/dp_equivalence.hpp"
#include "tessera/comm/launch.hpp"
#include "tessera/comm/threads.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/data/synthetic.hpp"
#include "tessera/models/mlp.hpp"

#include <cmath>
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
