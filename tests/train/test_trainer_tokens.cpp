// A language model in the Trainer: TokenLoader's windows (nanoGPT's get_batch made a pure function of
// seed, epoch and batch; ranks' shares of one global batch; consecutive windows for evaluation), and
// the Trainer driving GPT through the strategy protocol: one step equals the hand-written step,
// gradient accumulation equals the whole batch, DataParallel on two thread ranks equals one process,
// fit() learns a pattern, and an image batch given to a token model is refused by name; a GPT under
// DataParallel and ZeRO-1 against one process (parallel/gpt_dp_equivalence.hpp, also on MPI and Gloo);
// a pipeline over GPT's blocks against one process (parallel/pp_gpt_equivalence.hpp, also on MPI and
// Gloo), and under the Trainer stacked with DataParallel; the tensor-parallel GPT stacked with
// DataParallel (data x tensor parallelism) under the Trainer.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "parallel/gpt_dp_equivalence.hpp"
#include "parallel/pp_gpt_equivalence.hpp"
#include "support/temp_dir.hpp"
#include "tessera/comm/threads.hpp"
#include "tessera/data/token_loader.hpp"
#include "tessera/losses/cross_entropy.hpp"
#include "tessera/models/gpt.hpp"
#include "tessera/optim/adam.hpp"
#include "tessera/parallel/data_parallel.hpp"
#include "tessera/parallel/gradient_accumulation.hpp"
#include "tessera/parallel/pipeline.hpp"
#include "tessera/parallel/tensor_parallel_gpt.hpp"
#include "tessera/train/trainer.hpp"

using namespace tessera;

static_assert(TokenModel<GPT<CpuLocal>> && !TokenModel<Linear<CpuLocal>>);
static_assert(BatchSource<TokenLoader<float>, float> && BatchSource<DataLoader<float>, float>);

namespace {

// A token stream with structure to learn: runs of a repeated 5-token motif, with a little noise.
std::vector<std::uint16_t> tokens_stream(std::int64_t n, std::int64_t vocab) {
  std::vector<std::uint16_t> out(static_cast<std::size_t>(n));
  Rng rng(11);
  for (std::int64_t i = 0; i < n; ++i)
    out[static_cast<std::size_t>(i)] =
        static_cast<std::uint16_t>(rng.uniform() < 0.05 ? rng.below(static_cast<std::uint64_t>(vocab)) : (i * 3) % 5 + 1);
  return out;
}
TokenSpan tokens_span(const std::vector<std::uint16_t>& v) { return {v.data(), static_cast<std::int64_t>(v.size()), 0}; }

LoaderOptions tokens_options(std::int64_t batch, bool shuffle, int rank = 0, int world = 1) {
  LoaderOptions o;
  o.batch_size = batch;
  o.shuffle = shuffle;
  o.seed = 5;
  o.rank = rank;
  o.world_size = world;
  return o;
}

GPTConfig tokens_config() { return {.block_size = 8, .vocab_size = 7, .n_layer = 2, .n_head = 2, .n_embd = 8}; }

template <class Model>
std::vector<double> tokens_flat_parameters(Model& model) {
  std::vector<double> out;
  for (auto& [name, p] : named_tensors(model).parameters)
    for (std::int64_t i = 0; i < p->value.numel(); ++i) out.push_back(static_cast<double>(p->value.data()[i]));
  return out;
}

double tokens_largest_difference(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return worst;
}

TrainOptions tokens_quiet() {
  TrainOptions o;
  o.verbose = false;
  return o;
}
double tokens_lr(double) { return 3e-3; }

// One process trained for one epoch of 3 global batches of 8 windows (AdamW, float64): the
// parameters and the epoch's loss that the data x model parallel runs below must give.
struct TokensOneProcess {
  std::map<std::string, Tensor<double, Cpu>> parameters;
  double loss = 0;
};
TokensOneProcess tokens_one_process(const std::vector<std::uint16_t>& stream) {
  Rng rng(6);
  GPT<CpuLocal64> model(tokens_config(), rng);
  AdamW<CpuLocal64> opt(named_tensors(model), {.lr = 3e-3});
  Trainer trainer(model, opt, tokens_lr, tokens_quiet());
  TokenLoader<double> loader(tokens_span(stream), 8, tokens_options(8, true), 3);
  TokensOneProcess out;
  out.loss = trainer.fit(loader).at(0).train_loss;
  for (auto& [name, p] : named_tensors(model).parameters) out.parameters[name] = p->value;
  return out;
}

}  // namespace

