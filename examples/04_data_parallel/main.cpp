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
// --stop-after=N (stop after N epochs, to resume later), --checkpoint-every=N (also every N
// steps), and for the threads build --ranks=2. With --checkpoint, SIGUSR1 or SIGTERM (Slurm's
// warning before the time limit, or the limit) saves it at a step all ranks agree on and exits 75.
//
// Keeping the global batch fixed makes N ranks compute exactly what one process computes on the
// same batches (up to floating-point summation order), so the accuracy must match one rank's.
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <optional>
#include <cstdlib>
#include <string>
#include <vector>

#include "tessera/tessera.hpp"
#include "tessera/build_env.hpp"
#include "common/device_batch.hpp"
#include "common/fashion_mnist_data.hpp"
#include "common/memory.hpp"
#include "common/traffic.hpp"

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
  std::int64_t bucket_kib = 1024, stop_after = 0, checkpoint_every = 0;
  const StopSignals* stop_signals = nullptr;  // set with --checkpoint (main)
};

std::atomic<bool> stopped_for_resume{false};  // a rank stopped on a signal with its checkpoint saved

// FNV-1a over the bytes of every parameter: equal on two ranks only if their replicas are
// bit-identical (a sum could hide a difference; a hash of the exact bits cannot, short of a
// 1-in-2^64 collision).
template <class Model>
std::uint64_t parameter_checksum(Model& model) {
  std::uint64_t h = 1469598103934665603ull;
  for (auto& [name, p] : named_tensors(model).parameters) {
    const auto host = to_host(p->value);
    const auto* bytes = reinterpret_cast<const unsigned char*>(host.data());
    for (std::size_t k = 0; k < static_cast<std::size_t>(host.numel()) * sizeof(float); ++k)
      h = (h ^ bytes[k]) * 1099511628211ull;
  }
  return h;
}

// Every rank's checksum, gathered; prints them (rank 0) and says whether all are equal.
template <class Model>
bool replicas_identical(Comm& comm, Model& model, const char* when) {
  const std::array<std::int64_t, 1> mine{static_cast<std::int64_t>(parameter_checksum(model))};
  std::vector<std::int64_t> all(static_cast<std::size_t>(comm.size()));
  comm.all_gather(std::span<const std::int64_t>(mine), std::span<std::int64_t>(all));
  const bool same = std::all_of(all.begin(), all.end(), [&](std::int64_t h) { return h == all[0]; });
  if (comm.rank() == 0) {
    std::printf("check: parameter checksum per rank %s:", when);
    for (auto h : all) std::printf(" %016llx", static_cast<unsigned long long>(h));
    std::printf(" (%s)\n", comm.size() == 1 ? "one replica" : same ? "bit-identical replicas" : "REPLICAS DIFFER");
  }
  return same;
}

// The claim of this example, checked on its first steps: N ranks, each on its shard of every
// global batch, with gradients averaged, compute what one process computes on the whole global
// batches. Both run kCheckSteps SGD steps from rank 0's initial weights (separate models, so the
// training below starts as if this had not run); every rank compares its replica with the
// one-process reference. They differ only in summation order (a sum over 64 samples against two
// of 32 then an average): the stated tolerance is 1e-5 on every parameter.
constexpr int kCheckSteps = 3;
constexpr double kCheckTolerance = 1e-5;

