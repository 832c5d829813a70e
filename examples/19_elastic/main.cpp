// 19_elastic: data-parallel training that outlives a dead rank and takes in a replacement, without
// restarting the processes that stay and without a checkpoint file (torchft's per-step quorum).
//
//   tools/tessera-run -n 4 --elastic --replace 1 build/examples/19_elastic_gloo --epochs=3
//   kill -9 <a rank's pid>     the other 3 agree on a new group within a step or two and go on; the
//                              replacement tessera-run starts joins at a step boundary, healed
//                              from a survivor's memory, and the group is 4 again
//
// The global batch stays fixed and each batch covers the same samples at every group size, so the
// run follows the one-process trajectory: the final accuracy is that of an uninterrupted run. After
// every change each rank prints its parameters' checksum, DataParallel compares the replicas every
// --check-every steps, and the run ends by comparing them once more. --zero=1 trains with ZeRO-1,
// --zero=2 or 3 with FSDP of that stage, each shard on two ranks (ReplicatedZero1,
// ReplicatedFullyShardedOptimizer), so a dead rank's shard survives on its neighbour. README.md
// explains it.
#include <cinttypes>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>

#include "tessera/tessera.hpp"
#include "tessera/build_env.hpp"
#include "tessera/parallel/fully_sharded_replicated.hpp"
#include "tessera/parallel/zero_replicated.hpp"
#include "tessera/train/elastic.hpp"
#include "common/elastic_report.hpp"
#include "common/fashion_mnist_data.hpp"

using namespace tessera;