TEST_CASE("TokenLoader: next-token labels, ranks' shares of one global batch, resumable", "[train][data][text]") {
  const auto stream = tokens_stream(500, 7);
  const TokenSpan span = tokens_span(stream);
  TokenLoader<float> whole(span, 8, tokens_options(4, true), 3);
  TokenLoader<float> rank0(span, 8, tokens_options(2, true, 0, 2), 3), rank1(span, 8, tokens_options(2, true, 1, 2), 3);
  REQUIRE(whole.batches_per_epoch() == 3);
  whole.start_epoch(1);
  rank0.start_epoch(1);
  rank1.start_epoch(1);
  Batch<float> w, a, b;
  std::vector<Batch<float>> epoch1;
  while (whole.next(w)) {
    REQUIRE(rank0.next(a));
    REQUIRE(rank1.next(b));
    REQUIRE(w.tokens.shape() == Shape{4, 8});
    REQUIRE(w.labels.size() == 32);
    CHECK(w.images.numel() == 0);
    CHECK(w.samples() == 4);
    // Every label is the token after its input, somewhere in the stream.
    for (std::int64_t j = 0; j < 4; ++j) {
      const std::int64_t* x = w.tokens.data() + j * 8;
      const auto at = std::search(stream.begin(), stream.end(), x, x + 8, [](std::uint16_t s, std::int64_t t) { return s == t; });
      REQUIRE(at != stream.end());
      for (std::int64_t t = 0; t < 8; ++t) CHECK(w.labels[static_cast<std::size_t>(j * 8 + t)] == *(at + t + 1));
    }
    // Rank 0 holds windows 0-1 of the global batch, rank 1 windows 2-3.
    CHECK(std::equal(a.tokens.data(), a.tokens.data() + 16, w.tokens.data()));
    CHECK(std::equal(b.tokens.data(), b.tokens.data() + 16, w.tokens.data() + 16));
    CHECK(std::equal(b.labels.begin(), b.labels.end(), w.labels.begin() + 16));
    epoch1.push_back(w);
  }
  CHECK_FALSE(rank0.next(a));
  // Resuming at batch 2 of epoch 1 gives that batch; another epoch gives other windows.
  TokenLoader<float> resumed(span, 8, tokens_options(4, true), 3);
  resumed.set_state({1, 2});
  REQUIRE(resumed.next(w));
  CHECK(w.index == 2);
  CHECK(std::equal(w.tokens.data(), w.tokens.data() + 32, epoch1[2].tokens.data()));
  resumed.start_epoch(2);
  REQUIRE(resumed.next(w));
  CHECK_FALSE(std::equal(w.tokens.data(), w.tokens.data() + 32, epoch1[0].tokens.data()));
}

TEST_CASE("TokenLoader without shuffle: consecutive windows, each token once, short last batch",
          "[train][data][text]") {
  std::vector<std::uint16_t> stream(100);
  for (std::size_t i = 0; i < stream.size(); ++i) stream[i] = static_cast<std::uint16_t>(i);
  // 99 / 8 = 12 windows: 3 batches of 4 on one rank; on 2 ranks of 5, one batch of 10 and a last
  // of 2 (1 each).
  TokenLoader<double> one(tokens_span(stream), 8, tokens_options(4, false));
  CHECK(one.batches_per_epoch() == 3);
  Batch<double> b;
  std::int64_t next = 0;
  one.start_epoch(0);
  while (one.next(b))
    for (std::int64_t i = 0; i < b.tokens.numel(); ++i, ++next) {
      REQUIRE(b.tokens.data()[i] == next);
      REQUIRE(b.labels[static_cast<std::size_t>(i)] == next + 1);
    }
  CHECK(next == 96);
  TokenLoader<double> rank1(tokens_span(stream), 8, tokens_options(5, false, 1, 2));
  REQUIRE(rank1.batches_per_epoch() == 2);
  rank1.start_epoch(0);
  REQUIRE(rank1.next(b));
  CHECK(b.tokens.data()[0] == 40);  // windows 5-9 of the first global batch
  REQUIRE(rank1.next(b));
  CHECK(b.tokens.shape() == Shape{1, 8});
  CHECK(b.tokens.data()[0] == 88);  // window 11
  LoaderOptions drop = tokens_options(5, false, 1, 2);
  drop.drop_last = true;
  CHECK(TokenLoader<double>(tokens_span(stream), 8, drop).batches_per_epoch() == 1);
  // Bad settings name the loader and the setting.
  CHECK_THROWS_WITH(TokenLoader<double>(tokens_span(stream), 8, tokens_options(4, true), 0, "train"),
                    Catch::Contains("TokenLoader(train)") && Catch::Contains("batches_per_epoch > 0"));
  CHECK_THROWS_WITH(TokenLoader<double>(tokens_span(stream), 100, tokens_options(4, false)),
                    Catch::Contains("no window of 100 tokens"));
  CHECK(TokenLoader<double>(tokens_span(stream), 8, tokens_options(13, false)).batches_per_epoch() == 1);  // 12 windows
  LoaderOptions too_big = tokens_options(13, false);
  too_big.drop_last = true;
  CHECK_THROWS_WITH(TokenLoader<double>(tokens_span(stream), 8, too_big), Catch::Contains("do not fill one batch of 13"));
  CHECK_THROWS_WITH(one.set_state({0, 4}), Catch::Contains("outside this loader's 3 batches"));
}

