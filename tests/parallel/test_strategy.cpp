// The strategy protocol (parallel/strategy.hpp) driven by the Trainer: gradient accumulation as a
// strategy against one step on the whole batch, stack(DataParallel, GradientAccumulation) on two
// thread ranks against one process, a user-written strategy acting on the averaged gradients, a
// user-written gradient codec (a DDP communication hook), and per-rank state kept across a
// checkpoint (top-k residuals, LocalSgd's step count: a resume continues bit for bit). The
// compile-time checks (a missing hook, two loop owners) are in tests/compile_fail. A strategy that
// runs the model: the Pipeline alone and stacked under DataParallel, against one process.
#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "parallel/dp_equivalence.hpp"
#include "support/temp_dir.hpp"
#include "tessera/comm/threads.hpp"
#include "tessera/data/synthetic.hpp"
#include "tessera/parallel/gradient_accumulation.hpp"
#include "tessera/parallel/gradient_codec.hpp"
#include "tessera/parallel/pipeline.hpp"
#include "tessera/train/trainer.hpp"

using namespace tessera;

namespace {

constexpr std::int64_t kClasses = 10;

template <class Model>
std::vector<double> flat_parameters(Model& model) {
  std::vector<double> out;
  for (auto& [name, p] : named_tensors(model).parameters)
    for (std::int64_t i = 0; i < p->value.numel(); ++i) out.push_back(static_cast<double>(p->value.data()[i]));
  return out;
}

double largest_difference(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return worst;
}

TrainOptions quiet();
double constant_lr(double);

// The reference of the data-parallel cases: one process, SGD with momentum, on the whole global
// batches; its parameters after `steps` steps.
std::vector<double> one_process_parameters(const testing::DpData<double>& data, std::int64_t global, std::int64_t steps) {
  auto reference = lenet5<CpuLocal64>(1, 28, kClasses, 7);
  Sgd<CpuLocal64> sgd(named_tensors(reference), {.lr = 0.05, .momentum = 0.9});
  Trainer one_process(reference, sgd, constant_lr, quiet());
  for (std::int64_t s = 0; s < steps; ++s) one_process.train_step(data.trainer_batch(s * global, global));
  return flat_parameters(reference);
}

TrainOptions quiet() {
  TrainOptions o;
  o.verbose = false;
  return o;
}

double constant_lr(double) { return 0.05; }

}  // namespace

TEST_CASE("GradientAccumulation: k micro-batches step like one step on the whole batch (float64)", "[parallel]") {
  constexpr std::int64_t batch = 10, steps = 3;  // 10 samples in 4 micro-batches: 3, 3, 2, 2
  testing::DpData<double> data(batch * steps);
  auto whole = lenet5<CpuLocal64>(1, 28, kClasses, 7);
  auto split = lenet5<CpuLocal64>(1, 28, kClasses, 7);
  Sgd<CpuLocal64> whole_sgd(named_tensors(whole), {.lr = 0.05, .momentum = 0.9});
  Sgd<CpuLocal64> split_sgd(named_tensors(split), {.lr = 0.05, .momentum = 0.9});
  GradientAccumulation<CpuLocal64> accumulate(4);
  Trainer one_step(whole, whole_sgd, constant_lr, quiet());
  Trainer accumulated(split, split_sgd, accumulate, constant_lr, quiet());
  for (std::int64_t s = 0; s < steps; ++s) {
    const auto b = data.trainer_batch(s * batch, batch);
    const double expected = one_step.train_step(b);
    CHECK(accumulated.train_step(b) == Approx(expected).epsilon(1e-12));
  }
  CHECK(largest_difference(flat_parameters(whole), flat_parameters(split)) < 1e-12);
  CHECK(accumulated.state().global_step == steps);  // one optimizer step per batch, not per micro-batch

  CHECK_THROWS_WITH(accumulated.train_step(data.trainer_batch(0, 3)),
                    Catch::Contains("a batch of 3 samples cannot be split into 4 micro-batches"));
  CHECK_THROWS_WITH(GradientAccumulation<CpuLocal64>(0), Catch::Contains("micro_batches=0 must be >= 1"));
}

