// What example 12 (ZeRO stage 1 against data parallelism) measures and prints, kept out of its
// main: the bytes of an optimizer's state, and the table of memory and communication per rank by
// formula beside the measured figures, with the checks under it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "tessera/tessera.hpp"

namespace examples {

// Counts the bytes of an optimizer's state tensors (visit_state: the checkpoint's view of it).
struct StateBytes {
  std::size_t bytes = 0;
  template <class T>
  void buffer(const std::string&, T& t) {
    bytes += static_cast<std::size_t>(t.numel()) * sizeof(typename T::Scalar);
  }
  void integer(const std::string&, std::int64_t&) {}
};

// What an accuracy comparison cannot check: that Zero1 applies the averaged gradient. Adam divides
// by the gradient's own scale, so a gradient off by a constant factor (a sum over ranks instead of
// the average) would train the same under it; SGD's update is linear in the gradient. So both
// strategies take `steps` SGD steps through the Trainer from the same weights on the same
// batches, and every parameter must agree (to float32 summation order). Returns the largest
// difference. Collective.
template <class E>
double sgd_steps_apart(typename E::Comm& comm, const tessera::Dataset& train_set, std::int64_t batch, std::uint64_t seed,
                       std::int64_t steps) {
  using namespace tessera;
  std::vector<float> weights[2];
  for (const bool zero : {false, true}) {
    DataLoader<float> loader(train_set, {.batch_size = batch / comm.size(), .shuffle = true, .seed = seed,
                                         .rank = comm.rank(), .world_size = comm.size()});
    auto model = lenet5<E>(1, 28, 10, seed);
    const TrainOptions quiet{.verbose = false, .checkpoint_group = CheckpointGroup(comm), .stop_after_steps = steps};
    const auto lr = [](double) { return 0.05; };
    if (zero) {
      Zero1 zero1(model, comm);
      Sgd<E> sgd(zero1.shard_parameters(), {.lr = 0.05});
      Zero1Optimizer optimizer(zero1, sgd);
      Trainer(model, optimizer, lr, quiet).fit(loader);
    } else {
      DataParallel dp(model, comm);
      Sgd<E> sgd(dp.parameters(), {.lr = 0.05});
      Trainer(model, sgd, dp, lr, quiet).fit(loader);
    }
    for (auto& [name, p] : named_tensors(model).parameters)
      weights[zero].insert(weights[zero].end(), p->value.data(), p->value.data() + p->value.numel());
  }
  double apart = 0;
  for (std::size_t i = 0; i < weights[0].size(); ++i) apart = std::max(apart, std::abs(double{weights[0][i]} - weights[1][i]));
  return apart;
}

// One training run of example 12, as this rank saw it.
struct ZeroRun {
  double accuracy = 0, train_loss = 0, seconds = 0;
  std::size_t state_bytes = 0;  // this rank's optimizer state
  double model_bytes = 0;       // parameters, gradients and the strategy's buffers (allocator, requested)
};

// Formulas (float32, 4 bytes), P parameters on N ranks, shard = ceil(P/N): parameters P and
// gradients P on every rank under both; Adam's two moments 2P under DataParallel, 2 shard under
// Zero1. Per step a ring all-reduce moves 2 (N-1)/N x 4P bytes per rank; Zero1's reduce-scatter +
// all-gather of the padded N shard elements move (N-1)/N x 4 N shard each, the same up to the
// padding. The strategies' buffers: DataParallel's flat buckets P + 1 (the last carries the step's
// error flag, so one all-reduce tells every rank that some rank failed); Zero1's flat buffer
// N shard (gradients to reduce-scatter, then gathered values), its shard buffer, and the shard's
// own parameter pieces for the optimizer (values and gradients: 2 x the real elements of the
// shard; rank 0's, or the average over thread ranks, P/N). Zero1 saves 2P - 2P/N of Adam's state
// and spends about 3P/N on its buffers: less memory in all from N = 3. Prints the table (rank 0)
// and returns whether the optimizer state and buffers are the formulas' and the accuracies within
// `tolerance` points.
inline bool report_zero(bool print, int ranks, std::size_t params, bool shared_memory, const ZeroRun& dp,
                        const ZeroRun& zero, double tolerance) {
  const std::size_t shard = (params + static_cast<std::size_t>(ranks) - 1) / static_cast<std::size_t>(ranks);
  const double mib = 1024.0 * 1024.0, n = ranks, weights = 4.0 * static_cast<double>(params);
  const double dp_state = 2 * weights, zero_state = 2 * 4.0 * static_cast<double>(shard);
  const double dp_comm = 2 * (n - 1) / n * weights, zero_comm = 2 * (n - 1) / n * 4.0 * n * static_cast<double>(shard);
  const double own = shared_memory ? static_cast<double>(params) / n : static_cast<double>(std::min(shard, params));
  const double dp_model = 3 * weights + 4;
  const double zero_model = 4.0 * (2.0 * static_cast<double>(params) + (n + 1) * static_cast<double>(shard) + 2 * own);
  const auto row = [&](const char* what, double a, double b) {
    std::printf("%-34s %11.3f MiB %11.3f MiB\n", what, a / mib, b / mib);
  };
  if (print) {
    std::printf("\n%-34s %14s %14s\n", "per rank", "DataParallel", "Zero1");
    row("model + buffers, formula", dp_model, zero_model);
    row("model + buffers, measured", dp.model_bytes, zero.model_bytes);
    row("Adam state, formula", dp_state, zero_state);
    row("Adam state, measured", static_cast<double>(dp.state_bytes), static_cast<double>(zero.state_bytes));
    row("total, measured", dp.model_bytes + static_cast<double>(dp.state_bytes),
        zero.model_bytes + static_cast<double>(zero.state_bytes));
    row("communication per step (formula)", dp_comm, zero_comm);
    std::printf("%-34s %14.4f %14.4f\n", "final train loss", dp.train_loss, zero.train_loss);
    std::printf("%-34s %13.2f%% %13.2f%%\n", "final test accuracy", dp.accuracy, zero.accuracy);
    std::printf("%-34s %12.1f s %12.1f s\n", "training time", dp.seconds, zero.seconds);
  }
  // The claim: the optimizer state shrinks N-fold (exactly the formula) and training is the same.
  const bool memory_ok = static_cast<double>(dp.state_bytes) == dp_state &&
                         static_cast<double>(zero.state_bytes) == zero_state &&
                         std::abs(dp.model_bytes - dp_model) < 1 && std::abs(zero.model_bytes - zero_model) < 1;
  const double apart = std::abs(dp.accuracy - zero.accuracy);
  if (print)
    std::printf("\ncheck: Adam state %.2fx smaller (formula %.2fx: N = %d, up to padding), memory = formulas %s; test "
                "accuracies %.2f points apart (tolerance %.2f) %s\n",
                static_cast<double>(dp.state_bytes) / static_cast<double>(zero.state_bytes), dp_state / zero_state, ranks,
                memory_ok ? "ok" : "FAIL: measured differs from the formula", apart, tolerance,
                apart <= tolerance ? "ok" : "FAIL");
  return memory_ok && apart <= tolerance;
}

}  // namespace examples
