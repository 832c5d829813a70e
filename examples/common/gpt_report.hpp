// What example 15 (a GPT on English text) prepares, prints and checks around its training, kept
// out of its main: the corpus's token files, the cost model (compute per token and all-reduce bytes
// per step) beside the measured figures, a generated sample (with and without the key/value cache:
// the same tokens), and its result as one JSON line for bench/compare_gpt.py.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "common/data_parallel_report.hpp"
#include "tessera/tessera.hpp"

namespace examples {

// The fortunes package's text as byte tokens, dir/train.bin and dir/val.bin (the last 10%): rank 0
// writes them when they are missing (each file atomically), the other ranks wait at a barrier and
// open what it wrote (ranks of other hosts need dir on a shared file system). Without the package,
// rank 0 throws an IoError naming it and the apt-get command; the others would wait forever, so
// every rank learns the outcome from an all-reduce first.
template <class Comm>
tessera::PreparedCorpus fortunes_tokens(Comm& comm, const std::string& dir) {
  tessera::PreparedCorpus out{dir + "/train.bin", dir + "/val.bin"};
  std::string failure;
  if (comm.rank() == 0 && !(std::filesystem::exists(out.train) && std::filesystem::exists(out.val))) {
    try {
      const auto prepared = tessera::prepare_byte_corpus(tessera::TextCorpus::fortunes(), dir);
      std::printf("prepared %s: %lld training and %lld validation byte tokens\n", dir.c_str(),
                  static_cast<long long>(prepared.train_tokens), static_cast<long long>(prepared.val_tokens));
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  std::int64_t failed = failure.empty() ? 0 : 1;
  comm.all_reduce(std::span<std::int64_t>(&failed, 1), tessera::ReduceOp::Sum);
  TESSERA_CHECK(failed == 0, tessera::IoError, failure.empty() ? "rank 0 could not prepare the corpus in " + dir : failure);
  return out;
}

// The entropy of the tokens' frequencies in nats: the loss of the best model that ignores context.
inline double unigram_entropy(tessera::TokenSpan tokens, std::int64_t vocab) {
  std::vector<double> count(static_cast<std::size_t>(vocab), 0.0);
  for (std::int64_t i = 0; i < tokens.size; ++i) count[static_cast<std::size_t>(tokens[i])] += 1;
  double h = 0;
  for (const double c : count)
    if (c > 0) h -= c / static_cast<double>(tokens.size) * std::log(c / static_cast<double>(tokens.size));
  return h;
}

// Compute per token (Kaplan et al.; nanoGPT's estimate_mfu): every parameter in a product costs 2
// FLOPs forward and 4 backward, 6N per token (N without the position table, which is a lookup),
// and attention's two products 12 L T C per token (forward and backward, T = block size, the
// causal triangle counted whole as nanoGPT does). Communication: DataParallel's all-reduce of the
// gradients, 2(p-1)/p x 4P bytes per rank and step (print_traffic).
inline void print_gpt_cost(const tessera::GPTConfig& c, double params, double non_embedding, int ranks,
                           double tokens_per_second, double steps, double peer_before, double peer_after,
                           double loopback_before, double loopback_after) {
  const double per_token = 6 * non_embedding + 12.0 * static_cast<double>(c.n_layer * c.block_size * c.n_embd);
  std::printf("cost: compute per token = 6 N + 12 L T C = 6 x %.0f + 12 x %lld x %lld x %lld = %.2f MFLOP\n",
              non_embedding, static_cast<long long>(c.n_layer), static_cast<long long>(c.block_size),
              static_cast<long long>(c.n_embd), per_token / 1e6);
  std::printf("cost: measured: %.0f tokens/s over all ranks = %.1f GFLOP/s (%.1f per rank)\n", tokens_per_second,
              tokens_per_second * per_token / 1e9, tokens_per_second * per_token / 1e9 / ranks);
  print_traffic(ranks, params, 4.0, steps, peer_before >= 0 ? peer_after - peer_before : -1,
                loopback_before >= 0 ? loopback_after - loopback_before : -1);
}

// A sample from the prompt, drawn twice from the same seed: through the key/value cache and through
// the full forward. Prints the first; returns whether the two are the same tokens.
template <class Model>
bool print_sample(Model& model, const std::string& prompt, std::int64_t tokens, double temperature,
                  std::int64_t top_k, std::uint64_t seed) {
  const auto ids = tessera::ByteTokenizer::encode(prompt.empty() ? std::string("\n") : prompt);
  typename Model::GenerateOptions o{.max_new_tokens = tokens, .temperature = temperature, .top_k = top_k};
  tessera::Rng cached_rng(seed), full_rng(seed);
  const auto cached = model.generate(ids, 1, o, cached_rng);
  o.kv_cache = false;
  const auto full = model.generate(ids, 1, o, full_rng);
  std::printf("sample (temperature %.2f, top-k %lld):\n----\n%s\n----\n", temperature, static_cast<long long>(top_k),
              tessera::ByteTokenizer::decode(cached).c_str());
  const bool same = cached == full;
  std::printf("check: the sample through the key/value cache and through the full forward %s\n",
              same ? "are the same tokens" : "DIFFER");
  return same;
}

}  // namespace examples
