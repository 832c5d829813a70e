// DataParallel: synchronous data parallelism over any communicator (PyTorch DDP's design).
//
//   auto model = lenet5<E>(...);                          // E = CpuThreads, CpuMpi, CudaNccl, ...
//   DataParallel dp(model, comm);                         // DataParallel<E>, comm an E::Comm;
//                                                         // broadcasts rank 0's parameters/buffers
//   Sgd<E> sgd(dp.parameters(), {...});
//   loop: zero_grad; forward; loss; backward;             // all-reduces start during backward
//         sgd.step();                                     // finishes them first (or dp.finish())
//
// The optimizer step cannot skip the synchronization: DataParallel installs an update guard in
// every parameter, and every optimizer's step() (and GradScaler::unscale) calls finish() through
// it when gradients are pending. Stepping inside no_sync(), where gradients are never averaged,
// throws.
//
// Every rank holds the whole model and trains on its own shard of each global batch. After
// finish(), every parameter's grad is the average over ranks (and over micro-steps, see below) of
// the per-rank gradients, which for a mean-reduced loss and equal shard sizes is exactly the
// gradient of the global batch: N ranks x batch b step like one process on batch N x b.
//
// Buckets. Parameters are grouped, in reverse order of the model's parameter list (backward
// produces gradients roughly last layer first), into flat buckets of at most bucket_bytes; the
// first bucket is capped at first_bucket_bytes so that communication starts early in backward.
// Backward calls each parameter's grad_ready hook once its gradient is final; when every
// parameter of a bucket is in, its gradients are packed into the bucket and an asynchronous
// all_reduce(Avg) starts, overlapping the rest of backward; the last bucket, complete only when
// backward is, is reduced by finish() on the calling thread. Buckets are launched strictly in
// bucket order on every rank (a later bucket that fills first waits for the earlier ones), so
// the sequence of collectives is identical on all ranks whatever order hooks fire in.
//
// Gradient accumulation: inside `auto guard = dp.no_sync();` backward passes accumulate
// gradients locally with no communication; the first backward after the guard ends runs the
// all-reduces (finish() launches whatever has not been, so calling it inside the guard also
// works). Each gradient is divided by its number of micro-steps k when packed, before any
// compression, so k micro-steps of batch b equal one step of batch k x b (for a mean-reduced
// loss) and fp16 sees averages, not k-fold sums.
//
// Gradient compression: a codec reduces each bucket (parallel/gradient_codec.hpp), chosen by
// options.compression or installed with register_codec (PyTorch's register_comm_hook):
//   None:  all_reduce(Avg) of the bucket.
//   Fp16:  cast the bucket down to IEEE half, all_reduce(Avg) in half (reduced in float per
//          element, rounded once), cast up: half the bytes on the wire.
//   Bf16:  the same in bfloat16: float's range (no overflow past 65504), 8 significant bits.
//   TopK:  error feedback (Stich et al. 2018; Lin et al. 2018): corrected = gradient + residual;
//          send only the k = ceil(ratio n) entries of largest magnitude, as (index, value) pairs
//          exchanged with all_gather; residual = corrected minus what was sent. The averaged
//          sparse sums are scattered back into a dense gradient. Over steps, the applied updates
//          plus the residuals (averaged over ranks) sum exactly to the true averaged gradients, so
//          nothing is lost, only delayed. The residuals are per-rank state: the Trainer keeps them
//          with each checkpoint (save_state).
//
// Agreement: the constructor first checks, with one all_gather of two int64, that every rank
// holds the same options, parameter and buffer names and shapes, and bucket layout
// (parallel/agreement.hpp); ranks launched with different settings throw AgreementError on every
// rank naming the first field that differs and the ranks holding each value, instead of calling
// all-reduces of different sizes (a crash inside MPI or Gloo).
//
// Replica consistency: replicas that start equal and apply equal averaged gradients stay
// bit-identical. Every options.consistency_check_every synchronized steps (and at the first),
// finish() compares a 64-bit checksum of every parameter's bytes across ranks (one all_gather of
// one int64 when they agree) and throws AgreementError on every rank naming the step, the first
// parameter that differs and the ranks holding each checksum: different learning rates or
// optimizer settings per rank, a rank that skipped a step, or a checkpoint loaded on one rank only
// would otherwise train on silently (each rank a different model, accuracy the lowest of them).
//
// Unused parameters: finish() throws ArgumentError, on every rank, when any rank produced no
// gradient for some parameter in this step (a branch not taken in forward), a different number
// of gradients for some parameters (micro-steps that used different parts of the model), or one
// parameter's hook fired twice in a backward (a layer used twice in forward). The rank where it
// happened names the parameters. To make that agreement free, every rank still runs every
// bucket's collective (missing gradients count as zero) and the last bucket carries one extra
// element, a "something was wrong here" flag, that is averaged with the gradients: no rank waits
// for a collective another rank never issues, and no extra round trip is needed. After the
// error the DataParallel is reset and the next step can run; the thrown step's gradients are
// not applied (and TopK's residual is left as it was before the step).
//
// Requires: the model outlives the DataParallel and is not moved (hooks point into it); one
// DataParallel per model; the communicator outlives it too.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tessera/comm/communicator.hpp"
#include "tessera/comm/threads.hpp"
#include "tessera/core/env.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/parameter.hpp"
#include "tessera/device/cpu.hpp"
#include "tessera/kernels/elementwise.hpp"
#include "tessera/parallel/agreement.hpp"
#include "tessera/parallel/gradient_codec.hpp"
#include "tessera/parallel/strategy.hpp"

