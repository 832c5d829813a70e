// Checkpoints: model parameters, buffers (BN running statistics) and optimizer state in one
// safetensors file, plus the training position (epoch, step, data-loader position, RNG state) in
// its metadata, with the state of every random generator a layer owns (Dropout masks), so that
// resuming continues exactly where the run stopped.
//
// Tensor names are the model's state_dict names ("layer1.0.conv1.weight", BatchNorm's
// "bn1.num_batches_tracked" as an I64 scalar) and the optimizer's
// ("optim.momentum_buffer.layer1.0.conv1.weight"); from Python:
//   tensors, meta = safetensors_io.load("ckpt.safetensors")   (tools/tessera_tools/safetensors_io.py,
//                                                             or safetensors.numpy.load_file)
//
// Loading is all-or-nothing: every name, shape and dtype is checked against the model first, and
// only when all match is anything copied. A missing, unexpected or mismatched tensor gives an
// IoError that lists every problem, so a wrong file never half-loads. Also refused, naming the file
// and what is wrong: a file that is not a Tessera checkpoint or is of a newer format, a NaN or
// infinity in any parameter, buffer or optimizer state (on save and on load, unless
// CheckpointOptions::allow_non_finite), and training-position metadata out of range.
//
// Format "tessera-checkpoint-2" (read: 1 and 2). Version 2 adds "train.ranks" and, under data
// parallelism, every rank's random generators: rank 0's under the layer's name ("3.rng"), rank r's
// under "rank<r>.3.rng". Ranks seeded differently (per-rank Dropout masks or augmentation streams)
// then resume exactly. save_checkpoint with a CheckpointGroup (any Communicator) gathers the
// generators to rank 0, which writes the file; load_checkpoint with the group gives each rank its
// own streams and fails on every rank if any rank cannot load. Version 1 files hold one set of
// generators, which every rank loads.
//
// Elastic resume. A checkpoint taken by N ranks resumes on M ranks when the global batch (samples
// per optimizer step, all ranks together: train.loader_batch_size x train.loader_world_size) is a
// multiple of M; check_resume_world_size decides, and refuses any other M naming the file, both
// world sizes and the batch. What the file holds is rank-independent: parameters and buffers are
// replicated; optimizer state is whole tensors (Zero1Optimizer gathers its shards on save through
// the optional optimizer members below and re-shards them for M ranks on load); the position in
// the epoch is also stored in global samples ("train.loader_next_sample"), which the Trainer turns
// into a batch index for M ranks. With a fixed global batch, batch i of the epoch covers the same
// samples at every world size (DistributedSampler's interleaved split), so a resumed run matches
// an uninterrupted one up to floating-point summation order. Random generators: ranks
// 0 .. min(N, M) - 1 take their own streams back; ranks M .. N - 1's streams are dropped; ranks
// N .. M - 1 keep the generators their program constructed (derived from its seed). A model with
// Dropout therefore continues with other masks than an uninterrupted run (which had N streams and
// another split of each batch): statistically equivalent, not equal. A strategy's per-rank state
// (DataParallel's TopK residuals) is not in this file: the Trainer writes it beside it, one file
// per rank (train/trainer.hpp), and starts it afresh at another world size.
//
// Optional optimizer members (Zero1Optimizer and FullyShardedOptimizer have them), called on every
// rank of the group:
//   checkpoint_gather()       collective, before a save: make visit_state present whole tensors
//   checkpoint_before_load()  collective, before a load reads the file: give the model's tensors
//                             their shapes (FullyShardedDataParallel's stage 3 releases them)
//   checkpoint_scatter()      after a successful load: take this rank's part of what visit_state loaded
//   checkpoint_release()      after every save and load, also a failed one: free the whole tensors
// FullyShardedDataParallel also writes sharded checkpoints, a directory with one file per rank
// (train/sharded_checkpoint.hpp), which the Trainer chooses by FullyShardedOptions.
#pragma once

#include <algorithm>
#include <bit>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "tessera/comm/communicator.hpp"
#include "tessera/core/concepts.hpp"
#include "tessera/core/linkage.hpp"
#include "tessera/core/parameter.hpp"
#include "tessera/core/random.hpp"
#include "tessera/io/safetensors.hpp"

