// DataParallel against one process, on any communicator: N ranks each training on their shard
// of every global batch must end with the parameters of one process training on the whole
// batch, and with bit-identical parameters on every rank. Collective: every rank calls it.
// Returns failures as text (usable from threads and from plain multi-process programs).
#pragma once

#include <bit>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "tessera/comm/local.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/losses/cross_entropy.hpp"
#include "tessera/models/lenet.hpp"
#include "tessera/models/resnet.hpp"
#include "tessera/parallel/sync_batch_norm.hpp"
#include "tessera/optim/adam.hpp"
#include "tessera/optim/sgd.hpp"
#include "tessera/parallel/local_sgd.hpp"
#include "tessera/parallel/zero.hpp"
#include "tessera/parallel/data_parallel.hpp"

namespace tessera::testing {

struct DpCase {
  int per_rank_batch = 8;  // images per rank per step
  int steps = 3;
  int micro_steps = 1;     // gradient accumulation: per_rank_batch is split into this many pieces
  // false: each micro-step's loss is scaled by 1/micro_steps and DataParallel sums (PyTorch DDP);
  // true: the loss is left alone and DataParallel divides by the number of micro-steps.
  bool average_micro_steps = false;
  double tolerance = 1e-12;
  GradientCompression compression = GradientCompression::None;
};

template <class S>
struct DpData {
  std::vector<S> images;  // (steps * global_batch, 1, 28, 28)
  std::vector<std::int64_t> labels;