void check_against_one_process(Comm& comm, const Options& o, const Dataset& train_set) {
  const int rank = comm.rank(), ranks = comm.size();
  auto replica = lenet5<E>(1, 28, 10, o.seed + static_cast<std::uint64_t>(rank));  // DataParallel broadcasts rank 0's
  auto reference = lenet5<E>(1, 28, 10, o.seed);                                   // = rank 0's initial weights
  DataParallel dp(replica, comm);
  const SgdOptions sgd_options{.lr = o.lr, .momentum = 0.9, .weight_decay = o.weight_decay, .decay_norm_and_bias = false};
  Sgd<E> replica_sgd(dp.parameters(), sgd_options);
  Sgd<E> reference_sgd(named_tensors(reference), sgd_options);
  DataLoader<float> shard(train_set, {.batch_size = o.batch / ranks, .shuffle = true, .seed = o.seed, .rank = rank,
                                      .world_size = ranks});
  DataLoader<float> whole(train_set, {.batch_size = o.batch, .shuffle = true, .seed = o.seed});
  shard.start_epoch(0);
  whole.start_epoch(0);
  LeNet5<E>::Cache replica_cache{}, reference_cache{};
  CrossEntropyLoss<E> loss;
  CrossEntropyLoss<E>::Cache replica_loss_cache, reference_loss_cache;
  examples::DeviceBatch<Device> replica_images, reference_images;
  Batch<float> mine, global;
  for (int step = 0; step < kCheckSteps; ++step) {
    TESSERA_CHECK(shard.next(mine) && whole.next(global), Error, "04_data_parallel: fewer than ", kCheckSteps,
                  " batches to check with (--limit too small)");
    replica_sgd.zero_grad();
    std::array<double, 1> replica_loss{
        loss.forward(replica.forward(replica_images(mine.images), replica_cache), mine.labels, replica_loss_cache)};
    replica.backward(loss.backward(replica_loss_cache), replica_cache);
    replica_sgd.step();
    comm.all_reduce(std::span<double>(replica_loss), ReduceOp::Avg);  // the mean over equal shards
    reference_sgd.zero_grad();
    const float reference_loss =
        loss.forward(reference.forward(reference_images(global.images), reference_cache), global.labels,
                     reference_loss_cache);
    reference.backward(loss.backward(reference_loss_cache), reference_cache);
    reference_sgd.step();
    if (rank == 0)
      std::printf("check: step %d loss %.6f on %d rank(s), averaged; %.6f in one process on the global batch\n",
                  step + 1, replica_loss[0], ranks, static_cast<double>(reference_loss));
  }
  std::array<double, 1> worst{0};
  auto want = named_tensors(reference).parameters;
  auto got = named_tensors(replica).parameters;
  for (std::size_t k = 0; k < got.size(); ++k) {
    const auto a = to_host(got[k].second->value), b = to_host(want[k].second->value);
    for (std::int64_t i = 0; i < a.numel(); ++i)
      worst[0] = std::max(worst[0], static_cast<double>(std::abs(a[i] - b[i])));
  }
  comm.all_reduce(std::span<double>(worst), ReduceOp::Max);
  if (rank == 0)
    std::printf("check: after %d steps every rank's parameters are within %.1e of the one-process run's "
                "(tolerance %.0e)\n", kCheckSteps, worst[0], kCheckTolerance);
  TESSERA_CHECK(worst[0] <= kCheckTolerance, Error, "04_data_parallel: after ", kCheckSteps, " steps the ", ranks,
                "-rank replicas differ from one process on the same global batches by ", worst[0],
                " (tolerance ", kCheckTolerance, "): data parallelism did not compute the global batch's gradient");
  TESSERA_CHECK(replicas_identical(comm, replica, "after the check's steps"), Error,
                "04_data_parallel: the replicas differ after ", kCheckSteps, " steps (see the checksums)");
}