namespace tessera {

enum class GradientCompression { None, Fp16, Bf16, TopK };

inline std::string_view to_string(GradientCompression c) {
  switch (c) {
    case GradientCompression::None: return "none";
    case GradientCompression::Fp16: return "fp16";
    case GradientCompression::Bf16: return "bf16";
    case GradientCompression::TopK: return "topk";
  }
  return "?";
}

// The inverse of to_string, for a command-line flag: "none", "fp16", "bf16" or "topk".
inline GradientCompression gradient_compression_from_string(std::string_view name) {
  for (auto c : {GradientCompression::None, GradientCompression::Fp16, GradientCompression::Bf16,
                 GradientCompression::TopK})
    if (to_string(c) == name) return c;
  TESSERA_CHECK(false, ArgumentError, "GradientCompression: '", name, "' is not one of none, fp16, bf16, topk");
  return GradientCompression::None;
}

struct DataParallelOptions {
  std::size_t bucket_bytes = 25u << 20;      // PyTorch DDP's default bucket_cap_mb = 25
  std::size_t first_bucket_bytes = 1u << 20;  // and its 1 MiB first bucket
  bool broadcast_at_start = true;             // parameters and buffers from rank 0
  GradientCompression compression = GradientCompression::None;
  double topk_ratio = 0.01;  // TopK: fraction of each bucket's entries sent per step
  // Gradients accumulated over k micro-steps (k - 1 inside no_sync()) are summed, as in PyTorch
  // DDP: scale each micro-step's loss by 1/k, as one does with DDP, for the gradient of the
  // mean over the k micro-batches (a Pipeline stage does so itself). true: DataParallel divides
  // each gradient by its number of micro-steps instead, and the loss is left unscaled.
  bool average_micro_steps = false;
  // Compare the replicas' parameters (a 64-bit checksum each) across ranks at the first and then
  // every this many synchronized steps; 0: never. A check reads every parameter once (its cost is
  // in docs/api.md), a small fraction of the time of the steps between two checks.
  int consistency_check_every = 100;
};

template <class E>
class DataParallel final : public StrategyBase<E>, UpdateGuard {
 public:
  using Env = E;
  using S = typename E::Scalar;
  using D = typename E::Device;
  using Comm = typename E::Comm;
  static_assert(AsyncCommunicator<Comm>, "DataParallel needs a communicator with *_async operations");

  struct Bucket {
    std::vector<int> params;           // indices into parameters(), in bucket order
    std::vector<std::int64_t> offset;  // element offset of each in the flat buffer
    Tensor<S, D> flat;                 // packed gradients, reduced in place (+ the flag, last bucket)
    std::size_t elements = 0;          // gradient elements in flat; flat[elements] is the flag
    bool has_flag = false;             // the last bucket carries the step's error flag
    int ready = 0;                     // distinct parameters whose gradient is in this step
    bool launched = false;
    Work work, work2;                  // work2: TopK's second all_gather (values)
    // When this step's reduction was launched and first seen complete (polled at every
    // grad_ready hook and in finish(), so "seen" is at most one hook late): for timelines.
    std::chrono::steady_clock::time_point launched_at, completed_at;
    bool completion_seen = false;
  };

