// FullyShardedDataParallel (ZeRO-2 and ZeRO-3) over ThreadComm: equivalence with one process
// (LeNet-5 and ResNet-20 with SyncBatchNorm, float64 and float32, 2 to 4 ranks, SGD with momentum
// and AdamW, micro-batches, shard units of several model units), what each rank holds, and the
// errors. MPI and Gloo run the same equivalence as multi-process programs (parallel/dp_main.cpp).
#include <catch2/catch.hpp>

#include "parallel/fsdp_equivalence.hpp"
#include "support/text.hpp"
#include "tessera/comm/threads.hpp"
#include "tessera/models/lenet.hpp"
#include "tessera/parallel/data_parallel.hpp"
#include "tessera/train/trainer.hpp"

using namespace tessera;

namespace {
template <class S, class Maker = testing::MakeLenet>
void run_fsdp(int ranks, const testing::FsdpCase& c, Maker maker = {}) {
  ThreadWorld world(ranks);
  std::vector<std::vector<std::string>> failures(static_cast<std::size_t>(ranks));
  world.run([&](ThreadComm& comm) { failures[comm.rank()] = testing::fsdp_equivalence<S>(comm, c, maker); });
  for (const auto& f : failures) {
    INFO(testing::joined(f));
    CHECK(f.empty());
  }
}
}  // namespace

TEST_CASE("FullyShardedDataParallel: stages 2 and 3 at 2, 3 and 4 ranks equal one process (float64, LeNet-5)",
          "[parallel][fsdp]") {
  for (int stage : {2, 3})
    for (int ranks : {2, 3, 4})
      for (auto optimizer : {testing::FsdpOptimizer::SgdMomentum, testing::FsdpOptimizer::AdamW})
        DYNAMIC_SECTION("stage " << stage << ", " << ranks << " ranks, "
                                 << (optimizer == testing::FsdpOptimizer::AdamW ? "AdamW" : "SGD")) {
          run_fsdp<double>(ranks, {.stage = stage, .optimizer = optimizer, .per_rank_batch = 3});
        }
}

// AdamW to 1e-10 rather than 1e-12: its update divides by sqrt(v) + eps, so a gradient component
// near zero (ResNet-20 has some) carries its rounding error into the weights multiplied by up to
// lr / eps = 1e5, and the sum over ranks rounds differently from the sum over one batch (1.1e-12
// here, the same for both stages).
TEST_CASE("FullyShardedDataParallel: ResNet-20 with SyncBatchNorm equals one process (float64)", "[parallel][fsdp]") {
  for (int stage : {2, 3})
    for (int ranks : {2, 4})
      for (auto optimizer : {testing::FsdpOptimizer::SgdMomentum, testing::FsdpOptimizer::AdamW})
        DYNAMIC_SECTION("stage " << stage << ", " << ranks << " ranks, "
                                 << (optimizer == testing::FsdpOptimizer::AdamW ? "AdamW" : "SGD")) {
          const double tolerance = optimizer == testing::FsdpOptimizer::AdamW ? 1e-10 : 1e-12;
          run_fsdp<double>(ranks, {.stage = stage, .optimizer = optimizer, .per_rank_batch = 2, .steps = 2,
                                   .tolerance = tolerance},
                           testing::MakeResnet20{});
        }
}

TEST_CASE("FullyShardedDataParallel: float32 agrees with one process to 1e-5", "[parallel][fsdp]") {
  run_fsdp<float>(2, {.stage = 3, .optimizer = testing::FsdpOptimizer::AdamW, .per_rank_batch = 8, .tolerance = 1e-5});
}

TEST_CASE("FullyShardedDataParallel: micro-batches, grouped units and no prefetch change nothing", "[parallel][fsdp]") {
  SECTION("micro-batches") { run_fsdp<double>(2, {.stage = 3, .per_rank_batch = 4, .micro_batches = 2}); }
  SECTION("shard units of several layers") {
    run_fsdp<double>(3, {.stage = 3, .optimizer = testing::FsdpOptimizer::AdamW, .unit_boundaries = {0, 3, 7, 12}});
  }
  SECTION("no prefetch") { run_fsdp<double>(2, {.stage = 2, .prefetch = false}); }
}

