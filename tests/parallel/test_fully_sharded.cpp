// FullyShardedDataParallel (ZeRO-2 and ZeRO-3) over ThreadComm: equivalence with one process
// (LeNet-5, ResNet-20 with SyncBatchNorm, and GPT with its tied wte and dropout; float64 and
// float32, 2 to 4 ranks, SGD with momentum
// and AdamW, micro-batches, shard units of several model units), what each rank holds, and the
// errors. MPI and Gloo run the same equivalence as multi-process programs (parallel/dp_main.cpp).
#include <catch2/catch.hpp>

#include <algorithm>
#include <mutex>
#include <span>

#include "parallel/fsdp_equivalence.hpp"
#include "support/text.hpp"
#include "tessera/comm/local.hpp"
#include "tessera/comm/threads.hpp"
#include "tessera/models/gpt.hpp"
#include "tessera/models/lenet.hpp"
#include "tessera/models/mlp.hpp"
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

// AdamW on ResNet-20 is held to 1e-12 or to twice the reference's own floor, whichever is larger:
// one process trained again with each batch's samples shuffled differs from itself by up to a few
// 1e-12 (fsdp_equivalence.hpp says why), so 1e-12 alone would fail one process against itself.
// Measured: FSDP 2.35e-12 from one process at 2 ranks, 1.08e-12 at 4; the shuffled references
// 0.25e-12 to 3.7e-12. Against DataParallel (the same local gradients averaged) it is held to
// 1e-15 (measured: bit for bit).
TEST_CASE("FullyShardedDataParallel: ResNet-20 with SyncBatchNorm equals one process (float64)", "[parallel][fsdp]") {
  for (int stage : {2, 3})
    for (int ranks : {2, 3, 4})
      for (auto optimizer : {testing::FsdpOptimizer::SgdMomentum, testing::FsdpOptimizer::AdamW})
        DYNAMIC_SECTION("stage " << stage << ", " << ranks << " ranks, "
                                 << (optimizer == testing::FsdpOptimizer::AdamW ? "AdamW" : "SGD")) {
          const bool adamw = optimizer == testing::FsdpOptimizer::AdamW;
          run_fsdp<double>(ranks, {.stage = stage, .optimizer = optimizer, .per_rank_batch = 2, .steps = 2,
                                   .dp_tolerance = 1e-15, .reordered_references = adamw ? 12 : 0},
                           testing::MakeResnet20{});
        }
}

TEST_CASE("FullyShardedDataParallel: float32 agrees with one process to 1e-5", "[parallel][fsdp]") {
  run_fsdp<float>(2, {.stage = 3, .optimizer = testing::FsdpOptimizer::AdamW, .per_rank_batch = 8, .tolerance = 1e-5});
}

