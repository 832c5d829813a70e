// TokenLoader<S>: a language model's batches for the Trainer, from a span of tokens (TokenFile).
//
// Batch i of epoch e holds B windows of T tokens: tokens (B, T) as int64 ids and labels (B T), the
// next token at every position (x = tokens[s, s + T), y = tokens[s + 1, s + T + 1]).
//
//   shuffle = true    nanoGPT's get_batch: window starts s drawn uniformly from [0, n - T), each a
//                     pure function of (seed, e, i, j) for the j-th window of the global batch (a
//                     counter-based draw: no generator state), so that runs reproduce and a
//                     checkpoint resumes at the next batch without replaying the draws.
//                     batches_per_epoch is the caller's (nanoGPT counts iterations, not epochs).
//   shuffle = false   the span cut into consecutive windows s = k T, k = 0, 1, ...: an evaluation
//                     that sees every token of a validation split once (the tail that fills no
//                     global batch is left out with drop_last, else it is a smaller last batch,
//                     split evenly over the ranks). batches_per_epoch 0 = all of them.
//
// Ranks. As for DataLoader, the global batch G = B x world_size is one sequence of windows, and rank
// r takes its windows [r B, (r + 1) B): data-parallel ranks together see exactly the windows one
// process sees with batch G, so the two train alike (the equivalence tests' premise), and an
// elastic resume at another world size with the same G continues with the same windows.
//
// Cheap enough to need no worker thread: a batch is B T table reads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "tessera/core/error.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/data/text.hpp"

namespace tessera {

template <class S>
class TokenLoader {
 public:
  // options: batch_size (per rank), shuffle, seed, drop_last, rank, world_size; prefetch, workers and
  // drop_tail do not apply (there is nothing to prepare ahead, and every rank has equal windows).
  TokenLoader(TokenSpan tokens, std::int64_t block_size, LoaderOptions options, std::int64_t batches_per_epoch = 0,
              std::string name = "tokens")
      : tokens_(tokens), block_(block_size), opt_(options), name_(std::move(name)) {
    TESSERA_CHECK(block_size > 0 && tokens.size > block_size, ArgumentError, "TokenLoader(", name_, "): ",
                  tokens.size, " tokens hold no window of ", block_size, " tokens plus its next token");
    TESSERA_CHECK(opt_.global_batch_size == 0, ArgumentError, "TokenLoader(", name_, "): global_batch_size=",
                  opt_.global_batch_size, " is not supported (it splits batches unevenly); give batch_size per rank");
    TESSERA_CHECK(opt_.batch_size > 0, ArgumentError, "TokenLoader(", name_, "): batch_size=", opt_.batch_size,
                  " must be positive");
    TESSERA_CHECK(opt_.world_size >= 1 && opt_.rank >= 0 && opt_.rank < opt_.world_size, ArgumentError,
                  "TokenLoader(", name_, "): rank ", opt_.rank, " of world_size ", opt_.world_size);
    TESSERA_CHECK(batches_per_epoch >= 0, ArgumentError, "TokenLoader(", name_, "): batches_per_epoch=",
                  batches_per_epoch, " must be >= 0");
    const std::int64_t global = opt_.batch_size * opt_.world_size;
    if (opt_.shuffle) {
      TESSERA_CHECK(batches_per_epoch > 0, ArgumentError, "TokenLoader(", name_, "): random windows (shuffle) need "
                    "batches_per_epoch > 0: an epoch of random windows has no natural end");
      batches_ = batches_per_epoch;
      windows_ = batches_ * global;
    } else {
      const std::int64_t available = (tokens.size - 1) / block_size;  // the last window needs its next token
      const std::int64_t full = available / global, rest = available % global / opt_.world_size * opt_.world_size;
      const std::int64_t all = opt_.drop_last || rest == 0 ? full : full + 1;
      TESSERA_CHECK(all > 0, ArgumentError, "TokenLoader(", name_, "): ", available, " windows of ", block_size,
                    " tokens do not fill one batch of ", opt_.batch_size, " per rank on ", opt_.world_size, " rank(s)");
      windows_ = full * global + (all > full ? rest : 0);
      batches_ = batches_per_epoch > 0 ? std::min(batches_per_epoch, all) : all;
      windows_ = std::min(windows_, batches_ * global);
    }
  }

  void start_epoch(std::int64_t epoch) {
    TESSERA_CHECK(epoch >= 0, ArgumentError, "TokenLoader(", name_, "): epoch ", epoch, " must be >= 0");
    epoch_ = epoch;
    next_ = 0;
  }

  bool next(Batch<S>& out) {
    if (next_ >= batches_) return false;
    const std::int64_t global = opt_.batch_size * opt_.world_size;
    // This rank's share of the global batch: B windows, fewer in a short last batch, which the
    // ranks split evenly (data-parallel ranks average equal-sized batches), leaving out its
    // remainder of fewer than world_size windows.
    const std::int64_t first_global = next_ * global;
    const std::int64_t n = std::min(global, windows_ - first_global) / opt_.world_size;
    const std::int64_t begin = first_global + opt_.rank * n;
    out.images = Tensor<S>();
    out.tokens.resize({n, block_});
    out.labels.resize(static_cast<std::size_t>(n * block_));
    const std::uint64_t seed = epoch_seed(opt_.seed, epoch_);
    for (std::int64_t j = 0; j < n; ++j) {
      const std::int64_t s = start(begin + j, seed);
      std::int64_t* x = out.tokens.data() + j * block_;
      std::int64_t* y = out.labels.data() + j * block_;
      for (std::int64_t t = 0; t < block_; ++t) {
        x[t] = tokens_[s + t];
        y[t] = tokens_[s + t + 1];
      }
    }
    out.index = next_++;
    return true;
  }

  std::int64_t batches_per_epoch() const { return batches_; }
  // The tokens behind the windows (what a checkpoint records as the data set's size).
  std::int64_t dataset_size() const { return tokens_.size; }
  std::int64_t block_size() const { return block_; }
  LoaderState state() const { return {epoch_, next_}; }
  void set_state(const LoaderState& s) {
    TESSERA_CHECK(s.epoch >= 0 && s.next_batch >= 0 && s.next_batch <= batches_, ArgumentError, "TokenLoader(",
                  name_, "): state {epoch ", s.epoch, ", next_batch ", s.next_batch, "} is outside this loader's ",
                  batches_, " batches per epoch");
    epoch_ = s.epoch;
    next_ = s.next_batch;
  }
  const LoaderOptions& options() const { return opt_; }
  const std::string& name() const { return name_; }

 private:
  // Where window k (of the epoch's sequence of windows) starts.
  std::int64_t start(std::int64_t k, std::uint64_t seed) const {
    if (!opt_.shuffle) return k * block_;
    // splitmix64 of (epoch seed, k): a uniform 64-bit draw per window; reduced to [0, n - T) by
    // the multiply-high method (bias below 2^-32 for any span that fits in memory).
    std::uint64_t z = seed ^ (static_cast<std::uint64_t>(k) * 0x9e3779b97f4a7c15ULL);
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    const auto starts = static_cast<unsigned __int128>(tokens_.size - block_);
    return static_cast<std::int64_t>((static_cast<unsigned __int128>(z) * starts) >> 64);
  }

  TokenSpan tokens_;
  std::int64_t block_;
  LoaderOptions opt_;
  std::string name_;
  std::int64_t batches_ = 0, windows_ = 0;
  std::int64_t epoch_ = 0, next_ = 0;
};

}  // namespace tessera