TEST_CASE("stack(DataParallel, GradientAccumulation): 2 ranks x 2 micro-batches equal one process (float64)",
          "[parallel]") {
  constexpr int ranks = 2;
  constexpr std::int64_t per_rank = 8, global = ranks * per_rank, steps = 3;
  testing::DpData<double> data(global * steps);
  const auto expected = one_process_parameters(data, global, steps);

  std::vector<double> difference(ranks, 1.0);
  std::vector<std::string> names(ranks);
  ThreadWorld world(ranks);
  world.run([&](ThreadComm& comm) {
    auto model = lenet5<CpuThreads64>(1, 28, kClasses, 7);
    DataParallel dp(model, comm);
    Sgd<CpuThreads64> sgd(dp.parameters(), {.lr = 0.05, .momentum = 0.9});
    GradientAccumulation<CpuThreads64> accumulate(2);
    auto strategy = stack(dp, accumulate);
    TrainOptions o = quiet();
    o.checkpoint_group = CheckpointGroup(comm);
    Trainer trainer(model, sgd, strategy, constant_lr, o);
    // Only the last micro-batch's backward communicates: were the first one's buckets sent too,
    // the second backward's hooks would fire again and DataParallel would throw.
    for (std::int64_t s = 0; s < steps; ++s)
      trainer.train_step(data.trainer_batch(s * global + comm.rank() * per_rank, per_rank));
    difference[static_cast<std::size_t>(comm.rank())] = largest_difference(flat_parameters(model), expected);
    names[static_cast<std::size_t>(comm.rank())] = strategy.name();
  });
  for (int r = 0; r < ranks; ++r) {
    INFO("rank " << r);
    CHECK(difference[static_cast<std::size_t>(r)] < 1e-12);
    CHECK(names[static_cast<std::size_t>(r)] == "DataParallel x GradientAccumulation(2)");
  }
}

TEST_CASE("Top-k residuals are checkpointed: a resumed run continues bit for bit (float64, 2 ranks)",
          "[parallel][checkpoint]") {
  constexpr int ranks = 2;
  constexpr std::int64_t per_rank = 8, global = ranks * per_rank, steps = 6, cut = 3;
  testing::DpData<double> data(global * steps);
  testing::TempDir dir;
  const std::string path = dir / "topk.safetensors";
  struct Run {
    std::vector<std::vector<double>> losses = std::vector<std::vector<double>>(ranks);
    std::vector<std::vector<double>> parameters = std::vector<std::vector<double>>(ranks);
    std::vector<double> residual_at_cut = std::vector<double>(ranks, 0.0);
  };
  // Steps [from, to) of one run; `load`: resume from `path` first; `save`: save there at the end.
  const auto train = [&](Run& run, std::int64_t from, std::int64_t to, bool load, bool save) {
    ThreadWorld world(ranks);
    world.run([&](ThreadComm& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      auto model = lenet5<CpuThreads64>(1, 28, kClasses, 7);
      DataParallel dp(model, comm, {.compression = GradientCompression::TopK, .topk_ratio = 0.05});
      Sgd<CpuThreads64> sgd(dp.parameters(), {.lr = 0.05, .momentum = 0.9});
      TrainOptions o = quiet();
      o.checkpoint_group = CheckpointGroup(comm);
      Trainer trainer(model, sgd, dp, constant_lr, o);
      if (load) trainer.load(path);
      for (std::int64_t s = from; s < to; ++s)
        run.losses[r].push_back(trainer.train_step(data.trainer_batch(s * global + comm.rank() * per_rank, per_rank)));
      for (std::size_t p = 0; p < dp.parameters().parameters.size(); ++p)
        for (double v : dp.residual_of(p)) run.residual_at_cut[r] = std::max(run.residual_at_cut[r], std::abs(v));
      if (save) trainer.save(path);
      run.parameters[r] = flat_parameters(model);
    });
  };
  Run uninterrupted, resumed;
  train(uninterrupted, 0, steps, false, false);
  train(resumed, 0, cut, false, true);
  // The residuals hold what top-k has not sent yet (95% of each gradient's entries): far from zero.
  for (int r = 0; r < ranks; ++r) CHECK(resumed.residual_at_cut[static_cast<std::size_t>(r)] > 1e-6);
  for (int r = 0; r < ranks; ++r) CHECK(std::filesystem::exists(strategy_state_path(path, r)));
  train(resumed, cut, steps, true, false);
  for (int r = 0; r < ranks; ++r) {
    INFO("rank " << r);
    const auto u = static_cast<std::size_t>(r);
    REQUIRE(resumed.losses[u].size() == uninterrupted.losses[u].size());
    for (std::size_t s = 0; s < uninterrupted.losses[u].size(); ++s) {
      INFO("step " << s);
      CHECK(std::bit_cast<std::uint64_t>(resumed.losses[u][s]) == std::bit_cast<std::uint64_t>(uninterrupted.losses[u][s]));
    }
    CHECK(resumed.parameters[u] == uninterrupted.parameters[u]);
  }

  SECTION("a missing strategy file stops the resume on every rank, naming the rank") {
    std::filesystem::remove(strategy_state_path(path, 1));
    std::vector<std::string> errors(ranks);
    ThreadWorld world(ranks);
    world.run([&](ThreadComm& comm) {
      auto model = lenet5<CpuThreads64>(1, 28, kClasses, 7);
      DataParallel dp(model, comm, {.compression = GradientCompression::TopK, .topk_ratio = 0.05});
      Sgd<CpuThreads64> sgd(dp.parameters(), {.lr = 0.05, .momentum = 0.9});
      TrainOptions o = quiet();
      o.checkpoint_group = CheckpointGroup(comm);
      Trainer trainer(model, sgd, dp, constant_lr, o);
      try {
        trainer.load(path);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(comm.rank())] = e.what();
      }
    });
    CHECK_THAT(errors[0], Catch::Contains("rank(s) 1 could not load their strategy state"));
    CHECK_THAT(errors[1], Catch::Contains(".rank1.strategy"));
  }
}