  DpData(std::int64_t samples) : images(static_cast<std::size_t>(samples) * 784), labels(static_cast<std::size_t>(samples)) {
    Rng rng(2024);
    for (auto& v : images) v = static_cast<S>(rng.normal());
    for (auto& l : labels) l = static_cast<std::int64_t>(rng.uniform() * 10) % 10;
  }
  Tensor<S, Cpu> batch(std::int64_t first, std::int64_t n) const {
    Tensor<S, Cpu> x(Shape{n, 1, 28, 28});
    std::copy_n(images.begin() + first * 784, n * 784, x.data());
    return x;
  }
  std::span<const std::int64_t> batch_labels(std::int64_t first, std::int64_t n) const {
    return std::span<const std::int64_t>(labels).subspan(static_cast<std::size_t>(first), static_cast<std::size_t>(n));
  }
  // Samples [first, first + n) as the Trainer takes them.
  Batch<S> trainer_batch(std::int64_t first, std::int64_t n) const {
    Batch<S> b;
    b.images = batch(first, n);
    const auto l = batch_labels(first, n);
    b.labels.assign(l.begin(), l.end());
    return b;
  }
};

// One SGD step's worth of forward/backward of `model` on images [first, first + n).
template <class S, class Model>
void forward_backward(Model& model, const DpData<S>& data, std::int64_t first, std::int64_t n, double loss_scale = 1) {
  using E = typename Model::Env;
  typename Model::Cache cache{};
  CrossEntropyLoss<E> loss;
  typename CrossEntropyLoss<E>::Cache loss_cache;
  const auto x = data.batch(first, n);
  const auto& logits = model.forward(x, cache);
  loss.forward(logits, data.batch_labels(first, n), loss_cache);
  if (loss_scale == 1) {
    model.backward(loss.backward(loss_cache), cache);
  } else {  // the loss / k of gradient accumulation with PyTorch DDP
    Tensor<S, typename E::Device> dy = loss.backward(loss_cache);
    scale_elements(typename E::Device{}, dy.data(), dy.numel(), static_cast<S>(loss_scale), dy.data());
    model.backward(dy, cache);
  }
}

// Model makers: make<E>(seed) builds the model for Env E, once for the one-process reference
// (LocalComm) and once for the data-parallel copy (the communicator's Env).
struct MakeLenet {
  template <class E>
  static auto make(std::uint64_t seed) {
    return lenet5<E>(1, 28, 10, seed);
  }
};

struct MakeResnet20 {
  template <class E>
  static auto make(std::uint64_t seed) {
    return resnet20<E>({.in_channels = 1, .num_classes = 10, .seed = seed});
  }
};

// Maker builds the model; prepare(model, comm) runs on the data-parallel copy before training
// (e.g. convert_sync_batch_norm). The reference model's BatchNorms (if any) see the whole global
// batch, so models with BN match only with SyncBatchNorm.
// Compute: the Envs' compute type (S, or BFloat16 for the mixed-precision policy).
template <class S, class Comm, class Maker = MakeLenet, class Prepare = void (*)(void*, void*), class Compute = S>
std::vector<std::string> dp_equivalence(Comm& comm, const DpCase& c, Maker = {}, Prepare prepare = nullptr) {
  using Reference = Env<Cpu, LocalComm, S, Compute>;
  using E = Env<Cpu, Comm, S, Compute>;
  std::vector<std::string> failures;
  const int p = comm.size(), r = comm.rank();
  const std::int64_t b = c.per_rank_batch, global = b * p, piece = b / c.micro_steps;
  const DpData<S> data(global * c.steps);
  const SgdOptions sgd_options{.lr = 0.05, .momentum = 0.9, .weight_decay = 5e-4};

  // The reference: one process, whole global batch per step.
  auto reference = Maker::template make<Reference>(7);
  auto reference_params = named_tensors(reference);
  Sgd<Reference> reference_sgd(reference_params, sgd_options);
  for (int step = 0; step < c.steps; ++step) {
    reference_sgd.zero_grad();
    forward_backward<S>(reference, data, step * global, global);
    reference_sgd.step();
  }

  // Data parallel: ranks other than 0 start from different weights, which the constructor's
  // broadcast must replace.
  auto model = Maker::template make<E>(r == 0 ? 7 : 100 + static_cast<std::uint64_t>(r));
  if constexpr (!std::is_same_v<Prepare, void (*)(void*, void*)>) prepare(model, comm);
  DataParallel dp(model, comm,
                           {.bucket_bytes = 64 * 1024, .first_bucket_bytes = 8 * 1024, .compression = c.compression,
                            .average_micro_steps = c.average_micro_steps});
  const double loss_scale = c.average_micro_steps ? 1.0 : 1.0 / c.micro_steps;
  Sgd<E> sgd(dp.parameters(), sgd_options);
  for (int step = 0; step < c.steps; ++step) {
    sgd.zero_grad();
    for (int m = 0; m < c.micro_steps; ++m) {
      const std::int64_t first = step * global + r * b + m * piece;
      if (m + 1 < c.micro_steps) {
        auto guard = dp.no_sync();
        forward_backward<S>(model, data, first, piece, loss_scale);
      } else {
        forward_backward<S>(model, data, first, piece, loss_scale);
      }
    }
    dp.finish();
    sgd.step();
  }

  // Equal to the reference, and bit-identical across ranks (max == min over ranks, element-wise).
  double worst = 0;
  std::string worst_name;
  std::vector<S> flat;
  for (std::size_t i = 0; i < dp.parameters().parameters.size(); ++i) {
    const auto& mine = dp.parameters().parameters[i].second->value;
    const auto& want = reference_params.parameters[i].second->value;
    for (std::int64_t k = 0; k < mine.numel(); ++k) {
      const double diff = std::abs(static_cast<double>(mine.data()[k]) - static_cast<double>(want.data()[k])) /
                          std::max(1.0, std::abs(static_cast<double>(want.data()[k])));
      if (diff > worst) worst = diff, worst_name = dp.parameters().parameters[i].first;
      flat.push_back(mine.data()[k]);
    }
  }
  for (std::size_t i = 0; i < dp.parameters().buffers.size(); ++i) {  // BatchNorm running statistics
    const auto& mine = *dp.parameters().buffers[i].second;
    const auto& want = *reference_params.buffers[i].second;
    for (std::int64_t k = 0; k < mine.numel(); ++k) {
      const double diff = std::abs(static_cast<double>(mine.data()[k]) - static_cast<double>(want.data()[k])) /
                          std::max(1.0, std::abs(static_cast<double>(want.data()[k])));
      if (diff > worst) worst = diff, worst_name = dp.parameters().buffers[i].first;
    }
  }
  if (!(worst <= c.tolerance))
    failures.push_back("rank " + std::to_string(r) + ": parameters differ from one process by " + std::to_string(worst) +
                       " (relative) in " + worst_name);
  std::vector<S> high = flat, low = flat;
  comm.all_reduce(std::span<S>(high), ReduceOp::Max);
  comm.all_reduce(std::span<S>(low), ReduceOp::Min);
  for (std::size_t k = 0; k < flat.size(); ++k)
    if (high[k] != low[k]) {
      failures.push_back("rank " + std::to_string(r) + ": parameters differ across ranks at element " + std::to_string(k));
      break;
    }
  return failures;
}

// The same comparison for the alternatives to DataParallel: ZeRO-1 (optimizer state sharded)
// with SGD or Adam, and local SGD with period 1. Each must equal one process on the global batch.
enum class Strategy { Zero1Sgd, Zero1Adam, LocalSgdPeriod1 };

template <class S, class Comm>
std::vector<std::string> strategy_equivalence(Comm& comm, Strategy strategy, const DpCase& c) {
  using Reference = Env<Cpu, LocalComm, S>;
  using E = Env<Cpu, Comm, S>;
  const int p = comm.size(), r = comm.rank();
  const std::int64_t b = c.per_rank_batch, global = b * p;
  const DpData<S> data(global * c.steps);
  const SgdOptions sgd_options{.lr = 0.05, .momentum = 0.9, .weight_decay = 5e-4, .decay_norm_and_bias = false};
  const AdamOptions adam_options{.lr = 1e-3, .weight_decay = 1e-4};
  const bool adam = strategy == Strategy::Zero1Adam;

  auto reference = MakeLenet::make<Reference>(7);
  auto reference_params = named_tensors(reference);
  Sgd<Reference> reference_sgd(reference_params, sgd_options);
  Adam<Reference> reference_adam(reference_params, adam_options);
  for (int step = 0; step < c.steps; ++step) {
    adam ? reference_adam.zero_grad() : reference_sgd.zero_grad();
    forward_backward<S>(reference, data, step * global, global);
    adam ? reference_adam.step() : reference_sgd.step();
  }

  auto model = MakeLenet::make<E>(r == 0 ? 7 : 100 + static_cast<std::uint64_t>(r));
  auto model_params = named_tensors(model);
  if (strategy == Strategy::LocalSgdPeriod1) {
    LocalSgd local(model, comm, {.period = 1});
    Sgd<E> sgd(model_params, sgd_options);
    for (int step = 0; step < c.steps; ++step) {
      sgd.zero_grad();
      forward_backward<S>(model, data, step * global + r * b, b);
      sgd.step();
      local.after_step();
    }
  } else {
    Zero1 zero(model, comm);
    Sgd<E> sgd(zero.shard_parameters(), sgd_options);
    Adam<E> adam_opt(zero.shard_parameters(), adam_options);
    for (int step = 0; step < c.steps; ++step) {
      zero.zero_grad();
      forward_backward<S>(model, data, step * global + r * b, b);
      adam ? zero.step(adam_opt) : zero.step(sgd);
    }
  }
  std::vector<std::string> failures;
  double worst = 0;
  for (std::size_t i = 0; i < model_params.parameters.size(); ++i) {
    const auto& mine = model_params.parameters[i].second->value;
    const auto& want = reference_params.parameters[i].second->value;
    for (std::int64_t k = 0; k < mine.numel(); ++k)
      worst = std::max(worst, std::abs(static_cast<double>(mine.data()[k]) - static_cast<double>(want.data()[k])) /
                                  std::max(1.0, std::abs(static_cast<double>(want.data()[k]))));
  }
  if (!(worst <= c.tolerance))
    failures.push_back("rank " + std::to_string(r) + ": parameters differ from one process by " + std::to_string(worst));
  return failures;
}

// Ranks launched with different settings, on any communicator: rank 1 alone uses another bucket
// size (which used to crash inside MPI and Gloo), or another learning rate (which used to train on
// silently, each rank its own model). Each must end in the named AgreementError on every rank,
// the same text everywhere, and leave the communicator in step. Needs 2 ranks or more.
enum class Mismatch { BucketSize, LearningRate };

template <class S, class Comm>
std::vector<std::string> dp_mismatch(Comm& comm, Mismatch what) {
  using E = Env<Cpu, Comm, S>;
  const int p = comm.size(), r = comm.rank();
  std::vector<std::string> failures;
  if (p < 2) return failures;
  std::vector<int> others;
  for (int k = 0; k < p; ++k)
    if (k != 1) others.push_back(k);
  std::string error, expected;
  int steps_done = 0;
  const int steps = 4, check_every = 2;
  auto model = MakeLenet::make<E>(7);
  try {
    if (what == Mismatch::BucketSize) {
      expected = "DataParallel: ranks disagree on options.bucket_bytes: " + Disagreement::rank_list(others) +
                 ": 65536; rank 1: 16384";
      DataParallel dp(model, comm, {.bucket_bytes = r == 1 ? 16 * 1024u : 64 * 1024u, .first_bucket_bytes = 8 * 1024});
    } else {
      // Checks at the start of steps 1, 3: step 1's updates differ, so step 3's check throws.
      expected = "DataParallel: the replicas' parameters are no longer identical at the start of synchronized step 3 "
                 "(checked every 2 steps; equal at step 1): parameter conv1.weight: " +
                 Disagreement::rank_list(others) + ": checksum 0x";
      const DpData<S> data(4 * p * steps);
      DataParallel dp(model, comm, {.consistency_check_every = check_every});
      Sgd<E> sgd(dp.parameters(), {.lr = r == 1 ? 0.1 : 0.05, .momentum = 0.9});
      for (int step = 0; step < steps; ++step) {
        sgd.zero_grad();
        forward_backward<S>(model, data, (step * p + r) * 4, 4);
        sgd.step();
        ++steps_done;
      }
    }
  } catch (const AgreementError& e) {
    error = e.what();
  }
  const std::string where = "rank " + std::to_string(r) + ": ";
  if (error.rfind(expected, 0) != 0)
    failures.push_back(where + "expected an error starting \"" + expected + "\", got \"" + error + "\"");
  if (what == Mismatch::LearningRate) {
    if (steps_done != 2) failures.push_back(where + std::to_string(steps_done) + " steps done before the error, expected 2");
    if (error.find("; rank 1: checksum 0x") == std::string::npos || error.find("learning rate") == std::string::npos)
      failures.push_back(where + "the error does not name rank 1's checksum and the learning rate: " + error);
  }
  // The same text on every rank (its checksum gathered), and the group still in step.
  const std::int64_t mine = std::bit_cast<std::int64_t>(checksum64(error.data(), error.size()));
  std::vector<std::int64_t> all(static_cast<std::size_t>(p));
  comm.all_gather(std::span<const std::int64_t>(&mine, 1), std::span<std::int64_t>(all));
  for (std::int64_t other : all)
    if (other != mine) {
      failures.push_back(where + "the error text differs between ranks");
      break;
    }
  return failures;
}

// ResNet-20 with SyncBatchNorm against one process on the global batch.
template <class S, class Comm>
std::vector<std::string> dp_equivalence_resnet20_sync_bn(Comm& comm, const DpCase& c) {
  return dp_equivalence<S>(comm, c, MakeResnet20{}, [](auto& model, Comm& group) {
    if (convert_sync_batch_norm(model, group) < 19) throw std::runtime_error("expected at least 19 BatchNorm layers");
  });
}

}  // namespace tessera::testing
