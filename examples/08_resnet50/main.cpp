// Example 08: ResNet-50 (v1.5, 25,557,032 parameters at 1000 classes) training steps on synthetic
// ImageNet-shaped data. One source, one binary per backend:
//
//   ./08_resnet50 [--batch=8] [--steps=5] [--image=224] [--classes=1000] [--threads=N]
//                 [--ranks=1]  (>1: data parallel over that many ThreadComm ranks)
//   mpirun -n 2 ./08_resnet50_mpi ...                 data parallel over MPI
//   tools/tessera-run -n 2 ./08_resnet50_gloo ...     data parallel over Gloo
//   [--sync-bn] synchronizes BatchNorm statistics across ranks (default: per rank, as Goyal et al.)
//
// --batch is per rank. The learning rate follows the linear scaling rule for the global batch
// (0.1 x ranks x batch / 256), momentum 0.9, weight decay 1e-4 not on BN and biases, and the last
// BN of every block starts at zero (Goyal et al.).
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>

#include "tessera/tessera.hpp"
#if defined(TESSERA_EXAMPLE_MPI)
#include "tessera/comm/mpi.hpp"
#elif defined(TESSERA_EXAMPLE_GLOO)
#include "tessera/comm/gloo.hpp"
#else
#include "tessera/comm/threads.hpp"
#endif

using namespace tessera;

namespace {

struct Options {
  std::int64_t batch = 8, steps = 5, image = 224, classes = 1000;
  int threads = 0, ranks = 1;
  bool sync_bn = false;
};

// comm == nullptr: one process, no data parallelism.
template <class Comm>
void train(Comm* comm, const Options& o) {
  const int rank = comm ? comm->rank() : 0, ranks = comm ? comm->size() : 1;
  Cpu::set_num_threads(o.threads);
  using E = CpuLocal;
  auto model = resnet50<E>({.in_channels = 3, .num_classes = o.classes, .zero_init_residual = true, .seed = 1});
  if (comm && o.sync_bn) convert_sync_batch_norm(model, *comm);
  std::optional<DataParallel<float, Comm>> dp;
  if (comm) dp.emplace(model, *comm);
  auto named = named_tensors<float, Cpu>(model);
  if (rank == 0)
    std::printf("%s: %zu parameters, %d rank(s) x batch %lld, %lldx%lld, %d threads per rank%s\n", model.name().c_str(),
                count_parameters(named), ranks, static_cast<long long>(o.batch), static_cast<long long>(o.image),
                static_cast<long long>(o.image), Cpu::num_threads(),
                comm ? (o.sync_bn ? ", DataParallel + SyncBatchNorm" : ", DataParallel") : "");

  Sgd<E> sgd(named, {.lr = linear_scaling_rule(0.1, o.batch * ranks), .momentum = 0.9, .weight_decay = 1e-4,
                     .decay_norm_and_bias = false});
  Dataset data = SyntheticImages(o.batch * ranks * 4, 3, o.image, o.image, o.classes, 7);
  DataLoader<float> loader(data, {.batch_size = o.batch, .shuffle = true, .seed = 3, .drop_last = true,
                                  .rank = rank, .world_size = ranks});
  TrainOptions options{.epochs = 1, .verbose = false};
  if (dp) options.before_step = [&] { dp->finish(); };
  Trainer trainer(model, sgd, ConstantLr{sgd.lr()}, options);

  Batch<float> b;
  double total = 0;
  for (std::int64_t step = 0, epoch = 0; step < o.steps; ++epoch) {
    loader.start_epoch(epoch);
    while (step < o.steps && loader.next(b)) {
      const auto t0 = std::chrono::steady_clock::now();
      const float loss = trainer.train_step(b);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (step > 0) total += s;  // the first step warms up caches and workspaces
      if (rank == 0)
        std::printf("step %lld: loss %.4f (rank 0), %.2f s, %.1f img/s\n", static_cast<long long>(step + 1), loss, s,
                    static_cast<double>(o.batch * ranks) / s);
      ++step;
    }
  }
  if (o.steps > 1 && rank == 0)
    std::printf("steady state: %.1f img/s\n", static_cast<double>(o.batch * ranks * (o.steps - 1)) / total);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Flags flags(argc, argv);
    Options o;
    o.batch = flags.get("batch", o.batch);
    o.steps = flags.get("steps", o.steps);
    o.image = flags.get("image", o.image);
    o.classes = flags.get("classes", o.classes);
    o.threads = flags.get("threads", o.threads);
    o.ranks = flags.get("ranks", o.ranks);
    o.sync_bn = flags.get("sync-bn", o.sync_bn);
    flags.finish();
#if defined(TESSERA_EXAMPLE_MPI)
    auto comm = MpiComm::world();
    train(&comm, o);
#elif defined(TESSERA_EXAMPLE_GLOO)
    auto comm = GlooComm::from_env();
    train(&comm, o);
#else
    if (o.ranks <= 1) {
      train<ThreadComm>(nullptr, o);
    } else {
      ThreadWorld world(o.ranks);
      world.run([&](ThreadComm& comm) { train(&comm, o); });
    }
#endif
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