  // comm: the world, or a group from split (its type is the Env's Comm; another is refused at
  // compile time).
  template <class Model, class C>
  DataParallel(Model& model, C& comm, DataParallelOptions options = {})
      : comm_(comm_of_env<E>(comm)), options_(options), named_(parameters_of_env<E>(named_tensors(model))) {
    // Before anything whose size depends on these (the broadcast, the buckets), and before the
    // local checks below, which would otherwise throw on some ranks and leave the others waiting.
    check_agreement(comm_, agreement_record());
    TESSERA_CHECK(options.consistency_check_every >= 0, ArgumentError, "DataParallel: consistency_check_every=",
                  options.consistency_check_every, " must be >= 0 (0: no check)");
    TESSERA_CHECK(options.bucket_bytes > 0 && options.first_bucket_bytes > 0, ArgumentError,
                  "DataParallel: bucket sizes must be positive");
    TESSERA_CHECK(!named_.parameters.empty(), ArgumentError, "DataParallel: the model has no parameters");
    TESSERA_CHECK(options.topk_ratio > 0 && options.topk_ratio <= 1, ArgumentError, "DataParallel: topk_ratio=",
                  options.topk_ratio, " must lie in (0, 1]");
    TESSERA_CHECK(D::host_accessible || options.compression == GradientCompression::None, ArgumentError,
                  "DataParallel: gradient compression (fp16, bf16, top-k) packs buckets on the host; on the device '", D::name,
                  "' use GradientCompression::None");
    if (options.broadcast_at_start) broadcast_from_rank0();
    build_buckets();
    codec_ = make_codec();
    codec_->start(bucket_elements());
    install_hooks();
    for (const auto& [name, p] : named_.parameters) parameter_names_.push_back(name);
  }
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;
  ~DataParallel() {
    for (auto& b : buckets_)
      if (b.launched) {
        try {
          b.work.wait();  // never leave a reduction writing into freed memory
          b.work2.wait();
        } catch (...) {
        }
      }
    for (auto& [name, p] : named_.parameters) {
      p->on_grad_ready = nullptr;
      if (p->update_guard == this) p->update_guard = nullptr;
    }
  }

  // Copies rank 0's parameters and buffers to every rank (done at construction; call again
  // after loading a checkpoint on rank 0 only, or to re-align per-rank BatchNorm statistics).
  void broadcast_from_rank0() {
    for (auto& [name, p] : named_.parameters) comm_.broadcast(std::span<S>(p->value.data(), p->value.numel()), 0);
    for (auto& [name, t] : named_.buffers) comm_.broadcast(std::span<S>(t->data(), t->numel()), 0);
  }

  // RAII scope in which backward accumulates gradients without communicating.
  class NoSync {
   public:
    explicit NoSync(DataParallel& dp) : dp_(&dp) { dp_->sync_ = false; }
    NoSync(NoSync&& other) noexcept : dp_(other.dp_) { other.dp_ = nullptr; }
    NoSync(const NoSync&) = delete;
    ~NoSync() {
      if (dp_) dp_->sync_ = true;
    }

   private:
    DataParallel* dp_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }

