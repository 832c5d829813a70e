// 04_data_parallel: LeNet-5 on Fashion-MNIST trained by N ranks at once, each on its own shard of
// every batch, with gradients averaged by DataParallel. One source, one binary per communicator:
//
//   build/examples/04_data_parallel_threads --ranks 2          ranks are threads of this process
//   mpirun -n 2 build/examples/04_data_parallel_mpi            ranks are MPI processes
//   tools/tessera-run -n 2 build/examples/04_data_parallel_gloo  ranks are processes over Gloo/TCP
//   tools/tessera-run -n 2 build/examples/04_data_parallel_nccl  one process per GPU over NCCL
//
// Keeping the global batch fixed makes N ranks compute exactly what one process computes on the
// same batches (up to floating-point summation order): checked on the first steps, then the
// replicas' bit-identity after training. --help lists the flags (README.md explains them).
#include <atomic>
#include <cstdio>
#include <optional>
#include <string>

#include "tessera/tessera.hpp"
#include "tessera/build_env.hpp"
#include "common/data_parallel_report.hpp"
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
  std::string data_dir, trace, checkpoint, resume;
  GradientCompression compression = GradientCompression::None;
  std::int64_t bucket_kib = 1024, stop_after = 0, checkpoint_every = 0;
  const StopSignals* stop_signals = nullptr;  // set with --checkpoint (main)
};

std::atomic<bool> stopped_for_resume{false};  // a rank stopped on a signal with its checkpoint saved

void train(Comm& comm, const Options& o) {
  const int rank = comm.rank(), ranks = comm.size();
  TESSERA_CHECK(o.batch % ranks == 0, ArgumentError, "--batch=", o.batch, " (the global batch) must be divisible by the ",
                ranks, " ranks");
  Cpu::set_num_threads(o.threads);  // per rank (OpenMP settings are per thread)
  // Every rank reads the data set; the loader gives rank r the samples r, r + N, r + 2N, ... of
  // each epoch's shared permutation, so batch i of all ranks together is batch i of one process.
  auto [train_set, test_set] = examples::load_normalized_fashion_mnist(o.data_dir, o.limit);
  DataLoader<float> train_loader(train_set, {.batch_size = o.batch / ranks, .shuffle = true, .seed = o.seed,
                                             .rank = rank, .world_size = ranks});
  DataLoader<float> test_loader(test_set, {.batch_size = 500, .shuffle = false});
  const auto make_model = [](std::uint64_t seed) { return lenet5<E>(1, 28, 10, seed); };
  const SgdOptions sgd_options{.lr = o.lr, .momentum = 0.9, .weight_decay = o.weight_decay, .decay_norm_and_bias = false};
  // Lossy compression changes the averaged gradient by design, and a resumed run starts elsewhere:
  // the one-process comparison holds for plain averaging from the start.
  const bool plain = o.compression == GradientCompression::None && o.resume.empty();
  if (plain) examples::check_against_one_process<E>(comm, make_model, sgd_options, train_set, o.batch, o.seed);

  // Memory per rank, measured by the allocator from here on: first the model's state.
  examples::RankMemory<Device, Comm> memory(comm);
  memory.start();
  auto model = make_model(o.seed + static_cast<std::uint64_t>(rank));  // different on purpose: DataParallel broadcasts rank 0's
  const std::size_t bucket_bytes = static_cast<std::size_t>(o.bucket_kib) * 1024;
  DataParallel dp(model, comm, {.bucket_bytes = bucket_bytes, .first_bucket_bytes = std::min<std::size_t>(1u << 20, bucket_bytes),
                                .compression = o.compression});
  Sgd<E> sgd(dp.parameters(), sgd_options);
  const auto state_bytes = memory.held();  // parameters, gradients, DataParallel's buckets
  if (rank == 0)
    std::printf("04_data_parallel: LeNet-5, %d rank(s) x batch %lld = global batch %lld, %lld epochs, %zu buckets, "
                "compression %s\n", ranks, static_cast<long long>(o.batch / ranks), static_cast<long long>(o.batch),
                static_cast<long long>(o.epochs), dp.buckets().size(), std::string(to_string(o.compression)).c_str());
  // The Trainer drives DataParallel through the strategy protocol: it waits for the all-reduces
  // before each optimizer step, keeps top-k's residuals with each checkpoint, and (checkpoint_group)
  // saves every rank's random generators, so ranks seeded differently resume exactly.
  std::optional<Timeline> timeline;
  if (!o.trace.empty()) timeline.emplace(comm);
  examples::DataParallelMeter<Device, Comm, decltype(dp)> meter(memory, dp, plain, timeline.has_value());
  Trainer trainer(model, sgd, dp, CosineLr{o.lr, static_cast<double>(o.epochs), 0.0},
                  {.epochs = o.epochs, .checkpoint_path = o.checkpoint, .verbose = rank == 0,
                   .before_step = [&] { meter.record(); }, .timeline = timeline ? &*timeline : nullptr,
                   .trace_path = o.trace, .checkpoint_group = CheckpointGroup(comm),
                   .checkpoint_every_steps = o.checkpoint_every, .stop_signals = o.stop_signals});
  if (!o.resume.empty()) trainer.load(o.resume, train_loader);  // every rank: each gets its own random streams back
  if (!o.resume.empty() && rank == 0)
    std::printf("resumed from %s at epoch %lld, step %lld\n", o.resume.c_str(),
                static_cast<long long>(trainer.state().epoch), static_cast<long long>(trainer.state().global_step));
  const double lo_before = rank == 0 ? examples::loopback_bytes() : -1, peer_before = examples::peer_bytes(comm);
  if (plain) memory.start();
  const auto results = trainer.fit(train_loader, &test_loader, o.stop_after);
  if (trainer.stopped_by() != 0) stopped_for_resume = true;  // the Trainer said where, and the checkpoint
  if (trainer.stopped_by() != 0 || results.empty()) return;
  examples::report_data_parallel(comm, model, dp, meter, examples::DataParallelRun<decltype(state_bytes)>{
      .state = state_bytes, .ranks_per_process = memory.ranks_per_process(), .per_rank_batch = o.batch / ranks,
      .batches_per_epoch = train_loader.batches_per_epoch(), .compression = o.compression, .loopback_before = lo_before,
      .peer_before = peer_before, .trace = o.trace}, results);
}

