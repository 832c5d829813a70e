// A GPT under DataParallel, ZeRO-1 and FullyShardedDataParallel (ZeRO-2 and ZeRO-3, with the tied
// wte as a unit of its own) against one process, on any communicator: every rank
// trains on its share of each global batch of token windows (TokenLoader's split), with AdamW and
// nanoGPT's decay rule, and must end with the parameters of one process that trained on the whole
// global batches. Ranks start from different seeds: both strategies broadcast rank 0's weights.
// Collective: every rank calls it. Returns failures as text.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "tessera/comm/local.hpp"
#include "tessera/data/token_loader.hpp"
#include "tessera/losses/cross_entropy.hpp"
#include "tessera/models/gpt.hpp"
#include "tessera/optim/adam.hpp"
#include "tessera/parallel/data_parallel.hpp"
#include "tessera/parallel/fully_sharded.hpp"
#include "tessera/parallel/zero.hpp"

namespace tessera::testing {

enum class GptDpStrategy { DataParallel, Zero1, Fsdp2, Fsdp3 };

inline const char* to_string(GptDpStrategy s) {
  switch (s) {
    case GptDpStrategy::DataParallel: return "DataParallel";
    case GptDpStrategy::Zero1: return "Zero1";
    case GptDpStrategy::Fsdp2: return "FSDP stage 2";
    case GptDpStrategy::Fsdp3: return "FSDP stage 3";
  }
  return "?";
}

template <class S, class Comm>
std::vector<std::string> gpt_dp_equivalence(Comm& comm, GptDpStrategy strategy, int steps = 3,
                                            double tolerance = 1e-12) {
  using Reference = Env<Cpu, LocalComm, S>;
  using E = Env<Cpu, Comm, S>;
  const int p = comm.size(), r = comm.rank();
  const std::int64_t per_rank = 3, block = 8;
  const GPTConfig config{.block_size = block, .vocab_size = 13, .n_layer = 2, .n_head = 2, .n_embd = 8};
  const AdamWOptions adamw{.lr = 1e-2, .weight_decay = 0.1, .decay_norm_and_bias = false};
  std::vector<std::uint16_t> stream(500);
  Rng data(21);
  for (auto& t : stream) t = static_cast<std::uint16_t>(data.below(13));
  const TokenSpan span{stream.data(), static_cast<std::int64_t>(stream.size()), 0};
  const auto loader_options = [&](std::int64_t batch, int rank, int world) {
    LoaderOptions o;
    o.batch_size = batch;
    o.seed = 4;
    o.rank = rank;
    o.world_size = world;
    return o;
  };
  // One step of forward, cross-entropy over (B, T, V), backward.
  const auto forward_backward = [](auto& model, const Batch<S>& batch) {
    using M = std::remove_reference_t<decltype(model)>;
    typename M::Cache cache;
    CrossEntropyLoss<typename M::Env> ce;
    typename CrossEntropyLoss<typename M::Env>::Cache ce_cache;
    ce.forward(model.forward(batch.tokens, cache), batch.labels, ce_cache);
    model.backward(ce.backward(ce_cache), cache);
  };

  Rng reference_rng(9);
  GPT<Reference> reference(config, reference_rng);
  auto reference_params = named_tensors(reference);
  AdamW<Reference> reference_opt(reference_params, adamw);
  TokenLoader<S> whole(span, block, loader_options(per_rank * p, 0, 1), steps);
  whole.start_epoch(0);
  Batch<S> batch;
  while (whole.next(batch)) {
    reference_opt.zero_grad();
    forward_backward(reference, batch);
    reference_opt.step();
  }

  Rng rng(r == 0 ? 9 : 50 + static_cast<std::uint64_t>(r));
  GPT<E> model(config, rng);
  auto model_params = named_tensors(model);
  TokenLoader<S> mine(span, block, loader_options(per_rank, r, p), steps);
  mine.start_epoch(0);
  if (strategy == GptDpStrategy::DataParallel) {
    DataParallel dp(model, comm);
    AdamW<E> opt(dp.parameters(), adamw);
    while (mine.next(batch)) {
      opt.zero_grad();
      forward_backward(model, batch);
      opt.step();  // waits for DataParallel's all-reduces first
    }
  } else if (strategy == GptDpStrategy::Zero1) {
    Zero1 zero(model, comm);
    AdamW<E> opt(zero.shard_parameters(), adamw);
    while (mine.next(batch)) {
      zero.zero_grad();
      forward_backward(model, batch);
      zero.step(opt);
    }
  } else {
    // Two micro-batches: the accumulation inside the strategy changes nothing either.
    FullyShardedDataParallel fsdp(model, comm,
                                  {.stage = strategy == GptDpStrategy::Fsdp2 ? 2 : 3, .micro_batches = strategy == GptDpStrategy::Fsdp3 ? 3 : 1});
    AdamW<E> adamw_shard(fsdp.shard_parameters(), adamw);
    FullyShardedOptimizer opt(fsdp, adamw_shard);
    while (mine.next(batch)) {
      opt.zero_grad();
      fsdp.train_step(batch.tokens, batch.labels);
      opt.step();
    }
    fsdp.gather_full();  // the whole model back, to compare
  }
  double worst = 0;
  for (std::size_t i = 0; i < model_params.parameters.size(); ++i) {
    const auto& got = model_params.parameters[i].second->value;
    const auto& want = reference_params.parameters[i].second->value;
    for (std::int64_t k = 0; k < got.numel(); ++k)
      worst = std::max(worst, std::abs(static_cast<double>(got.data()[k]) - static_cast<double>(want.data()[k])) /
                                  std::max(1.0, std::abs(static_cast<double>(want.data()[k]))));
  }
  std::vector<std::string> failures;
  if (std::getenv("TESSERA_EQUIVALENCE_REPORT") != nullptr)
    std::printf("GPT %s rank %d of %d: worst relative difference from one process %.3g\n", to_string(strategy), r, p, worst);
  if (!(worst <= tolerance))
    failures.push_back("GPT " + std::string(to_string(strategy)) +
                       ", rank " + std::to_string(r) + " of " + std::to_string(p) +
                       ": parameters differ from one process by " + std::to_string(worst));
  return failures;
}

}  // namespace tessera::testing
