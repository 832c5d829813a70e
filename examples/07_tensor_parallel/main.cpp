// 07_tensor_parallel: a 784-1024-10 MLP on Fashion-MNIST whose layers are split across the ranks
// (Megatron-LM's tensor parallelism): every rank sees the same batch and holds 1/p of every weight.
// One source, one binary per communicator:
//
//   build/examples/07_tensor_parallel_threads --ranks=2
//   mpirun -n 4 build/examples/07_tensor_parallel_mpi
//
// Flags: --epochs=3 --batch=64 --hidden=1024 --lr=0.05 --threads=1 --seed=1 --limit=N
// --data-dir=DIR --trace=trace.json (after training, 3 more steps as a Chrome trace, the layers'
// collectives on the communication lane), and for the threads build --ranks=2.
//
// It checks itself first: the same network built densely from the same seed must give the same
// loss, and each rank's gradients must be its slice of the dense gradients, on the first batch.
#include <array>
#include <cmath>
#include <cstdio>
#include <string>

#include "tessera/tessera.hpp"
#include "tessera/build_env.hpp"
#include "common/device_batch.hpp"
#include "common/fashion_mnist_data.hpp"
#include "common/memory.hpp"
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

// The first batch through the dense network (same seed) and the split one.
void check_against_dense(TensorParallelClassifier& tp, Comm& comm, const Batch<float>& b, const Options& o) {
  Rng rng(o.seed);
  Linear<E> fc1(784, o.hidden, rng), fc2(o.hidden, 10, rng);
  Flatten<E> flatten;
  ReLU<E> relu;
  Flatten<E>::Cache cf;
  Linear<E>::Cache c1, c2;
  ReLU<E>::Cache cr;
  CrossEntropyLoss<E> loss;
  CrossEntropyLoss<E>::Cache lc_dense, lc_tp;
  examples::DeviceBatch<Device> images;
  const float expected = loss.forward(
      fc2.forward(relu.forward(fc1.forward(flatten.forward(images(b.images), cf), c1), cr), c2), b.labels, lc_dense);
  fc1.backward(relu.backward(fc2.backward(loss.backward(lc_dense), c2), cr), c1);
  TensorParallelClassifier::Cache cache;
  const float got = loss.forward(tp.forward(images(b.images), cache), b.labels, lc_tp);
  tp.backward(loss.backward(lc_tp), cache);
  // Rank r holds rows [r h/p, (r+1) h/p) of fc1 and columns [r h/p, (r+1) h/p) of fc2.
  auto named = named_tensors(tp);
  const std::int64_t w = o.hidden / comm.size(), first = w * comm.rank();
  double worst = 0;
  const auto g1 = to_host(named.parameters[0].second->grad);  // "0.weight" (w, 784)
  const auto dense_g1 = to_host(fc1.weight().grad);
  for (std::int64_t k = 0; k < g1.numel(); ++k)
    worst = std::max(worst, static_cast<double>(std::abs(g1[k] - dense_g1[first * 784 + k])));
  const auto g2 = to_host(named.parameters[2].second->grad);  // "2.weight" (10, w)
  const auto dense_g2 = to_host(fc2.weight().grad);
  for (std::int64_t i = 0; i < 10; ++i)
    for (std::int64_t j = 0; j < w; ++j)
      worst = std::max(worst, static_cast<double>(std::abs(g2[i * w + j] - dense_g2[i * o.hidden + first + j])));
  std::array<double, 1> all{worst};
  comm.all_reduce(std::span<double>(all), ReduceOp::Max);
  TESSERA_CHECK(std::abs(got - expected) < 1e-5f && all[0] < 1e-5, Error, "07_tensor_parallel: differs from the dense "
                "network: loss ", got, " vs ", expected, ", gradients by ", all[0]);
  if (comm.rank() == 0)
    std::printf("check: first batch = the dense network (loss %.6f vs %.6f, gradient slices within %.1e)\n", got,
                expected, all[0]);
  for (auto& [name, p] : named.parameters) p->grad.zero();
}

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
  examples::DeviceBatch<Device> images;  // the host batches, on the GPU in the NCCL build
  if (comm.rank() == 0)
    std::printf("07_tensor_parallel: MLP 784-%lld-10 split over %d ranks: %zu of %lld parameters on each rank; batch %lld\n",
                static_cast<long long>(o.hidden), comm.size(), count_parameters(named),
                static_cast<long long>(784 * o.hidden + o.hidden + o.hidden * 10 + 10), static_cast<long long>(o.batch));
  // Every rank reads the same batches (tensor parallelism splits the model, not the data).
  DataLoader<float> loader(train_set, {.batch_size = o.batch, .shuffle = true, .seed = o.seed});
  DataLoader<float> test_loader(test_set, {.batch_size = 500, .shuffle = false});
  Batch<float> batch;
  loader.start_epoch(0);
  TESSERA_CHECK(loader.next(batch), Error, "07_tensor_parallel: no training data");
  check_against_dense(model, comm, batch, o);

  Sgd<E> sgd(named, {.lr = o.lr, .momentum = 0.9});
  // The first step's memory: the peak of its forward and backward, then the momentum its optimizer
  // step creates (held at the second step, before its update, minus held at the first).
  examples::RankMemory<Device, Comm>::Bytes step_peak_bytes, first_held, optimizer_bytes;
  std::int64_t steps_seen = 0;
  const auto measure = [&] {
    if (++steps_seen == 1) {
      step_peak_bytes = memory.peak();
      first_held = memory.held();
    } else if (steps_seen == 2) {
      const auto now = memory.held();
      optimizer_bytes = {now.requested - first_held.requested, now.blocks - first_held.blocks};
    }
  };
  // The Trainer's loop, with no strategy: the split layers communicate inside forward and backward.
  // Every rank computes the same loss on the same batch, so each rank's figures are the group's
  // (the images/s too: each image is worked on by all ranks together).
  memory.start();
  const double lo_before = comm.rank() == 0 ? examples::loopback_bytes() : 0, peer_before = examples::peer_bytes(comm);
  Trainer trainer(model, sgd, CosineLr{o.lr, static_cast<double>(o.epochs), 0.0},
                  {.epochs = o.epochs, .verbose = comm.rank() == 0, .before_step = measure});
  trainer.fit(loader);  // the test set after training: its forward all-reduces are not a step's
  const double loopback = comm.rank() == 0 ? examples::loopback_bytes() - lo_before : 0;
  const double peer_bytes = peer_before >= 0 ? examples::peer_bytes(comm) - peer_before : -1;
  const double accuracy = trainer.evaluate(test_loader).second;
  if (comm.rank() == 0) std::printf("final test accuracy: %.2f%%\n", 100 * accuracy);
  const std::int64_t total_steps = trainer.state().global_step;
  // A few more steps with the timeline on: forward, backward and the optimizer step on the
  // compute lane, the row layer's all-reduce of the logits on the communication lane (inside
  // forward: every rank needs the whole logits before the loss).
  if (!o.trace.empty()) {
    constexpr int kTraceSteps = 3;
    Timeline timeline(comm);
    model.set_timeline(&timeline);
    Trainer traced(model, sgd, ConstantLr{sgd.lr()},
                   {.verbose = false, .timeline = &timeline, .stop_after_steps = kTraceSteps});
    traced.fit(loader);
    model.set_timeline(nullptr);
    timeline.write(comm, o.trace);
    if (comm.rank() == 0) std::printf("timeline of %d steps: %s\n", kTraceSteps, o.trace.c_str());
  }
  // The cost model. Communication: one all-reduce of the partial logits, N x 10 floats, per step
  // (backward needs none here, see the README); a bandwidth-optimal all-reduce sends 2(p-1)/p of
  // it per rank. Data parallelism on the same ranks would all-reduce every gradient instead.
  // Memory: each rank holds 1/p of W1, b1 and W2, and all of b2; gradients and momentum as much.
  const int p = comm.size();
  if (comm.rank() == 0 && p > 1) {
    const double logits = static_cast<double>(o.batch) * 10 * 4;
    const double per_rank = 2.0 * (p - 1) / p * logits;
    const double dense = static_cast<double>(784 * o.hidden + o.hidden + o.hidden * 10 + 10);
    const double mine = static_cast<double>(count_parameters(named));
    std::printf("cost: all-reduce per rank and step = 2(p-1)/p x N x 10 x 4 B = 2 x %d/%d x %.0f B = %.2f KiB "
                "(data parallelism: 2(p-1)/p x %.0f gradients x 4 B = %.1f KiB)\n",
                p - 1, p, logits, per_rank / 1024, dense, 2.0 * (p - 1) / p * dense * 4 / 1024);
    if (peer_bytes >= 0)  // threads: what the collectives copied between the ranks' buffers
      std::printf("cost: measured: %.2f KiB per rank and step moved between the ranks' buffers over %lld steps (%.2fx "
                  "the formula)\n", peer_bytes / static_cast<double>(total_steps) / 1024,
                  static_cast<long long>(total_steps), peer_bytes / static_cast<double>(total_steps) / per_rank);
    else if (examples::loopback_bytes() >= 0)
      std::printf("cost: measured on the loopback interface: %.2f KiB per rank and step over %lld steps (0 where the "
                  "backend moves bytes through shared memory; TCP headers count too)\n",
                  loopback / p / static_cast<double>(total_steps) / 1024, static_cast<long long>(total_steps));
    std::printf("memory per rank: parameters (784 h/p + h/p + 10 h/p + 10) = %.0f by formula, %.0f held; with their "
                "gradients and momentum 3 x 4 B each = %.2f MiB (dense: %.2f MiB)\n",
                (784.0 + 1 + 10) * static_cast<double>(o.hidden) / p + 10, mine, 12 * mine / (1 << 20),
                12 * dense / (1 << 20));
  }
  // Measured by the allocator (bytes requested; in its rounded blocks after the semicolon), per
  // rank: the model's values and gradients, the momentum, and the first step's peak: the batch the
  // Trainer holds (N x 784 images) and the activations, N x (784 flattened + h/p hidden + h/p after
  // ReLU + 10 logits) x 4 B, and in backward their gradients, N x (h/p + h/p + 10) x 4 B (the
  // images need none).
  if (comm.rank() == 0) {
    const double mine = static_cast<double>(count_parameters(named));
    const std::int64_t kept = 784 + 784 + 2 * o.hidden / p + 10, gradients = 2 * o.hidden / p + 10;
    const double activations = static_cast<double>(o.batch * (kept + gradients)) * 4;
    TESSERA_CHECK(state_bytes.requested == 8 * mine, Error, "the model takes ", state_bytes.requested,
                  " bytes per rank, not 2 x ", mine, " x 4 (its slices' values and gradients): a dense copy kept?");
    std::printf("memory: parameters + gradients = 2 x %.0f x 4 B = %.1f KiB | %.1f KiB measured (%.2fx; %.1f KiB in "
                "blocks)\n", mine, 8 * mine / 1024, state_bytes.requested / 1024, state_bytes.requested / (8 * mine),
                state_bytes.blocks / 1024);
    std::printf("memory: momentum = %.0f x 4 B = %.1f KiB | %.1f KiB measured (%.2fx; %.1f KiB in blocks)\n", mine,
                4 * mine / 1024, optimizer_bytes.requested / 1024, optimizer_bytes.requested / (4 * mine),
                optimizer_bytes.blocks / 1024);
    std::printf("memory: batch + activations + their gradients = N x ((784 + 784 + 2 h/p + 10) + (2 h/p + 10)) x 4 B = "
                "%lld x (%lld + "
                "%lld) x 4 B = %.1f KiB | step peak %.1f KiB measured (%.2fx; %.1f KiB in blocks)\n",
                static_cast<long long>(o.batch), static_cast<long long>(kept), static_cast<long long>(gradients),
                activations / 1024, step_peak_bytes.requested / 1024,
                step_peak_bytes.requested / activations, step_peak_bytes.blocks / 1024);
  }
}

Options parse(int argc, char** argv) {
  Flags flags(argc, argv);
  Options o;
  o.epochs = flags.get("epochs", o.epochs, {.min = 1});
  o.batch = flags.get("batch", o.batch, {.min = 1});  // every rank sees the whole batch: nothing to split
  o.hidden = flags.get("hidden", o.hidden, {.min = 1});
  o.lr = flags.get("lr", o.lr, {.above = 0});
  o.threads = flags.threads("threads", o.threads);
  o.ranks = flags.ranks("ranks", o.ranks, !SharedMemoryCommunicator<Comm>);
  // Ranks of the threads build share this process's cores (a process backend runs one rank here).
  check_thread_budget(SharedMemoryCommunicator<Comm> ? o.ranks : 1, "--ranks", o.threads, "--threads");
  o.seed = static_cast<std::uint64_t>(flags.get("seed", std::int64_t{1}));
  o.limit = flags.get("limit", o.limit, {.min = 0});
  o.data_dir = flags.get("data-dir", std::string());
  o.trace = flags.output_path("trace", o.trace);
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