// A strategy written by a user, acting on the gradients as a DDP communication hook would: it
// rounds every gradient to a multiple of 2^-10 after DataParallel averaged it (the stack runs
// before_optimizer_step in order: DataParallel's finish() first). Ten lines.
namespace {
template <class E>
struct RoundGradients : StrategyBase<E> {
  NamedTensors<E> parameters;
  explicit RoundGradients(NamedTensors<E> p) : parameters(std::move(p)) {}
  std::string name() const { return "RoundGradients(2^-10)"; }
  void before_optimizer_step() {
    for (auto& [name, p] : parameters.parameters)
      for (std::int64_t i = 0; i < p->grad.numel(); ++i)
        p->grad.data()[i] = std::round(p->grad.data()[i] * 1024.0) / 1024.0;
  }
};
}  // namespace

TEST_CASE("A user-written strategy stacks after DataParallel and sees the averaged gradients", "[parallel]") {
  constexpr int ranks = 2;
  constexpr std::int64_t per_rank = 4, global = ranks * per_rank;
  testing::DpData<double> data(global);
  // One process: the same codec on the whole batch's gradient.
  auto reference = lenet5<CpuLocal64>(1, 28, kClasses, 7);
  Sgd<CpuLocal64> reference_sgd(named_tensors(reference), {.lr = 0.05});
  RoundGradients<CpuLocal64> reference_codec(named_tensors(reference));
  Trainer one_process(reference, reference_sgd, reference_codec, constant_lr, quiet());
  one_process.train_step(data.trainer_batch(0, global));
  const auto expected = flat_parameters(reference);
  std::vector<double> difference(ranks, 1.0);
  ThreadWorld world(ranks);
  world.run([&](ThreadComm& comm) {
    auto model = lenet5<CpuThreads64>(1, 28, kClasses, 7);
    DataParallel dp(model, comm);
    Sgd<CpuThreads64> sgd(dp.parameters(), {.lr = 0.05});
    RoundGradients<CpuThreads64> codec(dp.parameters());
    auto strategy = stack(dp, codec);
    TrainOptions o = quiet();
    o.checkpoint_group = CheckpointGroup(comm);
    Trainer trainer(model, sgd, strategy, constant_lr, o);
    trainer.train_step(data.trainer_batch(comm.rank() * per_rank, per_rank));
    difference[static_cast<std::size_t>(comm.rank())] = largest_difference(flat_parameters(model), expected);
  });
  // Averages that differ in the last bits can round to neighbouring multiples: at most one step of
  // 2^-10 x lr apart, and nearly always equal.
  for (double d : difference) CHECK(d <= 0.05 / 1024 + 1e-12);
}