namespace tessera {

// Where training stands. Stored in the file's metadata as decimal strings.
struct TrainState {
  std::int64_t epoch = 0;              // epochs completed
  std::int64_t global_step = 0;        // optimizer steps taken
  std::int64_t loader_epoch = 0;       // the data loader's position: epoch being read ...
  std::int64_t loader_next_batch = 0;  // ... and the next batch index within it
  // What the position means: resuming with another batch size, seed, dataset or world size would
  // silently read other samples, so the Trainer checks these against its loader (0 = unknown).
  std::int64_t loader_batch_size = 0, loader_seed = 0, loader_samples = 0, loader_world_size = 0;
  // The same position in global samples: the epoch's samples consumed by all ranks together
  // (loader_next_batch x loader_batch_size x loader_world_size), the rank-independent form an
  // elastic resume re-splits. save_checkpoint fills it in when 0; absent in older files (derived).
  std::int64_t loader_next_sample = 0;
};

struct CheckpointOptions {
  // Save and load NaN and infinite values without complaint (to keep or inspect a diverged run).
  // By default both refuse them, naming the tensor and the first bad element.
  bool allow_non_finite = false;
};

// The ranks that take (or resume from) a checkpoint together: this rank, their number, and an
// all_gather of int64 values among them. Built from any Communicator, which it refers to (the
// communicator must outlive it); default: one process, rank 0 of 1. Implicit, so that
// save_checkpoint(path, model, optimizer, state, comm) reads naturally.
class CheckpointGroup {
 public:
  CheckpointGroup() = default;
  template <Communicator C>
  CheckpointGroup(C& comm)  // NOLINT(google-explicit-constructor)
      : rank_(comm.rank()), size_(comm.size()), all_gather_([&comm](std::span<const std::int64_t> in, std::span<std::int64_t> out) {
          comm.all_gather(in, out);
        }) {}
  int rank() const { return rank_; }
  int size() const { return size_; }
  // Every rank passes the same number of values; returns them concatenated in rank order.
  std::vector<std::int64_t> all_gather(std::span<const std::int64_t> in) const {
    std::vector<std::int64_t> out(in.size() * static_cast<std::size_t>(size_));
    if (size_ == 1) std::copy(in.begin(), in.end(), out.begin());
    else all_gather_(in, out);
    return out;
  }
  // The same into `out` (in.size() x size() values), as a Communicator's all_gather.
  void all_gather(std::span<const std::int64_t> in, std::span<std::int64_t> out) const {
    TESSERA_CHECK(out.size() == in.size() * static_cast<std::size_t>(size_), ArgumentError,
                  "CheckpointGroup::all_gather: out holds ", out.size(), " values, not ", in.size(), " x ", size_);
    if (size_ == 1) std::copy(in.begin(), in.end(), out.begin());
    else all_gather_(in, out);
  }

 private:
  int rank_ = 0, size_ = 1;
  std::function<void(std::span<const std::int64_t>, std::span<std::int64_t>)> all_gather_;
};

namespace detail {
// The ranks of `group` whose part of a save or load failed, as "1, 3" (empty: none), learned by
// every rank with one all_gather of this rank's flag: so that all ranks throw or none does.
TESSERA_LINKAGE std::string ranks_that_failed(const CheckpointGroup& group, bool this_rank_failed);
}  // namespace detail

// The one place that decides whether a run at world size `now` may resume from a checkpoint taken
// at world size `saved` (`what` names the file, or says "the checkpoint"). `global_batch` is the
// saved run's samples per optimizer step over all ranks (0: not recorded). Another world size is
// an elastic resume, allowed when the global batch splits evenly over `now` ranks (or was not
// recorded: then there is no data position to re-split); otherwise ArgumentError naming the file,
// both world sizes, the batch and the world sizes that would work.
TESSERA_LINKAGE void check_resume_world_size(const std::string& what, std::int64_t saved, std::int64_t now,
                                    std::int64_t global_batch);

inline constexpr int kCheckpointVersion = 2;

namespace detail {

// Index of the first NaN or infinity among the n IEEE values (float or double) at `data` (any
// alignment), or -1. One pass over the data: a value is non-finite iff its bits without the sign
// are >= those of +Inf (exponent all ones), and the maximum of those over a block of 4096 values
// is an unsigned max-reduction the compiler vectorizes (a constant trip count, so also at -O2);
// only a block whose maximum reaches +Inf is searched again for the position.
template <class S>
std::int64_t first_non_finite(const void* data, std::size_t n) {
  static_assert(std::is_same_v<S, float> || std::is_same_v<S, double>);
  using U = std::conditional_t<sizeof(S) == 8, std::uint64_t, std::uint32_t>;
  constexpr U inf = sizeof(S) == 8 ? static_cast<U>(0x7FF0000000000000ull) : static_cast<U>(0x7F800000u);
  constexpr U magnitude = static_cast<U>(~U{0} >> 1);
  constexpr std::size_t kBlock = 4096;
  const auto* bytes = static_cast<const unsigned char*>(data);
  auto bits = [bytes](std::size_t i) {
    U u;
    std::memcpy(&u, bytes + i * sizeof(U), sizeof(U));
    return static_cast<U>(u & magnitude);
  };
  auto search = [&](std::size_t begin, std::size_t end) -> std::int64_t {
    for (std::size_t i = begin; i < end; ++i)
      if (bits(i) >= inf) return static_cast<std::int64_t>(i);
    return -1;
  };
  std::size_t begin = 0;
  for (; begin + kBlock <= n; begin += kBlock) {
    U most = 0;
    for (std::size_t i = 0; i < kBlock; ++i) most = std::max(most, bits(begin + i));
    if (most >= inf) return search(begin, begin + kBlock);
  }
  return search(begin, n);
}

// "tensor 'fc.weight' (4, 64) holds NaN at index 17 = [0, 17]", or empty if all values are finite.
template <class S>
std::string non_finite_report(const std::string& name, const Shape& shape, const void* data) {
  const std::int64_t at = first_non_finite<S>(data, static_cast<std::size_t>(shape.numel()));
  if (at < 0) return {};
  S value;
  std::memcpy(&value, static_cast<const unsigned char*>(data) + static_cast<std::size_t>(at) * sizeof(S), sizeof(S));
  std::string index = "[";
  std::int64_t rest = at;
  std::vector<std::int64_t> digits(static_cast<std::size_t>(shape.rank()));
  for (int d = shape.rank() - 1; d >= 0; --d) {
    digits[static_cast<std::size_t>(d)] = rest % shape[d];
    rest /= shape[d];
  }
  for (std::size_t d = 0; d < digits.size(); ++d) index += (d ? ", " : "") + std::to_string(digits[d]);
  index += "]";
  return cat("tensor '", name, "' ", shape, " holds ", std::isnan(value) ? "NaN" : value > 0 ? "+Inf" : "-Inf",
             " at flat index ", at, " = ", index);
}

inline std::string rng_to_string(const Rng::State& s) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "%016" PRIx64 " %016" PRIx64 " %016" PRIx64 " %016" PRIx64 " %d %a", s.words[0],
                s.words[1], s.words[2], s.words[3], s.has_spare_normal ? 1 : 0, s.spare_normal);
  return buf;
}

