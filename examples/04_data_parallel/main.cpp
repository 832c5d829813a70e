// 04_data_parallel: LeNet-5 on Fashion-MNIST trained by N ranks at once, each on its own shard of
// every batch, with gradients averaged by DataParallel. One source, one binary per communicator:
//
//   build/examples/04_data_parallel_threads --ranks 2          ranks are threads of this process
//   mpirun -n 2 build/examples/04_data_parallel_mpi            ranks are MPI processes
//   tools/tessera-run -n 2 build/examples/04_data_parallel_gloo  ranks are processes over Gloo/TCP
//   tools/tessera-run -n 2 build/examples/04_data_parallel_nccl  one process per GPU over NCCL
//
// Flags: --epochs=5 --batch=64 (the GLOBAL batch: each rank takes batch/N) --lr=0.05
// --threads=1 (OpenMP threads per rank) --seed=1 --limit=N (first N training images)
// --data-dir=DIR --compression=none|fp16|topk --bucket-kib=1024 --trace=trace.json (a Chrome
// trace of every step on every rank, for chrome://tracing or ui.perfetto.dev),
// --checkpoint=ckpt.safetensors (written after every epoch, with every rank's random streams)
// --resume=ckpt.safetensors (also at another --ranks with the same --batch: elastic resume)
// --stop-after=N (stop after N epochs, to resume later), and for the
// threads build --ranks=2.
//
// Keeping the global batch fixed makes N ranks compute exactly what one process computes on the
// same batches (up to floating-point summation order), so the accuracy must match one rank's.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <cstdlib>
#include <string>

#include "tessera/tessera.hpp"
#include "tessera/build_env.hpp"
#include "common/device_batch.hpp"
#include "common/fashion_mnist_data.hpp"

using namespace tessera;

