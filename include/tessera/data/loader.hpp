// DataLoader<S>: batches of a Dataset in a per-epoch random order, split across data-parallel
// ranks, optionally prepared one step ahead on a background thread.
//
// Order. Epoch e visits the permutation epoch_permutation(N, seed, e) (identity when shuffle is
// off): a pure function of (seed, e), so runs are reproducible and a checkpointed LoaderState
// {epoch, next_batch} resumes at exactly the next batch.
// Ranks. Like torch's DistributedSampler (drop_last=False): the permutation is padded by repeating
// its head to world_size * ceil(N / world_size) entries and rank r takes entries r, r + W, r + 2W, ...
// Every rank therefore has the same number of samples and batches, the ranks' shares are disjoint
// except for the padding, and together they cover every sample. With drop_tail (torch's
// DistributedSampler(drop_last=True)) the permutation's last N mod W entries are dropped instead:
// floor(N / W) samples per rank, no duplicates, a few samples unseen per epoch (a different few
// each epoch). Either way all ranks have equal batch counts and equal last-batch sizes, so
// data-parallel ranks never wait on a rank that has run out of data. With world_size 1 it is a
// plain loader.
// Elastic resume. With a global batch G = batch_size x world_size, batch i of every rank together
// holds the permutation's entries [i G, (i + 1) G): the same samples at every world size that
// divides G, only split differently. A position is therefore stored in global samples
// (TrainState::loader_next_sample = next_batch x G), and a run at another world size with the
// same G continues at batch next_sample / G (Trainer does this). Where N is not a multiple of the
// world size, the padding (or drop_tail's dropped samples) at the epoch's end depends on it.
// Batches. Batch i of an epoch holds this rank's samples [i * B, min((i + 1) * B, samples)):
// images (n, C, H, W) converted to S, labels (n). drop_last drops a final batch with n < B.
//
// next(out) fills `out`, recycling its buffers: without prefetch it converts in place; with
// prefetch a background thread fills a ring of kSlots preallocated batches and next() swaps `out`
// with the ready slot (O(1)). After the first few batches neither allocates. The results are
// identical either way. An exception thrown while preparing batch i (e.g. by the transform) is
// rethrown from the next() that would have returned batch i; calling next() again retries it.
// The background thread uses one core and no OpenMP team, so it does not compete with the
// training step's threads; the destructor stops and joins it, also mid-epoch.
//
// Requires: the Dataset outlives the loader and is not modified while it exists. One thread
// calls the loader's methods (the background thread is internal).
#pragma once

#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <numeric>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/core/random.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/device/cpu.hpp"
#include "tessera/data/dataset.hpp"

namespace tessera {

struct LoaderOptions {
  std::int64_t batch_size = 0;
  bool shuffle = true;
  std::uint64_t seed = 0;
  bool drop_last = false;
  bool prefetch = true;
  int rank = 0;
  int world_size = 1;
  bool drop_tail = false;  // ranks: drop N mod world_size samples instead of padding (see above)
};

// Where a loader stands: the next call to next() returns batch `next_batch` of epoch `epoch`.
struct LoaderState {
  std::int64_t epoch = 0;
  std::int64_t next_batch = 0;

  friend bool operator==(const LoaderState&, const LoaderState&) = default;
};

template <class S>
struct Batch {
  Tensor<S> images;                  // (n, C, H, W)
  std::vector<std::int64_t> labels;  // (n)
  std::int64_t index = -1;           // batch index within the epoch
};

// The RNG seed of epoch `epoch`: distinct epochs and seeds give unrelated permutations.
inline std::uint64_t epoch_seed(std::uint64_t seed, std::int64_t epoch) {
  const auto splitmix = [](std::uint64_t z) {
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  };
  return splitmix(splitmix(seed) ^ static_cast<std::uint64_t>(epoch));
}

// out = a uniformly random permutation of 0..out.size()-1, determined by (seed, epoch).
inline void epoch_permutation(std::span<std::int64_t> out, std::uint64_t seed, std::int64_t epoch) {
  std::iota(out.begin(), out.end(), std::int64_t{0});
  Rng rng(epoch_seed(seed, epoch));
  rng.shuffle(out.begin(), out.end());
}

inline std::vector<std::int64_t> epoch_permutation(std::int64_t n, std::uint64_t seed, std::int64_t epoch) {
  std::vector<std::int64_t> out(static_cast<std::size_t>(n));
  epoch_permutation(std::span<std::int64_t>(out), seed, epoch);
  return out;
}

template <class S>
class DataLoader {
 public:
  static constexpr int kSlots = 3;
  // Runs after a batch is assembled (on the prefetch thread when prefetching), e.g. for data
  // augmentation. It must be a function of (batch contents, batch.index, epoch) only, so that
  // prefetch on and off, and resumed runs, give the same batches.
  using Transform = std::function<void(Batch<S>& batch, std::int64_t epoch)>;