inline bool rng_from_string(const std::string& text, Rng::State& s) {
  int spare = 0;
  const int n = std::sscanf(text.c_str(), "%" SCNx64 " %" SCNx64 " %" SCNx64 " %" SCNx64 " %d %la", &s.words[0],
                            &s.words[1], &s.words[2], &s.words[3], &spare, &s.spare_normal);
  s.has_spare_normal = spare != 0;
  return n == 6;
}

// A save refuses NaN and infinities (unless options allow them), naming the tensor and element.
template <class S>
void check_finite_for_save(const char* who, const std::string& path, const CheckpointOptions& options,
                           const std::string& name, const Tensor<S, Cpu>& t) {
  if constexpr (std::is_floating_point_v<S>) {
    if (options.allow_non_finite) return;
    const std::string bad = non_finite_report<S>(name, t.shape(), t.data());
    TESSERA_CHECK(bad.empty(), ArgumentError, who, ": '", path, "': ", bad,
                  "; nothing was written (a diverged run? pass CheckpointOptions{.allow_non_finite = true} to "
                  "save it anyway)");
  }
}

struct CheckpointSaver {
  SafetensorsWriter& writer;
  const CheckpointOptions& options;
  std::string path;
  template <class P>
  void parameter(const std::string& name, P& p) {
    buffer(name, p.value);
  }
  template <class S, class D>
  void buffer(const std::string& name, Tensor<S, D>& t) {
    if constexpr (D::host_accessible) {
      check_finite(name, t);
      writer.add(name, t);
    } else {
      const Tensor<S, Cpu> host = to_host(t);  // device memory: checked and written from one host copy
      check_finite(name, host);
      writer.add(name, host);
    }
  }
  // BatchNorm's num_batches_tracked: an I64 scalar tensor, as in torch's state_dict.
  void integer_buffer(const std::string& name, std::int64_t& v) {
    writer.add_raw(name, DType::I64, Shape{}, &v, sizeof v);
  }
  void integer(const std::string& name, std::int64_t& v) { writer.set_metadata(name, std::to_string(v)); }
  void optional_integer(const std::string& name, std::int64_t& v) { integer(name, v); }
  // Generators are written by save_checkpoint itself (every rank's, under per-rank names).
  void rng(const std::string&, Rng&) {}

  template <class S>
  void check_finite(const std::string& name, const Tensor<S, Cpu>& t) {
    check_finite_for_save("save_checkpoint", path, options, name, t);
  }
};

// The generators a model owns, in visit order (the same on every rank of a data-parallel group).
struct RngCollector {
  std::vector<std::pair<std::string, Rng*>> rngs;
  template <class P>
  void parameter(const std::string&, P&) {}
  template <class T>
  void buffer(const std::string&, T&) {}
  void integer_buffer(const std::string&, std::int64_t&) {}
  void integer(const std::string&, std::int64_t&) {}
  void optional_integer(const std::string&, std::int64_t&) {}
  void rng(const std::string& name, Rng& r) { rngs.emplace_back(name, &r); }
};

