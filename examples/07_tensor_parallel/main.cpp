// 07_tensor_parallel: a 784-1024-10 MLP on Fashion-MNIST whose layers are split across the ranks
// (Megatron-LM's tensor parallelism): every rank sees the same batch and holds 1/p of every weight.
// One source, one binary per communicator:
//
//   build/examples/07_tensor_parallel_threads --ranks=2
//   mpirun -n 4 build/examples/07_tensor_parallel_mpi
//
// It checks itself first: the same network built densely from the same seed must give the same
// loss, and each rank's gradients must be its slice of the dense gradients, on the first batch
// (common/tensor_parallel_report.hpp, with the cost model). --help lists the flags.
#include <array>
#include <cmath>
#include <cstdio>
#include <string>

#include "tessera/tessera.hpp"
#include "tessera/build_env.hpp"
#include "common/fashion_mnist_data.hpp"
#include "common/tensor_parallel_report.hpp"
#include "common/traffic.hpp"

using namespace tessera;

namespace {

struct Options {
  std::int64_t epochs = 3, batch = 64, hidden = 1024, limit = 0;
  double lr = 0.05;
  int threads = 1, ranks = 2;
  std::uint64_t seed = 1;
  std::string data_dir, trace;
};

using E = BuildEnv;  // CpuThreads, CpuMpi, CpuGloo or CudaNccl: chosen by the build, nowhere else
using Device = E::Device;
using Comm = E::Comm;

// Flatten -> [column-parallel Linear(784, hidden) -> ReLU -> row-parallel Linear(hidden, 10)].
struct TensorParallelClassifier {
  using Env = E;
  using Tensor = tessera::Tensor<float, Device>;
  struct Cache {
    Flatten<E>::Cache flatten;
    typename TensorParallelMlp<E>::Cache mlp;
  };
  Flatten<E> flatten;
  TensorParallelMlp<E> mlp;