  DataLoader(const Dataset& dataset, LoaderOptions options, Transform transform = {})
      : ds_(dataset), opt_(options), transform_(std::move(transform)) {
    check_dataset(ds_);
    TESSERA_CHECK(ds_.size() > 0, ArgumentError, "DataLoader(", ds_.name, "): the dataset is empty");
    TESSERA_CHECK(opt_.batch_size > 0, ArgumentError, "DataLoader(", ds_.name, "): batch_size=", opt_.batch_size,
                  " must be positive");
    TESSERA_CHECK(opt_.world_size >= 1 && opt_.rank >= 0 && opt_.rank < opt_.world_size, ArgumentError,
                  "DataLoader(", ds_.name, "): rank=", opt_.rank, " world_size=", opt_.world_size,
                  " need 0 <= rank < world_size");
    const std::int64_t n = ds_.size();
    samples_ = opt_.drop_tail ? n / opt_.world_size : (n + opt_.world_size - 1) / opt_.world_size;
    TESSERA_CHECK(samples_ > 0, ArgumentError, "DataLoader(", ds_.name, "): drop_tail leaves no samples for ",
                  opt_.world_size, " ranks out of ", n);
    batches_ = opt_.drop_last ? samples_ / opt_.batch_size : (samples_ + opt_.batch_size - 1) / opt_.batch_size;
    perm_.resize(static_cast<std::size_t>(n));
    indices_.resize(static_cast<std::size_t>(samples_));
    reset(0, 0);
    if (opt_.prefetch) {
      const std::int64_t rows = std::min(opt_.batch_size, samples_);
      for (auto& slot : ring_) {
        slot.images.resize({rows, ds_.channels(), ds_.height(), ds_.width()});
        slot.labels.reserve(static_cast<std::size_t>(rows));
      }
      worker_ = std::thread([this] { worker_loop(); });
    }
  }