// The metadata name of rank r's copy of generator `name`: rank 0's keeps the layer's own name
// (what version 1 files hold and single-process readers look up), rank r > 0's is "rank<r>.name".
inline std::string rank_rng_key(int rank, const std::string& name) {
  return rank == 0 ? name : "rank" + std::to_string(rank) + "." + name;
}

// Generator states as int64 words for all_gather: 4 state words, has_spare_normal, spare_normal's bits.
inline constexpr std::size_t kRngWords = 6;
inline void pack_rng(const Rng::State& s, std::int64_t* out) {
  for (int k = 0; k < 4; ++k) out[k] = std::bit_cast<std::int64_t>(s.words[static_cast<std::size_t>(k)]);
  out[4] = s.has_spare_normal ? 1 : 0;
  out[5] = std::bit_cast<std::int64_t>(s.spare_normal);
}
inline Rng::State unpack_rng(const std::int64_t* in) {
  Rng::State s;
  for (int k = 0; k < 4; ++k) s.words[static_cast<std::size_t>(k)] = std::bit_cast<std::uint64_t>(in[k]);
  s.has_spare_normal = in[4] != 0;
  s.spare_normal = std::bit_cast<double>(in[5]);
  return s;
}
// FNV-1a of the generator names: ranks whose models differ in their generators are caught.
inline std::int64_t names_hash(const std::vector<std::pair<std::string, Rng*>>& rngs) {
  std::uint64_t h = 1469598103934665603ull;
  for (const auto& [name, r] : rngs)
    for (char c : name + '\n') h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return std::bit_cast<std::int64_t>(h);
}

// Two passes over the same visit: first `check` collects every problem, then `copy` loads.
struct CheckpointLoader {
  const SafetensorsFile& file;
  bool copy = false;
  std::string rng_prefix;  // "" or "rank<r>.": whose generators this rank takes
  bool keep_rngs = false;  // elastic resume on a rank the saving run did not have: keep its own
  CheckpointOptions options{};
  std::vector<std::string> problems;
  std::set<std::string> seen;
  std::map<std::string, std::int64_t> integers;  // every integer metadata entry parsed (range checks)

  template <class P>
  void parameter(const std::string& name, P& p) {
    buffer(name, p.value);
  }
  template <class S, class D>
  void buffer(const std::string& name, Tensor<S, D>& t) {
    seen.insert(name);
    if (!file.has(name)) {
      problems.push_back("missing tensor '" + name + "' (shape " + t.shape().str() + ")");
      return;
    }
    const TensorInfo& info = file.info(name);
    if (info.shape != t.shape() || info.dtype != dtype_of<S>()) {
      problems.push_back(cat("tensor '", name, "': file has ", dtype_name(info.dtype), " ", info.shape,
                             ", model has ", dtype_name(dtype_of<S>()), " ", t.shape()));
      return;
    }
    if constexpr (std::is_floating_point_v<S>) {
      if (!copy && !options.allow_non_finite) {
        std::string bad = non_finite_report<S>(name, info.shape, file.raw(name));
        if (!bad.empty())
          problems.push_back(bad + " (pass CheckpointOptions{.allow_non_finite = true} to load it anyway)");
      }
    }
    if (copy) file.read_into(name, t);
  }
  // Absent in checkpoints written before BatchNorm kept it: the counter then stays as it is.
  void integer_buffer(const std::string& name, std::int64_t& v);
  void integer(const std::string& name, std::int64_t& v);
  // Absent in files written before the entry existed: the value stays as it is.
  void optional_integer(const std::string& name, std::int64_t& v);
  void rng(const std::string& name, Rng& r);
};

// The training position's entries (metadata, in every checkpoint format).
void visit_train_state(TrainState& state, auto& v) {
  v.integer("train.epoch", state.epoch);
  v.integer("train.global_step", state.global_step);
  v.integer("train.loader_epoch", state.loader_epoch);
  v.integer("train.loader_next_batch", state.loader_next_batch);
  v.integer("train.loader_batch_size", state.loader_batch_size);
  v.integer("train.loader_seed", state.loader_seed);
  v.integer("train.loader_samples", state.loader_samples);
  v.integer("train.loader_world_size", state.loader_world_size);
  v.optional_integer("train.loader_next_sample", state.loader_next_sample);
}

template <class Model, class Optimizer>
void visit_all(Model& model, Optimizer& optimizer, TrainState& state, auto& v) {
  static_assert(check_visitable<Model>());
  model.visit(v, "");
  optimizer.visit_state(v);
  visit_train_state(state, v);
}

// The file's format version: 1 or 2. Anything else is an IoError that says what the file is.
TESSERA_LINKAGE int checkpoint_version(const SafetensorsFile& file);