  TensorParallelClassifier(std::int64_t hidden, Rng& rng, Comm& comm) : mlp(784, hidden, 10, rng, comm) {
    mlp.set_needs_input_grad(false);  // dL/d(images) is not needed: saves the backward all-reduce
  }
  const Tensor& forward(const Tensor& x, Cache& c) { return mlp.forward(flatten.forward(x, c.flatten), c.mlp); }
  const Tensor& backward(const Tensor& dy, Cache& c) { return mlp.backward(dy, c.mlp); }  // dL/dx of the images: unused
  template <class V>
  void visit(V& v, const std::string& prefix) {
    mlp.visit(v, prefix);
  }
  void set_mode(Mode m) { mlp.set_mode(m); }
  void set_timeline(SpanSink* timeline) { mlp.set_timeline(timeline); }
};

void train(Comm& comm, const Options& o) {
  // Refused before the data is read (the parallel layers would refuse it later).
  TESSERA_CHECK(o.hidden % comm.size() == 0, ArgumentError, "--hidden=", o.hidden,
                " does not split over ", comm.size(), " ranks (each holds hidden / ranks units)");
  Cpu::set_num_threads(o.threads);
  auto [train_set, test_set] = examples::load_normalized_fashion_mnist(o.data_dir, o.limit);

  examples::RankMemory<Device, Comm> memory(comm);  // the model's state, measured from here
  memory.start();
  Rng rng(o.seed);  // the dense layers' draws; each rank keeps its slice
  TensorParallelClassifier model(o.hidden, rng, comm);
  auto named = named_tensors(model);
  const auto state_bytes = memory.held();  // the slices' values and gradients (the dense layers are gone)
  const double mine = static_cast<double>(count_parameters(named));
  if (comm.rank() == 0)
    std::printf("07_tensor_parallel: MLP 784-%lld-10 split over %d ranks: %.0f of %lld parameters on each rank; batch %lld\n",
                static_cast<long long>(o.hidden), comm.size(), mine,
                static_cast<long long>(784 * o.hidden + o.hidden + o.hidden * 10 + 10), static_cast<long long>(o.batch));
  // Every rank reads the same batches (tensor parallelism splits the model, not the data).
  DataLoader<float> loader(train_set, {.batch_size = o.batch, .shuffle = true, .seed = o.seed});
  DataLoader<float> test_loader(test_set, {.batch_size = 500, .shuffle = false});
  Batch<float> first;
  loader.start_epoch(0);
  TESSERA_CHECK(loader.next(first), Error, "07_tensor_parallel: no training data");
  examples::check_split_mlp_against_dense(model, comm, first, o.hidden, o.seed);

  // The split layers communicate inside forward and backward themselves: the strategy has no hook
  // to act in. It tells the Trainer that every rank sees the same samples, and routes the trace
  // (steps 2 to 4: forward, backward and the optimizer step on the compute lane, the row layer's
  // all-reduce of the logits inside forward on the communication lane) to the layers.
  TensorParallel<E> tensor(comm, model.mlp);
  Sgd<E> sgd(named, {.lr = o.lr, .momentum = 0.9});
  examples::FirstStepsMemory<Device, Comm> measured{memory};
  Timeline timeline(comm);
  memory.start();
  const double lo_before = comm.rank() == 0 ? examples::loopback_bytes() : -1, peer_before = examples::peer_bytes(comm);
  Trainer trainer(model, sgd, tensor, CosineLr{o.lr, static_cast<double>(o.epochs), 0.0},
                  {.epochs = o.epochs, .verbose = comm.rank() == 0, .before_step = [&] { measured.record(); },
                   .timeline = o.trace.empty() ? nullptr : &timeline, .timeline_first_step = 1, .timeline_steps = 3,
                   .trace_path = o.trace, .checkpoint_group = CheckpointGroup(comm)});
  trainer.fit(loader);  // the test set after training: its forward all-reduces are not a step's
  const double loopback = lo_before >= 0 ? examples::loopback_bytes() - lo_before : -1;
  const double peer = peer_before >= 0 ? examples::peer_bytes(comm) - peer_before : -1;
  const double accuracy = trainer.evaluate(test_loader).second;
  if (comm.rank() != 0) return;
  std::printf("final test accuracy: %.2f%%\n", 100 * accuracy);
  if (!o.trace.empty()) std::printf("timeline of 3 steps: %s\n", o.trace.c_str());
  const double steps = static_cast<double>(trainer.state().global_step);
  if (comm.size() > 1) examples::print_tensor_parallel_costs(comm.size(), o.batch, o.hidden, mine, steps, peer, loopback);
  examples::print_tensor_parallel_memory(comm.size(), o.batch, o.hidden, mine, state_bytes, measured.optimizer,
                                         measured.step_peak);
}

Options parse(int argc, char** argv) {
  Flags flags(argc, argv);
  Options o;
  o.epochs = flags.get("epochs", o.epochs, {.min = 1}, "passes over the training set");
  // every rank sees the whole batch: nothing to split
  o.batch = flags.get("batch", o.batch, {.min = 1}, "images per step, the same on every rank");
  o.hidden = flags.get("hidden", o.hidden, {.min = 1}, "hidden units h, split over the ranks (a multiple of them)");
  o.lr = flags.get("lr", o.lr, {.above = 0}, "SGD learning rate (momentum 0.9), decayed to 0 by a cosine");
  o.threads = flags.threads("threads", o.threads, "OpenMP threads per rank");
  o.ranks = flags.ranks("ranks", o.ranks, !SharedMemoryCommunicator<Comm>,
                        "ranks to run (the threads build: threads of this process)");
  // Ranks of the threads build share this process's cores (a process backend runs one rank here).
  check_thread_budget(SharedMemoryCommunicator<Comm> ? o.ranks : 1, "--ranks", o.threads, "--threads");
  o.seed = static_cast<std::uint64_t>(flags.get("seed", std::int64_t{1}, "seed of initialization and shuffling"));
  o.limit = flags.get("limit", o.limit, {.min = 0}, "train on the first N images only (0: all 60,000)");
  o.data_dir = flags.get("data-dir", std::string(),
                         "directory of the IDX files (empty: TESSERA_DATA_DIR, then the default)");
  o.trace = flags.output_path("trace", o.trace, "Chrome trace of training steps 2 to 4");
  flags.finish();
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    launch<E>([&](Comm& comm) { train(comm, o); }, {.ranks = o.ranks});  // --ranks: threads build only
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "07_tensor_parallel: %s\n", e.what());
    return 1;
  }
}
