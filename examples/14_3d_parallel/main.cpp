// 14_3d_parallel: data x pipeline x tensor parallelism at once (Megatron-LM's "3-D"), built from
// the world communicator with three split()s. An MLP 784-h-h-h-10 on Fashion-MNIST as two
// tensor-parallel blocks (column-parallel Linear -> ReLU -> row-parallel Linear, Megatron's MLP)
// with a ReLU between them:
//
//   unit 0  block1: Linear(784, h) | ReLU | Linear(h, h)    hidden split over the T tensor ranks
//   unit 1  ReLU
//   unit 2  block2: Linear(h, h) | ReLU | Linear(h, 10)     hidden split over the T tensor ranks
//
// The units are cut into P pipeline stages, each stage's layers are split over T tensor ranks,
// and D copies of the whole pipeline train on their shards of every batch (data parallel).
// World rank = (d P + s) T + t. One source, one binary per communicator:
//
//   build/examples/14_3d_parallel_threads                   8 thread ranks: D = P = T = 2
//   mpirun -n 8 build/examples/14_3d_parallel_mpi
//   tools/tessera-run -n 4 build/examples/14_3d_parallel_gloo --data=1
//
// It checks itself before training: on the first global batch, the loss (averaged over the D
// replicas) and every rank's gradient slices (averaged over the replicas) must equal those of
// the unsplit network built densely from the same seed, on one rank, on the whole batch. Then it
// trains, prints the global loss and test accuracy, and the cost model of each dimension.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tessera/tessera.hpp"
#include "tessera/build_env.hpp"
#include "common/device_batch.hpp"
#include "common/fashion_mnist_data.hpp"
#include "common/trace_files.hpp"
#include "common/rank_status.hpp"

using namespace tessera;