// Training-position metadata out of range, as problems naming the key (the file is named by the
// caller's header). `ints` holds what the check pass parsed.
TESSERA_LINKAGE void check_train_metadata(const std::map<std::string, std::int64_t>& ints, std::vector<std::string>& problems);
// load_checkpoint's error: every problem when there are few; a checkpoint of another model has one
// per tensor (ResNet-50's into LeNet-5: over 200 lines), so past kMaxListedProblems the list stops
// and a count by kind says what it means.
inline constexpr std::size_t kMaxListedProblems = 12;
TESSERA_LINKAGE std::string checkpoint_problems_text(const std::string& path, const std::vector<std::string>& problems);

// Calls the optional optimizer members described at the top of this file.
template <class Optimizer>
void optimizer_checkpoint_gather(Optimizer& o) {
  if constexpr (requires { o.checkpoint_gather(); }) o.checkpoint_gather();
}
template <class Optimizer>
void optimizer_checkpoint_before_load(Optimizer& o) {
  if constexpr (requires { o.checkpoint_before_load(); }) o.checkpoint_before_load();
}
template <class Optimizer>
void optimizer_checkpoint_scatter(Optimizer& o) {
  if constexpr (requires { o.checkpoint_scatter(); }) o.checkpoint_scatter();
}
template <class Optimizer>
struct ReleaseCheckpointState {
  Optimizer& o;
  ~ReleaseCheckpointState() {
    if constexpr (requires { o.checkpoint_release(); }) o.checkpoint_release();
  }
};

}  // namespace detail

// Saves model, optimizer state and training position to `path` (atomically). With a group of N > 1
// ranks every rank calls it: the ranks' generator states are gathered to rank 0, which writes the
// file; all ranks return or all throw. Refuses non-finite values unless options allow them.
template <class Model, class Optimizer>
void save_checkpoint(const std::string& path, Model& model, Optimizer& optimizer, TrainState state,
                     const CheckpointGroup& group = {}, const CheckpointOptions& options = {}) {
  if (state.loader_next_sample == 0)
    state.loader_next_sample = state.loader_next_batch * state.loader_batch_size * state.loader_world_size;
  detail::ReleaseCheckpointState<Optimizer> release{optimizer};
  detail::optimizer_checkpoint_gather(optimizer);  // collective (Zero1Optimizer: the shards to whole tensors)
  detail::RngCollector collected;
  {
    TrainState scratch;
    detail::visit_all(model, optimizer, scratch, collected);
  }
  const auto& rngs = collected.rngs;
  const int ranks = group.size();
  std::vector<std::int64_t> mine(rngs.size() * detail::kRngWords);
  for (std::size_t k = 0; k < rngs.size(); ++k) detail::pack_rng(rngs[k].second->state(), &mine[k * detail::kRngWords]);
  std::vector<std::int64_t> all = mine;
  if (ranks > 1) {
    // Every rank must hold the same generators (the same model): otherwise the gather below would
    // mix them up. All ranks see all heads, so all throw the same error.
    const std::int64_t head[2] = {static_cast<std::int64_t>(rngs.size()), detail::names_hash(rngs)};
    const auto heads = group.all_gather(head);
    for (int r = 1; r < ranks; ++r)
      TESSERA_CHECK(heads[2 * static_cast<std::size_t>(r)] == heads[0] && heads[2 * static_cast<std::size_t>(r) + 1] == heads[1],
                    ArgumentError, "save_checkpoint: '", path, "': rank ", r, " has ", heads[2 * static_cast<std::size_t>(r)],
                    " random generator(s) and rank 0 has ", heads[0],
                    " (or their names differ): the ranks' models are not the same");
    all = group.all_gather(mine);
  }
  std::exception_ptr failure;
  if (group.rank() == 0) {
    try {
      SafetensorsWriter writer;
      detail::CheckpointSaver saver{writer, options, path};
      detail::visit_all(model, optimizer, state, saver);
      for (int r = 0; r < ranks; ++r)
        for (std::size_t k = 0; k < rngs.size(); ++k)
          writer.set_metadata(detail::rank_rng_key(r, rngs[k].first),
                              detail::rng_to_string(detail::unpack_rng(
                                  &all[(static_cast<std::size_t>(r) * rngs.size() + k) * detail::kRngWords])));
      writer.set_metadata("train.ranks", std::to_string(ranks));
      writer.set_metadata("format", "tessera-checkpoint-" + std::to_string(kCheckpointVersion));
      writer.write(path);
    } catch (...) {
      failure = std::current_exception();
    }
  }
  if (ranks > 1) {
    const std::int64_t ok = failure ? 0 : 1;
    const auto oks = group.all_gather(std::span<const std::int64_t>(&ok, 1));
    if (!failure && oks[0] == 0)
      throw IoError(detail::cat("save_checkpoint: rank 0 could not write '", path, "' (its error says why)"));
  }
  if (failure) std::rethrow_exception(failure);
}

template <class Model, class Optimizer>
void save_checkpoint(const std::string& path, Model& model, Optimizer& optimizer, TrainState state,
                     const CheckpointOptions& options) {
  save_checkpoint(path, model, optimizer, state, CheckpointGroup{}, options);
}