  // Launches every bucket not yet launched (in order), waits for all of them, and writes the
  // averaged gradients back into the parameters; then resets for the next step. Throws on every
  // rank if any rank lacked a gradient (see "Unused parameters" above).
  void finish() {
    wait_began_ = std::chrono::steady_clock::now();
    launch_buckets(/*all=*/true);
    for (auto& b : buckets_) {
      b.work.wait();
      b.work2.wait();
      note_completion(b);
      decompress(b);
    }
    const Bucket& last = buckets_.back();
    // A second hook firing after the last bucket went out is known only here, on this rank (a
    // model that uses a layer twice does so on every rank, so every rank throws).
    S flag = 0;
    D::copy_to_host(&flag, last.flat.data() + last.elements, sizeof(S));
    D::synchronize();
    if (flag != S(0) || !duplicates_.empty()) {
      const std::string local = local_problems();
      reset();
      TESSERA_CHECK(false, ArgumentError, "DataParallel on rank ", comm_.rank(), ": ",
                    local.empty() ? std::string("another rank had a parameter without a gradient in this step "
                                                "(its error names it); this step's gradients were not applied")
                                  : local + "; this step's gradients were not applied");
    }
    for (std::size_t bucket = 0; bucket < buckets_.size(); ++bucket) {
      const Bucket& b = buckets_[bucket];
      for (std::size_t k = 0; k < b.params.size(); ++k) {
        auto& g = named_.parameters[static_cast<std::size_t>(b.params[k])].second->grad;
        D::copy(g.data(), b.flat.data() + b.offset[k], g.bytes());
      }
      codec_->commit(bucket);  // every rank's step succeeded: TopK's residual moves on
    }
    if (timeline_)
      for (std::size_t k = 0; k < buckets_.size(); ++k)
        timeline_->add("all_reduce bucket " + std::to_string(k) + " (" + std::to_string(buckets_[k].flat.bytes() / 1024) +
                           " KiB)",
                       "communication", buckets_[k].launched_at, buckets_[k].completed_at, SpanSink::kCommunication);
    reset();
    finished_since_backward_ = true;
    // Nothing is in flight now, and every rank is at the same synchronized step: the parameters
    // (not yet updated by this step's gradients) must be the same bits everywhere.
    const int every = options_.consistency_check_every;
    if (every > 0 && synced_steps_ % every == 0) check_replica_consistency();
    ++synced_steps_;
  }

  // The strategy protocol (parallel/strategy.hpp): what the Trainer calls. The constructor already
  // checked agreement and broadcast rank 0's parameters, so start() has nothing left to do.
  static constexpr bool kHooksGradients = true;
  std::string name() const { return codec_->name() == "none" ? "DataParallel" : "DataParallel(" + codec_->name() + ")"; }
  // Micro-batches before the last accumulate locally (no_sync); the last one's backward launches
  // the buckets. Decided before backward, not forward: a pipeline runs several forwards before
  // the first backward, and the step's last backward is always micro-batch count - 1's.
  void before_backward(const MicroBatch& mb) {
    TESSERA_CHECK(!options_.average_micro_steps || mb.count == 1, ArgumentError,
                  "DataParallel: options.average_micro_steps divides each gradient by its ", mb.count,
                  " micro-batches, and the Trainer (or the pipeline) already weights each micro-batch's loss by its "
                  "share of the batch: leave average_micro_steps false");
    sync_ = mb.last();
  }
  void after_backward(const MicroBatch& mb) {
    if (mb.last()) sync_ = true;
  }
  // Waits for the reductions (the optimizer's update guard would, too: this puts the wait in its
  // own span of the Trainer's timeline).
  void before_optimizer_step() { before_update(); }
  // The codec's per-rank state (TopK's error-feedback residuals: this rank's share of the gradient
  // not yet sent).
  void save_state(StrategyState& state) const { codec_->save_state(state); }
  void load_state(const StrategyState& state) { codec_->load_state(state); }

  // Replaces the gradient codec (PyTorch: register_comm_hook; parallel/gradient_codec.hpp).
  // Collective, between steps: every rank must install a codec of the same name (AgreementError
  // naming the ranks otherwise), since the codecs' collectives must match.
  void register_codec(std::unique_ptr<GradientCodec<E>> codec) {
    TESSERA_CHECK(codec != nullptr, ArgumentError, "DataParallel::register_codec: the codec is null");
    TESSERA_CHECK(std::all_of(fired_.begin(), fired_.end(), [](int f) { return f == 0; }), Error,
                  "DataParallel::register_codec: this step's gradients are pending (called between backward and the "
                  "optimizer step); register the codec between steps");
    AgreementRecord record("DataParallel::register_codec");
    record.add("codec", codec->name());
    check_agreement(comm_, record);
    codec->start(bucket_elements());
    codec_ = std::move(codec);
  }
  const GradientCodec<E>& codec() const { return *codec_; }
  // Each finish() records one span per bucket on the communication lane: launch to completion.
  void set_timeline(SpanSink* timeline) { timeline_ = timeline; }