namespace {

using E = BuildEnv;  // CpuGloo: the backend with an elastic group (comm/elastic.hpp says why only it)
using Comm = E::Comm;
using Group = ElasticGroupOf<Comm>;

constexpr const char* kStrategy[] = {"DataParallel", "ZeRO-1, each shard on 2 ranks", "FSDP stage 2, each shard on 2 ranks",
                                     "FSDP stage 3, each shard on 2 ranks"};

struct Options {
  std::int64_t epochs = 3, batch = 64, limit = 0, check_every = 1;
  double lr = 0.05, weight_decay = 5e-4, settle = 0, min_accuracy = 0;
  int threads = 1, min_ranks = 1;
  int zero = 0;
  std::uint64_t seed = 1;
  std::string data_dir;
};

// Trains through membership changes; prints each member's checksum after each change.
template <class Strat, class Model, class Optimizer>
std::vector<EpochResult> fit(const Options& o, Group& group, Model& model, Optimizer& optimizer,
                             std::function<void(std::optional<Strat>&, Comm&)> make_strategy,
                             const examples::FashionMnist& data, DataLoader<float>& test_loader,
                             std::vector<ElasticEvent>& events) {
  ElasticTrainer<Group, Model, Optimizer, Strat> trainer(
      group, model, optimizer, std::move(make_strategy), CosineLr{o.lr, static_cast<double>(o.epochs), 0.0},
      {.epochs = o.epochs, .progress = 0}, {.on_change = [&](const ElasticEvent& event) {
        std::printf("member %s: rank %d of %d at step %lld, parameters %016" PRIx64 "\n", group.member().c_str(),
                    group.comm().rank(), group.comm().size(), static_cast<long long>(event.healed_step),
                    examples::parameter_checksum(model));
        std::fflush(stdout);
      }});
  auto results = trainer.fit(data.train, {.shuffle = true, .seed = o.seed, .global_batch_size = o.batch}, &test_loader);
  events = trainer.events();
  return results;
}

int train(const Options& o) {
  Cpu::set_num_threads(o.threads);
  const auto data = examples::load_normalized_fashion_mnist(o.data_dir, o.limit);
  DataLoader<float> test_loader(data.test, {.batch_size = 500, .shuffle = false});
  auto model = lenet5<E>(1, 28, 10, o.seed);  // every member builds the same; the heal aligns a replacement
  const SgdOptions sgd_options{.lr = o.lr, .momentum = 0.9, .weight_decay = o.weight_decay, .decay_norm_and_bias = false};
  // Last, so that a replacement is ready to train when it is admitted (the group waits for it).
  Group group = Group::from_env({}, {.min_size = o.min_ranks, .settle = std::chrono::milliseconds(
                                                                  static_cast<std::int64_t>(o.settle * 1000))});
  if (group.comm().rank() == 0 && !group.joined_late()) {
    std::printf("19_elastic: LeNet-5, %d ranks, global batch %lld (split over however many ranks remain), %lld "
                "epochs, %s, member %s\n", group.comm().size(), static_cast<long long>(o.batch),
                static_cast<long long>(o.epochs), kStrategy[o.zero],
                group.member().c_str());
    examples::print_elastic_cost_model(static_cast<std::int64_t>(count_parameters(named_tensors(model))),
                     group.comm().options().timeout.count() / 1000.0, o.zero > 0);
  }
  if (group.joined_late())
    std::printf("member %s joined generation %lld as rank %d of %d\n", group.member().c_str(),
                static_cast<long long>(group.generation()), group.comm().rank(), group.comm().size());
  std::fflush(stdout);
  std::vector<ElasticEvent> events;
  std::vector<EpochResult> results;
  const int check_every = static_cast<int>(o.check_every);
  const auto make_sgd = [&](const NamedTensors<E>& shard) { return Sgd<E>(shard, sgd_options); };
  if (o.zero == 1) {  // parallel/zero_replicated.hpp: shard r on ranks r and r-1
    ReplicatedZero1<E, Sgd<E>> zero(model, make_sgd, {.consistency_check_every = check_every});
    results = fit<NoStrategy<E>>(o, group, model, zero, [](auto& none, Comm&) { none.emplace(); }, data, test_loader, events);
  } else if (o.zero > 1) {  // parallel/fully_sharded_replicated.hpp: FSDP of that stage, the same ring
    using Fsdp = FullyShardedDataParallel<decltype(model)>;
    ReplicatedFullyShardedOptimizer<Fsdp, Sgd<E>> sharded(model, make_sgd);
    results = fit<Fsdp>(o, group, model, sharded, [&](auto& fsdp, Comm& comm) {
      fsdp.emplace(model, comm, FullyShardedOptions{.stage = o.zero, .consistency_check_every = check_every});
    }, data, test_loader, events);
  } else {
    Sgd<E> sgd(named_tensors(model), sgd_options);
    results = fit<DataParallel<E>>(o, group, model, sgd, [&](auto& dp, Comm& comm) {
      dp.emplace(model, comm, DataParallelOptions{.consistency_check_every = check_every});
    }, data, test_loader, events);
  }
  examples::report_elastic_end(group, model, results, events, o.min_accuracy);  // the self-check
  return 0;
}

Options parse(int argc, char** argv) {
  Flags flags(argc, argv);
  Options o;
  o.epochs = flags.get("epochs", o.epochs, {.min = 1}, "passes over the training set");
  o.batch = flags.get("batch", o.batch, {.min = 1}, "global batch, split over the ranks there are (unevenly if need be)");
  o.lr = flags.get("lr", o.lr, {.above = 0}, "SGD learning rate (momentum 0.9), decayed to 0 by a cosine");
  o.weight_decay = flags.get("weight-decay", o.weight_decay, {.min = 0}, "SGD weight decay (not on biases)");
  o.threads = flags.threads("threads", o.threads, "OpenMP threads per rank");
  o.seed = static_cast<std::uint64_t>(flags.get("seed", std::int64_t{1}, "seed of initialization and shuffling"));
  o.limit = flags.get("limit", o.limit, {.min = 0}, "train on the first N images only (0: all 60,000)");
  o.data_dir = flags.get("data-dir", std::string(), "directory of the IDX files (empty: TESSERA_DATA_DIR, then the default)");
  o.check_every = flags.get("check-every", o.check_every, {.min = 0},
                            "compare the replicas' parameters every N steps (0: never)");
  o.settle = flags.get("settle", o.settle, {.min = 0},
                       "seconds the survivors wait for each other after a failure (0: twice the comm timeout)");
  o.min_ranks = static_cast<int>(flags.get("min-ranks", std::int64_t{1}, {.min = 1}, "fewer left: give up"));
  o.zero = static_cast<int>(flags.get("zero", std::int64_t{0}, {.min = 0, .max = 3}, "0: DataParallel; 1: ZeRO-1, "
                                      "2 and 3: FSDP of that stage, each shard on two ranks"));
  o.min_accuracy = flags.get("min-accuracy", o.min_accuracy, {.min = 0, .max = 1}, "fail below this test accuracy");
  flags.finish();
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return train(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "19_elastic: %s\n", e.what());
    return 1;
  }
}
