// DataLoader<S>: batches of a Dataset (in memory) or of a SampleSource (e.g. an ImageFolder that
// decodes and augments files) in a per-epoch random order, split across data-parallel ranks,
// optionally prepared ahead on a pool of background worker threads.
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
// plain loader. A rank reads (decodes) only its own share.
// Elastic resume. With a global batch G = batch_size x world_size, batch i of every rank together
// holds the permutation's entries [i G, (i + 1) G): the same samples at every world size that
// divides G, only split differently. A position is therefore stored in global samples
// (TrainState::loader_next_sample = next_batch x G), and a run at another world size with the
// same G continues at batch next_sample / G (Trainer does this). Where N is not a multiple of the
// world size, the padding (or drop_tail's dropped samples) at the epoch's end depends on it.
// Global batches split unevenly (global_batch_size = G > 0, batch_size 0): batch i is the
// permutation's entries [i G, min((i + 1) G, N)) at every world size, and rank r takes those at
// offsets r, r + W, r + 2W, ... of it: ceil((g - r) / W) of a batch of g samples, so ranks may
// differ by one. No padding: the epoch covers each sample once; a last batch of fewer than W
// samples (some rank would get none) is dropped, as is any partial last batch with drop_last.
// Each batch carries `weight` = W n_r / g, the factor by which this rank's mean-loss gradient is
// scaled so that the average over the W ranks (an all_reduce(Avg)) is the gradient of the mean
// loss over the whole batch (the Trainer applies it). The position (epoch, batch) then means the
// same samples at every world size, which is what lets a data-parallel group change size between
// two steps (train/elastic.hpp) and continue the one-process trajectory.
// Batches. Batch i of an epoch holds this rank's samples [i * B, min((i + 1) * B, samples)):
// images (n, C, H, W) converted to S, labels (n). drop_last drops a final batch with n < B.
// A SampleSource writes sample k of epoch e as a function of (k, e) only (its augmentation is
// seeded by them), so the batches do not depend on the worker count, on prefetch, on resuming,
// or on how the samples are split across ranks.
//
// next(out) fills `out`, recycling its buffers: without prefetch it converts in place; with
// prefetch, `workers` background threads (torch's num_workers) fill a ring of
// max(3, 2 x workers) preallocated batches (torch's prefetch_factor 2), each worker a whole batch,
// and next() swaps `out` with the ready slot (O(1)); batches are returned in order whichever
// worker finishes first. After the first few batches neither allocates. The results are
// identical either way. An exception thrown while preparing batch i (e.g. by the transform, or a
// corrupt file) is rethrown from the next() that would have returned batch i; calling next()
// again retries it. The worker threads use no OpenMP team, so they do not compete with the
// training step's threads beyond their own cores; the destructor stops and joins them, also
// mid-epoch.
//
// Requires: the Dataset or SampleSource outlives the loader and is not modified while it exists.
// One thread calls the loader's methods (the worker threads are internal).
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
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/core/linkage.hpp"
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
  int workers = 1;         // background threads preparing batches when prefetching (torch's num_workers)
  // > 0: every batch is a global batch of this many samples split over the world_size ranks
  // (see "Global batches" above); batch_size must then be 0.
  std::int64_t global_batch_size = 0;
};

// The batch a loader's position counts in, and the world size it is split over: a position
// (epoch, next_batch) means the samples [next_batch x batch x world, ...) of the epoch's
// permutation. A global-batch loader's position is world-size independent: (G, 1).
inline std::int64_t position_batch(const LoaderOptions& o) {
  return o.global_batch_size > 0 ? o.global_batch_size : o.batch_size;
}
inline std::int64_t position_world(const LoaderOptions& o) {
  return o.global_batch_size > 0 ? 1 : o.world_size;
}

