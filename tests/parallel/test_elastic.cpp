// Elastic resume on ThreadComm: a checkpoint taken mid-epoch by N ranks (DataParallel, or Zero1
// with its optimizer state sharded) resumes on M ranks, 2 -> 1, 2 -> 4 and 4 -> 2 (and 2 -> 2), and ends
// where an uninterrupted run ends, up to summation order (float64); M that does not divide the
// global batch, or a loader that does not keep the global batch, is refused naming the file, both
// world sizes and the batch. The same scenario over MPI and Gloo: tests/parallel/elastic_test.py.
#include <catch2/catch.hpp>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "parallel/elastic_resume.hpp"
#include "tessera/comm/local.hpp"
#include "tessera/comm/threads.hpp"

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