// Mixed precision as FSDP's MixedPrecision: parameters gathered and gradients reduced in 16 bits,
// the master shard and AdamW's state in float32. Three steps of LeNet-5 then differ from one
// process by the rounding (a relative 2^-9 per bfloat16 value, 2^-12 per float16 one, compounded
// by the updates), and the wire carries half the bytes.
TEST_CASE("FullyShardedDataParallel: 16-bit gathers and reductions, float32 master shard", "[parallel][fsdp]") {
  for (const ShardDType wire : {ShardDType::BFloat16, ShardDType::Float16})
    DYNAMIC_SECTION(to_string(wire)) {
      const double tolerance = wire == ShardDType::BFloat16 ? 3e-2 : 5e-3;
      run_fsdp<float>(2, {.stage = 3, .optimizer = testing::FsdpOptimizer::AdamW, .per_rank_batch = 8,
                          .param_dtype = wire, .reduce_dtype = wire, .tolerance = tolerance, .at_least = 1e-7});
      run_fsdp<float>(2, {.stage = 2, .per_rank_batch = 8, .reduce_dtype = wire, .tolerance = tolerance, .at_least = 1e-7});
    }
  ThreadWorld world(2);
  std::vector<FullyShardedStepStats> stats(2);
  const testing::DpData<float> data(8);
  world.run([&](ThreadComm& comm) {
    for (const ShardDType wire : {ShardDType::Same, ShardDType::BFloat16}) {
      auto model = lenet5<CpuThreads>(1, 28, 10, 7);
      FullyShardedDataParallel fsdp(model, comm, {.stage = 3, .param_dtype = wire, .reduce_dtype = wire});
      fsdp.train_step(data.batch(comm.rank() * 4, 4), data.batch_labels(comm.rank() * 4, 4));
      if (comm.rank() == 0) stats[wire == ShardDType::Same ? 0 : 1] = fsdp.last_step();
    }
  });
  CHECK(stats[1].gathered_elements == stats[0].gathered_elements);
  CHECK(stats[0].gathered_bytes == 4 * stats[0].gathered_elements);
  CHECK(stats[1].gathered_bytes * 2 == stats[0].gathered_bytes);
  CHECK(stats[1].reduce_scattered_bytes * 2 == stats[0].reduce_scattered_bytes);
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

// The point of sharding: a model that does not fit. Four ranks on threads share one process's
// allocator, so its limit is theirs together. Each strategy's peak over two AdamW steps of an MLP
// 784-512x8-10 (2.24 M parameters, 9 MB: DataParallel holds per rank values, gradients, their
// bucket copy and two Adam moments, 5 x 9 MB; stage 3 a quarter of the values, gradients and
// moments, plus the few units in use and, while it is built, the whole model) is measured first;
// under a limit between the two, DataParallel's step ends in the named error and stage 3 trains to
// the loss it reaches without a limit.
TEST_CASE("FullyShardedDataParallel: under a memory limit DataParallel passes, stage 3 trains", "[parallel][fsdp]") {
  constexpr int ranks = 4, steps = 2;
  constexpr std::int64_t per_rank = 4;
  const testing::DpData<float> data(per_rank * ranks * steps);
  CachingAllocator& allocator = Cpu::allocator();
  const auto make = [] { return Mlp<CpuThreads>(784, std::vector<std::int64_t>(8, 512), 10, 7); };
  // Trains `steps` steps under strategy kind (0: DataParallel, 1: stage 3); returns the last loss
  // of each rank and leaves the peak of bytes in use since `base` in *peak.
  const auto train = [&](int kind, std::size_t* peak) {
    std::vector<double> loss(ranks, 0);
    allocator.release_cached();
    const std::size_t base = allocator.stats().bytes_in_use;
    allocator.reset_peak();
    ThreadWorld world(ranks);
    world.run([&](ThreadComm& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      auto model = make();
      TrainOptions o = fsdp_quiet();
      if (kind == 0) {
        DataParallel dp(model, comm);
        AdamW<CpuThreads> adamw(dp.parameters(), {});
        Trainer trainer(model, adamw, dp, fsdp_lr, o);
        for (int s = 0; s < steps; ++s)
          loss[r] = trainer.train_step(data.trainer_batch((s * ranks + comm.rank()) * per_rank, per_rank));
      } else {
        FullyShardedDataParallel fsdp(model, comm, {.stage = 3});
        AdamW<CpuThreads> adamw(fsdp.shard_parameters(), {});
        FullyShardedOptimizer optimizer(fsdp, adamw);
        Trainer trainer(model, optimizer, fsdp, fsdp_lr, o);
        for (int s = 0; s < steps; ++s)
          loss[r] = trainer.train_step(data.trainer_batch((s * ranks + comm.rank()) * per_rank, per_rank));
      }
    });
    if (peak) *peak = allocator.stats().peak_bytes_in_use - base;
    return loss;
  };
  std::size_t dp_peak = 0, fsdp_peak = 0;
  const auto dp_loss = train(0, &dp_peak);
  const auto fsdp_loss = train(1, &fsdp_peak);
  INFO("peak bytes in use: DataParallel " << dp_peak << ", stage 3 " << fsdp_peak);
  REQUIRE(fsdp_peak < 0.6 * static_cast<double>(dp_peak));
  for (int r = 0; r < ranks; ++r) CHECK(std::abs(fsdp_loss[r] - dp_loss[r]) < 1e-5);

  struct LimitScope {  // the process's allocator gets its limit back whatever happens
    CachingAllocator& a;
    ~LimitScope() { a.set_limit(0); }
  } restore{allocator};
  allocator.release_cached();
  allocator.set_limit(allocator.stats().bytes_in_use + (dp_peak + fsdp_peak) / 2);
  std::string error;
  try {
    train(0, nullptr);
  } catch (const OutOfMemoryError& e) {
    error = e.what();
  }
  CHECK_THAT(error, Catch::Contains("memory limit of") && Catch::Contains("would be passed allocating") &&
                        Catch::Contains(" for the "));
  allocator.release_cached();
  const auto capped = train(1, nullptr);
  for (int r = 0; r < ranks; ++r) CHECK(std::abs(capped[r] - fsdp_loss[r]) < 1e-6);
}

// The prefetch, as the timeline shows it: unit k + 1's all_gather is issued before unit k's forward
// starts and waited for after it ends (the span covers the compute); without prefetch every gather
// ends before its unit's forward begins. Backward: unit k's reduce_scatter span covers unit k - 1's
// backward.
TEST_CASE("FullyShardedDataParallel: the next unit's gather runs during this unit's compute", "[parallel][fsdp]") {
  struct Recorder final : SpanSink {
    struct Span {
      std::string name;
      Clock::time_point begin, end;
    };
    std::mutex mutex;
    std::vector<Span> spans;
    void add(std::string name, const char*, Clock::time_point begin, Clock::time_point end, int) override {
      const std::lock_guard<std::mutex> lock(mutex);
      spans.push_back({std::move(name), begin, end});
    }
    const Span& find(const std::string& prefix) const {
      for (const auto& s : spans)
        if (s.name.rfind(prefix, 0) == 0) return s;
      FAIL("no span " << prefix);
      return spans.front();
    }
  };
  const testing::DpData<double> data(8);
  for (const bool prefetch : {true, false}) {
    Recorder recorder;
    ThreadWorld world(2);
    world.run([&](ThreadComm& comm) {
      auto model = lenet5<CpuThreads64>(1, 28, 10, 7);
      FullyShardedDataParallel fsdp(model, comm, {.stage = 3, .prefetch = prefetch});
      if (comm.rank() == 0) fsdp.set_timeline(&recorder);
      fsdp.train_step(data.batch(comm.rank() * 4, 4), data.batch_labels(comm.rank() * 4, 4));
    });
    INFO((prefetch ? "prefetch" : "no prefetch"));
    // LeNet-5's units: conv1, relu1, pool1, conv2, ...: the next unit with parameters after conv1
    // is conv2, whose gather is issued before conv1's forward (with prefetch).
    const auto& conv1 = recorder.find("forward conv1");
    const auto& gather_conv2 = recorder.find("all_gather conv2");
    if (prefetch) {
      CHECK(gather_conv2.begin <= conv1.begin);
      CHECK(gather_conv2.end >= conv1.end);
    } else {
      CHECK(gather_conv2.begin >= conv1.end);
    }
    const auto& backward_conv1 = recorder.find("backward conv1");
    const auto& reduce_conv2 = recorder.find("reduce_scatter conv2");
    CHECK(reduce_conv2.begin <= backward_conv1.begin);
    CHECK(reduce_conv2.end >= backward_conv1.end);
  }
}

TEST_CASE("FullyShardedDataParallel: GPT (token ids, tied wte) with dropout equals one process, micro-batches too",
          "[parallel][fsdp][gpt]") {
  // Every rank builds the model from one seed, so each draws the step's dropout key as one process
  // does; rank r's rows are rows [r n, (r + 1) n) of the global batch, and its held key's row
  // offset puts its masks where one process has them.
  using Reference = Env<Cpu, LocalComm, double>;
  using E = Env<Cpu, ThreadComm, double>;
  const GPTConfig config{.block_size = 8, .vocab_size = 13, .n_layer = 2, .n_head = 2, .n_embd = 8, .dropout = 0.2};
  const AdamWOptions adamw{.lr = 1e-2, .weight_decay = 0.1};
  constexpr std::int64_t global = 6, t = 8, steps = 2;
  Rng data(5);
  Tensor<std::int64_t, Cpu> ids({steps * global, t});
  std::vector<std::int64_t> labels(static_cast<std::size_t>(steps * global * t));
  for (std::int64_t k = 0; k < ids.numel(); ++k) ids.data()[k] = static_cast<std::int64_t>(data.below(13));
  for (auto& l : labels) l = static_cast<std::int64_t>(data.below(13));
  const auto rows = [&](std::int64_t first, std::int64_t n) {
    Tensor<std::int64_t, Cpu> out({n, t});
    std::copy_n(ids.data() + first * t, n * t, out.data());
    return out;
  };
  const auto row_labels = [&](std::int64_t first, std::int64_t n) {
    return std::span<const std::int64_t>(labels).subspan(static_cast<std::size_t>(first * t), static_cast<std::size_t>(n * t));
  };
  Rng reference_rng(9);
  GPT<Reference> reference(config, reference_rng);
  auto reference_params = named_tensors(reference);
  AdamW<Reference> reference_opt(reference_params, adamw);
  for (std::int64_t s = 0; s < steps; ++s) {
    reference_opt.zero_grad();
    GPT<Reference>::Cache cache;
    CrossEntropyLoss<Reference> ce;
    CrossEntropyLoss<Reference>::Cache ce_cache;
    ce.forward(reference.forward(rows(s * global, global), cache), row_labels(s * global, global), ce_cache);
    reference.backward(ce.backward(ce_cache), cache);
    reference_opt.step();
  }
  for (int ranks : {2, 3})
    for (int stage : {2, 3})
      for (int micro_batches : {1, 2})
        DYNAMIC_SECTION(ranks << " ranks, stage " << stage << ", " << micro_batches << " micro-batches") {
          std::vector<double> worst(static_cast<std::size_t>(ranks), 0.0);
          ThreadWorld world(ranks);
          world.run([&](ThreadComm& comm) {
            Rng rng(9);
            GPT<E> model(config, rng);
            const std::int64_t n = global / ranks;
            FullyShardedDataParallel fsdp(model, comm, {.stage = stage, .micro_batches = n % micro_batches == 0 ? micro_batches : 1});
            AdamW<E> shard_opt(fsdp.shard_parameters(), adamw);
            FullyShardedOptimizer opt(fsdp, shard_opt);
            for (std::int64_t s = 0; s < steps; ++s) {
              opt.zero_grad();
              const std::int64_t first = s * global + comm.rank() * n;
              fsdp.train_step(rows(first, n), row_labels(first, n));
              opt.step();
            }
            fsdp.gather_full();
            auto params = named_tensors(model);
            double w = 0;
            for (std::size_t i = 0; i < params.parameters.size(); ++i) {
              const auto& got = params.parameters[i].second->value;
              const auto& want = reference_params.parameters[i].second->value;
              for (std::int64_t k = 0; k < got.numel(); ++k) w = std::max(w, std::abs(got.data()[k] - want.data()[k]));
            }
            worst[static_cast<std::size_t>(comm.rank())] = w;
          });
          for (double w : worst) CHECK(w < 1e-12);
        }
}