// Samples that are made on demand rather than held in a Dataset: decoded files, augmented crops.
// read(k, epoch, out) writes sample k (C * H * W floats, shape sample_shape()) and returns its
// label. It must depend on (k, epoch) only and be safe to call from several threads at once; it
// may return another sample's image and label in place of an unreadable one (see ImageFolder's
// skip_corrupt), as long as that too depends on k only.
class SampleSource {
 public:
  virtual ~SampleSource() = default;
  virtual std::int64_t size() const = 0;
  virtual std::array<std::int64_t, 3> sample_shape() const = 0;  // (C, H, W)
  virtual std::int64_t num_classes() const = 0;
  virtual std::string name() const = 0;
  virtual std::int64_t read(std::int64_t index, std::int64_t epoch, float* out) const = 0;
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
  std::vector<std::int64_t> labels;  // (n); a language model's batch: the (n T) next tokens
  std::int64_t index = -1;           // batch index within the epoch
  // This rank's share of the global batch, as the factor its mean-loss gradient is scaled by
  // (world_size x n / global batch samples; 1 when every rank holds equal shares).
  double weight = 1.0;
  // A language model's batch (data/text.hpp's TokenLoader) holds token ids in place of images:
  // (n, T) inputs whose targets, row-major, are `labels`. Empty for an image batch.
  Tensor<std::int64_t> tokens;
  std::int64_t samples() const { return tokens.numel() > 0 ? tokens.dim(0) : static_cast<std::int64_t>(labels.size()); }
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
  static constexpr int kSlots = 3;  // the ring's size with one worker
  // Runs after a batch is assembled (on a worker thread when prefetching), e.g. for data
  // augmentation. It must be a function of (batch contents, batch.index, epoch) only, so that
  // prefetch on and off, and resumed runs, give the same batches.
  using Transform = std::function<void(Batch<S>& batch, std::int64_t epoch)>;

  DataLoader(const Dataset& dataset, LoaderOptions options, Transform transform = {})
      : ds_(&dataset), opt_(options), transform_(std::move(transform)) {
    check_dataset(dataset);
    name_ = dataset.name;
    size_ = dataset.size();
    shape_ = {dataset.channels(), dataset.height(), dataset.width()};
    init();
  }
  DataLoader(const SampleSource& source, LoaderOptions options, Transform transform = {})
      : source_(&source), opt_(options), transform_(std::move(transform)) {
    name_ = source.name();
    size_ = source.size();
    shape_ = source.sample_shape();
    TESSERA_CHECK(shape_[0] > 0 && shape_[1] > 0 && shape_[2] > 0, ArgumentError, "DataLoader(", name_,
                  "): the source's samples have shape (", shape_[0], ", ", shape_[1], ", ", shape_[2],
                  "), need positive (C, H, W)");
    TESSERA_CHECK(source.num_classes() > 0, ArgumentError, "DataLoader(", name_, "): num_classes=",
                  source.num_classes(), " must be positive");
    init();
  }