namespace {

using E = BuildEnv;  // CpuThreads, CpuMpi, CpuGloo or CudaNccl: chosen by the build, nowhere else
using Device = E::Device;
using Comm = E::Comm;

struct Options {
  std::int64_t epochs = 5, batch = 64, limit = 0;
  double lr = 0.05, weight_decay = 5e-4;
  int threads = 1, ranks = 2;
  std::uint64_t seed = 1;
  std::string data_dir, compression = "none", trace, checkpoint, resume;
  std::int64_t bucket_kib = 1024, stop_after = 0;
};

double train(Comm& comm, const Options& o) {
  const int rank = comm.rank(), ranks = comm.size();
  TESSERA_CHECK(o.batch % ranks == 0, ArgumentError, "--batch=", o.batch,
                " (the global batch) must be divisible by the ", ranks, " ranks");
  Cpu::set_num_threads(o.threads);  // per rank (OpenMP settings are per thread)

  // Every rank reads the data set; the loader gives rank r the samples r, r + N, r + 2N, ... of
  // each epoch's shared permutation, so batch i of all ranks together is batch i of one process.
  auto [train_set, test_set] = examples::load_normalized_fashion_mnist(o.data_dir, o.limit);

  // Ranks start from different weights on purpose: DataParallel broadcasts rank 0's.
  auto model = lenet5<E>(1, 28, 10, o.seed + static_cast<std::uint64_t>(rank));
  const GradientCompression compression = o.compression == "fp16"   ? GradientCompression::Fp16
                                          : o.compression == "topk" ? GradientCompression::TopK
                                                                    : GradientCompression::None;
  TESSERA_CHECK(o.compression == "none" || o.compression == "fp16" || o.compression == "topk", ArgumentError,
                "04_data_parallel: --compression=", o.compression, " is not one of none, fp16, topk");
  DataParallel dp(model, comm,
                  {.bucket_bytes = static_cast<std::size_t>(o.bucket_kib) * 1024,
                   .first_bucket_bytes = std::min<std::size_t>(1u << 20, static_cast<std::size_t>(o.bucket_kib) * 1024),
                   .compression = compression});
  Sgd<E> sgd(dp.parameters(), {.lr = o.lr, .momentum = 0.9, .weight_decay = o.weight_decay,
                                      .decay_norm_and_bias = false});
  const CosineLr schedule{o.lr, static_cast<double>(o.epochs), 0.0};

  DataLoader<float> train_loader(train_set, {.batch_size = o.batch / ranks, .shuffle = true, .seed = o.seed,
                                             .rank = rank, .world_size = ranks});
  DataLoader<float> test_loader(test_set, {.batch_size = 500, .shuffle = false});
  if (rank == 0)
    std::printf("04_data_parallel: LeNet-5, %d rank(s) x batch %lld = global batch %lld, %lld epochs, %zu buckets, "
                "compression %s\n",
                ranks, static_cast<long long>(o.batch / ranks), static_cast<long long>(o.batch),
                static_cast<long long>(o.epochs), dp.buckets().size(), o.compression.c_str());
  // Optional timeline: compute spans from the Trainer, one span per bucket all-reduce from
  // DataParallel, and the overlap: how much of the all-reduce time ran while backward still did.
  std::optional<Timeline> timeline;
  if (!o.trace.empty()) timeline.emplace(comm);
  double comm_us = 0, exposed_us = 0;
  // sgd.step() finishes the all-reduce by itself; with a timeline, finish here to record it.
  auto record = [&] {
    if (!timeline) return;
    dp.finish();
    auto last_done = dp.last_wait_began();
    for (std::size_t k = 0; k < dp.buckets().size(); ++k) {
      const auto& b = dp.buckets()[k];
      timeline->add("all_reduce bucket " + std::to_string(k) + " (" + std::to_string(b.flat.numel() * 4 / 1024) + " KiB)",
                    "communication", b.launched_at, b.completed_at, Timeline::kCommunication);
      comm_us += std::chrono::duration<double, std::micro>(b.completed_at - b.launched_at).count();
      last_done = std::max(last_done, b.completed_at);
    }
    exposed_us += std::chrono::duration<double, std::micro>(last_done - dp.last_wait_began()).count();
  };
  // Rank 0 reports; every rank trains (and evaluates: the replicas are identical).
  // checkpoint_group: a checkpoint (save/load) gathers every rank's random generators to rank 0's
  // file and gives each rank its own back, so ranks seeded differently resume exactly.
  Trainer trainer(model, sgd, schedule,
                  {.epochs = o.epochs, .checkpoint_path = o.checkpoint, .verbose = rank == 0, .before_step = record,
                   .timeline = timeline ? &*timeline : nullptr, .checkpoint_group = CheckpointGroup(comm)});
  if (!o.resume.empty()) {
    trainer.load(o.resume, train_loader);  // every rank: each gets its own random streams back
    if (rank == 0)
      std::printf("resumed from %s at epoch %lld, step %lld\n", o.resume.c_str(),
                  static_cast<long long>(trainer.state().epoch), static_cast<long long>(trainer.state().global_step));
    if (rank == 0 && o.compression == "topk")
      std::printf("note: TopK error-feedback residuals are not in checkpoints; they restart from zero\n");
  }
  const auto results = trainer.fit(train_loader, &test_loader, o.stop_after);
  if (results.empty()) return 0.0;
  if (timeline) {
    timeline->write(comm, o.trace);
    if (rank == 0)
      std::printf("timeline: %s; all-reduce time %.1f ms, of which %.1f ms waited for after backward: %.0f%% hidden "
                  "behind backward (rank 0)\n",
                  o.trace.c_str(), comm_us / 1000, exposed_us / 1000, 100.0 * (1.0 - exposed_us / std::max(comm_us, 1e-9)));
  }
  double seconds = 0;
  for (const auto& r : results) seconds += r.seconds;
  const double accuracy = results.back().test_accuracy;
  if (rank == 0)
    std::printf("final test accuracy: %.2f%% (%d ranks, %.1f s training, %.0f img/s)\n", 100 * accuracy, ranks, seconds,
                static_cast<double>(train_set.labels.size()) * static_cast<double>(results.size()) / seconds);
  return accuracy;
}

Options parse(int argc, char** argv) {
  Flags flags(argc, argv);
  Options o;
  o.epochs = flags.get("epochs", o.epochs, {.min = 1});
  o.batch = flags.get("batch", o.batch, {.min = 1});  // global; train() refuses one the ranks cannot split
  o.lr = flags.get("lr", o.lr, {.above = 0});
  o.weight_decay = flags.get("weight-decay", o.weight_decay, {.min = 0});
  o.threads = flags.threads("threads", o.threads);
  o.ranks = flags.get("ranks", o.ranks, {.min = 1});
  // Ranks of the threads build share this process's cores (a process backend runs one rank here).
  check_thread_budget(SharedMemoryCommunicator<Comm> ? o.ranks : 1, "--ranks", o.threads, "--threads");
  o.seed = static_cast<std::uint64_t>(flags.get("seed", std::int64_t{1}));
  o.limit = flags.get("limit", o.limit, {.min = 0});
  o.data_dir = flags.get("data-dir", std::string());
  o.compression = flags.choice("compression", o.compression, {"none", "fp16", "topk"});
  o.bucket_kib = flags.get("bucket-kib", o.bucket_kib, {.min = 1, .max = 1 << 20});  // 1 KiB .. 1 GiB
  o.trace = flags.output_path("trace", o.trace);
  o.checkpoint = flags.output_path("checkpoint", o.checkpoint);
  o.resume = flags.input_path("resume", o.resume);
  o.stop_after = flags.get("stop-after", o.stop_after, {.min = 0});
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
    std::fprintf(stderr, "04_data_parallel: %s\n", e.what());
    return 1;
  }
}