TEST_CASE("Trainer + GPT: a step is forward, cross-entropy over (B, T, V), backward and AdamW", "[train][gpt]") {
  const auto stream = tokens_stream(400, 7);
  TokenLoader<double> loader(tokens_span(stream), 8, tokens_options(3, true), 2);
  Rng rng_a(3), rng_b(3);
  GPT<CpuLocal64> by_trainer(tokens_config(), rng_a), by_hand(tokens_config(), rng_b);
  const AdamWOptions adamw{.lr = 3e-3, .weight_decay = 0.1, .decay_norm_and_bias = false};
  AdamW<CpuLocal64> opt_a(named_tensors(by_trainer), adamw), opt_b(named_tensors(by_hand), adamw);
  Trainer trainer(by_trainer, opt_a, tokens_lr, tokens_quiet());
  loader.start_epoch(0);
  Batch<double> batch;
  CrossEntropyLoss<CpuLocal64> ce;
  for (int step = 0; step < 2; ++step) {
    REQUIRE(loader.next(batch));
    const double loss = trainer.train_step(batch);
    GPT<CpuLocal64>::Cache cache;
    CrossEntropyLoss<CpuLocal64>::Cache ce_cache;
    opt_b.zero_grad();
    const auto& logits = by_hand.forward(batch.tokens, cache);
    CHECK(ce.forward(logits, batch.labels, ce_cache) == loss);
    by_hand.backward(ce.backward(ce_cache), cache);
    opt_b.step();
  }
  CHECK(tokens_flat_parameters(by_trainer) == tokens_flat_parameters(by_hand));
  // An image batch is refused by name.
  Batch<double> images;
  images.images.resize({2, 1, 2, 2});
  images.labels = {0, 1};
  CHECK_THROWS_WITH(trainer.train_step(images), Catch::Contains("reads token ids") && Catch::Contains("TokenLoader"));
}

TEST_CASE("Trainer + GPT: gradient accumulation over token windows equals the whole batch (float64)",
          "[train][gpt][parallel]") {
  const auto stream = tokens_stream(400, 7);
  Rng rng_a(4), rng_b(4);
  GPT<CpuLocal64> whole(tokens_config(), rng_a), split(tokens_config(), rng_b);
  AdamW<CpuLocal64> opt_a(named_tensors(whole), {.lr = 3e-3}), opt_b(named_tensors(split), {.lr = 3e-3});
  GradientAccumulation<CpuLocal64> accumulate(3);
  Trainer one(whole, opt_a, tokens_lr, tokens_quiet());
  Trainer three(split, opt_b, accumulate, tokens_lr, tokens_quiet());
  TokenLoader<double> loader(tokens_span(stream), 8, tokens_options(7, true), 2);  // 7 = 3 + 2 + 2 windows
  loader.start_epoch(0);
  Batch<double> batch;
  while (loader.next(batch)) CHECK(std::abs(one.train_step(batch) - three.train_step(batch)) < 1e-12);
  CHECK(tokens_largest_difference(tokens_flat_parameters(whole), tokens_flat_parameters(split)) < 1e-12);
}