  // Compares every parameter's checksum across ranks now (collective; call between steps, as
  // finish() does every options.consistency_check_every steps). Throws AgreementError on every
  // rank, naming the first parameter that differs, when the replicas are not bit-identical.
  void check_replica_consistency() {
    TESSERA_CHECK(next_launch_ == 0, Error, "DataParallel: check_replica_consistency() while this step's all-reduces "
                                            "are in flight; call it between steps");
    checksums_.resize(named_.parameters.size());
    for (std::size_t i = 0; i < named_.parameters.size(); ++i)
      checksums_[i] = tensor_checksum(named_.parameters[i].second->value, host_scratch_);
    const std::int64_t step = synced_steps_ + 1, every = options_.consistency_check_every;
    const std::string when =
        every > 0 && synced_steps_ % every == 0
            ? "at the start of synchronized step " + std::to_string(step) +
                  (step > every ? " (checked every " + std::to_string(every) + " steps; equal at step " +
                                      std::to_string(step - every) + ")"
                                : std::string(" (the first check)"))
            : "after " + std::to_string(synced_steps_) + " synchronized steps";
    check_replicas_agree(
        comm_, std::span<const std::uint64_t>(checksums_), std::span<const std::string>(parameter_names_),
        "DataParallel: the replicas' parameters are no longer identical " + when,
        "Every rank must apply the same update to the same averaged gradients. Likely causes, most likely first: "
        "a learning rate, schedule or optimizer setting that differs between ranks (flags or configuration given "
        "per rank); a rank that skipped or repeated an optimizer step (a per-rank NaN/inf or loss check, a "
        "GradScaler that decided on local values); parameters changed on some ranks only (a checkpoint loaded "
        "without broadcast_from_rank0(), weights edited on rank 0); a non-deterministic optimizer kernel. "
        "DataParallelOptions::consistency_check_every sets how often this is checked (0: never)");
  }

  const std::vector<Bucket>& buckets() const { return buckets_; }
  // When the last finish() started waiting for the reductions. With the buckets'
  // launched_at/completed_at this shows how much communication backward hid.
  std::chrono::steady_clock::time_point last_wait_began() const { return last_wait_began_; }
  // The codec's error-feedback residual of parameter `param` (TopK's; zeros for a codec that sends
  // everything), for tests and for logging how much is being delayed.
  std::vector<S> residual_of(std::size_t param) const {
    const Bucket& b = buckets_[static_cast<std::size_t>(bucket_of_[param])];
    const auto k = static_cast<std::size_t>(std::find(b.params.begin(), b.params.end(), static_cast<int>(param)) - b.params.begin());
    const std::int64_t n = named_.parameters[param].second->value.numel();
    std::vector<S> out(static_cast<std::size_t>(n), S(0));
    const auto residual = codec_->residual(static_cast<std::size_t>(bucket_of_[param]));
    if (!residual.empty()) std::copy_n(residual.begin() + b.offset[k], n, out.begin());
    return out;
  }
  const NamedTensors<E>& parameters() const { return named_; }
  Comm& comm() { return comm_; }

 private:
  // Which parameters go into which bucket (the layout every rank must share): parameters in
  // reverse order, a new bucket when the next would overflow the cap (first_bucket_bytes for the
  // first bucket, bucket_bytes after). Defined for any options (the agreement check runs before
  // they are validated).
  std::vector<std::vector<int>> bucket_plan() const {
    std::vector<std::vector<int>> plan;
    std::size_t cap = options_.first_bucket_bytes, bytes_in_last = 0;
    for (int i = static_cast<int>(named_.parameters.size()) - 1; i >= 0; --i) {
      const std::size_t bytes =
          static_cast<std::size_t>(named_.parameters[static_cast<std::size_t>(i)].second->value.numel()) * sizeof(S);
      if (plan.empty() || (!plan.back().empty() && bytes_in_last + bytes > cap)) {
        if (!plan.empty()) cap = options_.bucket_bytes;
        plan.emplace_back();
        bytes_in_last = 0;
      }
      plan.back().push_back(i);
      bytes_in_last += bytes;
    }
    return plan;
  }

