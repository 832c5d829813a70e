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
// --check-every steps, and the run ends by comparing them once more. README.md explains it.
#include <cinttypes>
#include <cstdio>
#include <optional>
#include <string>

#include "tessera/tessera.hpp"
#include "tessera/build_env.hpp"
#include "tessera/train/elastic.hpp"
#include "common/fashion_mnist_data.hpp"

using namespace tessera;

namespace {

using E = BuildEnv;  // CpuGloo: the backend with an elastic group (comm/elastic.hpp says why only it)
using Comm = E::Comm;
using Group = ElasticGroupOf<Comm>;

struct Options {
  std::int64_t epochs = 3, batch = 64, limit = 0, check_every = 1;
  double lr = 0.05, weight_decay = 5e-4, settle = 0, min_accuracy = 0;
  int threads = 1, min_ranks = 1;
  std::uint64_t seed = 1;
  std::string data_dir;
};

// One 64-bit checksum of every parameter's bytes, the same on replicas that are bit-identical.
template <class Model>
std::uint64_t parameter_checksum(Model& model) {
  std::uint64_t sum = 0;
  std::vector<float> host;
  for (const auto& [name, p] : parameters_of_env<E>(named_tensors(model)).parameters)
    sum = sum * 31 + tensor_checksum(p->value, host);
  return sum;
}

// What a membership change costs, from the model's size: the heal broadcasts parameters and
// optimizer state (SGD momentum: as many values again) from one member to the others.
template <class Model>
void print_cost_model(Model& model, double timeout) {
  std::int64_t parameters = 0;
  for (const auto& [name, p] : parameters_of_env<E>(named_tensors(model)).parameters) parameters += p->value.numel();
  const double heal_mb = 2.0 * static_cast<double>(parameters) * sizeof(float) / 1e6;
  std::printf("cost of a change: detection (a dead process: its connections reset, ~1 ms; a stopped one: the "
              "timeout, %.0f s) + check-in through the store + a new Gloo mesh + the heal, %.2f MB broadcast from "
              "one member (%lld parameters and as many momentum values)\n",
              timeout, heal_mb, static_cast<long long>(parameters));
}

int train(const Options& o) {
  Cpu::set_num_threads(o.threads);
  auto [train_set, test_set] = examples::load_normalized_fashion_mnist(o.data_dir, o.limit);
  DataLoader<float> test_loader(test_set, {.batch_size = 500, .shuffle = false});
  auto model = lenet5<E>(1, 28, 10, o.seed);  // every member builds the same; the heal aligns a replacement
  Sgd<E> sgd(named_tensors(model),
             {.lr = o.lr, .momentum = 0.9, .weight_decay = o.weight_decay, .decay_norm_and_bias = false});
  // Last, so that a replacement is ready to train when it is admitted (the group waits for it).
  Group group = Group::from_env({}, {.min_size = o.min_ranks, .settle = std::chrono::milliseconds(
                                                                  static_cast<std::int64_t>(o.settle * 1000))});
  const bool first = group.comm().rank() == 0 && !group.joined_late();
  if (first) {
    std::printf("19_elastic: LeNet-5, %d ranks, global batch %lld (split over however many ranks remain), %lld "
                "epochs, member %s\n", group.comm().size(), static_cast<long long>(o.batch),
                static_cast<long long>(o.epochs), group.member().c_str());
    print_cost_model(model, group.comm().options().timeout.count() / 1000.0);
  }
  if (group.joined_late())
    std::printf("member %s joined generation %lld as rank %d of %d\n", group.member().c_str(),
                static_cast<long long>(group.generation()), group.comm().rank(), group.comm().size());
  std::fflush(stdout);
  ElasticTrainer<Group, decltype(model), Sgd<E>, DataParallel<E>> trainer(
      group, model, sgd,
      [&](std::optional<DataParallel<E>>& dp, Comm& comm) {
        dp.emplace(model, comm, DataParallelOptions{.consistency_check_every = static_cast<int>(o.check_every)});
      },
      CosineLr{o.lr, static_cast<double>(o.epochs), 0.0}, {.epochs = o.epochs, .progress = 0},
      {.on_change = [&](const ElasticEvent& event) {
        std::printf("member %s: rank %d of %d at step %lld, parameters %016" PRIx64 "\n", group.member().c_str(),
                    group.comm().rank(), group.comm().size(), static_cast<long long>(event.healed_step),
                    parameter_checksum(model));
        std::fflush(stdout);
      }});
  const auto results = trainer.fit(train_set, {.shuffle = true, .seed = o.seed, .global_batch_size = o.batch},
                                   &test_loader);
  // Self-check: every member ends with the same parameters, bit for bit.
  Comm& comm = group.comm();
  const auto mine = static_cast<std::int64_t>(parameter_checksum(model));
  std::vector<std::int64_t> all(static_cast<std::size_t>(comm.size()));
  comm.all_gather(std::span<const std::int64_t>(&mine, 1), std::span<std::int64_t>(all));
  for (const auto other : all)
    TESSERA_CHECK(other == mine, Error, "19_elastic: the members' parameters differ at the end");
  const double accuracy = results.empty() ? 0.0 : results.back().test_accuracy;
  if (comm.rank() == 0) {
    std::printf("final: %d ranks (generation %lld, %zu change(s)), test accuracy %.2f%%, replicas identical "
                "(%016" PRIx64 ")\n", comm.size(), static_cast<long long>(group.generation()), group.history().size(),
                100 * accuracy, static_cast<std::uint64_t>(mine));
    for (const auto& e : trainer.events())
      std::printf("change: generation %lld at step %lld, %d -> %d ranks, membership %.3f s, heal %.3f s\n",
                  static_cast<long long>(e.change.generation), static_cast<long long>(e.healed_step),
                  e.change.size_before, e.change.size_after, e.change.seconds, e.heal_seconds);
  }
  TESSERA_CHECK(o.min_accuracy <= 0 || results.empty() || accuracy >= o.min_accuracy, Error, "19_elastic: test "
                "accuracy ", accuracy, " is below --min-accuracy=", o.min_accuracy);
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