TEST_CASE("Trainer + GPT: DataParallel on 2 thread ranks equals one process (float64)", "[train][gpt][parallel]") {
  constexpr int ranks = 2;
  const auto stream = tokens_stream(600, 7);
  std::vector<double> expected;
  {
    Rng rng(6);
    GPT<CpuLocal64> model(tokens_config(), rng);
    AdamW<CpuLocal64> opt(named_tensors(model), {.lr = 3e-3});
    Trainer trainer(model, opt, tokens_lr, tokens_quiet());
    TokenLoader<double> loader(tokens_span(stream), 8, tokens_options(6, true), 3);
    trainer.fit(loader);
    expected = tokens_flat_parameters(model);
  }
  std::vector<double> difference(ranks, 1.0);
  ThreadWorld world(ranks);
  world.run([&](ThreadComm& comm) {
    Rng rng(6);
    GPT<CpuThreads64> model(tokens_config(), rng);
    DataParallel dp(model, comm);
    AdamW<CpuThreads64> opt(dp.parameters(), {.lr = 3e-3});
    TrainOptions o = tokens_quiet();
    o.checkpoint_group = CheckpointGroup(comm);
    Trainer trainer(model, opt, dp, tokens_lr, o);
    TokenLoader<double> loader(tokens_span(stream), 8, tokens_options(3, true, comm.rank(), ranks), 3);
    const auto results = trainer.fit(loader);
    REQUIRE(results.size() == 1);
    difference[static_cast<std::size_t>(comm.rank())] = tokens_largest_difference(tokens_flat_parameters(model), expected);
  });
  for (int r = 0; r < ranks; ++r) {
    INFO("rank " << r);
    CHECK(difference[static_cast<std::size_t>(r)] < 1e-12);
  }
}