  ~DataLoader() {
    if (workers_.empty()) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& worker : workers_) worker.join();
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
    const auto slot = static_cast<std::size_t>(next_ % static_cast<std::int64_t>(ring_.size()));
    ready_cv_.wait(lock, [&] { return ready_[slot] == next_; });
    if (errors_[slot]) {
      // Discard what the workers prepared after it; the next call retries batch next_.
      std::exception_ptr error = std::exchange(errors_[slot], nullptr);
      restart_locked(lock, epoch_, next_);
      lock.unlock();
      work_cv_.notify_all();
      std::rethrow_exception(error);
    }
    Batch<S>& ready = ring_[slot];
    out.images.swap(ready.images);
    out.labels.swap(ready.labels);
    out.index = ready.index;
    out.weight = ready.weight;
    ready_[slot] = -1;
    ++next_;
    lock.unlock();
    work_cv_.notify_all();
    return true;
  }

  std::int64_t batches_per_epoch() const { return batches_; }
  // This rank's samples per epoch, padding included: ceil(N / world_size).
  std::int64_t samples_per_epoch() const { return samples_; }
  // This rank's sample order in the current epoch (dataset indices, padding included).
  std::span<const std::int64_t> epoch_indices() const { return indices_; }
  // Samples in the whole data set (every rank's share), and its name.
  std::int64_t dataset_size() const { return size_; }
  const std::string& dataset_name() const { return name_; }

  LoaderState state() const { return {epoch_, next_}; }
  void set_state(const LoaderState& s) {
    TESSERA_CHECK(s.epoch >= 0 && s.next_batch >= 0 && s.next_batch <= batches_, ArgumentError,
                  "DataLoader::set_state: epoch=", s.epoch, " next_batch=", s.next_batch,
                  " need epoch >= 0 and 0 <= next_batch <= batches_per_epoch (", batches_, ")");
    reset(s.epoch, s.next_batch);
  }

  const LoaderOptions& options() const { return opt_; }

 private:
  void init() {
    TESSERA_CHECK(size_ > 0, ArgumentError, "DataLoader(", name_, "): the dataset is empty");
    TESSERA_CHECK(opt_.global_batch_size >= 0, ArgumentError, "DataLoader(", name_, "): global_batch_size=",
                  opt_.global_batch_size, " must be >= 0");
    TESSERA_CHECK(opt_.global_batch_size == 0 || opt_.batch_size == 0, ArgumentError, "DataLoader(", name_,
                  "): give batch_size (per rank) or global_batch_size (split over the ranks), not both (",
                  opt_.batch_size, " and ", opt_.global_batch_size, ")");
    TESSERA_CHECK(opt_.batch_size > 0 || opt_.global_batch_size > 0, ArgumentError, "DataLoader(", name_,
                  "): batch_size=", opt_.batch_size, " must be positive");
    TESSERA_CHECK(opt_.world_size >= 1 && opt_.rank >= 0 && opt_.rank < opt_.world_size, ArgumentError,
                  "DataLoader(", name_, "): rank=", opt_.rank, " world_size=", opt_.world_size,
                  " need 0 <= rank < world_size");
    TESSERA_CHECK(opt_.workers >= 1 && opt_.workers <= 256, ArgumentError, "DataLoader(", name_, "): workers=",
                  opt_.workers, " must be in [1, 256]");
    const std::int64_t n = size_;
    std::int64_t rows = 0;  // the most samples a batch of this rank holds
    if (opt_.global_batch_size > 0) {
      const std::int64_t g = opt_.global_batch_size, w = opt_.world_size, tail = n % g;
      TESSERA_CHECK(g >= w, ArgumentError, "DataLoader(", name_, "): global_batch_size=", g, " is smaller than the ",
                    w, " ranks it is split over (some rank would get no sample)");
      batches_ = n / g + (tail >= w && !opt_.drop_last ? 1 : 0);
      TESSERA_CHECK(batches_ > 0, ArgumentError, "DataLoader(", name_, "): ", n, " samples do not fill one global "
                    "batch of ", g, opt_.drop_last ? " (drop_last)" : "");
      batch_first_.assign(static_cast<std::size_t>(batches_ + 1), 0);
      for (std::int64_t b = 0; b < batches_; ++b) {
        const std::int64_t size = std::min(g, n - b * g);
        const std::int64_t mine = (size - opt_.rank + w - 1) / w;
        batch_first_[static_cast<std::size_t>(b + 1)] = batch_first_[static_cast<std::size_t>(b)] + mine;
        rows = std::max(rows, mine);
      }
      samples_ = batch_first_.back();
    } else {
      samples_ = opt_.drop_tail ? n / opt_.world_size : (n + opt_.world_size - 1) / opt_.world_size;
      TESSERA_CHECK(samples_ > 0, ArgumentError, "DataLoader(", name_, "): drop_tail leaves no samples for ",
                    opt_.world_size, " ranks out of ", n);
      batches_ = opt_.drop_last ? samples_ / opt_.batch_size : (samples_ + opt_.batch_size - 1) / opt_.batch_size;
      rows = std::min(opt_.batch_size, samples_);
    }
    perm_.resize(static_cast<std::size_t>(n));
    indices_.resize(static_cast<std::size_t>(samples_));
    reset(0, 0);
    if (opt_.prefetch) {
      ring_.resize(static_cast<std::size_t>(std::max(kSlots, 2 * opt_.workers)));
      ready_.assign(ring_.size(), -1);
      errors_.resize(ring_.size());
      for (auto& slot : ring_) {
        slot.images.resize({rows, shape_[0], shape_[1], shape_[2]});
        slot.labels.reserve(static_cast<std::size_t>(rows));
      }
      for (int w = 0; w < opt_.workers; ++w) workers_.emplace_back([this] { worker_loop(); });
    }
  }

  // Moves to (epoch, batch). A no-op when already there, so start_epoch(0) right after
  // construction keeps the batches already prefetched.
  void reset(std::int64_t epoch, std::int64_t batch) {
    if (!opt_.prefetch) {
      if (initialized_ && epoch == epoch_ && batch == next_) return;
      if (!initialized_ || epoch != epoch_) fill_indices(epoch);
      initialized_ = true;
      epoch_ = epoch;
      next_ = batch;
      return;
    }
    std::unique_lock<std::mutex> lock(mutex_);
    if (initialized_ && epoch == epoch_ && batch == next_) return;
    restart_locked(lock, epoch, batch);
    lock.unlock();
    work_cv_.notify_all();
  }

  // With mutex_ held: waits until no worker is filling a slot, drops every prepared batch and
  // makes batch `batch` of `epoch` the next one the workers take.
  void restart_locked(std::unique_lock<std::mutex>& lock, std::int64_t epoch, std::int64_t batch) {
    ++generation_;  // a batch being filled now is for the old position: it will be discarded
    resetting_ = true;
    ready_cv_.wait(lock, [&] { return busy_ == 0; });
    resetting_ = false;
    if (!initialized_ || epoch != epoch_) fill_indices(epoch);
    initialized_ = true;
    epoch_ = epoch;
    next_ = claimed_ = batch;
    std::fill(ready_.begin(), ready_.end(), -1);
    for (auto& e : errors_) e = nullptr;
  }

  void fill_indices(std::int64_t epoch) {
    const std::int64_t n = size_;
    if (opt_.shuffle) {
      epoch_permutation(std::span<std::int64_t>(perm_), opt_.seed, epoch);
    } else {
      std::iota(perm_.begin(), perm_.end(), std::int64_t{0});
    }
    if (opt_.global_batch_size > 0) {  // batch b: entries b G + r, b G + r + W, ... below (b + 1) G and N
      const std::int64_t g = opt_.global_batch_size;
      for (std::int64_t b = 0; b < batches_; ++b) {
        std::int64_t k = batch_first_[static_cast<std::size_t>(b)];
        for (std::int64_t e = b * g + opt_.rank; e < std::min((b + 1) * g, n); e += opt_.world_size)
          indices_[static_cast<std::size_t>(k++)] = perm_[static_cast<std::size_t>(e)];
      }
      return;
    }
    for (std::int64_t i = 0; i < samples_; ++i) {
      indices_[static_cast<std::size_t>(i)] = perm_[static_cast<std::size_t>((opt_.rank + i * opt_.world_size) % n)];
    }
  }

  void fill(Batch<S>& out, std::int64_t b, std::int64_t epoch, bool parallel) const {
    std::int64_t first = b * opt_.batch_size, rows = std::min(opt_.batch_size, samples_ - first);
    out.weight = 1.0;
    if (opt_.global_batch_size > 0) {
      first = batch_first_[static_cast<std::size_t>(b)];
      rows = batch_first_[static_cast<std::size_t>(b + 1)] - first;
      const std::int64_t g = std::min(opt_.global_batch_size, size_ - b * opt_.global_batch_size);
      out.weight = static_cast<double>(opt_.world_size * rows) / static_cast<double>(g);
    }
    const std::int64_t per = shape_[0] * shape_[1] * shape_[2];
    out.images.resize({rows, shape_[0], shape_[1], shape_[2]});  // (n, C, H, W)
    out.labels.resize(static_cast<std::size_t>(rows));
    out.index = b;
    S* dst = out.images.data();
    const std::int64_t* order = indices_.data() + first;
    if (ds_ != nullptr) {
      const float* src = ds_->images.data();
      // detail::parallel_for, not `omp parallel for ... if (...)`: libomp allocates at the start of
      // every `omp for` and in every region it serializes, and a steady step allocates nothing.
      detail::parallel_for(rows, parallel && rows * per > (1 << 18), [&](std::int64_t i) {
        const std::int64_t sample = order[i];
        const float* from = src + sample * per;
        S* to = dst + i * per;
        for (std::int64_t k = 0; k < per; ++k) to[k] = static_cast<S>(from[k]);
        out.labels[static_cast<std::size_t>(i)] = ds_->labels[static_cast<std::size_t>(sample)];
      });
    } else {
      const auto read_one = [&](std::int64_t i) {
        S* to = dst + i * per;
        std::int64_t label;
        if constexpr (std::is_same_v<S, float>) {
          label = source_->read(order[i], epoch, to);
        } else {
          thread_local std::vector<float> scratch;  // reused: no allocation after the first sample
          scratch.resize(static_cast<std::size_t>(per));
          label = source_->read(order[i], epoch, scratch.data());
          for (std::int64_t k = 0; k < per; ++k) to[k] = static_cast<S>(scratch[static_cast<std::size_t>(k)]);
        }
        TESSERA_CHECK(label >= 0 && label < source_->num_classes(), ArgumentError, "DataLoader(", name_,
                      "): sample ", order[i], " has label ", label, " outside [0, ", source_->num_classes(), ")");
        out.labels[static_cast<std::size_t>(i)] = label;
      };
      if (parallel && rows > 1) {
        // Decoding dominates here, so even a small batch is worth the threads (without prefetch).
        // An exception must not leave an OpenMP region: the first one is kept and rethrown.
        std::exception_ptr error;
#pragma omp parallel for schedule(dynamic, 1)
        for (std::int64_t i = 0; i < rows; ++i) {
          try {
            read_one(i);
          } catch (...) {
#pragma omp critical(tessera_loader_error)
            if (!error) error = std::current_exception();
          }
        }
        if (error) std::rethrow_exception(error);
      } else {
        for (std::int64_t i = 0; i < rows; ++i) read_one(i);
      }
    }
    if (transform_) transform_(out, epoch);
  }

  void worker_loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto slots = static_cast<std::int64_t>(ring_.size());
    while (true) {
      work_cv_.wait(lock, [&] { return stop_ || (!resetting_ && claimed_ < batches_ && claimed_ - next_ < slots); });
      if (stop_) return;
      const std::int64_t b = claimed_++, epoch = epoch_;
      const std::uint64_t generation = generation_;
      const auto slot = static_cast<std::size_t>(b % slots);
      ++busy_;
      lock.unlock();
      std::exception_ptr error;
      try {
        fill(ring_[slot], b, epoch, false);
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      --busy_;
      if (generation == generation_) {
        ready_[slot] = b;
        errors_[slot] = error;
      }
      ready_cv_.notify_all();
    }
  }

  const Dataset* ds_ = nullptr;           // the samples, when given a Dataset ...
  const SampleSource* source_ = nullptr;  // ... or made by a source
  LoaderOptions opt_;
  Transform transform_;
  std::string name_;
  std::int64_t size_ = 0;                   // N
  std::array<std::int64_t, 3> shape_{};     // (C, H, W)
  std::int64_t samples_ = 0;  // per rank, padding included
  std::int64_t batches_ = 0;
  std::vector<std::int64_t> perm_;     // (N) the epoch's permutation of the dataset
  std::vector<std::int64_t> indices_;  // (samples_) this rank's share of it
  std::vector<std::int64_t> batch_first_;  // global batches: batch b is indices_[batch_first_[b], batch_first_[b + 1])

  // Consumer side: written only by the calling thread (under mutex_ when prefetching).
  bool initialized_ = false;
  std::int64_t epoch_ = 0;
  std::int64_t next_ = 0;

  // Prefetch: batch b is prepared in ring_[b % slots]; ready_[slot] == b once it is (with
  // errors_[slot] set if preparing it threw). Workers take batches claimed_, claimed_ + 1, ...
  // while they are fewer than `slots` ahead of next_, so a slot is reused only after next()
  // has handed its batch out.
  std::vector<Batch<S>> ring_;
  std::vector<std::int64_t> ready_;
  std::vector<std::exception_ptr> errors_;
  std::mutex mutex_;
  std::condition_variable work_cv_;   // wakes the workers: a slot freed, a reset, or stop
  std::condition_variable ready_cv_;  // wakes the consumer: a batch ready, or the workers idle
  std::int64_t claimed_ = 0;
  std::uint64_t generation_ = 0;
  int busy_ = 0;            // workers filling a slot (outside the lock)
  bool resetting_ = false;  // a restart waits for the workers: they must not start another batch
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

// The float and double loaders are compiled once, in tessera_kernels (core/linkage.hpp): nearly
// every program has one, and its prefetch ring, workers and gather are its largest piece of data code.
#if TESSERA_CPU_KERNELS_EXTERN
extern template class DataLoader<float>;
extern template class DataLoader<double>;
#endif

}  // namespace tessera