namespace {

using E = BuildEnv;  // CpuThreads, CpuMpi or CpuGloo: chosen by the build, nowhere else
using Comm = E::Comm;
using Device = E::Device;
using Block = TensorParallelMlp<E>;
using Model = Sequential<Block, ReLU<E>, Block>;

struct Options {
  std::int64_t epochs = 1, batch = 64, hidden = 256, limit = 0;
  int data = 2, stages = 2, tensor = 2, micro_batches = 2, threads = 1;
  double lr = 0.05;
  std::uint64_t seed = 1;
  std::string data_dir, trace;
  int ranks = 8;  // data x stages x tensor for the threads build to launch; 0 under a launcher (run() checks its -n)
};

// The blocks draw their dense weights from one Rng in order (block1's two layers, then block2's),
// as the dense reference does, so the split network equals the dense one.
Model build_model(const Options& o, Comm& tensor_group) {
  Rng rng(o.seed);
  Block block1(784, o.hidden, o.hidden, rng, tensor_group);
  block1.set_needs_input_grad(false);  // the images need no gradient: no backward all-reduce there
  Block block2(o.hidden, o.hidden, 10, rng, tensor_group);
  Model model(std::move(block1), ReLU<E>{}, std::move(block2));
  model.set_names({"block1", "relu", "block2"});
  return model;
}

// The dense network of the same seed: fc1..fc4 (block1 = fc1, fc2; block2 = fc3, fc4).
struct Dense {
  std::vector<Linear<E>> fc;
  explicit Dense(const Options& o) {
    Rng rng(o.seed);
    fc.emplace_back(784, o.hidden, rng);
    fc.emplace_back(o.hidden, o.hidden, rng);
    fc.emplace_back(o.hidden, o.hidden, rng);
    fc.emplace_back(o.hidden, 10, rng);
  }
  // Loss of the whole batch x (N, 784); leaves the gradients in fc[k].weight().grad / bias().grad.
  float loss_and_gradients(const Tensor<float, Device>& x, std::span<const std::int64_t> labels) {
    std::array<Linear<E>::Cache, 4> c;
    std::array<ReLU<E>::Cache, 3> rc;
    ReLU<E> relu;
    CrossEntropyLoss<E> loss;
    CrossEntropyLoss<E>::Cache lc;
    const auto* h = &x;
    for (int k = 0; k < 4; ++k) {
      h = &fc[static_cast<std::size_t>(k)].forward(*h, c[static_cast<std::size_t>(k)]);
      if (k < 3) h = &relu.forward(*h, rc[static_cast<std::size_t>(k)]);
    }
    const float l = loss.forward(*h, labels, lc);
    const auto* g = &loss.backward(lc);
    for (int k = 3; k >= 0; --k) {
      g = &fc[static_cast<std::size_t>(k)].backward(*g, c[static_cast<std::size_t>(k)]);
      if (k > 0) g = &relu.backward(*g, rc[static_cast<std::size_t>(k - 1)]);
    }
    return l;
  }
};

// Rank t's slice of a dense tensor, as its tensor-parallel layer holds it: the column layer
// ("<block>.0.*") holds output rows [t w, (t+1) w), the row layer's weight ("<block>.2.weight")
// input columns [t w, (t+1) w), and the row layer's bias all of it.
double slice_difference(const std::string& name, const Tensor<float>& mine, const Tensor<float>& dense, int t) {
  double worst = 0;
  if (name.ends_with(".2.weight")) {  // (out, w) of (out, w T)
    const std::int64_t out = mine.dim(0), w = mine.dim(1), in = dense.dim(1);
    for (std::int64_t i = 0; i < out; ++i)
      for (std::int64_t j = 0; j < w; ++j)
        worst = std::max(worst, static_cast<double>(std::abs(mine[i * w + j] - dense[i * in + t * w + j])));
  } else if (name.ends_with(".2.bias")) {
    for (std::int64_t i = 0; i < mine.numel(); ++i)
      worst = std::max(worst, static_cast<double>(std::abs(mine[i] - dense[i])));
  } else {  // ".0.weight" (w, in) or ".0.bias" (w): rows [t w, (t+1) w)
    const std::int64_t first = t * mine.numel();
    for (std::int64_t i = 0; i < mine.numel(); ++i)
      worst = std::max(worst, static_cast<double>(std::abs(mine[i] - dense[first + i])));
  }
  return worst;
}

Linear<E>& dense_layer(Dense& dense, const std::string& name) {
  const std::size_t block = name.starts_with("block1.") ? 0 : 2;
  return dense.fc[block + (name.find(".2.") != std::string::npos ? 1 : 0)];
}

int run(Comm& world, const Options& o) {
  const int D = o.data, P = o.stages, T = o.tensor;
  TESSERA_CHECK(world.size() == D * P * T, ArgumentError, "14_3d_parallel: ", world.size(), " ranks are not --data=", D,
                " x --stages=", P, " x --tensor=", T, " = ", D * P * T);
  TESSERA_CHECK(P <= 2, ArgumentError, "--stages=", P, ": at most 2 (of the 3 units, the relu between the blocks ",
                "holds no parameters: a stage of it alone would have nothing to train)");
  TESSERA_CHECK(o.hidden % T == 0, ArgumentError, "--hidden=", o.hidden, " does not split over --tensor=", T, " ranks");
  TESSERA_CHECK(o.batch % D == 0 && (o.batch / D) % o.micro_batches == 0, ArgumentError, "--batch=", o.batch,
                " does not split over --data=", D, " replicas and then --micro-batches=", o.micro_batches);
  Cpu::set_num_threads(o.threads);
  const int rank = world.rank(), t = rank % T, s = (rank / T) % P, d = rank / (T * P);
  // Three groups from one world: the ranks that share my layer slices' partners (same d, s), my
  // pipeline (same d, t: one rank per stage) and my replicas (same s, t: one rank per copy).
  Comm tensor_group = world.split(d * P + s, t);
  Comm pipe_group = world.split(d * T + t, s);
  Comm data_group = world.split(s * T + t, d);

  auto [train_set, test_set] = examples::load_normalized_fashion_mnist(o.data_dir, o.limit);
  Model model = build_model(o, tensor_group);
  Pipeline pipe(model, pipe_group, {.micro_batches = o.micro_batches});
  Sgd<E> sgd(pipe.stage_parameters(), {.lr = o.lr, .momentum = 0.9});
  const CosineLr schedule{o.lr, static_cast<double>(o.epochs), 0.0};
  // Replica d reads shard d of every global batch; the ranks of one replica read the same one.
  // Only whole batches (drop_last): a short last batch might not split into the micro-batches.
  DataLoader<float> loader(train_set, {.batch_size = o.batch / D, .shuffle = true, .seed = o.seed, .drop_last = true,
                                       .rank = d, .world_size = D, .drop_tail = true});
  DataLoader<float> test_loader(test_set, {.batch_size = 500, .shuffle = false});
  examples::DeviceBatch<Device> images;
  auto flat = [](Batch<float>& b) -> Batch<float>& {  // (N, 1, 28, 28) -> (N, 784): the MLP's input
    b.images.reshape(Shape{b.images.dim(0), 784});
    return b;
  };
  if (rank == 0) {
    std::printf("14_3d_parallel: MLP 784-%lld-%lld-%lld-10 on %d ranks = %d data x %d pipeline x %d tensor; global batch "
                "%lld = %d x %d micro-batches of %lld\n", static_cast<long long>(o.hidden),
                static_cast<long long>(o.hidden), static_cast<long long>(o.hidden), world.size(), D, P, T,
                static_cast<long long>(o.batch), D, o.micro_batches,
                static_cast<long long>(o.batch / D / o.micro_batches));
    for (int k = 0; k < P; ++k)
      std::printf("  stage %d: units %s..%s, each Linear's hidden units split over %d tensor rank(s)\n", k,
                  model.unit_name(pipe.boundaries()[static_cast<std::size_t>(k)]).c_str(),
                  model.unit_name(pipe.boundaries()[static_cast<std::size_t>(k) + 1] - 1).c_str(), T);
  }

  // Data parallelism over each stage slice's replicas. The pipeline's micro-batches accumulate; one
  // step's forward and backward run with DataParallel's hooks held back (no_sync), then one
  // all-reduce over the replicas (finish).
  std::optional<DataParallel<E>> dp;
  if (D > 1) dp.emplace(pipe.stage(), data_group, DataParallelOptions{.average_micro_steps = false});
  auto pipeline_step = [&](Batch<float>& b) {
    float loss;
    {
      std::optional<DataParallel<E>::NoSync> guard;
      if (dp) guard.emplace(dp->no_sync());
      loss = pipe.train_step(images(flat(b).images), b.labels);
    }
    if (dp) dp->finish();
    return loss;
  };

  // The check: the first global batch through the dense network on every rank (all B samples)
  // and through the 3-D one (each replica its B/D), gradients averaged over the replicas by the
  // same DataParallel that trains.
  {
    Batch<float> whole;
    DataLoader<float> all(train_set, {.batch_size = o.batch, .shuffle = true, .seed = o.seed, .drop_tail = true});
    all.start_epoch(0);
    TESSERA_CHECK(all.next(whole), Error, "14_3d_parallel: no training data");
    Dense dense(o);
    const float expected = dense.loss_and_gradients(images(flat(whole).images), whole.labels);
    Batch<float> mine;
    loader.start_epoch(0);
    loader.next(mine);
    std::array<double, 1> got{pipeline_step(mine)};
    data_group.all_reduce(std::span<double>(got), ReduceOp::Avg);  // the replicas' mean losses
    std::array<double, 1> worst{0};
    for (auto& [name, p] : pipe.stage_parameters().parameters) {
      Linear<E>& layer = dense_layer(dense, name);
      const auto& reference = name.ends_with("weight") ? layer.weight().grad : layer.bias().grad;
      worst[0] = std::max(worst[0], slice_difference(name, to_host(p->grad), to_host(reference), t));
    }
    world.all_reduce(std::span<double>(worst), ReduceOp::Max);
    const bool ok = std::abs(got[0] - expected) < 1e-5 && worst[0] < 1e-5;
    if (rank == 0)
      std::printf("check: first batch = the dense network on one rank (loss %.6f vs %.6f, every rank's gradient slices "
                  "within %.1e; tolerance 1e-5): %s\n", got[0], static_cast<double>(expected), worst[0],
                  ok ? "ok" : "FAIL");
    if (!ok) return 1;
    sgd.zero_grad();
  }

  Batch<float> batch;
  for (std::int64_t epoch = 0; epoch < o.epochs; ++epoch) {
    sgd.set_lr(schedule(static_cast<double>(epoch)));
    model.set_mode(Mode::Train);
    loader.start_epoch(epoch);
    std::array<double, 2> loss_sum{0, 0};
    const auto started = std::chrono::steady_clock::now();
    while (loader.next(batch)) {
      sgd.zero_grad();
      const float loss = pipeline_step(batch);
      sgd.step();
      loss_sum[0] += loss;
      loss_sum[1] += 1;
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    data_group.all_reduce(std::span<double>(loss_sum), ReduceOp::Sum);  // the replicas' mean losses
    model.set_mode(Mode::Eval);
    test_loader.start_epoch(0);
    std::array<double, 2> correct{0, 0};
    Batch<float> test_batch;
    while (test_loader.next(test_batch)) {
      const auto& logits = pipe.predict(images(flat(test_batch).images));
      if (s == P - 1) correct[0] += static_cast<double>(count_correct(logits, test_batch.labels));
      correct[1] += static_cast<double>(test_batch.labels.size());
    }
    pipe_group.all_reduce(std::span<double>(correct), ReduceOp::Max);  // the last stage's count, to stage 0
    if (rank == 0) {
      std::printf("epoch %lld: train loss %.4f (all replicas) | test acc %.2f%% | %.1f s, %.0f img/s (all ranks)\n",
                  static_cast<long long>(epoch + 1), loss_sum[0] / loss_sum[1], 100 * correct[0] / correct[1], seconds,
                  loss_sum[1] / D * static_cast<double>(o.batch) / seconds);
      if (epoch + 1 == o.epochs) std::printf("final test accuracy: %.2f%%\n", 100 * correct[0] / correct[1]);
      std::fflush(stdout);
    }
  }

  // One more step with the timeline on: every rank's pipeline spans, the tensor-parallel blocks'
  // all-reduces (inside the F and B spans) and the data all-reduce of the replicas' gradients
  // (after the last B), all on the communication lane.
  if (!o.trace.empty()) {
    Timeline timeline(world);
    pipe.set_timeline(&timeline);
    model.layer<0>().set_timeline(&timeline);
    model.layer<2>().set_timeline(&timeline);
    model.set_mode(Mode::Train);
    loader.start_epoch(0);
    loader.next(batch);
    sgd.zero_grad();
    pipeline_step(batch);
    if (dp) examples::record_buckets(timeline, *dp);
    model.layer<0>().set_timeline(nullptr);
    model.layer<2>().set_timeline(nullptr);
    pipe.set_timeline(nullptr);
    timeline.write(world, o.trace);
    if (rank == 0) std::printf("timeline of one step: %s\n", o.trace.c_str());
  }

  // The cost model per rank and step (float32), each dimension with its own formula:
  //   tensor: every block's row layer all-reduces its output (n, out) in forward and its column
  //     layer dL/d(input) (n, in) in backward (not block1's: the images need none), n = B/D
  //     samples per replica: 2(T-1)/T x 4 n (out [+ in]) bytes;
  //   pipeline: the boundary after a stage carries activations forward and gradients back,
  //     2 x 4 n h plus a 64-byte header per micro-batch;
  //   data: DataParallel all-reduces this rank's parameter slices: 2(D-1)/D x 4 x (slice).
  const double n = static_cast<double>(o.batch / D), h = static_cast<double>(o.hidden);
  const double params = static_cast<double>(count_parameters(pipe.stage_parameters()));
  std::vector<double> mine{params, static_cast<double>(pipe.last_step().bytes_sent_forward),
                           static_cast<double>(pipe.last_step().bytes_sent_backward)};
  std::vector<double> every(mine.size() * static_cast<std::size_t>(world.size()));
  world.all_gather(std::span<const double>(mine), std::span<double>(every));
  if (rank == 0) {
    std::printf("\ncost per rank and step (float32), by formula, and measured where the program can count it:\n");
    for (int k = 0; k < P; ++k) {
      const auto first = pipe.boundaries()[static_cast<std::size_t>(k)], end = pipe.boundaries()[static_cast<std::size_t>(k) + 1];
      double tensor_floats = 0, slice = 0;
      if (first == 0) tensor_floats += h;                                   // block1: forward output only
      if (end == 3) tensor_floats += 10 + h;                                // block2: forward output and dL/dx
      if (first == 0) slice += 784 * h / T + h / T + h * h / T + h;          // block1's slices
      if (end == 3) slice += h * h / T + h / T + 10 * h / T + 10;            // block2's slices
      const double held = every[static_cast<std::size_t>(3 * (k * T))];  // rank (0 P + k) T + 0
      std::printf("  stage %d: parameters %.0f by formula, %.0f held; tensor all-reduces 2(T-1)/T x 4 x %.0f x %.0f = "
                  "%.1f KiB; data all-reduce 2(D-1)/D x 4 x %.0f = %.1f KiB\n", k, slice, held, n, tensor_floats,
                  2.0 * (T - 1) / T * 4 * n * tensor_floats / 1024, slice, 2.0 * (D - 1) / D * 4 * slice / 1024);
      if (k + 1 < P) {
        const double sent = every[static_cast<std::size_t>(3 * (k * T) + 1)] +
                            every[static_cast<std::size_t>(3 * ((k + 1) * T) + 2)];
        std::printf("  stage %d <-> %d: 2 x 4 x %.0f x %.0f + %d x 64 B = %.1f KiB by formula, %.1f KiB sent in the "
                    "last step\n", k, k + 1, n, h, o.micro_batches, (8 * n * h + 64.0 * o.micro_batches) / 1024,
                    sent / 1024);
      }
    }
  }
  return 0;
}

Options parse(int argc, char** argv) {
  Flags flags(argc, argv);
  Options o;
  o.epochs = flags.get("epochs", o.epochs, {.min = 1});
  o.batch = flags.get("batch", o.batch, {.min = 1});
  o.hidden = flags.get("hidden", o.hidden, {.min = 1});
  o.data = flags.get("data", o.data, {.min = 1, .max = 4096});
  o.stages = flags.get("stages", o.stages, {.min = 1, .max = 2});  // see run()
  o.tensor = flags.get("tensor", o.tensor, {.min = 1, .max = 4096});
  o.micro_batches = flags.get("micro-batches", o.micro_batches, {.min = 1});
  o.lr = flags.get("lr", o.lr, {.above = 0});
  o.threads = flags.threads("threads", o.threads);
  o.seed = static_cast<std::uint64_t>(flags.get("seed", std::int64_t{1}));
  o.limit = flags.get("limit", o.limit, {.min = 0});
  o.data_dir = flags.get("data-dir", o.data_dir);
  o.trace = flags.output_path("trace", o.trace);
  // Under a launcher its -n decides, and run() names --data x --stages x --tensor when they differ
  // (launch's own check would name a --ranks flag this example does not have).
  o.ranks = SharedMemoryCommunicator<Comm> ? o.data * o.stages * o.tensor : 0;
  check_thread_budget(SharedMemoryCommunicator<Comm> ? o.ranks : 1, "--data x --stages x --tensor", o.threads,
                      "--threads");
  flags.finish();
  return o;
}

}  // namespace

int main(int argc, char** argv) { return examples::run_checked<E>("14_3d_parallel", argc, argv, parse, run); }