TEST_CASE("LocalSgd under the Trainer keeps its period across a resume (float64, 2 ranks)", "[parallel][checkpoint]") {
  constexpr int ranks = 2;
  constexpr std::int64_t per_rank = 4, global = ranks * per_rank, steps = 5, cut = 2, period = 3;
  testing::DpData<double> data(global * steps);
  testing::TempDir dir;
  const std::string path = dir / "local.safetensors";
  std::vector<std::vector<double>> uninterrupted(ranks), resumed(ranks);
  const auto train = [&](std::vector<std::vector<double>>& out, std::int64_t from, std::int64_t to, bool load, bool save) {
    ThreadWorld world(ranks);
    world.run([&](ThreadComm& comm) {
      // Ranks start apart (LocalSgd broadcasts rank 0's weights) and train on their own shards, so
      // the replicas differ between averages: an average at another step gives other weights.
      auto model = lenet5<CpuThreads64>(1, 28, kClasses, 7);
      LocalSgd local(model, comm, {.period = period});
      // Momentum buffers differ by rank too: the Trainer keeps each rank's (kPerRankOptimizerState).
      Sgd<CpuThreads64> sgd(named_tensors(model), {.lr = 0.05, .momentum = 0.9});
      TrainOptions o = quiet();
      o.checkpoint_group = CheckpointGroup(comm);
      Trainer trainer(model, sgd, local, constant_lr, o);
      if (load) trainer.load(path);
      for (std::int64_t s = from; s < to; ++s)
        trainer.train_step(data.trainer_batch(s * global + comm.rank() * per_rank, per_rank));
      if (save) trainer.save(path);
      out[static_cast<std::size_t>(comm.rank())] = flat_parameters(model);
    });
  };
  train(uninterrupted, 0, steps, false, false);
  train(resumed, 0, cut, false, true);
  train(resumed, cut, steps, true, false);
  for (int r = 0; r < ranks; ++r) {
    INFO("rank " << r);
    CHECK(resumed[static_cast<std::size_t>(r)] == uninterrupted[static_cast<std::size_t>(r)]);
  }
  // The replicas differ after step 5 (last averaged at step 3), as they did at the cut (step 2): the
  // resumed ranks got their own parameters back, not rank 0's.
  CHECK(uninterrupted[0] != uninterrupted[1]);
}

// A gradient codec written by a user (PyTorch: a DDP communication hook): a float64 model's
// gradients travel as float32, half the bytes, averaged in float32.
namespace {
template <class E>
struct Float32Codec final : GradientCodec<E> {
  using S = typename E::Scalar;
  using Comm = typename E::Comm;
  std::vector<std::vector<float>> wire;  // per bucket, kept across steps
  std::string name() const override { return "float32"; }
  CodecWork launch(Comm& comm, const CodecBucket<S>& b, bool blocking) override {
    if (wire.size() <= b.index) wire.resize(b.index + 1);
    std::vector<float>& w = wire[b.index];
    w.assign(b.values.begin(), b.values.end());
    return average_over_ranks(comm, std::span<float>(w), blocking);
  }
  void decode(Comm&, const CodecBucket<S>& b) override { std::copy(wire[b.index].begin(), wire[b.index].end(), b.values.begin()); }
};
}  // namespace