// Loads what save_checkpoint wrote, all or nothing. With a group, every rank calls it, reads the
// file and takes its own generators; if any rank cannot load, every rank throws and none loads.
template <class Model, class Optimizer>
TrainState load_checkpoint(const std::string& path, Model& model, Optimizer& optimizer,
                           const CheckpointGroup& group = {}, const CheckpointOptions& options = {}) {
  std::optional<SafetensorsFile> file;
  TrainState state;
  std::string rng_prefix;
  bool keep_rngs = false;
  detail::ReleaseCheckpointState<Optimizer> release{optimizer};
  // Collective, so on every rank before anything that can fail on some ranks only.
  detail::optimizer_checkpoint_before_load(optimizer);  // FullyShardedOptimizer: the model's tensors back
  std::exception_ptr failure;
  try {
    file.emplace(SafetensorsFile::load(path));
    const int version = detail::checkpoint_version(*file);
    detail::RngCollector collected;
    detail::visit_all(model, optimizer, state, collected);
    std::vector<std::string> problems;
    if (version >= 2) {
      // Whose generators: a version-2 file holds every rank's. At another world size (an elastic
      // resume, if check_resume_world_size allows it) ranks the saving run had take theirs and
      // the others keep their own.
      detail::CheckpointLoader ranks_entry{*file}, batch_entries{*file};
      std::int64_t saved_ranks = 0, batch = 0, world = 0;  // (the check pass only parses into .integers)
      ranks_entry.integer("train.ranks", saved_ranks);
      problems = ranks_entry.problems;
      detail::check_train_metadata(ranks_entry.integers, problems);
      // The global batch, when recorded (problems with these entries are the full check's to report).
      batch_entries.integer("train.loader_batch_size", batch);
      batch_entries.integer("train.loader_world_size", world);
      const bool batch_known = batch_entries.integers.count("train.loader_batch_size") &&
                               batch_entries.integers.count("train.loader_world_size") &&
                               batch_entries.integers.at("train.loader_batch_size") > 0 &&
                               batch_entries.integers.at("train.loader_world_size") > 0;
      if (problems.empty()) {
        saved_ranks = ranks_entry.integers.at("train.ranks");
        check_resume_world_size("'" + path + "'", saved_ranks, group.size(),
                                batch_known ? batch_entries.integers.at("train.loader_batch_size") *
                                                  batch_entries.integers.at("train.loader_world_size")
                                            : 0);
        keep_rngs = group.rank() >= saved_ranks;
      }
      if (group.rank() > 0) rng_prefix = "rank" + std::to_string(group.rank()) + ".";
    }
    detail::CheckpointLoader check{*file, false, rng_prefix, keep_rngs, options};
    detail::visit_all(model, optimizer, state, check);
    for (const auto& name : file->names())
      if (!check.seen.count(name)) check.problems.push_back("unexpected tensor '" + name + "' (not in this model)");
    detail::check_train_metadata(check.integers, problems);
    problems.insert(problems.begin(), check.problems.begin(), check.problems.end());
    if (!problems.empty()) throw IoError(detail::checkpoint_problems_text(path, problems));
  } catch (...) {
    failure = std::current_exception();
  }
  if (group.size() > 1) {
    const std::string failed = detail::ranks_that_failed(group, failure != nullptr);
    if (!failure && !failed.empty())
      throw IoError(detail::cat("load_checkpoint: '", path, "': rank(s) ", failed,
                                " could not load it (their errors say why); nothing was loaded on any rank"));
  }
  if (failure) std::rethrow_exception(failure);
  detail::CheckpointLoader copy{*file, true, rng_prefix, keep_rngs, options};
  detail::visit_all(model, optimizer, state, copy);
  detail::optimizer_checkpoint_scatter(optimizer);  // local (Zero1Optimizer: this rank's part of each tensor)
  if (!file->metadata().count("train.loader_next_sample"))
    state.loader_next_sample = state.loader_next_batch * state.loader_batch_size * state.loader_world_size;
  return state;
}

template <class Model, class Optimizer>
TrainState load_checkpoint(const std::string& path, Model& model, Optimizer& optimizer,
                           const CheckpointOptions& options) {
  return load_checkpoint(path, model, optimizer, CheckpointGroup{}, options);
}

#if TESSERA_HEADER_DEFINITIONS

TESSERA_LINKAGE auto detail::ranks_that_failed(const CheckpointGroup& group, bool this_rank_failed) -> std::string {
  const std::int64_t ok = this_rank_failed ? 0 : 1;
  const auto oks = group.all_gather(std::span<const std::int64_t>(&ok, 1));
  std::string failed;
  for (int r = 0; r < group.size(); ++r)
    if (oks[static_cast<std::size_t>(r)] == 0) failed += (failed.empty() ? "" : ", ") + std::to_string(r);
  return failed;
}