  ~DataLoader() {
    if (!worker_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    work_cv_.notify_all();
    worker_.join();
  }
  // The loader reads the dataset it was given until it is destroyed: never a temporary.
  DataLoader(Dataset&&, LoaderOptions, Transform = {}) = delete;
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // Begins epoch `epoch` at its first batch.
  void start_epoch(std::int64_t epoch) {
    TESSERA_CHECK(epoch >= 0, ArgumentError, "DataLoader::start_epoch: epoch=", epoch, " must be >= 0");
    reset(epoch, 0);
  }

  // Fills `out` with the next batch of the current epoch; false once the epoch is exhausted.
  bool next(Batch<S>& out) {
    if (!opt_.prefetch) {
      if (next_ >= batches_) return false;
      fill(out, next_, epoch_, true);
      ++next_;
      return true;
    }
    std::unique_lock<std::mutex> lock(mutex_);
    if (next_ >= batches_) return false;
    ready_cv_.wait(lock, [&] { return produced_ > next_ || error_; });
    if (produced_ <= next_) {
      std::exception_ptr error = std::exchange(error_, nullptr);  // the worker retries on the next call
      lock.unlock();
      work_cv_.notify_one();
      std::rethrow_exception(error);
    }
    Batch<S>& slot = ring_[static_cast<std::size_t>(next_ % kSlots)];
    out.images.swap(slot.images);
    out.labels.swap(slot.labels);
    out.index = slot.index;
    ++next_;
    lock.unlock();
    work_cv_.notify_one();
    return true;
  }

  std::int64_t batches_per_epoch() const { return batches_; }
  // This rank's samples per epoch, padding included: ceil(N / world_size).
  std::int64_t samples_per_epoch() const { return samples_; }
  // This rank's sample order in the current epoch (dataset indices, padding included).
  std::span<const std::int64_t> epoch_indices() const { return indices_; }

  LoaderState state() const { return {epoch_, next_}; }
  void set_state(const LoaderState& s) {
    TESSERA_CHECK(s.epoch >= 0 && s.next_batch >= 0 && s.next_batch <= batches_, ArgumentError,
                  "DataLoader::set_state: epoch=", s.epoch, " next_batch=", s.next_batch,
                  " need epoch >= 0 and 0 <= next_batch <= batches_per_epoch (", batches_, ")");
    reset(s.epoch, s.next_batch);
  }

  const LoaderOptions& options() const { return opt_; }
  const Dataset& dataset() const { return ds_; }

 private:
  // Moves to (epoch, batch). A no-op when already there, so start_epoch(0) right after
  // construction keeps the batches already prefetched.
  void reset(std::int64_t epoch, std::int64_t batch) {
    std::unique_lock<std::mutex> lock(mutex_, std::defer_lock);
    if (opt_.prefetch) {
      lock.lock();
      if (initialized_ && epoch == epoch_ && batch == next_ && !error_) return;
      ++generation_;  // a batch being filled now is for the old position: it will be discarded
      resetting_ = true;
      ready_cv_.wait(lock, [&] { return !busy_; });
      resetting_ = false;
    } else if (initialized_ && epoch == epoch_ && batch == next_) {
      return;
    }
    if (!initialized_ || epoch != epoch_) fill_indices(epoch);
    initialized_ = true;
    epoch_ = epoch;
    next_ = produced_ = batch;
    error_ = nullptr;
    if (lock.owns_lock()) {
      lock.unlock();
      work_cv_.notify_one();
    }
  }

  void fill_indices(std::int64_t epoch) {
    const std::int64_t n = ds_.size();
    if (opt_.shuffle) {
      epoch_permutation(std::span<std::int64_t>(perm_), opt_.seed, epoch);
    } else {
      std::iota(perm_.begin(), perm_.end(), std::int64_t{0});
    }
    for (std::int64_t i = 0; i < samples_; ++i) {
      indices_[static_cast<std::size_t>(i)] = perm_[static_cast<std::size_t>((opt_.rank + i * opt_.world_size) % n)];
    }
  }

  void fill(Batch<S>& out, std::int64_t b, std::int64_t epoch, bool parallel) const {
    const std::int64_t first = b * opt_.batch_size;
    const std::int64_t rows = std::min(opt_.batch_size, samples_ - first);
    const std::int64_t per = ds_.sample_numel();
    out.images.resize({rows, ds_.channels(), ds_.height(), ds_.width()});  // (n, C, H, W)
    out.labels.resize(static_cast<std::size_t>(rows));
    out.index = b;
    const float* src = ds_.images.data();
    S* dst = out.images.data();
    const std::int64_t* order = indices_.data() + first;
#pragma omp parallel for schedule(static) if (parallel && rows * per > (1 << 18))
    for (std::int64_t i = 0; i < rows; ++i) {
      const std::int64_t sample = order[i];
      const float* from = src + sample * per;
      S* to = dst + i * per;
      for (std::int64_t k = 0; k < per; ++k) to[k] = static_cast<S>(from[k]);
      out.labels[static_cast<std::size_t>(i)] = ds_.labels[static_cast<std::size_t>(sample)];
    }
    if (transform_) transform_(out, epoch);
  }

  void worker_loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      work_cv_.wait(lock, [&] { return stop_ || (!error_ && !resetting_ && produced_ < batches_ && produced_ - next_ < kSlots); });
      if (stop_) return;
      const std::int64_t b = produced_, epoch = epoch_;
      const std::uint64_t generation = generation_;
      busy_ = true;
      lock.unlock();
      std::exception_ptr error;
      try {
        fill(ring_[static_cast<std::size_t>(b % kSlots)], b, epoch, false);
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      busy_ = false;
      if (generation == generation_) {
        if (error) {
          error_ = error;
        } else {
          ++produced_;
        }
      }
      ready_cv_.notify_all();
    }
  }

  const Dataset& ds_;
  LoaderOptions opt_;
  Transform transform_;
  std::int64_t samples_ = 0;  // per rank, padding included
  std::int64_t batches_ = 0;
  std::vector<std::int64_t> perm_;     // (N) the epoch's permutation of the dataset
  std::vector<std::int64_t> indices_;  // (samples_) this rank's share of it

  // Consumer side: written only by the calling thread (under mutex_ when prefetching).
  bool initialized_ = false;
  std::int64_t epoch_ = 0;
  std::int64_t next_ = 0;

  // Prefetch: batches next_ .. produced_-1 are ready in ring_[i % kSlots]; the worker fills
  // batch produced_ while it is fewer than kSlots ahead of next_.
  std::array<Batch<S>, kSlots> ring_;
  std::mutex mutex_;
  std::condition_variable work_cv_;   // wakes the worker: a slot freed, a reset, or stop
  std::condition_variable ready_cv_;  // wakes the consumer: a batch ready, an error, or the worker idle
  std::int64_t produced_ = 0;
  std::uint64_t generation_ = 0;
  bool busy_ = false;       // the worker is filling a slot (outside the lock)
  bool resetting_ = false;  // reset() waits for the worker: it must not start another batch
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread worker_;
};

}  // namespace tessera