TEST_CASE("Trainer + GPT: fit() learns the motif; validation over consecutive windows; metrics in tokens",
          "[train][gpt]") {
  const auto stream = tokens_stream(3000, 7);
  const TokenSpan train_span{stream.data(), 2400, 0}, val_span{stream.data() + 2400, 600, 2400};
  TokenLoader<float> train(train_span, 8, tokens_options(8, true), 40), val(val_span, 8, tokens_options(8, false));
  testing::TempDir dir;
  Rng rng(7);
  GPT<CpuLocal> model(tokens_config(), rng);
  AdamW<CpuLocal> opt(named_tensors(model), {.lr = 1e-2, .weight_decay = 0.1, .decay_norm_and_bias = false});
  TrainOptions o = tokens_quiet();
  o.epochs = 3;
  o.metrics_path = dir / "metrics.jsonl";
  Trainer trainer(model, opt, [](double) { return 1e-2; }, o);
  const auto [loss0, acc0] = trainer.evaluate(val);
  const auto results = trainer.fit(train, &val);
  REQUIRE(results.size() == 3);
  INFO("val loss " << loss0 << " -> " << results.back().test_loss);
  CHECK(loss0 > 1.5);                          // about ln 7 = 1.95 at initialization
  CHECK(results.back().test_loss < 0.6);       // the motif is 95% predictable
  CHECK(results.back().test_accuracy > 0.85);  // next tokens predicted
  std::ifstream in(o.metrics_path);
  const std::string first_line((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(first_line.find("\"tokens_per_second\"") != std::string::npos);
  CHECK(first_line.find("images_per_second") == std::string::npos);
}

TEST_CASE("GPT under DataParallel, ZeRO-1, ZeRO-2 and ZeRO-3 equals one process on 2, 3 and 4 thread ranks (float64, AdamW)",
          "[train][gpt][parallel][fsdp]") {
  for (int ranks : {2, 3, 4})
    for (auto strategy : {testing::GptDpStrategy::DataParallel, testing::GptDpStrategy::Zero1,
                          testing::GptDpStrategy::Fsdp2, testing::GptDpStrategy::Fsdp3}) {
      DYNAMIC_SECTION(ranks << " ranks, " << testing::to_string(strategy)) {
        std::vector<std::vector<std::string>> failures(static_cast<std::size_t>(ranks));
        ThreadWorld world(ranks);
        world.run([&](ThreadComm& comm) {
          failures[static_cast<std::size_t>(comm.rank())] = testing::gpt_dp_equivalence<double>(comm, strategy);
        });
        for (const auto& rank_failures : failures) {
          CHECK(rank_failures.empty());
          for (const auto& f : rank_failures) FAIL_CHECK(f);
        }
      }
    }
}

TEST_CASE("Pipeline over GPT blocks equals one process on 2 to 5 thread stages, dropout too (float32)",
          "[parallel][gpt]") {
  struct Variant {
    int stages;
    PipelineSchedule schedule;
    int micro_batches;
    bool checkpointing, measure_costs;
    double dropout = 0;
  };
  for (const Variant v : {Variant{2, PipelineSchedule::GPipe, 2, false, false},
                          Variant{2, PipelineSchedule::OneFOneB, 4, true, false},
                          Variant{3, PipelineSchedule::OneFOneB, 2, false, false},
                          Variant{3, PipelineSchedule::GPipe, 2, true, true},
                          Variant{4, PipelineSchedule::OneFOneB, 4, false, false},
                          Variant{5, PipelineSchedule::GPipe, 1, false, false},
                          Variant{2, PipelineSchedule::OneFOneB, 4, false, false, 0.2},
                          Variant{3, PipelineSchedule::GPipe, 2, true, true, 0.1}}) {
    DYNAMIC_SECTION(v.stages << " stages, " << schedule_name(v.schedule) << ", " << v.micro_batches
                             << " micro-batches" << (v.checkpointing ? ", checkpointed" : "")
                             << (v.measure_costs ? ", measured costs" : "") << ", dropout " << v.dropout) {
      std::vector<std::vector<std::string>> failures(static_cast<std::size_t>(v.stages));
      ThreadWorld world(v.stages);
      world.run([&](ThreadComm& comm) {
        testing::PpGptCase k{.micro_batches = v.micro_batches, .schedule = v.schedule,
                             .checkpointing = v.checkpointing, .measure_costs = v.measure_costs};
        k.config.dropout = v.dropout;
        failures[static_cast<std::size_t>(comm.rank())] = testing::pp_gpt_equivalence<float>(comm, k);
      });
      for (const auto& rank_failures : failures) {
        CHECK(rank_failures.empty());
        for (const auto& f : rank_failures) FAIL_CHECK(f);
      }
    }
  }
}

TEST_CASE("Pipeline over GPT: interleaved 1F1B, ZB-H1 and ZB-V equal one process, the blocks' backward split in two "
          "(float32)",
          "[parallel][gpt][pipeline]") {
  struct Variant {
    int ranks;
    PipelineSchedule schedule;
    int micro_batches;
    std::int64_t n_layer = 3;  // units: n_layer + 2, at least the stages (2 per rank unless ZB-H1)
    bool checkpointing = false;
    double dropout = 0;
  };
  for (const Variant v : {Variant{2, PipelineSchedule::ZBH1, 4}, Variant{3, PipelineSchedule::ZBH1, 6, 3, false, 0.1},
                          Variant{4, PipelineSchedule::ZBH1, 8, 3}, Variant{2, PipelineSchedule::ZBH1, 4, 3, true},
                          Variant{2, PipelineSchedule::Interleaved1F1B, 4}, Variant{2, PipelineSchedule::ZBV, 4},
                          Variant{3, PipelineSchedule::ZBV, 6, 4, false, 0.2}}) {
    DYNAMIC_SECTION(v.ranks << " ranks, " << schedule_name(v.schedule) << ", " << v.micro_batches << " micro-batches"
                            << (v.checkpointing ? ", checkpointed" : "") << ", dropout " << v.dropout) {
      std::vector<std::vector<std::string>> failures(static_cast<std::size_t>(v.ranks));
      ThreadWorld world(v.ranks);
      world.run([&](ThreadComm& comm) {
        testing::PpGptCase k{.batch = v.micro_batches, .micro_batches = v.micro_batches, .schedule = v.schedule,
                             .checkpointing = v.checkpointing};
        k.config.n_layer = v.n_layer;
        k.config.dropout = v.dropout;
        failures[static_cast<std::size_t>(comm.rank())] = testing::pp_gpt_equivalence<float>(comm, k);
      });
      for (const auto& rank_failures : failures) {
        CHECK(rank_failures.empty());
        for (const auto& f : rank_failures) FAIL_CHECK(f);
      }
    }
  }
}

TEST_CASE("Trainer + GPT: stack(DataParallel, Pipeline) on 2 replicas x 2 stages equals one process (float64)",
          "[train][gpt][parallel]") {
  const auto stream = tokens_stream(600, 7);
  const TokensOneProcess expected = tokens_one_process(stream);
  std::vector<double> difference(4, 1.0), loss(4, 0.0);
  ThreadWorld world(4);
  world.run([&](ThreadComm& comm) {
    const int replica = comm.rank() / 2, stage = comm.rank() % 2;
    ThreadComm pipe_comm = comm.split(replica, stage), data_comm = comm.split(stage, replica);
    Rng rng(6);
    GPT<CpuThreads64> model(tokens_config(), rng);
    Pipeline pipe(model, pipe_comm, {.micro_batches = 2});
    DataParallel dp(pipe.stage(), data_comm);
    AdamW<CpuThreads64> opt(pipe.stage_parameters(), {.lr = 3e-3});
    auto strategy = stack(dp, pipe);
    TrainOptions o = tokens_quiet();
    o.checkpoint_group = CheckpointGroup(comm);
    Trainer trainer(model, opt, strategy, tokens_lr, o);
    TokenLoader<double> loader(tokens_span(stream), 8, tokens_options(4, true, replica, 2), 3);
    loss[static_cast<std::size_t>(comm.rank())] = trainer.fit(loader).at(0).train_loss;
    double worst = 0;
    for (auto& [name, p] : pipe.stage_parameters().parameters)
      for (std::int64_t i = 0; i < p->value.numel(); ++i)
        worst = std::max(worst, std::abs(p->value.data()[i] - expected.parameters.at(name).data()[i]));
    difference[static_cast<std::size_t>(comm.rank())] = worst;
  });
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r);
    CHECK(difference[static_cast<std::size_t>(r)] < 1e-12);
    CHECK(std::abs(loss[static_cast<std::size_t>(r)] - expected.loss) < 1e-12);
  }
}