TESSERA_LINKAGE void check_resume_world_size(const std::string& what, std::int64_t saved, std::int64_t now,
                                    std::int64_t global_batch) {
  TESSERA_CHECK(now >= 1, ArgumentError, "resume: ", what, ": world size ", now, " must be >= 1");
  if (saved == now || global_batch <= 0 || global_batch % now == 0) return;
  std::string fits;  // the first 12 divisors, and the batch itself
  std::int64_t listed = 0, last = 0;
  for (std::int64_t d = 1; d <= std::min<std::int64_t>(global_batch, 1 << 20) && listed < 12; ++d)
    if (global_batch % d == 0) {
      fits += (listed++ ? ", " : "") + std::to_string(d);
      last = d;
    }
  if (last != global_batch) fits += ", ..., " + std::to_string(global_batch);
  throw ArgumentError(detail::cat("resume: ", what, " was saved by a run at world size ", saved, " (", saved,
                          saved == 1 ? " rank" : " ranks", ") with a global batch of ", global_batch, " (",
                          global_batch % saved == 0 ? std::to_string(global_batch / saved) : std::string("?"),
                          " per rank); this run has world size ", now, ", which does not divide the global batch ",
                          global_batch, ": an elastic resume keeps the global batch, so resume at a world size "
                          "that divides it (", fits, "), or read only the weights with load_state_dict(path, model, "
                          "/*strict=*/false)"));
}

TESSERA_LINKAGE auto detail::checkpoint_version(const SafetensorsFile& file) -> int {
  const std::string& path = file.path();
  auto it = file.metadata().find("format");
  TESSERA_CHECK(it != file.metadata().end(), IoError, "load_checkpoint: '", path,
                "' is a safetensors file without Tessera checkpoint metadata (format missing); was it written by "
                "save_state_dict or by another program? (load_state_dict reads weights from such files)");
  const std::string& format = it->second;
  TESSERA_CHECK(format != "pt", IoError, "load_checkpoint: '", path,
                "' is a state dict (format 'pt', as save_state_dict and safetensors.torch write it), not a "
                "Tessera checkpoint: it has no optimizer state or training position; read it with load_state_dict");
  const std::string prefix = "tessera-checkpoint-";
  int version = 0;
  if (format.size() > prefix.size() && format.size() <= prefix.size() + 6 && format.compare(0, prefix.size(), prefix) == 0 &&
      std::all_of(format.begin() + static_cast<std::ptrdiff_t>(prefix.size()), format.end(),
                  [](char c) { return c >= '0' && c <= '9'; }))
    version = std::stoi(format.substr(prefix.size()));
  TESSERA_CHECK(version >= 1, IoError, "load_checkpoint: '", path, "' has format '", format,
                "', which is not a Tessera checkpoint format (this build reads tessera-checkpoint-1 to ",
                prefix, kCheckpointVersion, ")");
  TESSERA_CHECK(version <= kCheckpointVersion, IoError, "load_checkpoint: '", path, "': format '", format,
                "' is newer than this build reads (", prefix, kCheckpointVersion,
                "); load it with the newer Tessera that wrote it");
  return version;
}

TESSERA_LINKAGE auto detail::checkpoint_problems_text(const std::string& path, const std::vector<std::string>& problems)
    -> std::string {
  std::string msg = "load_checkpoint: '" + path + "': nothing was loaded:";
  std::size_t missing = 0, unexpected = 0;
  for (std::size_t i = 0; i < problems.size(); ++i) {
    missing += problems[i].rfind("missing tensor ", 0) == 0;
    unexpected += problems[i].rfind("unexpected tensor ", 0) == 0;
    if (i < kMaxListedProblems || problems.size() <= kMaxListedProblems + 1) msg += "\n  - " + problems[i];
  }
  if (problems.size() > kMaxListedProblems + 1)
    msg += cat("\n  ... and ", problems.size() - kMaxListedProblems, " more: ", problems.size(), " problems in all, ",
               missing, " tensors of this model missing from the file and ", unexpected,
               " in the file not in this model", 2 * (missing + unexpected) >= problems.size()
                   ? " (is the checkpoint of another model? tools/read_checkpoint.py lists what it holds)"
                   : "");
  return msg;
}