double train(Comm& comm, const Options& o) {
  const int rank = comm.rank(), ranks = comm.size();
  TESSERA_CHECK(o.batch % ranks == 0, ArgumentError, "--batch=", o.batch,
                " (the global batch) must be divisible by the ", ranks, " ranks");
  Cpu::set_num_threads(o.threads);  // per rank (OpenMP settings are per thread)

  // Every rank reads the data set; the loader gives rank r the samples r, r + N, r + 2N, ... of
  // each epoch's shared permutation, so batch i of all ranks together is batch i of one process.
  auto [train_set, test_set] = examples::load_normalized_fashion_mnist(o.data_dir, o.limit);

  // The activation formula's values per sample (a probe model of the same shapes, freed before
  // the measurement starts).
  const std::int64_t values_per_sample = [&] {
    auto probe = lenet5<E>(1, 28, 10, o.seed);
    const auto values = examples::unit_output_values_per_sample<Device>(probe, Shape{1, 1, 28, 28});
    return std::accumulate(values.begin(), values.end(), std::int64_t{0});
  }();
  // Memory per rank, measured by the allocator from here on: first the model's state.
  examples::RankMemory<Device, Comm> memory(comm);
  memory.start();
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
  const auto state_bytes = memory.held();  // parameters, gradients, DataParallel's buckets

  DataLoader<float> train_loader(train_set, {.batch_size = o.batch / ranks, .shuffle = true, .seed = o.seed,
                                             .rank = rank, .world_size = ranks});
  DataLoader<float> test_loader(test_set, {.batch_size = 500, .shuffle = false});
  if (rank == 0)
    std::printf("04_data_parallel: LeNet-5, %d rank(s) x batch %lld = global batch %lld, %lld epochs, %zu buckets, "
                "compression %s\n",
                ranks, static_cast<long long>(o.batch / ranks), static_cast<long long>(o.batch),
                static_cast<long long>(o.epochs), dp.buckets().size(), o.compression.c_str());
  // Lossy compression changes the averaged gradient by design, and a resumed run starts elsewhere:
  // the one-process comparison holds for plain averaging from the start.
  if (o.compression == "none" && o.resume.empty())
    check_against_one_process(comm, o, train_set);
  else if (rank == 0)
    std::printf("check: one-process comparison skipped (%s)\n",
                o.resume.empty() ? "--compression changes the gradients by design" : "resumed run");
  // Optional timeline: compute spans from the Trainer, one span per bucket all-reduce from
  // DataParallel (the Trainer hands it the timeline), and the overlap: how much of the all-reduce
  // time ran while backward still did.
  std::optional<Timeline> timeline;
  if (!o.trace.empty()) timeline.emplace(comm);
  double comm_us = 0, exposed_us = 0;
  // Memory of the training steps (from memory.start() below): after step 1's backward, the most
  // in use at once (activations, their gradients, workspaces) and what stays held; after step 2's,
  // also the optimizer state its first step created. Not on a resumed run (its state was loaded)
  // nor with compression (its buffers live outside the allocator).
  const bool measure_memory = o.resume.empty() && o.compression == "none";
  std::int64_t steps_seen = 0;
  examples::RankMemory<Device, Comm>::Bytes step_peak_bytes, step_held_bytes, optimizer_bytes;  // held: stays for step 2
  // Called by the Trainer after DataParallel's before_optimizer_step hook finished the all-reduces.
  auto record = [&] {
    ++steps_seen;
    const bool measuring = measure_memory && steps_seen <= 2;
    if (measuring) {
      if (steps_seen == 1) {
        step_peak_bytes = memory.peak();
        step_held_bytes = memory.held();
      } else {
        const auto now = memory.held();
        optimizer_bytes = {now.requested - step_held_bytes.requested, now.blocks - step_held_bytes.blocks};
      }
    }
    if (!timeline) return;
    auto last_done = dp.last_wait_began();
    double step_comm_us = 0;
    for (const auto& b : dp.buckets()) {
      step_comm_us += std::chrono::duration<double, std::micro>(b.completed_at - b.launched_at).count();
      last_done = std::max(last_done, b.completed_at);
    }
    // Exposed: from the end of backward to the last bucket's completion; none when the buckets were
    // all done before backward ended (a bucket's span can also start after backward's end, so cap
    // it at the step's all-reduce time).
    const double step_us = std::chrono::duration<double, std::micro>(last_done - dp.last_wait_began()).count();
    exposed_us += std::clamp(step_us, 0.0, step_comm_us);
    comm_us += step_comm_us;
  };
  // Rank 0 reports; every rank trains (and evaluates: the replicas are identical). The Trainer
  // drives DataParallel through the strategy protocol (parallel/strategy.hpp): it waits for the
  // all-reduces before each optimizer step, and keeps top-k's residuals with each checkpoint.
  // checkpoint_group: a checkpoint (save/load) gathers every rank's random generators to rank 0's
  // file and gives each rank its own back, so ranks seeded differently resume exactly.
  Trainer trainer(model, sgd, dp, schedule,
                  {.epochs = o.epochs, .checkpoint_path = o.checkpoint, .verbose = rank == 0, .before_step = record,
                   .timeline = timeline ? &*timeline : nullptr, .checkpoint_group = CheckpointGroup(comm),
                   .checkpoint_every_steps = o.checkpoint_every, .stop_signals = o.stop_signals});
  if (!o.resume.empty()) {
    trainer.load(o.resume, train_loader);  // every rank: each gets its own random streams back
    if (rank == 0)
      std::printf("resumed from %s at epoch %lld, step %lld\n", o.resume.c_str(),
                  static_cast<long long>(trainer.state().epoch), static_cast<long long>(trainer.state().global_step));
  }
  const double lo_before = rank == 0 ? examples::loopback_bytes() : -1, peer_before = examples::peer_bytes(comm);
  if (measure_memory) memory.start();
  const auto results = trainer.fit(train_loader, &test_loader, o.stop_after);
  if (trainer.stopped_by() != 0) {  // the Trainer said where, and the checkpoint
    stopped_for_resume = true;
    return 0.0;
  }
  if (results.empty()) return 0.0;
  // The cost model: a bandwidth-optimal all-reduce (ring, or halving-doubling) of G bytes sends
  // (p-1)/p x G per rank to reduce-scatter and as much again to all-gather: 2(p-1)/p x G per rank
  // and step, whatever p is. G = parameters x bytes per value sent.
  if (rank == 0 && ranks > 1 && o.compression != "topk") {
    const double g = static_cast<double>(count_parameters(dp.parameters())) * (o.compression == "fp16" ? 2.0 : 4.0);
    const double per_step = 2.0 * (ranks - 1) / ranks * g;
    const double steps = static_cast<double>(results.size() * static_cast<std::size_t>(train_loader.batches_per_epoch()));
    std::printf("cost: all-reduce per rank and step = 2(p-1)/p x G = 2 x %d/%d x %.1f KiB = %.1f KiB\n", ranks - 1, ranks,
                g / 1024, per_step / 1024);
    const double lo_after = examples::loopback_bytes(), peer_after = examples::peer_bytes(comm);
    if (peer_before >= 0)  // threads: what the collectives copied between the ranks' buffers
      std::printf("cost: measured: %.1f KiB per rank and step moved between the ranks' buffers over %.0f steps (%.2fx "
                  "the formula)\n",
                  (peer_after - peer_before) / steps / 1024, steps, (peer_after - peer_before) / steps / per_step);
    else if (lo_before >= 0 && lo_after >= 0)
      std::printf("cost: measured on the loopback interface: %.1f KiB per rank and step over %.0f steps (%.2fx the "
                  "formula; 0 where the backend moves bytes through shared memory)\n",
                  (lo_after - lo_before) / ranks / steps / 1024, steps, (lo_after - lo_before) / ranks / steps / per_step);
  }
  // Memory per rank: parameters, gradients and DataParallel's flat buckets hold P values each
  // (the last bucket one more: the step's error flag, all-reduced with the gradients so that every
  // rank learns when one failed), SGD's momentum P more; a step's activations, b x (the input and every layer's output per
  // sample), are the bulk of its peak. Measured: bytes requested from the allocator (and in its
  // blocks, which round a request below 1 MiB up to a power of two: fc1's 187.5 KiB take 256 KiB).
  if (rank == 0 && measure_memory && steps_seen >= 2) {
    const double p = static_cast<double>(count_parameters(dp.parameters()));
    const double b = static_cast<double>(o.batch / ranks);
    const double activations = b * static_cast<double>(values_per_sample + 28 * 28) * 4.0;
    auto line = [](const char* what, const char* formula, double bytes, const examples::RankMemory<Device, Comm>::Bytes& m) {
      std::printf("memory: %s = %s = %.1f KiB | %.1f KiB (%.2fx; %.1f KiB in blocks)\n", what, formula, bytes / 1024,
                  m.requested / 1024, m.requested / bytes, m.blocks / 1024);
    };
    std::printf("memory per rank: formula | measured by the allocator%s\n",
                memory.ranks_per_process() > 1 ? " (this process's over its thread ranks; their peaks need not coincide)"
                                               : "");
    const std::string p_text = std::to_string(static_cast<long long>(p));
    line("parameters + gradients + buckets", ("3 x " + p_text + " x 4 B + 4 B").c_str(), 3 * p * 4 + 4, state_bytes);
    line("optimizer state (SGD momentum)", (p_text + " x 4 B").c_str(), p * 4, optimizer_bytes);
    // Parameters, gradients and buckets are tensors of known sizes: the bytes requested must be
    // exactly the formula's (on every rank alike: one rank's, or the average of thread ranks).
    TESSERA_CHECK(state_bytes.requested == 3 * p * 4 + 4, Error, "the model state takes ", state_bytes.requested,
                  " bytes per rank, not 3 x P x 4 + 4 = ", 3 * p * 4 + 4,
                  " (an extra copy of the parameters or gradients?)");
    line("activations, the step's peak",
         ("b x (input + layer outputs) x 4 B = " + std::to_string(o.batch / ranks) + " x (784 + " +
          std::to_string(values_per_sample) + ") x 4 B").c_str(),
         activations, step_peak_bytes);
  }
  if (timeline) {
    timeline->write(comm, o.trace);
    if (rank == 0)
      std::printf("timeline: %s; all-reduce time %.1f ms, of which %.1f ms waited for after backward: %.0f%% hidden "
                  "behind backward (rank 0)\n",
                  o.trace.c_str(), comm_us / 1000, exposed_us / 1000, 100.0 * (1.0 - exposed_us / std::max(comm_us, 1e-9)));
  }
  double seconds = 0;
  for (const auto& r : results) seconds += r.seconds;  // the slowest rank's (EpochResult)
  const double accuracy = results.back().test_accuracy;
  TESSERA_CHECK(replicas_identical(comm, model, "after training"), Error,
                "04_data_parallel: the replicas differ after training (see the checksums)");
  if (rank == 0)
    std::printf("final test accuracy: %.2f%% (%d rank(s), %.1f s training, %.0f img/s over all ranks)\n", 100 * accuracy,
                ranks, seconds, static_cast<double>(train_set.labels.size()) * static_cast<double>(results.size()) / seconds);
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
  o.ranks = flags.ranks("ranks", o.ranks, !SharedMemoryCommunicator<Comm>);
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
  o.checkpoint_every = flags.get("checkpoint-every", o.checkpoint_every, {.min = 0});
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