TEST_CASE("A user-written gradient codec (float32 on the wire) trains like one process to float32 rounding",
          "[parallel]") {
  constexpr int ranks = 2;
  constexpr std::int64_t per_rank = 8, global = ranks * per_rank, steps = 3;
  testing::DpData<double> data(global * steps);
  const auto expected = one_process_parameters(data, global, steps);
  std::vector<double> difference(ranks, 1.0);
  std::vector<std::string> names(ranks), mismatch(ranks);
  ThreadWorld world(ranks);
  world.run([&](ThreadComm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    auto model = lenet5<CpuThreads64>(1, 28, kClasses, 7);
    DataParallel dp(model, comm);
    dp.register_codec(std::make_unique<Float32Codec<CpuThreads64>>());
    Sgd<CpuThreads64> sgd(dp.parameters(), {.lr = 0.05, .momentum = 0.9});
    TrainOptions o = quiet();
    o.checkpoint_group = CheckpointGroup(comm);
    Trainer trainer(model, sgd, dp, constant_lr, o);
    for (std::int64_t s = 0; s < steps; ++s)
      trainer.train_step(data.trainer_batch(s * global + comm.rank() * per_rank, per_rank));
    difference[r] = largest_difference(flat_parameters(model), expected);
    names[r] = dp.name();
    // Ranks that install codecs of different names would issue different collectives.
    try {
      if (comm.rank() == 0) dp.register_codec(std::make_unique<Fp16Codec<CpuThreads64>>());
      else dp.register_codec(std::make_unique<Float32Codec<CpuThreads64>>());
    } catch (const AgreementError& e) {
      mismatch[r] = e.what();
    }
  });
  for (int r = 0; r < ranks; ++r) {
    INFO("rank " << r);
    const auto u = static_cast<std::size_t>(r);
    CHECK(difference[u] < 1e-5);  // float32 rounding of each averaged gradient
    CHECK(difference[u] > 0);     // and it did go through float32
    CHECK(names[u] == "DataParallel(float32)");
    CHECK_THAT(mismatch[u], Catch::Contains("codec"));
  }
}

// A strategy that runs the model (kRunsModel): the Pipeline's stages each run their units, the
// Trainer hands it whole batches. 2 stages, 1F1B over 4 micro-batches: every stage's parameters
// after 3 steps are the one-process Trainer's on the same batches.
TEST_CASE("Pipeline under the Trainer: 2 stages step like one process (float64)", "[parallel]") {
  constexpr int stages = 2;
  constexpr std::int64_t batch = 8, steps = 3;
  testing::DpData<double> data(batch * steps);
  auto reference = lenet5<CpuLocal64>(1, 28, kClasses, 7);
  {
    Sgd<CpuLocal64> sgd(named_tensors(reference), {.lr = 0.05, .momentum = 0.9});
    Trainer one_process(reference, sgd, constant_lr, quiet());
    for (std::int64_t s = 0; s < steps; ++s) one_process.train_step(data.trainer_batch(s * batch, batch));
  }
  std::map<std::string, std::vector<double>> expected;
  for (auto& [name, p] : named_tensors(reference).parameters) expected[name].assign(p->value.data(), p->value.data() + p->value.numel());

  std::vector<double> difference(stages, 1.0);
  std::vector<std::size_t> compared(stages, 0);
  std::vector<std::string> names(stages);
  ThreadWorld world(stages);
  world.run([&](ThreadComm& comm) {
    auto model = lenet5<CpuThreads64>(1, 28, kClasses, 7);
    Pipeline pipe(model, comm, {.micro_batches = 4, .schedule = PipelineSchedule::OneFOneB});
    Sgd<CpuThreads64> sgd(pipe.stage_parameters(), {.lr = 0.05, .momentum = 0.9});
    TrainOptions o = quiet();
    o.checkpoint_group = CheckpointGroup(comm);
    Trainer trainer(model, sgd, pipe, constant_lr, o);
    for (std::int64_t s = 0; s < steps; ++s) trainer.train_step(data.trainer_batch(s * batch, batch));
    double worst = 0;
    for (auto& [name, p] : pipe.stage_parameters().parameters) {
      const std::vector<double> mine(p->value.data(), p->value.data() + p->value.numel());
      worst = std::max(worst, largest_difference(mine, expected.at(name)));
      ++compared[static_cast<std::size_t>(comm.rank())];
    }
    difference[static_cast<std::size_t>(comm.rank())] = worst;
    names[static_cast<std::size_t>(comm.rank())] = pipe.name();
    // A checkpoint would hold rank 0's stage only: refused by name, and a checkpoint_path up front
    // (not after the first epoch's training).
    CHECK_THROWS_WITH(trainer.save("unused.safetensors"), Catch::Contains("checkpoints of a split model"));
    TrainOptions with_checkpoint = o;
    with_checkpoint.checkpoint_path = "unused.safetensors";
    CHECK_THROWS_WITH(Trainer(model, sgd, pipe, constant_lr, with_checkpoint),
                      Catch::Contains("checkpoints of a split model"));
  });
  for (int r = 0; r < stages; ++r) {
    INFO("stage " << r);
    CHECK(difference[static_cast<std::size_t>(r)] < 1e-12);
    CHECK(compared[static_cast<std::size_t>(r)] > 0);
    CHECK(names[static_cast<std::size_t>(r)] == "Pipeline(1F1B, 2 stages, 4 micro-batches)");
  }
}