TESSERA_LINKAGE auto detail::check_train_metadata(const std::map<std::string, std::int64_t>& ints, std::vector<std::string>& problems) -> void {
  auto get = [&](const char* key) -> std::optional<std::int64_t> {
    auto it = ints.find(key);
    return it == ints.end() ? std::nullopt : std::optional<std::int64_t>(it->second);
  };
  auto bad = [&](const std::string& key, std::int64_t value, const std::string& why) {
    problems.push_back(cat("metadata entry '", key, "' = ", value, " is out of range: ", why));
  };
  bool ok = true;
  // Counters of the optimizer, the loss scaler and the parameter server (under any prefix): a
  // negative one is a corrupt or edited file, which loaded as is would act as a fresh start
  // (SGD's momentum buffer would be overwritten instead of continued).
  for (const auto& [key, value] : ints)
    for (const char* counter : {"optim.step", "grad_scaler.clean_steps", "ps.version", "ps.staleness.applied",
                                "ps.staleness.sum", "ps.staleness.max"}) {
      const std::string_view k(key), c(counter);
      const bool named = k == c || (k.size() > c.size() && k.substr(k.size() - c.size()) == c && k[k.size() - c.size() - 1] == '.');
      if (named && value < 0) {
        bad(key, value, "a count of steps or updates is never negative");
        ok = false;
      }
    }
  for (const char* key : {"train.epoch", "train.global_step", "train.loader_epoch", "train.loader_next_batch",
                          "train.loader_batch_size", "train.loader_samples", "train.loader_world_size",
                          "train.loader_next_sample"})
    if (auto v = get(key); v && *v < 0) {
      bad(key, *v, "must be >= 0 (0 = not recorded for the loader settings)");
      ok = false;
    }
  if (auto v = get("train.ranks"); v && *v < 1) {
    bad("train.ranks", *v, "a checkpoint is taken by at least 1 rank");
    ok = false;
  }
  if (!ok) return;
  const auto epoch = get("train.epoch"), loader_epoch = get("train.loader_epoch");
  if (epoch && loader_epoch && *loader_epoch > *epoch)
    bad("train.loader_epoch", *loader_epoch, cat("the data loader cannot be ahead of training (train.epoch = ", *epoch, ")"));
  const auto next = get("train.loader_next_batch"), batch = get("train.loader_batch_size"),
             samples = get("train.loader_samples"), world = get("train.loader_world_size");
  if (next && batch && samples && world && *batch > 0 && *samples > 0 && *world > 0) {
    // Most batches a rank can have: ceil(ceil(samples / world) / batch) (fewer with drop_last/drop_tail).
    const std::int64_t per_rank = (*samples + *world - 1) / *world, batches = (per_rank + *batch - 1) / *batch;
    if (*next > batches)
      bad("train.loader_next_batch", *next, cat("an epoch of ", *samples, " samples on ", *world,
                                                *world == 1 ? " rank" : " ranks", " in batches of ", *batch,
                                                " has at most ", batches, " batches"));
  }
  // The position in global samples must be the same position (an elastic resume trusts it).
  if (const auto sample = get("train.loader_next_sample"); sample && next && batch && world && *batch > 0 && *world > 0 &&
                                                            *sample != *next * *batch * *world)
    bad("train.loader_next_sample", *sample,
        cat("it must equal train.loader_next_batch x train.loader_batch_size x train.loader_world_size = ", *next,
            " x ", *batch, " x ", *world, " = ", *next * *batch * *world));
}

TESSERA_LINKAGE auto detail::CheckpointLoader::integer_buffer(const std::string& name, std::int64_t& v) -> void {
  seen.insert(name);
  if (!file.has(name)) return;
  const TensorInfo& info = file.info(name);
  if (info.shape != Shape{} || info.dtype != DType::I64) {
    problems.push_back(cat("tensor '", name, "': file has ", dtype_name(info.dtype), " ", info.shape,
                           ", model has I64 ()"));
    return;
  }
  if (copy) v = file.tensor<std::int64_t>(name)[0];
}

TESSERA_LINKAGE auto detail::CheckpointLoader::integer(const std::string& name, std::int64_t& v) -> void {
  auto it = file.metadata().find(name);
  if (it == file.metadata().end()) {
    problems.push_back("missing metadata entry '" + name + "'");
    return;
  }
  try {
    std::size_t used = 0;
    const long long parsed = std::stoll(it->second, &used);
    if (used != it->second.size()) throw std::invalid_argument("trailing characters");
    integers[name] = parsed;
    if (copy) v = parsed;
  } catch (const std::exception&) {
    problems.push_back("metadata entry '" + name + "' = '" + it->second + "' is not an integer");
  }
}

TESSERA_LINKAGE auto detail::CheckpointLoader::optional_integer(const std::string& name, std::int64_t& v) -> void {
  if (file.metadata().count(name)) integer(name, v);
}

TESSERA_LINKAGE auto detail::CheckpointLoader::rng(const std::string& name, Rng& r) -> void {
  if (keep_rngs) return;
  const std::string key = rng_prefix + name;
  auto it = file.metadata().find(key);
  Rng::State s;
  if (it == file.metadata().end() || !rng_from_string(it->second, s)) {
    problems.push_back("missing or malformed generator state '" + key + "'");
    return;
  }
  if (copy) r.set_state(s);
}

#endif  // TESSERA_HEADER_DEFINITIONS

}  // namespace tessera
