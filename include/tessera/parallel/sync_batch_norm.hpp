// SyncBatchNorm: BatchNorm whose batch statistics are those of the whole data-parallel batch,
// not of each rank's shard (torch.nn.SyncBatchNorm.convert_sync_batchnorm).
//
//   auto model = resnet20<E>({...});
//   convert_sync_batch_norm(model, comm);   // every BatchNorm2d in the model now synchronizes
//   DataParallel dp(model, comm);            // comm: the model Env's Comm
//
// Each training forward of a BN layer all-reduces (sum x, sum x^2, count) per channel, 2C + 1
// doubles, and each backward (sum dy, sum dy xhat), 2C doubles: with SyncBatchNorm, N ranks on
// shards of b are exactly one process on the batch N x b, BN included. Without it every rank
// normalizes with its own shard's statistics, which is what Goyal et al. do on purpose (per-GPU
// BN over 32 images; the statistics' noise regularizes, and no communication is needed), and
// the running statistics then differ between ranks (DataParallel::broadcast_from_rank0
// re-aligns them before evaluation or a checkpoint).
//
// The all-reduces are blocking and happen inside forward and backward on every rank in the same
// order, so every rank must run the same number of forward/backward passes.
//
// Agreement: convert_sync_batch_norm checks (one all_gather of two int64) that every rank
// converted the same layers, by name and channel count: otherwise the statistics all-reduces
// would differ in size (a crash inside MPI or Gloo) (parallel/agreement.hpp).
#pragma once

#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tessera/comm/communicator.hpp"
#include "tessera/core/env.hpp"
#include "tessera/layers/batch_norm.hpp"
#include "tessera/parallel/agreement.hpp"

namespace tessera {

namespace detail {
// Visits a model and gives every BatchNorm2d the same statistics hook (empty: per-rank statistics).
struct BatchNormStatsSetter {
  std::function<void(std::span<double>)> hook;
  int converted = 0;
  std::vector<std::pair<std::string, std::int64_t>> layers;  // name, channels
  template <class E>
  void batch_norm(const std::string& name, BatchNorm2d<E>& bn) {
    bn.set_stats_all_reduce(hook);
    ++converted;
    // Layers visit with their prefix ("layer1.0.bn1."): the name without the trailing dot.
    layers.emplace_back(name.ends_with('.') ? name.substr(0, name.size() - 1) : name,
                        static_cast<std::int64_t>(bn.num_features()));
  }
  template <class P>
  void parameter(const std::string&, P&) {}
  template <class T>
  void buffer(const std::string&, T&) {}
  template <class R>
  void rng(const std::string&, R&) {}
};
}  // namespace detail

// Makes every BatchNorm2d in `model` synchronize its statistics over `comm` (which must outlive
// the model's use). Returns how many layers were converted.
template <class Model, Communicator Comm>
int convert_sync_batch_norm(Model& model, Comm& comm) {
  static_assert(check_comm_of_env<typename Model::Env, Comm>());
  detail::BatchNormStatsSetter setter{[c = &comm](std::span<double> values) { c->all_reduce(values, ReduceOp::Sum); }};
  model.visit(setter, "");
  AgreementRecord record("convert_sync_batch_norm");
  record.add("converted", setter.converted);
  for (std::size_t i = 0; i < setter.layers.size(); ++i) {
    const std::string key = "batch_norm[" + std::to_string(i) + "]";
    record.add(key + " name", setter.layers[i].first);
    record.add(key + " (" + setter.layers[i].first + ") channels", setter.layers[i].second);
  }
  check_agreement(comm, record, "every rank must convert the same model");
  return setter.converted;
}

// Back to per-rank statistics.
template <class Model>
int convert_local_batch_norm(Model& model) {
  detail::BatchNormStatsSetter setter{nullptr};
  model.visit(setter, "");
  return setter.converted;
}

}  // namespace tessera
