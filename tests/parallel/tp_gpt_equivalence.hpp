// TensorParallelGPT (tensor + sequence parallelism) against the dense GPT on any communicator: every
// rank builds the dense model from the same seed and its tensor-parallel slices, runs both on the
// same batches, and compares the logits, the loss, every gradient (its slice of the dense one) and,
// after SGD steps, every parameter. Where the communicator counts the bytes it moves between the
// ranks (ThreadComm::peer_bytes), one forward + backward must move exactly the formula's bytes.
// Collective: every rank calls it. Returns failures as text.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "tessera/losses/cross_entropy.hpp"
#include "tessera/optim/sgd.hpp"
#include "tessera/parallel/tensor_parallel_gpt.hpp"

namespace tessera::testing {

struct TpGptCase {
  GPTConfig config{.block_size = 16, .vocab_size = 23, .n_layer = 2, .n_head = 12, .n_embd = 24, .bias = true};
  std::int64_t batch = 2, t = 12;  // T divides over 2, 3 and 4 ranks, and so do the 12 heads
  int steps = 3;
  double tolerance = 1e-5;  // of the largest magnitude of each compared tensor (float32)
};

// What a run measured: the largest relative difference of anything compared, and the bytes one
// forward + backward moved between the ranks (-1 where the communicator does not count them)
// beside the formula's.
struct TpGptReport {
  double worst = 0;
  double moved_bytes = -1, formula_bytes = 0;
  int compared = 0;
};

inline std::string tp_gpt_number(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g", v);
  return text;
}

// The largest |a - b| over the largest |b| (or 1 where that is smaller).
template <class S>
double tp_gpt_relative_difference(const S* a, const S* b, std::int64_t n) {
  double worst = 0, scale = 1e-30;
  for (std::int64_t i = 0; i < n; ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return worst / std::max(scale, 1.0);
}

template <class S, class Comm>
std::vector<std::string> tp_gpt_equivalence(Comm& comm, const TpGptCase& k = {}, TpGptReport* report = nullptr) {
  TpGptReport local_report;
  TpGptReport& r = report ? *report : local_report;
  using E = Env<Cpu, Comm, S>;
  std::vector<std::string> failures;
  const std::string where = "TensorParallelGPT" +
                            (k.config.dropout > 0 ? " with dropout " + tp_gpt_number(k.config.dropout) : "") + " on " +
                            std::to_string(comm.size()) + " ranks (rank " + std::to_string(comm.rank()) + "): ";
  Rng rng(17);
  GPT<E> dense(k.config, rng);
  TensorParallelGPT<E> split(dense, comm);
  typename GPT<E>::Cache dense_cache;
  typename TensorParallelGPT<E>::Cache split_cache;
  CrossEntropyLoss<E> ce;
  typename CrossEntropyLoss<E>::Cache dense_ce, split_ce;
  auto dense_named = named_tensors(dense);
  auto split_named = named_tensors(split);
  Sgd<E> dense_sgd(dense_named, {.lr = 0.1}), split_sgd(split_named, {.lr = 0.1});
  const auto compare = [&](const char* what, const std::string& name, const Tensor<S, Cpu>& mine,
                           const Tensor<S, Cpu>& dense_full, int step) {
    const Tensor<S, Cpu> expected = split.shard_of(name, dense_full);
    if (mine.shape() != expected.shape()) {
      failures.push_back(where + what + " of " + name + ": shape " + mine.shape().str() + ", expected " +
                         expected.shape().str());
      return;
    }
    const double d = tp_gpt_relative_difference(mine.data(), expected.data(), mine.numel());
    r.worst = std::max(r.worst, d);
    ++r.compared;
    if (!(d <= k.tolerance))
      failures.push_back(where + "step " + std::to_string(step) + ": " + what + " of " + name + " differs by " +
                         tp_gpt_number(d) + " (relative; tolerance " + tp_gpt_number(k.tolerance) + ")");
  };
  Rng data(5);
  std::vector<std::int64_t> ids(static_cast<std::size_t>(k.batch * k.t)), targets(ids.size());
  for (int step = 0; step < k.steps; ++step) {
    for (auto& v : ids) v = static_cast<std::int64_t>(data.below(static_cast<std::uint64_t>(k.config.vocab_size)));
    for (auto& v : targets) v = static_cast<std::int64_t>(data.below(static_cast<std::uint64_t>(k.config.vocab_size)));
    dense_sgd.zero_grad();
    split_sgd.zero_grad();
    const auto& dense_logits = dense.forward(ids, k.batch, k.t, dense_cache);
    const S dense_loss = ce.forward(dense_logits, targets, dense_ce);
    dense.backward(ce.backward(dense_ce), dense_cache);
    const double peer_before = [&] {
      if constexpr (requires { comm.peer_bytes(); }) return static_cast<double>(comm.peer_bytes());
      else return -1.0;
    }();
    const auto& split_logits = split.forward(ids, k.batch, k.t, split_cache);
    const S split_loss = ce.forward(split_logits, targets, split_ce);
    split.backward(ce.backward(split_ce), split_cache);
    if constexpr (requires { comm.peer_bytes(); }) {
      const double moved = static_cast<double>(comm.peer_bytes()) - peer_before;
      const double formula =
          static_cast<double>(k.config.n_layer) *
              TensorParallelGPT<E>::block_bytes_per_step(k.batch, k.t, k.config.n_embd, comm.size()) +
          split.other_bytes_per_step(k.batch, k.t);
      r.moved_bytes = moved;
      r.formula_bytes = formula;
      if (std::abs(moved - formula) > 0.5)
        failures.push_back(where + "moved " + tp_gpt_number(moved) + " bytes in forward + backward; the formula says " +
                           tp_gpt_number(formula));
    }
    const double dl = tp_gpt_relative_difference(split_logits.data(), dense_logits.data(), dense_logits.numel());
    r.worst = std::max(r.worst, dl);
    ++r.compared;
    if (!(dl <= k.tolerance))
      failures.push_back(where + "step " + std::to_string(step) + ": logits differ by " + tp_gpt_number(dl));
    if (!(std::abs(static_cast<double>(split_loss - dense_loss)) <= k.tolerance * std::max(1.0, std::abs(double(dense_loss)))))
      failures.push_back(where + "step " + std::to_string(step) + ": loss " + std::to_string(split_loss) + " vs " +
                         std::to_string(dense_loss));
    for (auto& [name, p] : split_named.parameters) {
      // Captured by an init-capture: C++20 lets a lambda capture a structured binding, clang 14 does not.
      const auto it = std::find_if(dense_named.parameters.begin(), dense_named.parameters.end(),
                                   [&name = name](const auto& d) { return d.first == name; });
      if (it == dense_named.parameters.end()) {
        failures.push_back(where + "the dense model has no parameter " + name);
        continue;
      }
      compare("the gradient", name, p->grad, it->second->grad, step);
    }
    dense_sgd.step();
    split_sgd.step();
    for (auto& [name, p] : split_named.parameters) {
      const auto it = std::find_if(dense_named.parameters.begin(), dense_named.parameters.end(),
                                   [&name = name](const auto& d) { return d.first == name; });
      if (it != dense_named.parameters.end()) compare("the value after the step", name, p->value, it->second->value, step);
    }
  }
  if (split_named.parameters.size() != dense_named.parameters.size())
    failures.push_back(where + std::to_string(split_named.parameters.size()) + " parameters, the dense model has " +
                       std::to_string(dense_named.parameters.size()));
  return failures;
}

}  // namespace tessera::testing
