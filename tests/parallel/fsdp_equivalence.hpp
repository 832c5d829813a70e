// FullyShardedDataParallel (ZeRO-2 and ZeRO-3) against one process, on any communicator: N ranks
// each training on their part of every global batch, each updating its own shard, must end with
// the parameters of one process training on the whole batch (gathered back with gather_full()),
// for SGD with momentum and for AdamW. Collective: every rank calls it. Returns failures as text.
#pragma once

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "parallel/dp_equivalence.hpp"
#include "tessera/optim/adam.hpp"
#include "tessera/optim/sgd.hpp"
#include "tessera/parallel/data_parallel.hpp"
#include "tessera/parallel/fully_sharded.hpp"
#include "tessera/parallel/sync_batch_norm.hpp"

namespace tessera::testing {

enum class FsdpOptimizer { SgdMomentum, AdamW };

struct FsdpCase {
  int stage = 3;
  FsdpOptimizer optimizer = FsdpOptimizer::SgdMomentum;
  int per_rank_batch = 4;
  int steps = 3;
  int micro_batches = 1;
  bool prefetch = true;
  std::vector<std::size_t> unit_boundaries;  // empty: one shard unit per model unit
  ShardDType param_dtype = ShardDType::Same, reduce_dtype = ShardDType::Same;
  double tolerance = 1e-12;
  // Also against DataParallel with the same optimizer, ranks and data (0: not run): the same
  // local gradients averaged across ranks, so FSDP must match it far closer than one process,
  // whose one-batch sums round differently (what AdamW's lr / eps amplifies on ResNet-20).
  double dp_tolerance = 0;
  // With a 16-bit wire: the parameters must also differ from one process by at least this much
  // (the rounding shows), so a wire that silently stayed at full precision fails.
  double at_least = 0;
  // The reference's own noise floor (0: not measured): one process trained again this many times
  // on the same batches with each batch's samples shuffled, which changes nothing but the order of
  // its sums. The tolerance is then max(tolerance, 2 x the largest such difference). AdamW needs
  // it on ResNet-20: a weight whose gradient is nearly zero moves by lr g / (|g| + eps), so a
  // rounding difference dg in g moves it by lr dg / eps, 1e5 dg. One process against itself,
  // reordered, then differs by 0.25e-12 to 3.7e-12 (30 shuffles, batches of 4 and 8): float64's
  // floor for this case lies above the 1e-12 asked of SGD, for any implementation.
  int reordered_references = 0;
};

inline std::string describe(const FsdpCase& c) {
  return "stage " + std::to_string(c.stage) + (c.optimizer == FsdpOptimizer::AdamW ? ", AdamW" : ", SGD momentum") +
         (c.micro_batches > 1 ? ", " + std::to_string(c.micro_batches) + " micro-batches" : "") +
         (c.prefetch ? "" : ", no prefetch") +
         (c.param_dtype != ShardDType::Same ? std::string(", parameters in ") + to_string(c.param_dtype) : "") +
         (c.reduce_dtype != ShardDType::Same ? std::string(", gradients in ") + to_string(c.reduce_dtype) : "");
}

// The optimizers of every run below, reference and sharded alike.
inline SgdOptions fsdp_sgd_options() { return {.lr = 0.05, .momentum = 0.9, .weight_decay = 5e-4, .decay_norm_and_bias = false}; }
inline AdamWOptions fsdp_adamw_options() { return {.lr = 1e-3, .weight_decay = 1e-2}; }

// One process trained on `steps` global batches of `global` samples, each batch's samples in the
// order of a shuffle seeded by `shuffle_seed` (0: as stored), its parameters flattened.
template <class S, class Maker>
std::vector<double> reference_parameters(const DpData<S>& data, std::int64_t global, int steps, bool adamw,
                                         std::uint64_t shuffle_seed) {
  using Reference = Env<Cpu, LocalComm, S>;
  auto reference = Maker::template make<Reference>(7);
  auto params = named_tensors(reference);
  Sgd<Reference> sgd(params, fsdp_sgd_options());
  AdamW<Reference> adamw_optimizer(params, fsdp_adamw_options());
  std::vector<std::int64_t> order(static_cast<std::size_t>(global));
  std::iota(order.begin(), order.end(), std::int64_t{0});
  Rng rng(shuffle_seed);
  for (int step = 0; step < steps; ++step) {
    if (shuffle_seed != 0)  // Fisher-Yates
      for (std::size_t i = order.size() - 1; i > 0; --i)
        std::swap(order[i], order[static_cast<std::size_t>(rng.uniform() * static_cast<double>(i + 1)) % (i + 1)]);
    const std::int64_t first = step * global;
    Tensor<S, Cpu> x(Shape{global, 1, 28, 28});
    std::vector<std::int64_t> labels(order.size());
    for (std::size_t i = 0; i < order.size(); ++i) {
      std::copy_n(data.images.begin() + (first + order[i]) * 784, 784, x.data() + static_cast<std::int64_t>(i) * 784);
      labels[i] = data.labels[static_cast<std::size_t>(first + order[i])];
    }
    adamw ? adamw_optimizer.zero_grad() : sgd.zero_grad();
    typename decltype(reference)::Cache cache{};
    CrossEntropyLoss<Reference> loss;
    typename CrossEntropyLoss<Reference>::Cache loss_cache;
    loss.forward(reference.forward(x, cache), labels, loss_cache);
    reference.backward(loss.backward(loss_cache), cache);
    adamw ? adamw_optimizer.step() : sgd.step();
  }
  std::vector<double> flat;
  for (auto& [name, q] : params.parameters)
    for (std::int64_t k = 0; k < q->value.numel(); ++k) flat.push_back(static_cast<double>(q->value.data()[k]));
  return flat;
}

// The largest relative difference, in the measure fsdp_equivalence uses, between two flattenings.
inline double worst_relative_difference(const std::vector<double>& mine, const std::vector<double>& want) {
  if (mine.size() != want.size()) return INFINITY;
  double worst = 0;
  for (std::size_t k = 0; k < mine.size(); ++k)
    worst = std::max(worst, std::abs(mine[k] - want[k]) / std::max(1.0, std::abs(want[k])));
  return worst;
}

// The largest difference between `reference` and one process trained on the same batches shuffled
// `shuffles` times (0 when none). Kept per case for the process: ranks that are threads (and
// sections that differ only in the strategy) share one computation.
template <class S, class Maker>
double reference_noise_floor(const DpData<S>& data, std::int64_t global, int steps, bool adamw, int shuffles,
                             const std::vector<double>& reference) {
  if (shuffles == 0) return 0;
  static std::mutex mutex;
  static std::map<std::tuple<std::int64_t, int, bool, int>, double> floors;
  const std::lock_guard lock(mutex);
  const auto key = std::make_tuple(global, steps, adamw, shuffles);
  if (const auto found = floors.find(key); found != floors.end()) return found->second;
  double floor = 0;
  for (int k = 1; k <= shuffles; ++k)
    floor = std::max(floor, worst_relative_difference(
                                reference_parameters<S, Maker>(data, global, steps, adamw, 1000 + static_cast<std::uint64_t>(k)), reference));
  return floors[key] = floor;
}

// Maker: MakeLenet, or MakeResnet20 (its BatchNorms are converted to SyncBatchNorm on the sharded
// copy, so that they see the global batch as the reference's do).
template <class S, class Comm, class Maker = MakeLenet>
std::vector<std::string> fsdp_equivalence(Comm& comm, const FsdpCase& c, Maker = {}) {
  using Reference = Env<Cpu, LocalComm, S>;
  using E = Env<Cpu, Comm, S>;
  const int p = comm.size(), r = comm.rank();
  const std::int64_t b = c.per_rank_batch, global = b * p;
  const DpData<S> data(global * c.steps);
  const SgdOptions sgd_options = fsdp_sgd_options();
  const AdamWOptions adamw_options = fsdp_adamw_options();
  const bool adamw = c.optimizer == FsdpOptimizer::AdamW;

  const std::vector<double> reference = reference_parameters<S, Maker>(data, global, c.steps, adamw, 0);
  const double noise_floor = reference_noise_floor<S, Maker>(data, global, c.steps, adamw, c.reordered_references, reference);
  const double tolerance = std::max(c.tolerance, 2 * noise_floor);

  // Ranks other than 0 start from other weights, which the constructor's broadcast must replace.
  auto model = Maker::template make<E>(r == 0 ? 7 : 100 + static_cast<std::uint64_t>(r));
  if constexpr (std::is_same_v<Maker, MakeResnet20>) convert_sync_batch_norm(model, comm);
  FullyShardedDataParallel fsdp(model, comm,
                                {.stage = c.stage, .unit_boundaries = c.unit_boundaries, .micro_batches = c.micro_batches,
                                 .prefetch = c.prefetch, .param_dtype = c.param_dtype, .reduce_dtype = c.reduce_dtype});
  Sgd<E> sgd(fsdp.shard_parameters(), sgd_options);
  AdamW<E> adamw_optimizer(fsdp.shard_parameters(), adamw_options);
  FullyShardedOptimizer sharded_sgd(fsdp, sgd);
  FullyShardedOptimizer sharded_adamw(fsdp, adamw_optimizer);
  for (int step = 0; step < c.steps; ++step) {
    adamw ? sharded_adamw.zero_grad() : sharded_sgd.zero_grad();
    const auto x = data.batch(step * global + r * b, b);
    fsdp.train_step(x, data.batch_labels(step * global + r * b, b));
    adamw ? sharded_adamw.step() : sharded_sgd.step();
  }

  std::vector<std::string> failures;
  const std::string where = "rank " + std::to_string(r) + " (" + describe(c) + "): ";
  // DataParallel on the same ranks, data and optimizer: its parameters, to compare below.
  std::vector<double> with_dp;
  if (c.dp_tolerance > 0) {
    auto dp_model = Maker::template make<E>(r == 0 ? 7 : 100 + static_cast<std::uint64_t>(r));
    if constexpr (std::is_same_v<Maker, MakeResnet20>) convert_sync_batch_norm(dp_model, comm);
    DataParallel dp(dp_model, comm);
    Sgd<E> dp_sgd(dp.parameters(), sgd_options);
    AdamW<E> dp_adamw(dp.parameters(), adamw_options);
    for (int step = 0; step < c.steps; ++step) {
      adamw ? dp_adamw.zero_grad() : dp_sgd.zero_grad();
      forward_backward<S>(dp_model, data, step * global + r * b, b);
      adamw ? dp_adamw.step() : dp_sgd.step();
    }
    for (auto& [name, q] : named_tensors(dp_model).parameters)
      for (std::int64_t k = 0; k < q->value.numel(); ++k) with_dp.push_back(static_cast<double>(q->value.data()[k]));
  }
  const std::int64_t shard = fsdp.shard_elements(), whole = fsdp.model_elements();
  if (!(shard * p >= whole && shard * p < whole + p * static_cast<std::int64_t>(fsdp.unit_count())))
    failures.push_back(where + "the shard holds " + std::to_string(shard) + " elements for a model of " +
                       std::to_string(whole) + " over " + std::to_string(p) + " ranks");
  auto model_params = named_tensors(model);
  if (c.stage == 3)
    for (auto& [name, q] : model_params.parameters)
      if (!q->value.empty()) failures.push_back(where + "stage 3 left parameter " + name + " gathered between steps");
  fsdp.gather_full();
  double worst = 0, worst_dp = 0;
  std::string worst_name;
  std::size_t flat = 0;
  auto shapes_model = Maker::template make<Reference>(7);  // the shapes gather_full() must give back
  auto reference_shapes = named_tensors(shapes_model);
  for (std::size_t i = 0; i < model_params.parameters.size(); ++i) {
    const auto& mine = model_params.parameters[i].second->value;
    const Shape& want = reference_shapes.parameters[i].second->value.shape();
    const std::size_t at = flat;
    flat += static_cast<std::size_t>(mine.numel());
    if (mine.shape() != want || flat > reference.size()) {
      failures.push_back(where + model_params.parameters[i].first + " has shape " + mine.shape().str() +
                         " after gather_full(), " + want.str() + " expected");
      continue;
    }
    for (std::int64_t k = 0; k < mine.numel(); ++k) {
      const double value = static_cast<double>(mine.data()[k]), expected = reference[at + static_cast<std::size_t>(k)];
      const double diff = std::abs(value - expected) / std::max(1.0, std::abs(expected));
      if (diff > worst) worst = diff, worst_name = model_params.parameters[i].first;
      if (at + static_cast<std::size_t>(k) < with_dp.size()) {
        const double dp_value = with_dp[at + static_cast<std::size_t>(k)];
        worst_dp = std::max(worst_dp, std::abs(value - dp_value) / std::max(1.0, std::abs(dp_value)));
      }
    }
  }
  if (std::getenv("TESSERA_EQUIVALENCE_REPORT") != nullptr)
    std::printf("FSDP rank %d of %d (%s): worst relative difference from one process %.3g in %s (tolerance %.3g, "
                "one process reordered: %.3g)%s\n", r, p, describe(c).c_str(), worst, worst_name.c_str(), tolerance, noise_floor,
                with_dp.empty() ? "" : (", from DataParallel's " + std::string(worst_dp == 0 ? "0 (bit for bit)" : std::to_string(worst_dp))).c_str());
  if (c.dp_tolerance > 0 && !(worst_dp <= c.dp_tolerance && with_dp.size() == flat)) {
    char text[32];
    std::snprintf(text, sizeof text, "%.3g", worst_dp);
    failures.push_back(where + "parameters differ from DataParallel's by " + text + " (relative)");
  }
  if (!(worst >= c.at_least))
    failures.push_back(where + "parameters equal one process's to " + std::to_string(worst) + ": the 16-bit wire was not used");
  if (!(worst <= tolerance)) {
    char text[96];
    std::snprintf(text, sizeof text, "%.3g (relative, tolerance %.3g)", worst, tolerance);
    failures.push_back(where + "parameters differ from one process by " + text + " in " + worst_name);
  }
  fsdp.release_full();
  return failures;
}

}  // namespace tessera::testing
