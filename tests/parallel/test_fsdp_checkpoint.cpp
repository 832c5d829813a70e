// FullyShardedDataParallel's checkpoints on ThreadComm (train/sharded_checkpoint.hpp): a 4-rank
// sharded checkpoint, taken mid-epoch through the Trainer, resumes on 2, 3 and 4 ranks (stage 3 and
// stage 2) and ends where the uninterrupted run ends (float64; bit for bit at the same world size);
// the one-file form (save_checkpoint's, and consolidate_sharded_checkpoint's from a directory) loads
// in a run without FSDP; GPT's tied wte round-trips (lm_head.weight written once, as an alias);
// and a shard set that is incomplete, corrupt, truncated or mixed from two
// saves is refused on every rank, naming the shard, with nothing loaded.
#include <catch2/catch.hpp>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>

#include "parallel/elastic_resume.hpp"
#include "tessera/comm/local.hpp"
#include "tessera/comm/threads.hpp"
#include "tessera/models/gpt.hpp"
#include "tessera/train/sharded_checkpoint.hpp"

using namespace tessera;
using tessera::testing::ElasticCase;
using tessera::testing::ElasticResult;
using tessera::testing::ElasticStrategy;
using tessera::testing::elastic_run;
using tessera::testing::elastic_run_threads;
using tessera::testing::max_difference;
namespace fs = std::filesystem;

namespace {

fs::path fsdp_checkpoint_dir() { return testing::elastic_temp_dir("tessera_fsdp_ckpt"); }

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
    auto model = testing::elastic_model<E>(4);
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
    const std::string ckpt = (dir / (std::string("shards_") + testing::to_string(strategy))).string();
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
      DYNAMIC_SECTION(testing::to_string(strategy) << ": 4 -> " << to << " ranks") {
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
    DYNAMIC_SECTION(file << " -> " << testing::to_string(strategy) << " at " << ranks << " ranks") {
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
      auto model = testing::elastic_model<E>(4);
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
