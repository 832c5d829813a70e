// What example 04 (data parallelism) checks and measures around its training, kept out of its
// main: the replicas' bit-identity (a checksum per rank), N ranks against one process on the same
// global batches, and the cost model (bytes per step, memory per rank, how much of the
// all-reduce time hid behind backward) beside the measured figures.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "common/device_batch.hpp"
#include "common/memory.hpp"
#include "common/traffic.hpp"
#include "tessera/tessera.hpp"

namespace examples {

// FNV-1a over the bytes of every parameter: equal on two ranks only if their replicas are
// bit-identical (a sum could hide a difference; a hash of the exact bits cannot, short of a
// 1-in-2^64 collision).
template <class Model>
std::uint64_t parameter_checksum(Model& model) {
  std::uint64_t h = 1469598103934665603ull;
  for (auto& [name, p] : tessera::named_tensors(model).parameters) {
    const auto host = tessera::to_host(p->value);
    const auto* bytes = reinterpret_cast<const unsigned char*>(host.data());
    for (std::size_t k = 0; k < static_cast<std::size_t>(host.numel()) * sizeof(float); ++k)
      h = (h ^ bytes[k]) * 1099511628211ull;
  }
  return h;
}

// Every rank's checksum, gathered; prints them (rank 0) and throws unless all are equal.
template <class Comm, class Model>
void check_replicas_identical(Comm& comm, Model& model, const char* when) {
  const std::array<std::int64_t, 1> mine{static_cast<std::int64_t>(parameter_checksum(model))};
  std::vector<std::int64_t> all(static_cast<std::size_t>(comm.size()));
  comm.all_gather(std::span<const std::int64_t>(mine), std::span<std::int64_t>(all));
  const bool same = std::all_of(all.begin(), all.end(), [&](std::int64_t h) { return h == all[0]; });
  if (comm.rank() == 0) {
    std::printf("check: parameter checksum per rank %s:", when);
    for (auto h : all) std::printf(" %016llx", static_cast<unsigned long long>(h));
    std::printf(" (%s)\n", comm.size() == 1 ? "one replica" : same ? "bit-identical replicas" : "REPLICAS DIFFER");
  }
  TESSERA_CHECK(same, tessera::Error, "the replicas differ ", when, " (see the checksums)");
}

// The claim of data parallelism, checked on its first steps: N ranks, each on its shard of every
// global batch, with gradients averaged, compute what one process computes on the whole global
// batches. Both run `steps` SGD steps through the Trainer from rank 0's initial weights (models of
// their own, so the real training starts as if this had not run); every rank compares its
// replica with the one-process reference. They differ only in summation order (a sum over 64
// samples against two of 32, then an average): the tolerance is 1e-5 on every parameter.
template <class E, class MakeModel>
void check_against_one_process(typename E::Comm& comm, MakeModel make_model, const tessera::SgdOptions& sgd_options,
                               const tessera::Dataset& train_set, std::int64_t batch, std::uint64_t seed) {
  using namespace tessera;
  constexpr int kSteps = 3;
  constexpr double kTolerance = 1e-5;
  const int rank = comm.rank(), ranks = comm.size();
  auto replica = make_model(seed + static_cast<std::uint64_t>(rank));  // DataParallel broadcasts rank 0's
  auto reference = make_model(seed);                                  // = rank 0's initial weights
  DataParallel<E> dp(replica, comm);
  Sgd<E> replica_sgd(dp.parameters(), sgd_options), reference_sgd(named_tensors(reference), sgd_options);
  const auto lr = [&](double) { return sgd_options.lr; };
  Trainer replicas(replica, replica_sgd, dp, lr, {.verbose = false, .checkpoint_group = CheckpointGroup(comm)});
  Trainer one_process(reference, reference_sgd, lr, {.verbose = false});
  DataLoader<float> shard(train_set, {.batch_size = batch / ranks, .shuffle = true, .seed = seed, .rank = rank,
                                      .world_size = ranks});
  DataLoader<float> whole(train_set, {.batch_size = batch, .shuffle = true, .seed = seed});
  shard.start_epoch(0);
  whole.start_epoch(0);
  Batch<float> mine, global;
  for (int step = 0; step < kSteps; ++step) {
    TESSERA_CHECK(shard.next(mine) && whole.next(global), Error, "fewer than ", kSteps,
                  " batches to check with (--limit too small)");
    std::array<double, 1> replica_loss{static_cast<double>(replicas.train_step(mine))};
    comm.all_reduce(std::span<double>(replica_loss), ReduceOp::Avg);  // the mean over equal shards
    const double reference_loss = one_process.train_step(global);
    if (rank == 0)
      std::printf("check: step %d loss %.6f on %d rank(s), averaged; %.6f in one process on the global batch\n",
                  step + 1, replica_loss[0], ranks, reference_loss);
  }
  std::array<double, 1> worst{0};
  auto want = named_tensors(reference).parameters;
  auto got = named_tensors(replica).parameters;
  for (std::size_t k = 0; k < got.size(); ++k) {
    const auto a = to_host(got[k].second->value), b = to_host(want[k].second->value);
    for (std::int64_t i = 0; i < a.numel(); ++i) worst[0] = std::max(worst[0], static_cast<double>(std::abs(a[i] - b[i])));
  }
  comm.all_reduce(std::span<double>(worst), ReduceOp::Max);
  if (rank == 0)
    std::printf("check: after %d steps every rank's parameters are within %.1e of the one-process run's "
                "(tolerance %.0e)\n", kSteps, worst[0], kTolerance);
  TESSERA_CHECK(worst[0] <= kTolerance, Error, "after ", kSteps, " steps the ", ranks, "-rank replicas differ from one "
                "process on the same global batches by ", worst[0], " (tolerance ", kTolerance, "): data parallelism "
                "did not compute the global batch's gradient");
  check_replicas_identical(comm, replica, "after the check's steps");
}

// Measured during training, from the Trainer's before_step hook (after DataParallel waited for
// its all-reduces): the memory of the first two steps (FirstStepsMemory) and, with a timeline,
// each step's all-reduce time and the part of it that was waited for after backward.
template <class Device, class Comm, class DP>
class DataParallelMeter {
 public:
  DataParallelMeter(RankMemory<Device, Comm>& rank_memory, const DP& dp, bool measure_memory, bool measure_overlap)
      : memory{rank_memory}, dp_(dp), measure_memory_(measure_memory), measure_overlap_(measure_overlap) {}