Options parse(int argc, char** argv) {
  Flags flags(argc, argv);
  Options o;
  o.epochs = flags.get("epochs", o.epochs, {.min = 1}, "passes over the training set");
  o.batch = flags.get("batch", o.batch, {.min = 1}, "global batch; each of N ranks takes batch / N (N must divide it)");
  o.lr = flags.get("lr", o.lr, {.above = 0}, "SGD learning rate (momentum 0.9), decayed to 0 by a cosine");
  o.weight_decay = flags.get("weight-decay", o.weight_decay, {.min = 0},
                             "SGD weight decay (not on biases or BatchNorm)");
  o.threads = flags.threads("threads", o.threads, "OpenMP threads per rank");
  o.ranks = flags.ranks("ranks", o.ranks, !SharedMemoryCommunicator<Comm>,
                        "ranks to run (the threads build: threads of this process)");
  // Ranks of the threads build share this process's cores (a process backend runs one rank here).
  check_thread_budget(SharedMemoryCommunicator<Comm> ? o.ranks : 1, "--ranks", o.threads, "--threads");
  o.seed = static_cast<std::uint64_t>(flags.get("seed", std::int64_t{1}, "seed of initialization and shuffling"));
  o.limit = flags.get("limit", o.limit, {.min = 0}, "train on the first N images only (0: all 60,000)");
  o.data_dir = flags.get("data-dir", std::string(),
                         "directory of the IDX files (empty: TESSERA_DATA_DIR, then the default)");
  const std::string compression = flags.choice("compression", "none", {"none", "fp16", "bf16", "topk"},
                                               "encoding of the gradient buckets the ranks exchange");
  o.compression = gradient_compression_from_string(compression);
  o.bucket_kib = flags.get("bucket-kib", o.bucket_kib, {.min = 1, .max = 1 << 20},
                           "largest gradient bucket after the first, in KiB (first: <= 1 MiB)");
  o.trace = flags.output_path("trace", o.trace, "Chrome trace of every step on every rank");
  o.checkpoint = flags.output_path("checkpoint", o.checkpoint,
                                   "checkpoint saved after every epoch and on SIGUSR1/SIGTERM");
  o.resume = flags.input_path("resume", o.resume, "checkpoint to resume, also at another rank count (same --batch)");
  o.stop_after = flags.get("stop-after", o.stop_after, {.min = 0},
                           "stop after N epochs of the schedule, to resume later (0: run all)");
  o.checkpoint_every = flags.get("checkpoint-every", o.checkpoint_every, {.min = 0},
                                 "also save the checkpoint every N steps (0: after each epoch only)");
  flags.finish();
  TESSERA_CHECK(o.checkpoint_every == 0 || !o.checkpoint.empty(), ArgumentError, "--checkpoint-every=",
                o.checkpoint_every, " needs --checkpoint=PATH (the file to save to)");
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Options o = parse(argc, argv);
    std::optional<StopSignals> stop_signals;  // one per process, for all its ranks
    if (!o.checkpoint.empty()) o.stop_signals = &stop_signals.emplace();
    launch<E>([&](Comm& comm) { train(comm, o); }, {.ranks = o.ranks});  // --ranks: threads build only
    return stopped_for_resume ? kExitStoppedForResume : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "04_data_parallel: %s\n", e.what());
    return 1;
  }
}
