// Elastic resume on ThreadComm: a checkpoint taken mid-epoch by N ranks (DataParallel, or Zero1
// with its optimizer state sharded; FullyShardedDataParallel's sharded checkpoints at the end of
// this file) resumes on M ranks, 2 -> 1, 2 -> 4 and 4 -> 2 (and 2 -> 2), and ends
// where an uninterrupted run ends, up to summation order (float64); M that does not divide the
// global batch, or a loader that does not keep the global batch, is refused naming the file, both
// world sizes and the batch. The same scenario over MPI and Gloo: tests/parallel/elastic_test.py.
#include <catch2/catch.hpp>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>

#include "parallel/elastic_resume.hpp"
#include "tessera/comm/local.hpp"
#include "tessera/comm/threads.hpp"
#include "tessera/comm/threads_elastic.hpp"
#include "tessera/models/gpt.hpp"
#include "tessera/models/lenet.hpp"
#include "tessera/optim/schedule.hpp"
#include "tessera/optim/sgd.hpp"
#include "tessera/parallel/data_parallel.hpp"
#include "tessera/parallel/local_sgd.hpp"
#include "tessera/parallel/fully_sharded_replicated.hpp"
#include "tessera/parallel/zero_replicated.hpp"
#include "tessera/train/elastic.hpp"
#include "tessera/train/sharded_checkpoint.hpp"

using namespace tessera;
// Names, not the namespace: this file shares a unity file with others (tests/meson.build), and a
// using-directive for tessera::testing would make their `detail::` ambiguous.
using tessera::testing::ElasticCase;
using tessera::testing::ElasticResult;
using tessera::testing::ElasticStrategy;
using tessera::testing::elastic_run;
using tessera::testing::elastic_run_threads;
using tessera::testing::max_difference;
namespace fs = std::filesystem;