  void record() {
    if (measure_memory_) memory.record();
    if (!measure_overlap_) return;
    auto last_done = dp_.last_wait_began();
    double step_comm_us = 0;
    for (const auto& b : dp_.buckets()) {
      step_comm_us += std::chrono::duration<double, std::micro>(b.completed_at - b.launched_at).count();
      last_done = std::max(last_done, b.completed_at);
    }
    // Exposed: from the end of backward to the last bucket's completion; none when every bucket
    // was done before backward ended (capped at the step's all-reduce time).
    const double step_us = std::chrono::duration<double, std::micro>(last_done - dp_.last_wait_began()).count();
    exposed_us += std::clamp(step_us, 0.0, step_comm_us);
    comm_us += step_comm_us;
  }
  bool memory_measured() const { return measure_memory_ && memory.steps >= 2; }

  FirstStepsMemory<Device, Comm> memory;
  double comm_us = 0, exposed_us = 0;

 private:
  const DP& dp_;
  bool measure_memory_, measure_overlap_;
};

// A bandwidth-optimal all-reduce (ring, or halving-doubling) of G bytes sends (p-1)/p x G per
// rank to reduce-scatter and as much again to all-gather: 2(p-1)/p x G per rank and step,
// whatever p is. G = parameters x bytes per value sent. Beside it: what the threads build's
// collectives copied between the ranks' buffers, or what crossed the loopback interface.
inline void print_traffic(int ranks, double parameters, double bytes_per_value, double steps, double peer_bytes,
                          double loopback_bytes) {
  const double g = parameters * bytes_per_value, per_step = 2.0 * (ranks - 1) / ranks * g;
  if (ranks == 1) {
    std::printf("cost: all-reduce per rank and step = 2(p-1)/p x G = 0 on one rank (nothing to average)\n");
    return;
  }
  std::printf("cost: all-reduce per rank and step = 2(p-1)/p x G = 2 x %d/%d x %.1f KiB = %.1f KiB\n", ranks - 1, ranks,
              g / 1024, per_step / 1024);
  if (peer_bytes >= 0)
    std::printf("cost: measured: %.1f KiB per rank and step moved between the ranks' buffers over %.0f steps (%.2fx "
                "the formula)\n", peer_bytes / steps / 1024, steps, peer_bytes / steps / per_step);
  else if (loopback_bytes >= 0)
    std::printf("cost: measured on the loopback interface: %.1f KiB per rank and step over %.0f steps (%.2fx the "
                "formula; 0 where the backend moves bytes through shared memory)\n",
                loopback_bytes / ranks / steps / 1024, steps, loopback_bytes / ranks / steps / per_step);
}

// Memory per rank: parameters, gradients and DataParallel's flat buckets hold P values each (the
// last bucket one more: the step's error flag, all-reduced with the gradients so that every rank
// learns when one failed), SGD's momentum P more; a step's activations, b x (the input and every
// layer's output per sample), are the bulk of its peak. Measured: bytes requested from the
// allocator (and in its blocks, which round a request below 1 MiB up to a power of two). Throws
// unless the model state is exactly the formula's (an extra copy of the parameters would show).
template <class Bytes>
void print_memory(double parameters, std::int64_t per_rank_batch, std::int64_t values_per_sample, const Bytes& state,
                  const Bytes& optimizer, const Bytes& step_peak, int ranks_per_process) {
  auto line = [](const char* what, const std::string& formula, double bytes, const Bytes& m) {
    std::printf("memory: %s = %s = %.1f KiB | %.1f KiB (%.2fx; %.1f KiB in blocks)\n", what, formula.c_str(),
                bytes / 1024, m.requested / 1024, m.requested / bytes, m.blocks / 1024);
  };
  std::printf("memory per rank: formula | measured by the allocator%s\n",
              ranks_per_process > 1 ? " (this process's over its thread ranks; their peaks need not coincide)" : "");
  const std::string p = std::to_string(static_cast<long long>(parameters));
  line("parameters + gradients + buckets", "3 x " + p + " x 4 B + 4 B", 3 * parameters * 4 + 4, state);
  line("optimizer state (SGD momentum)", p + " x 4 B", parameters * 4, optimizer);
  TESSERA_CHECK(state.requested == 3 * parameters * 4 + 4, tessera::Error, "the model state takes ", state.requested,
                " bytes per rank, not 3 x P x 4 + 4 = ", 3 * parameters * 4 + 4,
                " (an extra copy of the parameters or gradients?)");
  const double activations = static_cast<double>(per_rank_batch * (values_per_sample + 28 * 28)) * 4.0;
  line("activations, the step's peak", "b x (input + layer outputs) x 4 B = " + std::to_string(per_rank_batch) +
       " x (784 + " + std::to_string(values_per_sample) + ") x 4 B", activations, step_peak);
}

// What report_data_parallel needs besides the model, the strategy and the meter.
template <class Bytes>
struct DataParallelRun {
  Bytes state;  // parameters, gradients and buckets, measured when they were built
  int ranks_per_process = 1;
  std::int64_t per_rank_batch = 0, batches_per_epoch = 0;
  tessera::GradientCompression compression = tessera::GradientCompression::None;
  double loopback_before = -1, peer_before = -1;  // the counters before training (-1: not measured)
  std::string trace;                               // the trace written, or empty
};

// After training: the cost model beside the measurements (rank 0: bytes per step, memory, the
// all-reduce time hidden behind backward), the replicas' checksums (every rank), the final line.
template <class Comm, class Model, class DP, class Meter, class Bytes>
void report_data_parallel(Comm& comm, Model& model, DP& dp, const Meter& meter, const DataParallelRun<Bytes>& run,
                          const std::vector<tessera::EpochResult>& results) {
  using Device = typename Model::Env::Device;
  const int rank = comm.rank(), ranks = comm.size();
  const double parameters = static_cast<double>(tessera::count_parameters(dp.parameters()));
  const double steps = static_cast<double>(results.size()) * static_cast<double>(run.batches_per_epoch);
  const double peer = peer_bytes(comm) - run.peer_before, lo = loopback_bytes() - run.loopback_before;
  const auto compression = run.compression;
  const bool half_wire = compression == tessera::GradientCompression::Fp16 || compression == tessera::GradientCompression::Bf16;
  if (rank == 0 && ranks > 1 && compression != tessera::GradientCompression::TopK)
    print_traffic(ranks, parameters, half_wire ? 2.0 : 4.0, steps,
                  run.peer_before >= 0 ? peer : -1, run.loopback_before >= 0 ? lo : -1);
  if (rank == 0 && meter.memory_measured()) {
    const auto values = unit_output_values_per_sample<Device>(model, tessera::Shape{1, 1, 28, 28});
    print_memory(parameters, run.per_rank_batch, std::accumulate(values.begin(), values.end(), std::int64_t{0}),
                 run.state, meter.memory.optimizer, meter.memory.step_peak, run.ranks_per_process);
  }
  if (!run.trace.empty() && rank == 0)
    std::printf("timeline: %s; all-reduce time %.1f ms, of which %.1f ms waited for after backward: %.0f%% hidden "
                "behind backward (rank 0)\n", run.trace.c_str(), meter.comm_us / 1000, meter.exposed_us / 1000,
                100.0 * (1.0 - meter.exposed_us / std::max(meter.comm_us, 1e-9)));
  double seconds = 0;
  for (const auto& r : results) seconds += r.seconds;  // the slowest rank's (EpochResult)
  check_replicas_identical(comm, model, "after training");
  if (rank == 0)
    std::printf("final test accuracy: %.2f%% (%d rank(s), %.1f s training, %.0f img/s over all ranks)\n",
                100 * results.back().test_accuracy, ranks, seconds, results.back().images_per_second);
}

}  // namespace examples