  // What every rank must hold alike (check_agreement compares it across the group).
  AgreementRecord agreement_record() const {
    AgreementRecord record("DataParallel");
    record.add("strategy", "DataParallel");
    record.add("device", D::name);
    record.add("options.bucket_bytes", options_.bucket_bytes);
    record.add("options.first_bucket_bytes", options_.first_bucket_bytes);
    record.add("options.broadcast_at_start", options_.broadcast_at_start);
    record.add("options.compression", to_string(options_.compression));
    record.add("options.topk_ratio", options_.topk_ratio);
    record.add("options.average_micro_steps", options_.average_micro_steps);
    record.add("options.consistency_check_every", options_.consistency_check_every);
    record.add_named_tensors(named_);
    const auto plan = bucket_plan();
    record.add("buckets", plan.size());
    for (std::size_t k = 0; k < plan.size(); ++k) {
      std::int64_t elements = 0;
      for (int i : plan[k]) elements += named_.parameters[static_cast<std::size_t>(i)].second->value.numel();
      record.add("bucket[" + std::to_string(k) + "].elements", elements);
      record.add_list("bucket[" + std::to_string(k) + "].parameters", plan[k]);
    }
    return record;
  }

  void build_buckets() {
    const int n = static_cast<int>(named_.parameters.size());
    fired_.assign(static_cast<std::size_t>(n), 0);
    bucket_of_.assign(static_cast<std::size_t>(n), -1);
    for (const auto& params : bucket_plan()) {
      Bucket& b = buckets_.emplace_back();
      for (int i : params) {
        b.offset.push_back(static_cast<std::int64_t>(b.elements));
        b.params.push_back(i);
        b.elements += static_cast<std::size_t>(named_.parameters[static_cast<std::size_t>(i)].second->value.numel());
        bucket_of_[static_cast<std::size_t>(i)] = static_cast<int>(buckets_.size()) - 1;
      }
    }
    buckets_.back().has_flag = true;
    for (auto& b : buckets_) {  // one allocation per bucket, on the device; the flag slot after the last
      b.flat.resize({static_cast<std::int64_t>(b.elements + (b.has_flag ? 1 : 0))});
      b.flat.zero();
    }
    in_sync_pass_.assign(static_cast<std::size_t>(n), 0);
  }

  void install_hooks() {
    for (std::size_t i = 0; i < named_.parameters.size(); ++i) {
      Parameter<S, D>* p = named_.parameters[i].second;
      TESSERA_CHECK(!p->on_grad_ready, ArgumentError, "DataParallel: parameter '", named_.parameters[i].first,
                    "' already has a grad_ready hook (one DataParallel per model)");
      p->on_grad_ready = [this, i](Parameter<S, D>&) { on_grad_ready(static_cast<int>(i)); };
      p->update_guard = this;
    }
  }

  // Called by the optimizer before it applies gradients: the step must see averaged gradients.
  void before_update() override {
    const bool pending = std::any_of(fired_.begin(), fired_.end(), [](int f) { return f != 0; });
    if (!pending) return;  // finish() already ran (or no backward since the last step)
    TESSERA_CHECK(sync_, Error, "DataParallel on rank ", comm_.rank(),
                  ": optimizer step inside no_sync(): these gradients were accumulated locally and never averaged "
                  "across ranks; end the no_sync() scope and run the last micro-step's backward outside it, then step");
    finish();
  }

  void on_grad_ready(int i) {
    const auto u = static_cast<std::size_t>(i);
    if (sync_ && in_sync_pass_[u]) {  // a second gradient in one backward: its bucket may be sent
      duplicates_.push_back(i);
      return;
    }
    ++fired_[u];
    finished_since_backward_ = false;
    if (!sync_) return;  // accumulating: no communication until the last micro-step
    in_sync_pass_[u] = 1;
    ++buckets_[static_cast<std::size_t>(bucket_of_[u])].ready;
    launch_buckets(/*all=*/false);
    // Drive progress of what is in flight: MPI's non-blocking collectives advance only inside
    // MPI calls, and a test is cheap for the other backends.
    for (auto& in_flight : buckets_)
      if (in_flight.launched && !in_flight.completion_seen && in_flight.work.is_completed() &&
          in_flight.work2.is_completed())
        note_completion(in_flight);
  }

  void note_completion(Bucket& b) {
    if (b.completion_seen) return;
    b.completed_at = std::chrono::steady_clock::now();
    b.completion_seen = true;
  }