namespace {

fs::path elastic_dir() { return tessera::testing::elastic_temp_dir("tessera_elastic"); }

// The message of the ArgumentError every rank throws ("" if none did; "ranks disagree" if they differ).
std::string refusal(int ranks, const ElasticCase& c) {
  std::vector<std::string> errors(static_cast<std::size_t>(ranks));
  ThreadWorld world(ranks);
  world.run([&](ThreadComm& comm) {
    try {
      elastic_run<double>(comm, c);
    } catch (const ArgumentError& e) {
      errors[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  for (const auto& e : errors)
    if (e != errors[0]) return "ranks disagree: '" + errors[0] + "' vs '" + e + "'";
  return errors[0];
}

}  // namespace

TEST_CASE("Elastic resume: N -> M ranks mid-epoch ends where an uninterrupted run ends (DataParallel, Zero1)",
          "[parallel][elastic]") {
  const auto dir = elastic_dir();
  const bool report = std::getenv("TESSERA_ELASTIC_REPORT") != nullptr;
  for (ElasticStrategy strategy : {ElasticStrategy::DataParallelSgd, ElasticStrategy::Zero1Adam}) {
    // 2 -> 2: the plain resume, which with Zero1 needs the other ranks' shards from the file too.
    for (auto [from, to] : {std::pair{2, 1}, std::pair{2, 4}, std::pair{4, 2}, std::pair{2, 2}}) {
      const std::string ckpt = (dir / ("ckpt_" + std::to_string(from) + ".safetensors")).string();
      const ElasticResult straight = elastic_run_threads(from, {.strategy = strategy});
      // 6 steps per epoch: step 8 stops after batch 2 of epoch 2.
      const ElasticResult first = elastic_run_threads(from, {.strategy = strategy, .stop_after_steps = 8, .checkpoint = ckpt});
      const ElasticResult resumed = elastic_run_threads(to, {.strategy = strategy, .resume = ckpt});
      const ElasticResult straight_m = elastic_run_threads(to, {.strategy = strategy});
      const double diff = max_difference(straight.params, resumed.params);
      char line[320];
      std::snprintf(line, sizeof line,
                    "%s %d -> %d: final epoch loss uninterrupted(%d) %.17g, resumed(%d) %.17g, uninterrupted(%d) "
                    "%.17g; max |param diff| resumed vs uninterrupted(%d) %.3g, vs uninterrupted(%d) %.3g",
                    to_string(strategy), from, to, from, straight.losses.back(), to,
                    resumed.losses.empty() ? 0.0 : resumed.losses.back(), to, straight_m.losses.back(), from, diff, to,
                    max_difference(straight_m.params, resumed.params));
      INFO(line);
      if (report) std::printf("%s\n", line);
      REQUIRE(straight.losses.size() == 3);
      CHECK(first.losses.size() == 1);  // epoch 1 complete, epoch 2 cut short
      CHECK(first.global_step == 8);
      CHECK(first.epoch == 1);
      REQUIRE(resumed.losses.size() == 2);  // the rest of epoch 2, and epoch 3
      CHECK(resumed.global_step == 18);
      CHECK(resumed.ranks_identical);
      CHECK(first.losses[0] == Approx(straight.losses[0]).epsilon(1e-12));
      CHECK(resumed.losses[1] == Approx(straight.losses[2]).epsilon(1e-11));
      CHECK(diff < 1e-11);
      CHECK(max_difference(straight_m.params, resumed.params) < 1e-11);
      if (from == to) CHECK(diff == 0);  // the same world size resumes bit for bit
      // Training moved the parameters (a resume that loaded nothing would not match).
      CHECK(max_difference(straight.params, first.params) > 1e-3);
    }
  }
  fs::remove_all(dir);
}

TEST_CASE("Elastic resume: a world size that does not divide the global batch is refused, naming file, sizes, batch",
          "[parallel][elastic]") {
  const auto dir = elastic_dir();
  const std::string ckpt = (dir / "ckpt_2.safetensors").string();
  elastic_run_threads(2, {.stop_after_steps = 8, .checkpoint = ckpt});
  // 3 ranks cannot split a global batch of 16.
  const std::string three = refusal(3, {.resume = ckpt, .per_rank_batch = 5});
  CHECK_THAT(three, Catch::Contains("'" + ckpt + "' was saved by a run at world size 2 (2 ranks) with a global batch of "
                                    "16 (8 per rank); this run has world size 3, which does not divide the global "
                                    "batch 16") &&
                        Catch::Contains("(1, 2, 4, 8, 16)"));
  // 4 ranks can, but a loader of 8 per rank would make the global batch 32.
  const std::string doubled = refusal(4, {.resume = ckpt, .per_rank_batch = 8});
  CHECK_THAT(doubled, Catch::Contains("'" + ckpt + "' was saved at world size 2 with a global batch of 16 (2 x 8)") &&
                          Catch::Contains("at world size 4 the loader's batch_size must be 4, but it is 8"));
  // Zero1 too (its optimizer state in the file is whole tensors, so only the batch decides).
  const std::string zckpt = (dir / "zero_2.safetensors").string();
  elastic_run_threads(2, {.strategy = ElasticStrategy::Zero1Adam, .stop_after_steps = 8, .checkpoint = zckpt});
  CHECK_THAT(refusal(3, {.strategy = ElasticStrategy::Zero1Adam, .resume = zckpt, .per_rank_batch = 5}),
             Catch::Contains("world size 3, which does not divide the global batch 16"));
  fs::remove_all(dir);
}

TEST_CASE("Zero1 checkpoints hold whole tensors under the unsharded names, loadable without ZeRO", "[parallel][elastic]") {
  const auto dir = elastic_dir();
  const std::string ckpt = (dir / "zero.safetensors").string();
  elastic_run_threads(4, {.strategy = ElasticStrategy::Zero1Adam, .stop_after_steps = 8, .checkpoint = ckpt});
  const SafetensorsFile file = SafetensorsFile::load(ckpt);
  CHECK(file.info("optim.exp_avg.1.weight").shape == Shape{32, 100});
  CHECK(file.info("optim.exp_avg_sq.3.bias").shape == Shape{4});
  CHECK(file.metadata().at("optim.step") == "8");
  CHECK(file.metadata().at("train.loader_next_sample") == "32");
  CHECK(file.metadata().at("train.ranks") == "4");
  // Every element of the second moments was written by some rank's shard: none is left at zero.
  const auto sq = file.tensor<double>("optim.exp_avg_sq.1.weight");
  std::int64_t zeros = 0;
  for (std::int64_t k = 0; k < sq.numel(); ++k) zeros += sq.data()[k] == 0.0;
  CHECK(zeros < sq.numel() / 10);  // (inputs that are exactly 0 leave a few at zero)
  // One process with a plain Adam over the whole model reads it.
  using E = Env<Cpu, LocalComm, double>;
  auto model = tessera::testing::elastic_model<E>(4);
  auto named = named_tensors(model);
  Adam<E> adam(named, {.lr = 1e-2, .weight_decay = 1e-4});
  const TrainState state = load_checkpoint(ckpt, model, adam);
  CHECK(state.global_step == 8);
  CHECK(state.loader_next_batch == 2);
  CHECK(adam.steps() == 8);
  fs::remove_all(dir);
}

// FullyShardedDataParallel's checkpoints (train/sharded_checkpoint.hpp): a 4-rank sharded checkpoint,
// taken mid-epoch through the Trainer, resumes on 2, 3 and 4 ranks (stage 3 and stage 2) and ends where
// the uninterrupted run ends (float64; bit for bit at the same world size); the one-file form
// (save_checkpoint's, and consolidate_sharded_checkpoint's from a directory) loads in a run without
// FSDP; GPT's tied wte round-trips (lm_head.weight written once, as an alias); and a shard set that
// is incomplete, corrupt, truncated or mixed from two saves is refused on every rank, naming the
// shard, with nothing loaded.
namespace {

fs::path fsdp_checkpoint_dir() { return tessera::testing::elastic_temp_dir("tessera_fsdp_ckpt"); }

// A global batch of 24 splits over 2, 3 and 4 ranks; 96 samples: 4 steps per epoch, 12 in all;
// step 6 stops after batch 2 of epoch 2.
constexpr std::int64_t kGlobal = 24, kStop = 6, kSteps = 12;

// Loads `dir` with load_sharded_checkpoint at `ranks` ranks into a fresh stage-3 model and AdamW;
// returns each rank's error (empty: loaded) and checks that a failed load changed no piece.
std::vector<std::string> try_load(int ranks, const std::string& dir) {
  std::vector<std::string> errors(static_cast<std::size_t>(ranks));
  std::vector<int> untouched(static_cast<std::size_t>(ranks), 1);
  ThreadWorld world(ranks);
  world.run([&](ThreadComm& comm) {
    using E = Env<Cpu, ThreadComm, double>;
    auto model = tessera::testing::elastic_model<E>(4);
    FullyShardedDataParallel fsdp(model, comm, {.stage = 3});
    AdamW<E> adamw(fsdp.shard_parameters(), {.lr = 1e-2});
    FullyShardedOptimizer optimizer(fsdp, adamw);
    std::vector<double> before;
    for (auto& [name, p] : fsdp.shard_parameters().parameters) before.insert(before.end(), p->value.begin(), p->value.end());
    try {
      load_sharded_checkpoint(dir, model, optimizer, CheckpointGroup(comm));
    } catch (const IoError& e) {
      errors[static_cast<std::size_t>(comm.rank())] = e.what();
      std::vector<double> after;
      for (auto& [name, p] : fsdp.shard_parameters().parameters) after.insert(after.end(), p->value.begin(), p->value.end());
      untouched[static_cast<std::size_t>(comm.rank())] = after == before;
    }
  });
  for (int r = 0; r < ranks; ++r) {
    INFO("rank " << r << ": a failed load must change nothing");
    CHECK(untouched[static_cast<std::size_t>(r)] == 1);
  }
  return errors;
}

// Whether every rank failed, and one of them with a message containing all of `parts`.
bool refused_naming(const std::vector<std::string>& errors, std::initializer_list<std::string> parts) {
  bool named = false;
  for (const auto& e : errors) {
    if (e.empty()) return false;
    bool all = true;
    for (const auto& part : parts) all = all && e.find(part) != std::string::npos;
    named = named || all;
  }
  return named;
}

}  // namespace

TEST_CASE("FSDP sharded checkpoints: 4 ranks resume on 2, 3 and 4 where the uninterrupted run ends",
          "[parallel][fsdp][elastic]") {
  const auto dir = fsdp_checkpoint_dir();
  for (ElasticStrategy strategy : {ElasticStrategy::Fsdp3AdamW, ElasticStrategy::Fsdp2AdamW}) {
    const std::string ckpt = (dir / (std::string("shards_") + tessera::testing::to_string(strategy))).string();
    const ElasticResult straight = elastic_run_threads(4, {.strategy = strategy, .global_batch = kGlobal});
    const ElasticResult first =
        elastic_run_threads(4, {.strategy = strategy, .global_batch = kGlobal, .stop_after_steps = kStop, .checkpoint = ckpt});
    REQUIRE(straight.losses.size() == 3);
    CHECK(first.global_step == kStop);
    CHECK(max_difference(straight.params, first.params) > 1e-3);  // training moved them: a no-op load would show
    // Four shards and the index, nothing else (no temporaries, no gathered file).
    std::vector<std::string> files;
    for (const auto& entry : fs::directory_iterator(ckpt)) files.push_back(entry.path().filename().string());
    std::sort(files.begin(), files.end());
    CHECK(files == std::vector<std::string>{"index.json", "shard-00000-of-00004.safetensors", "shard-00001-of-00004.safetensors",
                                            "shard-00002-of-00004.safetensors", "shard-00003-of-00004.safetensors"});
    for (int to : {2, 3, 4}) {
      DYNAMIC_SECTION(tessera::testing::to_string(strategy) << ": 4 -> " << to << " ranks") {
        const ElasticResult resumed = elastic_run_threads(to, {.strategy = strategy, .global_batch = kGlobal, .resume = ckpt});
        const double diff = max_difference(straight.params, resumed.params);
        INFO("final epoch loss uninterrupted " << straight.losses.back() << ", resumed "
                                               << (resumed.losses.empty() ? 0.0 : resumed.losses.back())
                                               << "; max |param diff| " << diff);
        REQUIRE(resumed.losses.size() == 2);  // the rest of epoch 2, and epoch 3
        CHECK(resumed.global_step == kSteps);
        CHECK(resumed.ranks_identical);
        CHECK(resumed.losses[1] == Approx(straight.losses[2]).epsilon(1e-12));
        CHECK(diff < 1e-12);
        if (to == 4) CHECK(diff == 0);  // the same world size resumes bit for bit
      }
    }
  }
  fs::remove_all(dir);
}

TEST_CASE("FSDP one-file checkpoints: save_checkpoint's and consolidate_sharded_checkpoint's load without FSDP",
          "[parallel][fsdp][elastic]") {
  const auto dir = fsdp_checkpoint_dir();
  const std::string shards = (dir / "shards").string(), one = (dir / "one.safetensors").string(),
                    consolidated = (dir / "consolidated.safetensors").string();
  const ElasticResult straight = elastic_run_threads(4, {.strategy = ElasticStrategy::Fsdp3AdamW, .global_batch = kGlobal});
  elastic_run_threads(4, {.strategy = ElasticStrategy::Fsdp3AdamW, .global_batch = kGlobal, .stop_after_steps = kStop,
                       .checkpoint = shards});
  elastic_run_threads(4, {.strategy = ElasticStrategy::Fsdp3AdamW, .global_batch = kGlobal, .stop_after_steps = kStop,
                       .checkpoint = one, .consolidated = true});
  REQUIRE(fs::is_regular_file(one));
  consolidate_sharded_checkpoint(shards, consolidated);
  // The two one-file forms hold the same tensors, bit for bit, and the same training position.
  const SafetensorsFile a = SafetensorsFile::load(one), b = SafetensorsFile::load(consolidated);
  CHECK(a.names() == b.names());
  for (const auto& name : a.names()) {
    INFO(name);
    REQUIRE(b.has(name));
    CHECK(a.info(name).shape == b.info(name).shape);
    CHECK(std::memcmp(a.raw(name), b.raw(name), a.info(name).end - a.info(name).begin) == 0);
  }
  for (const char* key : {"train.global_step", "train.epoch", "train.loader_next_sample", "train.ranks", "optim.step", "format"}) {
    INFO(key);
    CHECK(a.metadata().at(key) == b.metadata().at(key));
  }
  CHECK(a.has("optim.exp_avg.1.weight"));  // a one-process AdamW's names
  // One process without FSDP, and FSDP at 2 ranks, resume from them to where the 4 ranks ended.
  for (auto [file, ranks, strategy] : {std::tuple{consolidated, 1, ElasticStrategy::DataParallelAdamW},
                                       std::tuple{consolidated, 2, ElasticStrategy::DataParallelAdamW},
                                       std::tuple{one, 2, ElasticStrategy::Fsdp3AdamW}}) {
    DYNAMIC_SECTION(file << " -> " << tessera::testing::to_string(strategy) << " at " << ranks << " ranks") {
      const ElasticResult resumed = elastic_run_threads(ranks, {.strategy = strategy, .global_batch = kGlobal, .resume = file});
      REQUIRE(resumed.losses.size() == 2);
      CHECK(resumed.global_step == kSteps);
      CHECK(max_difference(straight.params, resumed.params) < 1e-12);
    }
  }
  fs::remove_all(dir);
}

TEST_CASE("FSDP sharded checkpoints: an incomplete, corrupt or mixed shard set is refused naming the shard",
          "[parallel][fsdp][elastic]") {
  const auto dir = fsdp_checkpoint_dir();
  const fs::path saved = dir / "saved", other = dir / "other";
  elastic_run_threads(4, {.strategy = ElasticStrategy::Fsdp3AdamW, .global_batch = kGlobal, .stop_after_steps = kStop,
                       .checkpoint = saved.string()});
  elastic_run_threads(4, {.strategy = ElasticStrategy::Fsdp3AdamW, .global_batch = kGlobal, .stop_after_steps = kStop - 1,
                       .checkpoint = other.string()});
  REQUIRE(try_load(2, saved.string()) == std::vector<std::string>(2));  // the intact set loads
  const auto broken = [&](const std::string& name) {
    const fs::path copy = dir / name;
    fs::remove_all(copy);
    fs::copy(saved, copy);
    return copy;
  };
  SECTION("a shard missing") {
    const fs::path d = broken("missing");
    fs::remove(d / "shard-00002-of-00004.safetensors");
    CHECK(refused_naming(try_load(3, d.string()), {"missing shard", "shard-00002-of-00004.safetensors", "rank 2 of the 4"}));
  }
  SECTION("a flipped bit in a shard's data") {
    const fs::path d = broken("corrupt"), file = d / "shard-00001-of-00004.safetensors";
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-20, std::ios::end);
    char byte = 0;
    f.read(&byte, 1);
    byte = static_cast<char>(byte ^ 0x10);
    f.seekp(-20, std::ios::end);
    f.write(&byte, 1);
    f.close();
    CHECK(refused_naming(try_load(2, d.string()), {"shard-00001-of-00004.safetensors", "is corrupt"}));
  }
  SECTION("a truncated shard") {
    const fs::path d = broken("truncated"), file = d / "shard-00003-of-00004.safetensors";
    fs::resize_file(file, fs::file_size(file) - 8);
    CHECK(refused_naming(try_load(2, d.string()), {"shard-00003-of-00004.safetensors", "the index says"}));
  }
  SECTION("no index: a save cut short") {
    const fs::path d = broken("no_index");
    fs::remove(d / "index.json");
    CHECK(refused_naming(try_load(2, d.string()), {"incomplete sharded checkpoint", "index.json"}));
  }
  SECTION("a shard of another save") {
    const fs::path d = broken("mixed");
    fs::copy_file(other / "shard-00000-of-00004.safetensors", d / "shard-00000-of-00004.safetensors",
                  fs::copy_options::overwrite_existing);
    const auto errors = try_load(2, d.string());
    // The other save's file differs in size or in save id; either way the shard is named.
    CHECK((refused_naming(errors, {"shard-00000-of-00004.safetensors", "belongs to save"}) ||
           refused_naming(errors, {"shard-00000-of-00004.safetensors", "the index says"})));
  }
  SECTION("another optimizer's state") {
    // Saved with AdamW; a load with SGD momentum names the tensors it does not hold.
    std::vector<std::string> errors(2);
    ThreadWorld world(2);
    world.run([&](ThreadComm& comm) {
      using E = Env<Cpu, ThreadComm, double>;
      auto model = tessera::testing::elastic_model<E>(4);
      FullyShardedDataParallel fsdp(model, comm, {.stage = 3});
      Sgd<E> sgd(fsdp.shard_parameters(), {.lr = 0.1, .momentum = 0.9});
      FullyShardedOptimizer optimizer(fsdp, sgd);
      try {
        load_sharded_checkpoint(saved.string(), model, optimizer, CheckpointGroup(comm));
      } catch (const IoError& e) {
        errors[static_cast<std::size_t>(comm.rank())] = e.what();
      }
    });
    CHECK(refused_naming(errors, {"missing tensor 'optim.momentum_buffer.", "unexpected tensor 'optim.exp_avg."}));
  }
  SECTION("a world size that does not split the global batch") {
    std::vector<std::string> errors(5);
    ThreadWorld world(5);
    world.run([&](ThreadComm& comm) {
      try {
        elastic_run<double>(comm, {.strategy = ElasticStrategy::Fsdp3AdamW, .global_batch = kGlobal,
                                   .resume = saved.string(), .per_rank_batch = 5});
      } catch (const ArgumentError& e) {
        errors[static_cast<std::size_t>(comm.rank())] = e.what();
      }
    });
    CHECK(refused_naming(errors, {"world size 4", "world size 5", "global batch of 24"}));
  }
  fs::remove_all(dir);
}

TEST_CASE("FSDP sharded checkpoints of GPT: the tied wte (lm_head.weight) round-trips, and one process loads the consolidated file",
          "[parallel][fsdp][elastic][gpt]") {
  const auto dir = fsdp_checkpoint_dir();
  const std::string shards = (dir / "gpt").string(), one = (dir / "gpt.safetensors").string();
  const GPTConfig config{.block_size = 8, .vocab_size = 13, .n_layer = 2, .n_head = 2, .n_embd = 8, .dropout = 0.1};
  std::vector<double> trained;  // rank 0's gathered parameters after two steps
  std::vector<double> reloaded(3, -1);
  const auto flat = [](auto& model) {
    std::vector<double> out;
    for (auto& [name, p] : named_tensors(model).parameters) out.insert(out.end(), p->value.begin(), p->value.end());
    return out;
  };
  {
    ThreadWorld world(2);
    world.run([&](ThreadComm& comm) {
      using E = Env<Cpu, ThreadComm, double>;
      Rng rng(9), data(3 + static_cast<std::uint64_t>(comm.rank()));
      GPT<E> model(config, rng);
      FullyShardedDataParallel fsdp(model, comm, {.stage = 3});
      AdamW<E> adamw(fsdp.shard_parameters(), {.lr = 1e-2});
      FullyShardedOptimizer optimizer(fsdp, adamw);
      Tensor<std::int64_t, Cpu> ids({3, 8});
      std::vector<std::int64_t> labels(24);
      for (int s = 0; s < 2; ++s) {
        for (std::int64_t k = 0; k < ids.numel(); ++k) ids.data()[k] = static_cast<std::int64_t>(data.below(13));
        for (auto& l : labels) l = static_cast<std::int64_t>(data.below(13));
        optimizer.zero_grad();
        fsdp.train_step(ids, labels);
        optimizer.step();
      }
      save_sharded_checkpoint(shards, model, optimizer, TrainState{.global_step = 2}, CheckpointGroup(comm));
      fsdp.gather_full();
      if (comm.rank() == 0) trained = flat(model);
      fsdp.release_full();
    });
  }
  consolidate_sharded_checkpoint(shards, one);
  const SafetensorsFile file = SafetensorsFile::load(one);
  REQUIRE(file.has("lm_head.weight"));
  CHECK(std::memcmp(file.raw("lm_head.weight"), file.raw("transformer.wte.weight"),
                    file.info("transformer.wte.weight").end - file.info("transformer.wte.weight").begin) == 0);
  CHECK(file.metadata().count("transformer.drop.rng"));        // rank 0's dropout generator
  CHECK(file.metadata().count("rank1.transformer.drop.rng"));  // and rank 1's
  // One process, a fresh model from another seed, reads it: the parameters are the trained ones.
  using Local = Env<Cpu, LocalComm, double>;
  Rng other(77);
  GPT<Local> single(config, other);
  auto named = named_tensors(single);
  AdamW<Local> adamw(named, {.lr = 1e-2});
  const TrainState state = load_checkpoint(one, single, adamw);
  CHECK(state.global_step == 2);
  CHECK(adamw.steps() == 2);
  CHECK(max_difference(flat(single), trained) == 0);
  // Three thread ranks of FSDP load the shards back, as saved.
  ThreadWorld world(3);
  world.run([&](ThreadComm& comm) {
    using E = Env<Cpu, ThreadComm, double>;
    Rng rng(55);
    GPT<E> model(config, rng);
    FullyShardedDataParallel fsdp(model, comm, {.stage = 2});
    AdamW<E> shard_opt(fsdp.shard_parameters(), {.lr = 1e-2});
    FullyShardedOptimizer optimizer(fsdp, shard_opt);
    load_sharded_checkpoint(shards, model, optimizer, CheckpointGroup(comm));
    fsdp.gather_full();
    reloaded[static_cast<std::size_t>(comm.rank())] = max_difference(flat(model), trained);
  });
  for (double d : reloaded) CHECK(d == 0);
  fs::remove_all(dir);
}

namespace {

// n random 1x28x28 images, labels i % 10.
Dataset elastic_random_images(std::int64_t n, std::uint64_t seed) {
  Dataset ds;
  ds.name = "random";
  ds.num_classes = 10;
  ds.images.resize({n, 1, 28, 28});
  Rng rng(seed);
  for (auto& v : ds.images) v = static_cast<float>(rng.normal());
  for (std::int64_t i = 0; i < n; ++i) ds.labels.push_back(i % 10);
  return ds;
}

template <class Model>
std::vector<double> elastic_flat_parameters(Model& model) {
  std::vector<double> out;
  for (auto& [name, p] : named_tensors(model).parameters) out.insert(out.end(), p->value.begin(), p->value.end());
  return out;
}

double elastic_max_difference(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t k = 0; k < a.size(); ++k) worst = std::max(worst, std::abs(a[k] - b[k]));
  return worst;
}

// LeNet-5 trained by one process on `ds` with global batches of 16 (float64): the reference.
std::vector<double> elastic_one_process_lenet(const Dataset& ds, std::int64_t epochs) {
  auto model = lenet5<CpuLocal64>(1, 28, 10, 3);
  Sgd<CpuLocal64> sgd(named_tensors(model), {.lr = 0.05, .momentum = 0.9});
  DataLoader<double> loader(ds, {.seed = 9, .global_batch_size = 16});
  Trainer trainer(model, sgd, ConstantLr{0.05}, {.epochs = epochs, .verbose = false});
  trainer.fit(loader);
  return elastic_flat_parameters(model);
}

}  // namespace

TEST_CASE("Global batches split unevenly over 3 ranks train as one process (the weights of Batch::weight)",
          "[parallel][elastic]") {
  // 52 samples, global batch 16: three batches of 16 (6, 5, 5 per rank) and a last one of 4
  // (2, 1, 1). float64: the same parameters up to summation order.
  const Dataset ds = elastic_random_images(52, 5);
  const auto flat = [](auto& model) { return elastic_flat_parameters(model); };
  const TrainOptions quiet{.epochs = 2, .verbose = false};
  const SgdOptions sgd_options{.lr = 0.05, .momentum = 0.9};
  const std::vector<double> one = elastic_one_process_lenet(ds, 2);
  std::vector<std::vector<double>> split(3);
  ThreadWorld world(3);
  world.run([&](ThreadComm& comm) {
    auto model = lenet5<CpuThreads64>(1, 28, 10, 3);
    DataParallel dp(model, comm);
    Sgd<CpuThreads64> sgd(dp.parameters(), sgd_options);
    DataLoader<double> loader(ds, {.seed = 9, .rank = comm.rank(), .world_size = 3, .global_batch_size = 16});
    TrainOptions o = quiet;
    o.checkpoint_group = CheckpointGroup(comm);
    Trainer trainer(model, sgd, dp, ConstantLr{0.05}, o);
    const auto results = trainer.fit(loader);
    REQUIRE(results.size() == 2);
    split[static_cast<std::size_t>(comm.rank())] = flat(model);
  });
  for (const auto& rank : split) {
    REQUIRE(rank.size() == one.size());
    double worst = 0;
    for (std::size_t k = 0; k < one.size(); ++k) worst = std::max(worst, std::abs(rank[k] - one[k]));
    CHECK(worst < 1e-12);
  }
}

namespace {

// 4 threads train LeNet-5 under ElasticTrainer; `fault(group, step)` runs after every step on
// every member (it may throw, or sleep past the timeout). Returns each member's final parameters
// (keyed by member id) and the trainer's events of the member that ends as rank 0.
struct ElasticThreadsRun {
  std::map<std::string, std::vector<double>> parameters;
  std::vector<std::string> survivors;
  std::vector<ElasticEvent> events;
  std::map<std::string, int> epochs;  // epochs each member's fit() returned
};

template <class Strat = DataParallel<CpuThreads64>, class Fault>
ElasticThreadsRun elastic_threads_run(const Dataset& ds, Fault fault, bool replace, CommOptions comm = {}) {
  ElasticThreadsRun out;
  std::mutex mutex;
  ThreadElasticHub hub(4, comm);
  std::function<void(ThreadElasticGroup&)> member;
  member = [&](ThreadElasticGroup& group) {
    auto model = lenet5<CpuThreads64>(1, 28, 10, 3);
    Sgd<CpuThreads64> sgd(named_tensors(model), {.lr = 0.05, .momentum = 0.9});
    TrainOptions options{.epochs = 2, .verbose = false};
    options.after_step = [&] { fault(group, hub, member, replace); };
    ElasticTrainer<ThreadElasticGroup, decltype(model), Sgd<CpuThreads64>, Strat> trainer(
        group, model, sgd,
        [&](std::optional<Strat>& strategy, ThreadComm& c) {
          if constexpr (std::is_same_v<Strat, DataParallel<CpuThreads64>>)
            strategy.emplace(model, c, DataParallelOptions{.consistency_check_every = 1});
          else
            strategy.emplace(model, c, LocalSgdOptions{.period = 3});
        },
        ConstantLr{0.05}, options);
    const auto results = trainer.fit(ds, {.seed = 9, .global_batch_size = 16}, static_cast<DataLoader<double>*>(nullptr));
    REQUIRE(!results.empty());
    CHECK(results.back().epoch == 2);
    std::lock_guard lock(mutex);
    out.epochs[group.member()] = static_cast<int>(results.size());
    out.parameters[group.member()] = elastic_flat_parameters(model);
    out.survivors.push_back(group.member());
    if (group.comm().rank() == 0) out.events = trainer.events();
  };
  hub.run(member);
  return out;
}

}  // namespace

TEST_CASE("ElasticTrainer on threads: a rank that dies mid-run, the survivors end where one process ends",
          "[parallel][elastic]") {
  // 96 samples, global batch 16: 6 steps per epoch, 12 in all. The member of slot 2 throws after
  // step 5; the others fail in step 6's all-reduce, regroup as 3 and redo step 6 split 6/5/5.
  const Dataset ds = elastic_random_images(96, 7);
  const std::vector<double> one = elastic_one_process_lenet(ds, 2);
  SECTION("without a replacement") {
    const auto run = elastic_threads_run(ds, [](ThreadElasticGroup& g, ThreadElasticHub&, auto&, bool) {
      static thread_local int steps = 0;
      if (g.member() == "2.0" && ++steps == 5) throw std::runtime_error("slot 2 dies");
    }, false);
    REQUIRE(run.survivors.size() == 3);
    for (const auto& [member, p] : run.parameters) {
      INFO("member " << member);
      CHECK(elastic_max_difference(p, one) < 1e-10);
    }
    for (const auto& [member, n] : run.epochs) CHECK(n == 2);  // both epochs, whichever generation ran them
    REQUIRE(run.events.size() == 1);
    CHECK(run.events[0].change.size_before == 4);
    CHECK(run.events[0].change.size_after == 3);
    CHECK(run.events[0].change.left == std::vector<std::string>{"2.0"});
    CHECK(run.events[0].healed_step == 5);  // no step lost
  }
  SECTION("with a replacement, which ends bit-identical to the others") {
    // Member 0.0 plays the launcher: once the group has lost slot 2, it starts a replacement.
    const auto run = elastic_threads_run(ds, [](ThreadElasticGroup& g, ThreadElasticHub& hub, auto& member, bool) {
      static thread_local int steps = 0;
      static std::atomic<bool> replaced{false};
      if (g.member() == "2.0" && ++steps == 5) throw std::runtime_error("slot 2 dies");
      if (g.member() == "0.0" && g.generation() == 1 && !replaced.exchange(true)) hub.replace(2, member);
    }, true);
    REQUIRE(run.survivors.size() == 4);
    REQUIRE(run.parameters.count("2.1") == 1);
    for (const auto& [member, p] : run.parameters) {
      INFO("member " << member);
      CHECK(p == run.parameters.at("0.0"));  // bit for bit
      CHECK(elastic_max_difference(p, one) < 1e-10);
    }
    REQUIRE(!run.events.empty());
    CHECK(run.events.back().change.size_after == 4);
  }
  SECTION("a stalled rank is left out after the timeout and told so when it runs again") {
    const auto run = elastic_threads_run(ds, [](ThreadElasticGroup& g, ThreadElasticHub&, auto&, bool) {
      static thread_local int steps = 0;
      if (g.member() == "1.0" && ++steps == 3) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    }, false, CommOptions{.timeout = std::chrono::milliseconds(200)});
    REQUIRE(run.survivors.size() == 3);
    CHECK(run.parameters.count("1.0") == 0);
    for (const auto& [member, p] : run.parameters) CHECK(elastic_max_difference(p, one) < 1e-10);
  }
}

TEST_CASE("ElasticTrainer on threads: LocalSgd goes on after a rank dies", "[parallel][elastic]") {
  // Local SGD is not the one-process trajectory, so no reference: the survivors regroup, heal to
  // the member with the most steps (its parameters and momentum), and finish with finite values.
  const Dataset ds = elastic_random_images(96, 7);
  const auto run = elastic_threads_run<LocalSgd<CpuThreads64>>(
      ds, [](ThreadElasticGroup& g, ThreadElasticHub&, auto&, bool) {
        static thread_local int steps = 0;
        if (g.member() == "1.0" && ++steps == 4) throw std::runtime_error("slot 1 dies");
      }, false);
  REQUIRE(run.survivors.size() == 3);
  REQUIRE(run.events.size() == 1);
  CHECK(run.events[0].change.left == std::vector<std::string>{"1.0"});
  for (const auto& [member, p] : run.parameters)
    for (const double v : p) REQUIRE(std::isfinite(v));
}

namespace {

// Sgd that dies (throws) once, on member `dying`, when it is asked for update number `at`: a rank
// killed after the commit of a ReplicatedZero1 step, in the middle of its update.
struct SgdDyingInUpdate {
  using Env = CpuThreads64;
  Sgd<CpuThreads64> sgd;
  std::function<void()> before_update;
  void step() {
    if (before_update) before_update();
    sgd.step();
  }
  void zero_grad() { sgd.zero_grad(); }
  double lr() const { return sgd.lr(); }
  void set_lr(double lr) { sgd.set_lr(lr); }
  std::int64_t steps() const { return sgd.steps(); }
  template <class V>
  void visit_state(V& v) {
    sgd.visit_state(v);
  }
};

struct ShardedElasticRun {
  std::map<std::string, std::vector<double>> parameters;
  std::vector<ElasticEvent> events;
  std::map<std::string, std::string> errors;  // member -> what its fit() threw
};

// 4 threads train LeNet-5 under ElasticTrainer with replicated shards: stage 1, ReplicatedZero1;
// 2 or 3, FullyShardedDataParallel of that stage under ReplicatedFullyShardedOptimizer.
// `dies(member, update)`: 1, the member dies (throws) when its shard optimizer runs that update
// (1-based, primary and replica counted apart: update 2k-1 is step k's primary, 2k its replica);
// 2, a CommError there instead (it lives on, one step behind the others); `after_step` as in
// elastic_threads_run. dies(member, kBuildOf + g) is asked as each shard optimizer of
// generation g is built (a regroup, a bind): 1 or 2 fail the build the same ways.
constexpr int kBuildOf = -1000;

template <class Dies, class AfterStep>
ShardedElasticRun sharded_elastic_run(const Dataset& ds, int stage, Dies dies, AfterStep after_step) {
  using E = CpuThreads64;
  ShardedElasticRun out;
  std::mutex mutex;
  ThreadElasticHub hub(4);
  std::function<void(ThreadElasticGroup&)> member;
  member = [&](ThreadElasticGroup& group) {
    auto model = lenet5<E>(1, 28, 10, 3);
    auto updates = std::make_shared<int>(0);
    const auto make_sgd = [&, updates](const NamedTensors<E>& shard) {
      // Building a shard's optimizer (a regroup, a bind) asks too, as "update" kBuildOf + generation.
      const int building = dies(group.member(), kBuildOf + static_cast<int>(group.generation()));
      if (building == 1) throw std::runtime_error("dies building its shards");
      if (building == 2) throw CommError("its link fails while it builds its shards");
      return SgdDyingInUpdate{Sgd<E>(shard, {.lr = 0.05, .momentum = 0.9}), [&, updates] {
                                const int what = dies(group.member(), ++*updates);
                                if (what == 1) throw std::runtime_error("dies in its update");
                                if (what == 2) throw CommError("its connection fails after the commit");
                              }};
    };
    TrainOptions options{.epochs = 2, .verbose = false};
    options.after_step = [&] { after_step(group, hub, member); };
    const auto fit = [&]<class Strat>(auto& optimizer, typename ElasticTrainer<ThreadElasticGroup, decltype(model),
                                      std::remove_reference_t<decltype(optimizer)>, Strat>::MakeStrategy make) {
      ElasticTrainer<ThreadElasticGroup, decltype(model), std::remove_reference_t<decltype(optimizer)>, Strat> trainer(
          group, model, optimizer, std::move(make), ConstantLr{0.05}, options);
      try {
        trainer.fit(ds, {.seed = 9, .global_batch_size = 16}, static_cast<DataLoader<double>*>(nullptr));
      } catch (const Error& e) {
        std::lock_guard lock(mutex);
        out.errors[group.member()] = e.what();
        return;
      }
      std::lock_guard lock(mutex);
      out.parameters[group.member()] = elastic_flat_parameters(model);
      if (group.comm().rank() == 0) out.events = trainer.events();
    };
    if (stage == 1) {
      ReplicatedZero1<E, SgdDyingInUpdate> zero(model, make_sgd, {.consistency_check_every = 1});
      fit.template operator()<NoStrategy<E>>(zero, [](std::optional<NoStrategy<E>>& s, ThreadComm&) { s.emplace(); });
    } else {
      using Fsdp = FullyShardedDataParallel<decltype(model)>;
      ReplicatedFullyShardedOptimizer<Fsdp, SgdDyingInUpdate> sharded(model, make_sgd);
      fit.template operator()<Fsdp>(sharded, [&](std::optional<Fsdp>& f, ThreadComm& c) {
        f.emplace(model, c, FullyShardedOptions{.stage = stage, .consistency_check_every = 1});
      });
    }
  };
  hub.run(member);
  return out;
}

const auto no_death = [](const std::string&, int) { return 0; };
const auto no_after_step = [](ThreadElasticGroup&, ThreadElasticHub&, auto&) {};

}  // namespace

// Stage 1: ReplicatedZero1; 2 and 3: FSDP under ReplicatedFullyShardedOptimizer. (A name much
// longer than this hangs Catch2 v2's console reporter when it prints a failure's header.)
TEST_CASE("Replicated shards on threads: a dead rank's shard comes from its replica", "[parallel][elastic]") {
  // 96 samples, global batch 16: 12 steps. Shard s lives on ranks s and s-1, so slot 2's shard
  // survives on slot 1; the survivors end where one process ends (float64, summation order).
  const Dataset ds = elastic_random_images(96, 7);
  const std::vector<double> one = elastic_one_process_lenet(ds, 2);
  const int stage = GENERATE(1, 2, 3);
  INFO("stage " << stage << (stage == 1 ? " (ReplicatedZero1)" : " (FSDP, ReplicatedFullyShardedOptimizer)"));
  const auto sharded_run = [&](auto dies, auto after_step) {
    return sharded_elastic_run(ds, stage, dies, after_step);
  };
  const auto check_all = [&](const ShardedElasticRun& run, std::size_t members) {
    REQUIRE(run.errors.empty());
    REQUIRE(run.parameters.size() == members);
    for (const auto& [member, p] : run.parameters) {
      INFO("member " << member);
      CHECK(p == run.parameters.begin()->second);  // bit for bit
      CHECK(elastic_max_difference(p, one) < 1e-10);
    }
  };
  SECTION("no failure: 4 ranks train as one process") {
    check_all(sharded_run(no_death, no_after_step), 4);
  }
  SECTION("a rank dies between two steps: step 6 is redone by 3") {
    const auto run = sharded_run(no_death, [](ThreadElasticGroup& g, ThreadElasticHub&, auto&) {
      static thread_local int steps = 0;
      if (g.member() == "2.0" && ++steps == 5) throw std::runtime_error("slot 2 dies");
    });
    check_all(run, 3);
    REQUIRE(run.events.size() == 1);
    CHECK(run.events[0].change.left == std::vector<std::string>{"2.0"});
    CHECK(run.events[0].healed_step == 5);
  }
  SECTION("a rank dies in its update after step 6's commit: the others keep step 6") {
    // Update 11 is step 6's primary update on slot 2; the others committed step 6 and fail in
    // their next collective (ZeRO-1: the all_gather after the update), and the step counts.
    const auto run = sharded_run(
        [](const std::string& m, int update) { return m == "2.0" && update == 11 ? 1 : 0; }, no_after_step);
    check_all(run, 3);
    REQUIRE(run.events.size() == 1);
    CHECK(run.events[0].healed_step == 6);
  }
  SECTION("a rank's update fails after step 6's commit and it lives on: it rolls forward, nobody leaves") {
    // Slot 1 throws CommError before updating: it holds step 6's gradients but not its update,
    // the others took step 6. Its regroup applies them (the roll-forward), and the Trainer
    // position comes from a member that counted step 6.
    const auto run = sharded_run(
        [](const std::string& m, int update) { return m == "1.0" && update == 11 ? 2 : 0; }, no_after_step);
    check_all(run, 4);
    REQUIRE(run.events.size() == 1);
    CHECK(run.events[0].change.left.empty());
    CHECK(run.events[0].healed_step == 6);
    CHECK(run.events[0].source_rank != 1);
  }
  SECTION("with a replacement: the world returns to 4, the newcomer's shards from the others") {
    std::atomic<bool> replaced{false};
    const auto run = sharded_run(no_death, [&replaced](ThreadElasticGroup& g, ThreadElasticHub& hub, auto& member) {
      static thread_local int steps = 0;
      if (g.member() == "2.0" && ++steps == 5) throw std::runtime_error("slot 2 dies");
      if (g.member() == "0.0" && g.generation() == 1 && !replaced.exchange(true)) hub.replace(2, member);
    });
    check_all(run, 4);
    CHECK(run.parameters.count("2.1") == 1);
    REQUIRE(!run.events.empty());
    CHECK(run.events.back().change.size_after == 4);
  }
  SECTION("a second failure while the survivors build the new layout: the old one, kept, carries on") {
    // Slot 2 dies after step 5; in generation 1's build slot 0 dies and slot 3's link fails, while
    // slot 1 builds its shards. Generation 1's shard 0 (on slots 0 and 3) is then lost, but slot 1
    // kept its generation-0 shards 1 and 2 until a commit in generation 1, and slot 3 still has
    // shards 3 and 0: generation 0 is whole, and slots 1 and 3 go on from step 5 as one process.
    const auto run = sharded_run(
        [](const std::string& m, int update) {
          if (update != kBuildOf + 1) return 0;
          return m == "0.0" ? 1 : m == "3.0" ? 2 : 0;
        },
        [](ThreadElasticGroup& g, ThreadElasticHub&, auto&) {
          static thread_local int steps = 0;
          if (g.member() == "2.0" && ++steps == 5) throw std::runtime_error("slot 2 dies");
        });
    check_all(run, 2);
    CHECK(run.parameters.count("1.0") == 1);
    CHECK(run.parameters.count("3.0") == 1);
    REQUIRE(!run.events.empty());
    CHECK(run.events.back().change.size_after == 2);
    CHECK(run.events.back().healed_step == 5);
  }
  SECTION("two neighbours die in one step: the shard they held is lost, and every survivor says so") {
    const auto run = sharded_run(no_death, [](ThreadElasticGroup& g, ThreadElasticHub&, auto&) {
      static thread_local int steps = 0;
      if ((g.member() == "1.0" || g.member() == "2.0") && ++steps == 5) throw std::runtime_error("dies");
    });
    CHECK(run.parameters.empty());
    REQUIRE(run.errors.size() == 2);
    for (const auto& [member, what] : run.errors) {
      INFO(what);
      CHECK(what.find("lost shard(s) 2") != std::string::npos);
      CHECK(what.find("resume from a checkpoint") != std::string::npos);
    }
  }
}