TEST_CASE("Trainer + GPT: stack(DataParallel, TensorParallel) on 2 replicas x 2 tensor ranks equals one process "
          "(float64)", "[train][gpt][parallel]") {
  const auto stream = tokens_stream(600, 7);
  const TokensOneProcess expected = tokens_one_process(stream);
  std::vector<double> difference(4, 1.0), loss(4, 0.0);
  ThreadWorld world(4);
  world.run([&](ThreadComm& comm) {
    const int replica = comm.rank() / 2, part = comm.rank() % 2;
    ThreadComm tensor_comm = comm.split(replica, part), data_comm = comm.split(part, replica);
    Rng rng(6);
    GPT<CpuThreads64> dense(tokens_config(), rng);
    TensorParallelGPT<CpuThreads64> model(dense, tensor_comm);
    DataParallel dp(model, data_comm);
    TensorParallel<CpuThreads64> tensor(tensor_comm, model);
    AdamW<CpuThreads64> opt(dp.parameters(), {.lr = 3e-3});
    auto strategy = stack(dp, tensor);
    TrainOptions o = tokens_quiet();
    o.checkpoint_group = CheckpointGroup(comm);
    Trainer trainer(model, opt, strategy, tokens_lr, o);
    TokenLoader<double> loader(tokens_span(stream), 8, tokens_options(4, true, replica, 2), 3);
    loss[static_cast<std::size_t>(comm.rank())] = trainer.fit(loader).at(0).train_loss;
    double worst = 0;
    for (auto& [name, p] : named_tensors(model).parameters) {
      const Tensor<double, Cpu> slice = model.shard_of(name, expected.parameters.at(name));
      REQUIRE(slice.shape() == p->value.shape());
      for (std::int64_t i = 0; i < p->value.numel(); ++i)
        worst = std::max(worst, std::abs(p->value.data()[i] - slice.data()[i]));
    }
    difference[static_cast<std::size_t>(comm.rank())] = worst;
  });
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r);
    CHECK(difference[static_cast<std::size_t>(r)] < 1e-12);
    CHECK(std::abs(loss[static_cast<std::size_t>(r)] - expected.loss) < 1e-12);
  }
}