// Hybrid data x pipeline declared as one stack and run by fit(): DataParallel over the replicas
// of each stage syncs inside the pipeline's last backward (its before_backward hook), and the
// epoch's figures count each sample once although every stage of a replica sees it.
TEST_CASE("stack(DataParallel, Pipeline) under fit(): 2 replicas x 2 stages equal one process", "[parallel]") {
  using E = CpuThreads;
  constexpr std::int64_t global = 16;
  const Dataset data = SyntheticImages(64, 1, 28, 28, kClasses, 3);
  const Dataset test = SyntheticImages(40, 1, 28, 28, kClasses, 4);
  const auto lr = [](double) { return 0.05; };
  auto reference = lenet5<CpuLocal>(1, 28, kClasses, 7);
  Sgd<CpuLocal> reference_sgd(named_tensors(reference), {.lr = 0.05, .momentum = 0.9});
  Trainer one_process(reference, reference_sgd, lr, {.epochs = 2, .verbose = false});
  DataLoader<float> loader(data, {.batch_size = global, .shuffle = false});
  DataLoader<float> test_loader(test, {.batch_size = 20, .shuffle = false});
  const auto want = one_process.fit(loader, &test_loader);
  std::map<std::string, std::vector<float>> expected;
  for (auto& [name, p] : named_tensors(reference).parameters) expected[name].assign(p->value.data(), p->value.data() + p->value.numel());

  std::vector<std::vector<EpochResult>> got(4);
  std::vector<double> difference(4, 1.0);
  ThreadWorld world(4);
  world.run([&](ThreadComm& comm) {
    const int replica = comm.rank() / 2, stage = comm.rank() % 2;
    ThreadComm pipe_comm = comm.split(replica, stage), dp_comm = comm.split(stage, replica);
    auto model = lenet5<E>(1, 28, kClasses, 7);
    Pipeline pipe(model, pipe_comm, {.micro_batches = 2, .schedule = PipelineSchedule::GPipe});
    DataParallel<E> dp(pipe.stage(), dp_comm);
    Sgd<E> sgd(dp.parameters(), {.lr = 0.05, .momentum = 0.9});
    auto strategy = stack(dp, pipe);
    Trainer trainer(model, sgd, strategy, lr, {.epochs = 2, .verbose = false, .checkpoint_group = CheckpointGroup(comm)});
    DataLoader<float> shard(data, {.batch_size = global / 2, .shuffle = false, .rank = replica, .world_size = 2});
    DataLoader<float> tests(test, {.batch_size = 20, .shuffle = false});
    got[static_cast<std::size_t>(comm.rank())] = trainer.fit(shard, &tests);
    double worst = 0;
    for (auto& [name, p] : dp.parameters().parameters)
      for (std::int64_t i = 0; i < p->value.numel(); ++i)
        worst = std::max(worst, static_cast<double>(std::abs(p->value.data()[i] - expected.at(name)[static_cast<std::size_t>(i)])));
    difference[static_cast<std::size_t>(comm.rank())] = worst;
  });
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r);
    CHECK(difference[static_cast<std::size_t>(r)] < 1e-5);
    REQUIRE(got[static_cast<std::size_t>(r)].size() == 2);
    for (std::size_t e = 0; e < 2; ++e) {
      const EpochResult& g = got[static_cast<std::size_t>(r)][e];
      CHECK(g.train_loss == Approx(want[e].train_loss).epsilon(1e-5));
      CHECK(g.train_accuracy == Approx(want[e].train_accuracy));
      CHECK(g.test_loss == Approx(want[e].test_loss).epsilon(1e-5));
      CHECK(g.test_accuracy == Approx(want[e].test_accuracy));
    }
  }
}