namespace {
TrainOptions fsdp_quiet() {
  TrainOptions o;
  o.verbose = false;
  return o;
}
double fsdp_lr(double) { return 1e-3; }
}  // namespace

TEST_CASE("FullyShardedDataParallel: the Trainer drives it like DataParallel, to the same parameters", "[parallel][fsdp]") {
  constexpr int ranks = 2;
  constexpr std::int64_t per_rank = 4, global = ranks * per_rank, steps = 4;
  const testing::DpData<double> data(global * steps);
  std::vector<std::vector<double>> with_dp(ranks), with_fsdp(ranks);
  std::vector<double> fsdp_loss(ranks, 0), dp_loss(ranks, 0);
  ThreadWorld world(ranks);
  world.run([&](ThreadComm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    const auto flat = [](auto& model) {
      std::vector<double> out;
      for (auto& [name, p] : named_tensors(model).parameters) out.insert(out.end(), p->value.begin(), p->value.end());
      return out;
    };
    {
      auto model = lenet5<CpuThreads64>(1, 28, 10, 7);
      DataParallel dp(model, comm);
      AdamW<CpuThreads64> adamw(dp.parameters(), {});
      Trainer trainer(model, adamw, dp, fsdp_lr, fsdp_quiet());
      for (std::int64_t s = 0; s < steps; ++s)
        dp_loss[r] = trainer.train_step(data.trainer_batch(s * global + comm.rank() * per_rank, per_rank));
      with_dp[r] = flat(model);
    }
    auto model = lenet5<CpuThreads64>(1, 28, 10, 7);
    FullyShardedDataParallel fsdp(model, comm, {.stage = 3});
    AdamW<CpuThreads64> adamw(fsdp.shard_parameters(), {});
    FullyShardedOptimizer optimizer(fsdp, adamw);
    Trainer trainer(model, optimizer, fsdp, fsdp_lr, fsdp_quiet());
    for (std::int64_t s = 0; s < steps; ++s)
      fsdp_loss[r] = trainer.train_step(data.trainer_batch(s * global + comm.rank() * per_rank, per_rank));
    fsdp.gather_full();
    with_fsdp[r] = flat(model);
  });
  for (std::size_t r = 0; r < ranks; ++r) {
    INFO("rank " << r);
    REQUIRE(with_fsdp[r].size() == with_dp[r].size());
    double worst = 0;
    for (std::size_t k = 0; k < with_dp[r].size(); ++k) worst = std::max(worst, std::abs(with_fsdp[r][k] - with_dp[r][k]));
    CHECK(worst < 1e-12);
    CHECK(std::abs(fsdp_loss[r] - dp_loss[r]) < 1e-12);
  }
}