  // Launches, in bucket order, every bucket whose parameters are all in (all: every bucket, the
  // last one included). The last bucket waits for finish(), which runs its collective on the
  // calling thread: its final hook is the end of backward, so nothing is left for it to overlap
  // with, and an asynchronous launch would only add two thread hand-offs (to the communicator's
  // worker and back) to the exposed time. With one rank per core those hand-offs wait on the
  // scheduler: LeNet-5 over Gloo, 2 ranks, one bucket, ran faster without them.
  void launch_buckets(bool all) {
    while (next_launch_ < buckets_.size() &&
           (all || (!buckets_[next_launch_].has_flag &&
                    buckets_[next_launch_].ready == static_cast<int>(buckets_[next_launch_].params.size())))) {
      Bucket& b = buckets_[next_launch_++];
      // Each gradient holds the sum of its micro-steps: pack it (or its mean with
      // average_micro_steps). No gradient: zeros.
      for (std::size_t k = 0; k < b.params.size(); ++k) {
        const auto p = static_cast<std::size_t>(b.params[k]);
        const auto& g = named_.parameters[p].second->grad;
        S* dst = b.flat.data() + b.offset[k];
        if (fired_[p] == 0) fill_elements(D{}, dst, g.numel(), S(0));
        else if (fired_[p] == 1 || !options_.average_micro_steps) D::copy(dst, g.data(), g.bytes());
        else scale_elements(D{}, g.data(), g.numel(), S(1) / static_cast<S>(fired_[p]), dst);
      }
      // The last bucket goes out after every parameter's hook, so what this rank knows is final.
      if (b.has_flag) {
        const S flag = has_local_problem() ? S(1) : S(0);
        D::copy_to_device(b.flat.data() + b.elements, &flag, sizeof(S));
      }
      b.launched_at = std::chrono::steady_clock::now();
      compress_and_launch(b, /*blocking=*/b.has_flag);
      b.launched = true;
    }
  }

  // Whether local_problems() would say anything (every step: no strings built).
  bool has_local_problem() const {
    const int micro_steps = *std::max_element(fired_.begin(), fired_.end());
    return micro_steps == 0 || !duplicates_.empty() ||
           std::any_of(fired_.begin(), fired_.end(), [&](int f) { return f != micro_steps; });
  }

  // What is wrong with this rank's step, in words; empty when nothing is (only on the error path).
  std::string local_problems() const {
    const int micro_steps = *std::max_element(fired_.begin(), fired_.end());
    // Right after a completed finish(), the likely cause is a second call in the same step (this
    // rank cannot tell that from a skipped backward: both still join the collective, so that
    // every rank learns of it). It was reported as a skipped backward only, blaming the data.
    if (micro_steps == 0 && finished_since_backward_)
      return "finish() called again with no backward pass since the last finish(): twice in one step (the "
             "optimizer's step() calls it itself while gradients are pending), or this rank skipped a step's backward "
             "(an empty or short data shard)";
    if (micro_steps == 0)
      return "finish() without a backward pass since the last step (this rank skipped backward, e.g. an empty or "
             "short data shard, or called finish() twice)";
    std::string missing, uneven, twice;
    for (std::size_t i = 0; i < fired_.size(); ++i) {
      const std::string& name = named_.parameters[i].first;
      if (fired_[i] == 0) missing += (missing.empty() ? "" : ", ") + name;
      else if (fired_[i] != micro_steps) uneven += (uneven.empty() ? "" : ", ") + name;
    }
    for (int i : duplicates_) twice += (twice.empty() ? "" : ", ") + named_.parameters[static_cast<std::size_t>(i)].first;
    std::string out;
    auto add = [&](const std::string& what, const std::string& names) {
      if (!names.empty()) out += (out.empty() ? "" : "; ") + what + names;
    };
    if (!missing.empty())
      missing += " (likely causes, most likely first: a custom layer whose backward does not call grad_ready() on "
                 "this parameter once its gradient is final (see docs/adding-a-layer.md); a parameter this forward "
                 "did not use, e.g. a branch not taken: DataParallel has no find_unused_parameters, so use every "
                 "parameter on every rank, or call grad_ready() on it yourself after backward (its gradient then "
                 "counts as is, zero if untouched); a backward pass that ended early on this rank (an exception caught and "
                 "ignored between layers))";
    add("no gradient in this step for: ", missing);
    if (!uneven.empty()) uneven += " (every micro-step must use every parameter)";
    if (!twice.empty()) twice += " (each parameter must be used once per forward and backward on every rank)";
    add("gradients in fewer than all " + std::to_string(micro_steps) + " micro-steps for: ", uneven);
    add("two gradients in one backward (used twice in forward) for: ", twice);
    return out;
  }