TEST_CASE("FullyShardedDataParallel: bad input and ranks that disagree are named", "[parallel][fsdp]") {
  SECTION("stepping the shard's optimizer directly") {
    ThreadWorld world(2);
    std::vector<std::string> errors(2);
    world.run([&](ThreadComm& comm) {
      auto model = lenet5<CpuThreads64>(1, 28, 10, 7);
      FullyShardedDataParallel fsdp(model, comm);
      Sgd<CpuThreads64> sgd(fsdp.shard_parameters(), {.lr = 0.1});
      try {
        sgd.step();
      } catch (const Error& e) {
        errors[static_cast<std::size_t>(comm.rank())] = e.what();
      }
    });
    CHECK_THAT(errors[1], Catch::Contains("FullyShardedDataParallel on rank 1") &&
                              Catch::Contains("FullyShardedOptimizer(fsdp, optimizer)"));
  }
  SECTION("ranks launched with different stages, or learning rates") {
    ThreadWorld world(2);
    std::vector<std::string> stage_errors(2), lr_errors(2);
    const testing::DpData<double> data(8);
    world.run([&](ThreadComm& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      auto model = lenet5<CpuThreads64>(1, 28, 10, 7);
      try {
        FullyShardedDataParallel fsdp(model, comm, {.stage = r == 1 ? 2 : 3});
      } catch (const AgreementError& e) {
        stage_errors[r] = e.what();
      }
      FullyShardedDataParallel fsdp(model, comm, {.stage = 3});
      Sgd<CpuThreads64> sgd(fsdp.shard_parameters(), {.lr = r == 1 ? 0.2 : 0.1});
      FullyShardedOptimizer optimizer(fsdp, sgd);
      try {
        optimizer.zero_grad();
        fsdp.train_step(data.batch(comm.rank() * 4, 4), data.batch_labels(comm.rank() * 4, 4));
        optimizer.step();
      } catch (const AgreementError& e) {
        lr_errors[r] = e.what();
      }
    });
    for (std::size_t r = 0; r < 2; ++r) {
      CHECK_THAT(stage_errors[r], Catch::StartsWith("FullyShardedDataParallel: ranks disagree on options.stage: rank 0: 3; rank 1: 2"));
      CHECK_THAT(lr_errors[r], Catch::StartsWith("FullyShardedDataParallel: ranks disagree on optimizer.lr: rank 0: 0.1; rank 1: 0.2 (at optimizer step 1:"));
    }
  }
  SECTION("a batch that does not split into the micro-batches, labels of another size") {
    ThreadWorld world(1);
    std::string split, labels;
    const testing::DpData<double> data(8);
    world.run([&](ThreadComm& comm) {
      auto model = lenet5<CpuThreads64>(1, 28, 10, 7);
      FullyShardedDataParallel fsdp(model, comm, {.micro_batches = 3});
      try {
        fsdp.train_step(data.batch(0, 4), data.batch_labels(0, 4));
      } catch (const ShapeError& e) {
        split = e.what();
      }
      try {
        fsdp.train_step(data.batch(0, 6), data.batch_labels(0, 5));
      } catch (const ShapeError& e) {
        labels = e.what();
      }
    });
    CHECK_THAT(split, Catch::Contains("the batch of 4 samples") && Catch::Contains("does not split into 3"));
    CHECK_THAT(labels, Catch::Contains("5 labels for a batch of 6 samples"));
  }
}

TEST_CASE("FullyShardedDataParallel: what each rank holds between steps", "[parallel][fsdp]") {
  ThreadWorld world(4);
  std::vector<std::int64_t> model_elements(4), shard(4), held_stage2(4), held_stage3(4);
  world.run([&](ThreadComm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    const auto held = [](auto& model) {  // parameter and gradient elements the model's tensors keep
      std::int64_t n = 0;
      for (auto& [name, p] : named_tensors(model).parameters) n += p->value.numel() + p->grad.numel();
      return n;
    };
    auto model2 = lenet5<CpuThreads64>(1, 28, 10, 7), model3 = lenet5<CpuThreads64>(1, 28, 10, 7);
    FullyShardedDataParallel stage2(model2, comm, {.stage = 2}), stage3(model3, comm, {.stage = 3});
    model_elements[r] = stage3.model_elements();
    shard[r] = stage3.shard_elements();
    held_stage2[r] = held(model2);
    held_stage3[r] = held(model3);
  });
  for (std::size_t r = 0; r < 4; ++r) {
    CHECK(model_elements[r] == 61706);  // LeNet-5 on 28 x 28: 156 + 2,416 + 48,120 + 10,164 + 850
    // Each unit's F_u elements padded to a multiple of 4: at most 3 per unit with parameters (5).
    CHECK(shard[r] * 4 >= model_elements[r]);
    CHECK(shard[r] * 4 <= model_elements[r] + 5 * 3);
    CHECK(held_stage2[r] == model_elements[r]);  // the values, no gradients
    CHECK(held_stage3[r] == 0);                  // neither
  }
}