  // blocking: the collectives run on this thread and are done on return (b.work stays complete).
  void compress_and_launch(Bucket& b, bool blocking) {
    CodecWork work = codec_->launch(comm_, codec_view(b), blocking);
    b.work = std::move(work.first);
    b.work2 = std::move(work.second);
  }

  // After the bucket's collectives finished: its averaged gradient back into b.flat.
  void decompress(Bucket& b) { codec_->decode(comm_, codec_view(b)); }

  CodecBucket<S> codec_view(Bucket& b) {
    return {static_cast<std::size_t>(&b - buckets_.data()), b.flat.span(), b.elements, b.has_flag};
  }
  std::vector<std::size_t> bucket_elements() const {
    std::vector<std::size_t> out;
    for (const auto& b : buckets_) out.push_back(b.elements);
    return out;
  }
  std::unique_ptr<GradientCodec<E>> make_codec() const {
    switch (options_.compression) {
      case GradientCompression::Fp16:
        return std::make_unique<Fp16Codec<E>>();
      case GradientCompression::Bf16:
        if constexpr (BHalfCommunicator<Comm>) {
          return std::make_unique<Bf16Codec<E>>();
        } else {
          TESSERA_CHECK(false, ArgumentError, "DataParallel: GradientCompression::Bf16 needs a communicator that sends ",
                        "BHalf (BHalfCommunicator); this one does not: use Fp16 or None");
          break;
        }
      case GradientCompression::TopK:
        return std::make_unique<TopKCodec<E>>(options_.topk_ratio);
      case GradientCompression::None:
        break;
    }
    return std::make_unique<AverageCodec<E>>();
  }

  void reset() {
    last_wait_began_ = wait_began_;
    for (auto& b : buckets_) b.completion_seen = false;
    std::fill(fired_.begin(), fired_.end(), 0);
    std::fill(in_sync_pass_.begin(), in_sync_pass_.end(), 0);
    duplicates_.clear();
    for (auto& b : buckets_) {
      b.ready = 0;
      b.launched = false;
      b.work = Work();
      b.work2 = Work();
    }
    next_launch_ = 0;
  }

  Comm& comm_;
  DataParallelOptions options_;
  NamedTensors<E> named_;
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_;  // parameter index -> bucket
  std::vector<int> fired_;      // grad_ready calls per parameter since the last finish()
  bool finished_since_backward_ = false;  // the last event was a completed finish() (no hook since)
  std::vector<char> in_sync_pass_;  // grad_ready seen in the communicating backward
  std::vector<int> duplicates_;     // parameters whose hook fired again in that backward
  std::size_t next_launch_ = 0;
  bool sync_ = true;
  std::chrono::steady_clock::time_point wait_began_, last_wait_began_;
  // Replica consistency: completed finish() calls, and the checksum scratch.
  std::int64_t synced_steps_ = 0;
  std::vector<std::string> parameter_names_;
  std::vector<std::uint64_t> checksums_;
  std::vector<S> host_scratch_;  // a device parameter's bytes, copied to the host to be checksummed
  SpanSink* timeline_ = nullptr;  // set_timeline: bucket spans
  std::unique_ptr<GradientCodec<E>> codec_;  // how a bucket is reduced (make_codec, register_codec)
};

// DataParallel dp(model, comm): the Env is the model's.
template <class Model, class C>
DataParallel(Model&, C&, DataParallelOptions = {}) -> DataParallel<typename Model::Env>;

// DataParallel of the CPU backends' float Envs, which nearly every multi-rank CPU program of the
// meson build instantiates (the examples once per backend), is compiled once: CpuThreads' in
// tessera_layers (src/strategies_cpu.cpp), declared extern here where the build links it
// (core/linkage.hpp's define). A backend with a library of its own compiles its Env's there and
// declares it extern at the end of its header, when this definition precedes it
// (TESSERA_DATA_PARALLEL_DEFINED), as it does in every program of the build (the precompiled
// header, src/pch, holds tessera.hpp). Not here: a backend's macro tested in this header would
// differ between the backends' programs and void the precompiled header they share. Only the
// constructor, a template on the model, is still compiled in the program (docs/testing.md has
// what that saves).
#if TESSERA_CPU_KERNELS_EXTERN
extern template class DataParallel<CpuThreads>;
#endif
#define TESSERA_DATA_PARALLEL_DEFINED 1

}  // namespace tessera

