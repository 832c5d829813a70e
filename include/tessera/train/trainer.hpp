// Trainer: the loop the examples share. Per step: forward, softmax cross-entropy, backward,
// optimizer step with the scheduled learning rate (set per iteration, so warmup is smooth). The
// model is an image classifier (a Layer, batches from a DataLoader) or a language model (a
// TokenModel such as GPT, batches of token windows from a TokenLoader).
// Per epoch: mean loss, accuracy, images/s, test accuracy; a progress bar or plain lines; one JSON
// line per epoch in the metrics file; optionally a checkpoint.
//
// Resuming: load(path, loader) then fit() continues at the epoch and sample where the checkpoint
// was taken, also in the middle of an epoch (TrainOptions::stop_after_steps stops there, and so
// does a signal with TrainOptions::stop_signals, as a job's time limit does; checkpoint_every_steps
// saves there too) and also at another world size when the global batch is kept (elastic resume:
// the loader of each of the M ranks has batch_size = global batch / M; see train/checkpoint.hpp).
// The EpochResult of a resumed epoch covers the steps taken since the resume.
//
// Strategies (parallel/strategy.hpp): Trainer(model, optimizer, strategy, schedule, options) drives
// any strategy or Stack of them through the protocol's hooks: DataParallel, LocalSgd,
// GradientAccumulation, stack(dp, accumulation), a Pipeline (of a Layer or of a TokenModel such as
// GPT: it runs the model itself), stack(dp, pipe). A strategy's per-rank state (DataParallel's top-k
// residuals, LocalSgd's step count) is saved with each checkpoint in one file per rank beside it,
// "<path>.rank<r>.strategy" (strategy_state_path), and loaded with it; a resume then continues
// exactly as the uninterrupted run would. When the strategy says the ranks' optimizer states
// differ (kPerRankOptimizerState: LocalSgd), that file also holds this rank's optimizer state
// ("optimizer/<name>" for each entry of its visit_state), loaded over the checkpoint's rank 0 copy.
//
// Everything a step touches (the model's activation cache, the loss cache, the batch) lives in
// the Trainer and is reused, so after the first step a training step allocates nothing.
#pragma once

#include <array>
#include <bit>
#include <chrono>
#include <concepts>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tessera/core/allocator.hpp"
#include "tessera/core/concepts.hpp"
#include "tessera/core/env.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/kernels/elementwise.hpp"
#include "tessera/losses/cross_entropy.hpp"
#include "tessera/parallel/agreement.hpp"
#include "tessera/parallel/strategy.hpp"
#include "tessera/train/checkpoint.hpp"
#include "tessera/train/metrics.hpp"
#include "tessera/train/preemption.hpp"
#include "tessera/train/progress.hpp"
#include "tessera/train/sharded_checkpoint.hpp"
#include "tessera/train/timeline.hpp"

namespace tessera {

// What the Trainer trains: a Layer (images (n, C, H, W) -> logits (n, classes)), or a TokenModel,
// a language model such as GPT (token ids (n, T) -> logits (n, T, V), whose backward takes
// dL/dlogits and returns nothing: token ids have no gradient). Its loss is the cross-entropy of
// every position's logits against the next token (the batch's labels), its accuracy the share of
// next tokens predicted (top-1), and its throughput counted in tokens.
template <class M>
concept TokenModel = requires { typename M::Env; typename M::Tensor; typename M::Cache; } &&
    requires(M& m, const Tensor<std::int64_t, Cpu>& ids, typename M::Cache& c, const typename M::Tensor& dlogits) {
      { m.forward(ids, c) } -> std::same_as<const typename M::Tensor&>;
      m.backward(dlogits, c);
      m.set_mode(Mode::Train);
      m.visit(std::declval<VisitorArchetype&>(), std::string());
      { m.name() } -> std::convertible_to<std::string>;
    };

// What fit() reads batches from: DataLoader (images) or TokenLoader (data/token_loader.hpp).
template <class L, class S>
concept BatchSource = requires(L& l, const L& cl, Batch<S>& b, std::int64_t epoch, const LoaderState& st) {
  l.start_epoch(epoch);
  { l.next(b) } -> std::same_as<bool>;
  l.set_state(st);
  { cl.state() } -> std::same_as<LoaderState>;
  { cl.batches_per_epoch() } -> std::convertible_to<std::int64_t>;
  { cl.dataset_size() } -> std::convertible_to<std::int64_t>;
  { cl.options() } -> std::convertible_to<const LoaderOptions&>;
};

namespace detail {
template <class M>
consteval bool check_trainable_model() {
  if constexpr (TokenModel<M>) return true;
  else return check_layer<M>();
}
}  // namespace detail

struct TrainOptions {
  std::int64_t epochs = 1;
  std::string metrics_path;          // JSON lines; empty = none
  std::string checkpoint_path;       // saved after every epoch; empty = none
  int progress = -1;                 // -1 detect terminal, 0 plain lines, 1 bar
  bool verbose = true;               // false: no progress output at all (tests)
  double label_smoothing = 0.0;
  // Called after backward and before the optimizer step (e.g. to record a timeline of
  // DataParallel's buckets after dp.finish()). Not needed for synchronization: the optimizer's
  // step finishes a DataParallel's all-reduce itself. Empty: nothing.
  std::function<void()> before_step;
  // Optional: forward, backward, the before_step hook and the optimizer step of every training
  // step as spans on the compute lane (see train/timeline.hpp), and the strategy's own spans.
  Timeline* timeline = nullptr;
  // With a timeline: record only the steps [timeline_first_step, timeline_first_step +
  // timeline_steps) of the run (global step numbers from 0; the first steps fill caches and
  // buffers); timeline_steps 0: every step.
  std::int64_t timeline_first_step = 0, timeline_steps = 0;
  // With a timeline: after the recorded steps (or at the end of fit(), if it ends first), every
  // rank of checkpoint_group writes its part to this Chrome trace (Timeline::write: collective).
  std::string trace_path;
  // The ranks that train together (data parallelism: CheckpointGroup(comm)), so that save()
  // keeps every rank's random generators and load() gives each rank its own, and so that each
  // epoch's train loss, accuracy and images/s are those of all ranks (see EpochResult).
  // Default: one process.
  CheckpointGroup checkpoint_group{};
  CheckpointOptions checkpoint_options{};  // e.g. {.allow_non_finite = true}
  // > 0: fit() returns once this many optimizer steps have been taken in all (state().global_step),
  // also in the middle of an epoch, saving a checkpoint there first when checkpoint_path is set:
  // what a job stopped by its time limit does; a later load() and fit() continue at the next
  // sample. 0: no limit.
  std::int64_t stop_after_steps = 0;
  // > 0: also save the checkpoint (checkpoint_path) every this many optimizer steps, in the middle
  // of an epoch too, so that a job killed without warning (a node lost, SIGKILL) loses at most
  // that many steps. 0: after each epoch only.
  std::int64_t checkpoint_every_steps = 0;
  // Set: after every step the ranks of checkpoint_group agree whether any of them received one of
  // its signals (one int64 all_gather per step); if one did, all save the checkpoint there (when
  // checkpoint_path is set) and fit() returns at that same step, and stopped_by() names the
  // signal. The program then exits kExitStoppedForResume (train/preemption.hpp). Null: signals
  // keep their usual effect.
  const StopSignals* stop_signals = nullptr;
  // Called after every optimizer step, at the step boundary (state().global_step counts the step),
  // before the stop and checkpoint checks; an exception it throws leaves fit() there with the state
  // consistent (the elastic driver, train/elastic.hpp, leaves this way to change the group). Empty:
  // nothing.
  std::function<void()> after_step;
};

// The figures count predictions: images, or for a TokenModel tokens (a batch of n windows of T
// tokens is n T predictions: the losses are means over tokens and images_per_second is then tokens
// per second; the progress line and the metrics say "tok/s" and "tokens_per_second").
// With a checkpoint_group of N ranks, the training figures are global, the same on every rank:
// train_loss and train_accuracy over the samples of all ranks (what one process training on the
// global batches reports), seconds the slowest rank's, images_per_second all ranks' samples over
// those seconds; rank_images_per_second is this rank's own. Test figures are this rank's
// evaluation of the whole test set (identical on data-parallel replicas).
struct EpochResult {
  std::int64_t epoch = 0;
  double train_loss = 0, train_accuracy = 0, test_loss = 0, test_accuracy = 0;
  double seconds = 0, images_per_second = 0, lr = 0;
  double rank_images_per_second = 0;
  int ranks = 1;
  // Time the step loop spent in train.next(), waiting for the loader's workers (0 when they keep
  // ahead), and its share of the epoch's training time.
  double data_wait_seconds = 0, data_wait_fraction = 0;
  bool complete = true;  // false: stopped (stop_after_steps, a stop signal) before the epoch's end (no test metrics)
};

// The checkpoint's companion file holding rank `rank`'s strategy state (written only when the
// strategy has some).
inline std::string strategy_state_path(const std::string& checkpoint_path, int rank) {
  return checkpoint_path + ".rank" + std::to_string(rank) + ".strategy";
}

namespace detail {
// An optimizer's visit_state entries into a StrategyState as float64 ("optimizer/<name>"), and
// back: exact for float32 and float64 values and for step counts below 2^53.
struct OptimizerStateToRankState {
  StrategyState& out;
  template <class S, class D>
  void buffer(const std::string& name, const Tensor<S, D>& t) {
    std::vector<S> host(static_cast<std::size_t>(t.numel()));
    if (!host.empty()) D::copy_to_host(host.data(), t.data(), t.bytes());
    out.put("optimizer/" + name, std::span<const S>(host));
  }
  void integer(const std::string& name, const std::int64_t& v) { out.put("optimizer/" + name, v); }
};
struct OptimizerStateFromRankState {
  const StrategyState& in;
  template <class S, class D>
  void buffer(const std::string& name, Tensor<S, D>& t) {
    std::vector<S> host(static_cast<std::size_t>(t.numel()));
    in.get("optimizer/" + name, std::span<S>(host));
    if (!host.empty()) D::copy_to_device(t.data(), host.data(), t.bytes());
  }
  void integer(const std::string& name, std::int64_t& v) { v = in.get_int("optimizer/" + name); }
};
}  // namespace detail

template <class Model, class Optimizer, class Strat = NoStrategy<typename Model::Env>>
class Trainer {
  static_assert(detail::check_trainable_model<Model>());
  static_assert(!requires { typename Optimizer::Env; } || check_same_env<typename Model::Env, typename Optimizer::Env>());
  static_assert(check_strategy<Strat>());
  static_assert(check_same_env<typename Model::Env, typename Strat::Env>());

 public:
  using E = typename Model::Env;
  using S = typename E::Scalar;
  using Schedule = std::function<double(double)>;  // fractional epoch -> learning rate

  // One process, or a strategy the program drives itself (before_step).
  Trainer(Model& model, Optimizer& optimizer, Schedule schedule, TrainOptions options)
    requires std::is_same_v<Strat, NoStrategy<E>>
      : Trainer(model, optimizer, none_, std::move(schedule), std::move(options)) {}
  // The strategy (or stack) outlives the Trainer.
  Trainer(Model& model, Optimizer& optimizer, Strat& strategy, Schedule schedule, TrainOptions options)
      : model_(model),
        optimizer_(optimizer),
        strategy_(strategy),
        schedule_(std::move(schedule)),
        options_(std::move(options)),
        loss_(Reduction::Mean, options_.label_smoothing),
        metrics_(options_.metrics_path),
        micro_step_([this](const Batch<S>& micro, const MicroBatch& mb) { return micro_step(micro, mb); }) {
    TESSERA_CHECK(!kRunsModel || options_.label_smoothing == 0.0, ArgumentError, "Trainer: label_smoothing=",
                  options_.label_smoothing, " with ", strategy_.name(), ", which computes the loss itself: give the "
                  "smoothing to its loss");
    if (!options_.checkpoint_path.empty()) refuse_split_model_checkpoint(options_.checkpoint_path);  // not after an epoch
    strategy_.set_timeline(recording() ? options_.timeline : nullptr);
    stop_flags_.resize(static_cast<std::size_t>(std::max(1, options_.checkpoint_group.size())));
  }
  // The caches hold pointers into this object (the batch): it stays where it was built.
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // One optimizer step on `batch`, through the strategy's hooks (parallel/strategy.hpp); returns
  // the batch's mean loss. Accumulates correct-prediction counts.
  S train_step(const Batch<S>& batch) {
    if (!strategy_started_) {
      strategy_.start();
      strategy_started_ = true;
    }
    const bool record = recording();
    if (record != recorded_last_step_) strategy_.set_timeline(record ? options_.timeline : nullptr);
    recorded_last_step_ = record;
    Timeline* t = record ? options_.timeline : nullptr;
    optimizer_.zero_grad();
    S loss;
    batch_weight_ = batch.weight;  // micro_step scales this rank's loss gradient by it (data/loader.hpp)
    // A strategy that runs the model weights the loss gradient itself, when it can (FSDP).
    constexpr bool kWeighsBatches = requires { strategy_.set_batch_weight(1.0); };
    TESSERA_CHECK(!kRunsModel || kWeighsBatches || batch.weight == 1.0, ArgumentError, "Trainer: ", strategy_.name(),
                  " computes the loss itself and cannot weight a rank's share of an unevenly split batch (weight ",
                  batch.weight, "); split the global batch evenly (batch_size per rank)");
    if constexpr (kWeighsBatches) strategy_.set_batch_weight(batch.weight);
    if constexpr (kRunsModel) {  // a pipeline or FSDP: it runs forward, loss and backward
      const ModelStepResult r = strategy_.run_model(model_input(batch), batch.labels, strategy_);
      correct_ += r.correct;
      loss = static_cast<S>(r.loss);
    } else {
      loss = static_cast<S>(strategy_.run_micro_batches(batch, micro_step_));
    }
    std::optional<Timeline::Span> span;
    if (t) span.emplace(t->span("gradient sync wait"));
    strategy_.before_optimizer_step();
    if (options_.before_step) options_.before_step();
    if (t) span.emplace(t->span("optimizer step"));
    const MemoryScope memory("the optimizer step (optimizer state)");
    optimizer_.step();
    strategy_.after_optimizer_step();
    span.reset();
    state_.global_step++;
    if (record && options_.timeline_steps > 0 &&
        state_.global_step == options_.timeline_first_step + options_.timeline_steps)
      write_trace();
    return loss;
  }

  // Trains from the current state until options.epochs epochs are complete (or, with
  // stop_after > 0, until that many: the schedule still spans options.epochs, as when a job's time
  // limit stops it), evaluating on `test` after each epoch. Resumes where load() left off. Returns
  // the completed epochs (an epoch cut short by options.stop_after_steps is not among them).
  template <BatchSource<S> Loader>
  std::vector<EpochResult> fit(Loader& train, std::type_identity_t<Loader>* test = nullptr, std::int64_t stop_after = 0) {
    const std::int64_t last = stop_after > 0 ? std::min(stop_after, options_.epochs) : options_.epochs;
    if (!settings_checked_) {
      check_settings_agree(train);
      settings_checked_ = true;
    }
    std::vector<EpochResult> results;
    while (state_.epoch < last && !step_limit_reached() && stopped_by_ == 0) {
      EpochResult r = train_epoch(train, test);
      if (!r.complete) break;
      results.push_back(r);
    }
    if (options_.timeline && !trace_written_ && state_.global_step > options_.timeline_first_step) write_trace();
    return results;
  }

  template <BatchSource<S> Loader>
  EpochResult train_epoch(Loader& train, std::type_identity_t<Loader>* test) {
    check_loader_matches_state(train);
    const std::int64_t epoch = state_.epoch;
    const std::int64_t batches = train.batches_per_epoch();
    if (state_.loader_epoch == epoch && state_.loader_next_batch > 0) {
      train.set_state({epoch, state_.loader_next_batch});  // resuming inside this epoch
    } else {
      train.start_epoch(epoch);
    }
    model_.set_mode(Mode::Train);
    Progress progress("epoch " + std::to_string(epoch + 1) + "/" + std::to_string(options_.epochs), batches,
                      options_.progress);
    const auto start = std::chrono::steady_clock::now();
    double loss_sum = 0;
    std::int64_t seen = 0, done = train.state().next_batch;
    correct_ = 0;
    char stats[128];
    double waited = 0;
    while (true) {
      const auto asked = std::chrono::steady_clock::now();
      const bool more = train.next(batch_);
      waited += std::chrono::duration<double>(std::chrono::steady_clock::now() - asked).count();
      if (!more) break;
      optimizer_.set_lr(schedule_(static_cast<double>(epoch) + static_cast<double>(done) / static_cast<double>(batches)));
      const S loss = train_step(batch_);
      const auto n = static_cast<std::int64_t>(batch_.labels.size());
      loss_sum += static_cast<double>(loss) * static_cast<double>(n);
      seen += n;
      ++done;
      state_.loader_epoch = epoch;
      state_.loader_next_batch = done;
      state_.loader_next_sample = done * position_batch(train.options()) * position_world(train.options());
      if (options_.after_step) options_.after_step();
      if (options_.verbose) {
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        // Per step, this rank's own figures (no collective per step); labelled so when there are others.
        std::snprintf(stats, sizeof stats, "%sloss %.4f acc %.2f%% %.0f %s lr %.4g",
                      options_.checkpoint_group.size() > 1 ? "this rank: " : "", loss_sum / static_cast<double>(seen),
                      100.0 * static_cast<double>(correct_) / static_cast<double>(seen),
                      static_cast<double>(seen) / std::max(secs, 1e-9), kUnit, optimizer_.lr());
        progress.update(done, stats);
      }
      if (done < batches) {
        if (step_limit_reached() || (stopped_by_ = agreed_stop_signal()) != 0) break;
        if (options_.checkpoint_every_steps > 0 && !options_.checkpoint_path.empty() &&
            state_.global_step % options_.checkpoint_every_steps == 0)
          save(options_.checkpoint_path);
      } else {
        // The epoch's last step: its checkpoint follows the evaluation below; fit() stops after it.
        stopped_by_ = agreed_stop_signal();
      }
    }
    EpochResult r;
    r.epoch = epoch + 1;
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    r.rank_images_per_second = static_cast<double>(seen) / std::max(r.seconds, 1e-9);
    r.data_wait_seconds = waited;
    r.data_wait_fraction = waited / std::max(r.seconds, 1e-9);
    // Over all ranks: sums of loss x samples, samples and correct ones; the slowest rank's time.
    // A sample seen by several ranks (a pipeline's stages) counts once.
    const auto& group = options_.checkpoint_group;
    r.ranks = group.size();
    const double copies = detail::sample_copies(strategy_);
    double total_loss = loss_sum, total_seen = static_cast<double>(seen), total_correct = static_cast<double>(correct_);
    if (group.size() > 1) {
      // Doubles travel bit for bit through the group's int64 all_gather; every rank sums them in
      // rank order, so every rank gets the same figures.
      const std::array<std::int64_t, 4> mine{std::bit_cast<std::int64_t>(loss_sum), seen, correct_,
                                             std::bit_cast<std::int64_t>(r.seconds)};
      const auto all = group.all_gather(std::span<const std::int64_t>(mine));
      total_loss = total_seen = total_correct = 0;
      for (std::size_t k = 0; k < all.size(); k += mine.size()) {
        total_loss += std::bit_cast<double>(all[k]);
        total_seen += static_cast<double>(all[k + 1]);
        total_correct += static_cast<double>(all[k + 2]);
        r.seconds = std::max(r.seconds, std::bit_cast<double>(all[k + 3]));
      }
      total_loss /= copies;
      total_seen /= copies;
      total_correct /= copies;
    }
    r.train_loss = total_seen > 0 ? total_loss / total_seen : 0.0;
    r.train_accuracy = total_seen > 0 ? total_correct / total_seen : 0.0;
    r.images_per_second = total_seen / std::max(r.seconds, 1e-9);
    r.lr = optimizer_.lr();
    if (done < batches) {  // stopped by stop_after_steps or a signal: the position is mid-epoch
      r.complete = false;
      if (options_.verbose) {
        std::printf("stopped %safter step %lld (epoch %lld, batch %lld of %lld)%s\n",
                    stopped_by_ ? ("by " + StopSignals::name(stopped_by_) + " ").c_str() : "",
                    static_cast<long long>(state_.global_step), static_cast<long long>(epoch + 1),
                    static_cast<long long>(done), static_cast<long long>(batches),
                    options_.checkpoint_path.empty() ? "" : ("; checkpoint " + options_.checkpoint_path).c_str());
        std::fflush(stdout);
      }
      if (!options_.checkpoint_path.empty()) save(options_.checkpoint_path);
      return r;
    }
    if (test) {
      auto [test_loss, test_acc] = evaluate(*test);
      r.test_loss = test_loss;
      r.test_accuracy = test_acc;
    }
    state_.epoch = epoch + 1;
    state_.loader_epoch = epoch + 1;
    state_.loader_next_batch = 0;
    state_.loader_next_sample = 0;
    if (options_.verbose) {
      char ranks[96] = "";
      if (r.ranks > 1)
        std::snprintf(ranks, sizeof ranks, " (all %d ranks; %.0f per rank)", r.ranks, r.images_per_second / r.ranks);
      char tested[64] = "";  // fit() without a test loader: no test figures (not zeros)
      if (test) std::snprintf(tested, sizeof tested, " | test loss %.4f acc %.2f%%", r.test_loss, 100 * r.test_accuracy);
      std::printf("epoch %lld: train loss %.4f acc %.2f%%%s | %.1f s, %.0f %s%s\n", static_cast<long long>(r.epoch),
                  r.train_loss, 100 * r.train_accuracy, tested, r.seconds, r.images_per_second, kUnit, ranks);
      std::fflush(stdout);
    }
    // Checkpoint first: if the process dies between the two, a resume redoes this epoch's
    // metrics line rather than writing it twice.
    if (!options_.checkpoint_path.empty()) save(options_.checkpoint_path);
    metrics_.write(JsonRecord()
                       .add("epoch", r.epoch)
                       .add("train_loss", r.train_loss)
                       .add("train_accuracy", r.train_accuracy)
                       .add("test_loss", r.test_loss)
                       .add("test_accuracy", r.test_accuracy)
                       .add("seconds", r.seconds)
                       .add(TokenModel<Model> ? "tokens_per_second" : "images_per_second", r.images_per_second)
                       .add(TokenModel<Model> ? "rank_tokens_per_second" : "rank_images_per_second",
                            r.rank_images_per_second)
                       .add("ranks", r.ranks)
                       .add("data_wait_fraction", r.data_wait_fraction)
                       .add("lr", r.lr));
    return r;
  }

  // Mean loss and accuracy over a whole loader, in eval mode (BN uses running statistics), forward
  // only (Mode::Inference: convolutions fused with the BatchNorm, ReLU and residual add after them).
  template <BatchSource<S> Loader>
  std::pair<double, double> evaluate(Loader& loader) {
    model_.set_mode(Mode::Inference);
    loader.start_epoch(0);
    double loss_sum = 0;
    std::int64_t correct = 0, seen = 0;
    while (loader.next(eval_batch_)) {
      const auto n = static_cast<std::int64_t>(eval_batch_.labels.size());
      if constexpr (kRunsModel) {
        const ModelStepResult r = strategy_.evaluate_batch(model_input(eval_batch_), eval_batch_.labels);
        loss_sum += r.loss * static_cast<double>(n);
        correct += r.correct;
      } else {
        const auto& logits = forward(eval_batch_);
        loss_sum += static_cast<double>(loss_.forward(logits, eval_batch_.labels, loss_cache_)) * static_cast<double>(n);
        correct += count_correct(logits, eval_batch_.labels);
      }
      seen += n;
    }
    model_.set_mode(Mode::Train);
    return {seen ? loss_sum / static_cast<double>(seen) : 0.0,
            seen ? static_cast<double>(correct) / static_cast<double>(seen) : 0.0};
  }

  // The checkpoint, then each rank's strategy state beside it (when the strategy has any). With an
  // optimizer that checkpoints as shards (FullyShardedOptimizer) and asks for them, `path` is a
  // directory of per-rank shards (train/sharded_checkpoint.hpp); load() reads either kind.
  void save(const std::string& path) {
    refuse_split_model_checkpoint(path);
    if (writes_shards())
      save_sharded(path);
    else
      save_checkpoint(path, model_, optimizer_, state_, options_.checkpoint_group, options_.checkpoint_options);
    save_strategy_state(path);
  }
  void load(const std::string& path) {
    refuse_split_model_checkpoint(path);
    if (is_sharded_checkpoint(path))
      state_ = load_sharded(path);
    else
      state_ = load_checkpoint(path, model_, optimizer_, options_.checkpoint_group, options_.checkpoint_options);
    loaded_from_ = path;
    load_strategy_state(path);
  }
  // Also checks at once that the checkpoint's data-loader position fits `train` (world size, batch
  // size, seed, dataset size), so that a mismatch is reported before anything says "resumed".
  template <BatchSource<S> Loader>
  void load(const std::string& path, const Loader& train) {
    load(path);
    check_loader_matches_state(train);
  }

  const TrainState& state() const { return state_; }
  // Continues from `state` (the elastic driver's: taken from a healthy peer's memory instead of a
  // checkpoint file); fit() then checks it against its loader as it checks a loaded one.
  void set_state(const TrainState& state) { state_ = state; }
  // The signal that stopped fit() (TrainOptions::stop_signals), or 0.
  int stopped_by() const { return stopped_by_; }

 private:
  static constexpr bool kRunsModel = detail::strategy_runs_model<Strat>();
  static constexpr const char* kUnit = TokenModel<Model> ? "tok/s" : "img/s";

  // What the model reads from a batch: its token ids (a TokenModel), or its images where the model is.
  decltype(auto) model_input(const Batch<S>& batch) {
    check_batch_kind(batch);
    if constexpr (TokenModel<Model>) return (batch.tokens);
    else return on_device(batch.images);
  }
  void check_batch_kind(const Batch<S>& batch) const {
    if constexpr (TokenModel<Model>) {
      TESSERA_CHECK(batch.tokens.rank() == 2 && batch.tokens.numel() > 0 &&
                        static_cast<std::int64_t>(batch.labels.size()) == batch.tokens.numel(),
                    ArgumentError, "Trainer: ", model_.name(), " reads token ids (n, T) with n T next-token labels, "
                    "but the batch has tokens ", batch.tokens.shape(), " and ", batch.labels.size(), " labels (an image "
                    "loader? use a TokenLoader)");
    } else {
      TESSERA_CHECK(batch.tokens.numel() == 0, ArgumentError, "Trainer: the batch holds token ids ",
                    batch.tokens.shape(), " but the model takes images (a TokenLoader feeds a TokenModel such as GPT)");
    }
  }

  // The model's logits for a batch: images through a Layer, token ids through a TokenModel.
  const typename Model::Tensor& forward(const Batch<S>& batch) {
    check_batch_kind(batch);
    if constexpr (TokenModel<Model>) return model_.forward(batch.tokens, model_cache_);
    else return model_.forward(on_device(batch.images), model_cache_);
  }

  // A checkpoint holds one copy of the model and of the optimizer, rank 0's: right for replicas,
  // wrong for a model split over ranks (each pipeline stage trains and steps its own units only),
  // unless the optimizer gathers the parts or writes them as shards (FullyShardedOptimizer).
  void refuse_split_model_checkpoint(const std::string& path) const {
    TESSERA_CHECK(!kRunsModel || ShardedCheckpointOptimizer<Optimizer>, ArgumentError, "Trainer: checkpoint '", path,
                  "' with ", strategy_.name(), ": its ranks each hold part of the model and of the optimizer state, "
                  "and a checkpoint holds rank 0's; checkpoints of a split model are not supported yet (train "
                  "without checkpoint_path)");
  }
  bool writes_shards() const {
    if constexpr (ShardedCheckpointOptimizer<Optimizer>) return optimizer_.sharded_checkpoints();
    else return false;
  }
  void save_sharded(const std::string& path) {
    if constexpr (ShardedCheckpointOptimizer<Optimizer>)
      save_sharded_checkpoint(path, model_, optimizer_, state_, options_.checkpoint_group, options_.checkpoint_options);
  }
  TrainState load_sharded(const std::string& path) {
    if constexpr (ShardedCheckpointOptimizer<Optimizer>) {
      return load_sharded_checkpoint(path, model_, optimizer_, options_.checkpoint_group, options_.checkpoint_options);
    } else {
      throw ArgumentError(detail::cat("Trainer: '", path, "' is a sharded checkpoint (a directory of per-rank shards, ",
                                      "which FullyShardedDataParallel writes); load it under FullyShardedDataParallel, ",
                                      "or make it one file with consolidate_sharded_checkpoint(dir, file)"));
    }
  }

  // Whether this step is recorded on the timeline (TrainOptions::timeline_first_step, timeline_steps).
  bool recording() const {
    if (options_.timeline == nullptr || trace_written_) return false;
    const std::int64_t step = state_.global_step;
    return step >= options_.timeline_first_step &&
           (options_.timeline_steps == 0 || step < options_.timeline_first_step + options_.timeline_steps);
  }
  // Collective over the checkpoint group; recording stops.
  void write_trace() {
    trace_written_ = true;
    strategy_.set_timeline(nullptr);
    recorded_last_step_ = false;
    if (!options_.trace_path.empty()) options_.timeline->write(options_.checkpoint_group, options_.trace_path);
  }

  // The batch's images where the model is: the host batch itself on the CPU, else a copy in one of
  // two device tensors used in turn and kept across steps (the model's caches point at one until
  // backward), sent through the device's page-locked staging buffers on its copy stream
  // (Cuda::upload_rotating), so this step's transfer overlaps the last step's backward and the
  // loader prepares the next batch meanwhile.
  const Tensor<S, typename E::Device>& on_device(const Tensor<S, Cpu>& images) {
    using D = typename E::Device;
    if constexpr (std::is_same_v<D, Cpu>) {
      return images;
    } else {
      // Both sized at once, so the first step's memory already counts the second.
      bool fresh = false;
      for (auto& buffer : device_images_) {
        const S* before = buffer.data();
        buffer.resize(images.shape());
        fresh = fresh || buffer.data() != before;
      }
      auto& dst = device_images_[next_device_images_];
      next_device_images_ = 1 - next_device_images_;
      D::upload_rotating(dst.data(), images.data(), images.bytes(), fresh);  // staged, asynchronous
      return dst;
    }
  }

  bool step_limit_reached() const {
    return options_.stop_after_steps > 0 && state_.global_step >= options_.stop_after_steps;
  }

  // The first stop signal any rank has received (0: none), the same on every rank: each rank's
  // flag may flip between two ranks' reads, so they stop at a step all of them agree on.
  int agreed_stop_signal() {
    if (options_.stop_signals == nullptr) return 0;
    const std::int64_t mine = options_.stop_signals->received();
    const auto& group = options_.checkpoint_group;
    if (group.size() <= 1) return static_cast<int>(mine);
    group.all_gather(std::span<const std::int64_t>(&mine, 1), std::span<std::int64_t>(stop_flags_));  // kept buffer
    for (const std::int64_t seen : stop_flags_)
      if (seen != 0) return static_cast<int>(seen);
    return 0;
  }

  // What the Trainer does for each micro-batch of the strategy's loop: forward and loss, backward of
  // the loss weighted by the micro-batch's share of the step's samples, the hooks around them.
  double micro_step(const Batch<S>& micro, const MicroBatch& mb) {
    Timeline* t = recorded_last_step_ ? options_.timeline : nullptr;
    std::optional<Timeline::Span> span;
    strategy_.before_forward(mb);
    if (t) span.emplace(t->span("forward"));
    std::optional<MemoryScope> memory(std::in_place, "the forward pass (activations)");
    const auto& logits = forward(micro);  // (n, classes), or a TokenModel's (n, T, V)
    const S loss = loss_.forward(logits, micro.labels, loss_cache_);
    correct_ += count_correct(logits, micro.labels);
    strategy_.before_backward(mb);
    if (t) span.emplace(t->span("backward"));
    memory.emplace("the backward pass (gradients)");
    const auto& dlogits = loss_.backward(loss_cache_);
    const double weight = mb.weight * batch_weight_;
    if (weight == 1.0) {
      model_.backward(dlogits, model_cache_);
    } else {  // d(w L)/dlogits = w dL/dlogits
      weighted_dlogits_.resize(dlogits.shape());
      scale_elements(typename E::Device{}, dlogits.data(), dlogits.numel(), static_cast<S>(weight),
                     weighted_dlogits_.data());
      model_.backward(weighted_dlogits_, model_cache_);
    }
    span.reset();
    strategy_.after_backward(mb);
    return static_cast<double>(loss);
  }

  // Every rank writes its own strategy state (all ranks succeed or all throw). The file records the
  // step and world size it belongs to, so a stale one (a save cut short between the checkpoint and
  // it) is refused on load instead of mixed in.
  void save_strategy_state(const std::string& path) {
    StrategyState st;
    rank_state(st);
    if (st.empty()) return;
    const auto& group = options_.checkpoint_group;
    const std::string file = strategy_state_path(path, group.rank());
    std::exception_ptr failure;
    try {
      SafetensorsWriter writer;
      for (const auto& [name, values] : st.entries())
        writer.add_raw(name, DType::F64, Shape{static_cast<std::int64_t>(values.size())}, values.data(),
                       values.size() * sizeof(double));
      writer.set_metadata("format", "tessera-strategy-state-1");
      writer.set_metadata("strategy", strategy_.name());
      writer.set_metadata("train.global_step", std::to_string(state_.global_step));
      writer.set_metadata("train.ranks", std::to_string(group.size()));
      writer.write(file);
    } catch (...) {
      failure = std::current_exception();
    }
    agree_or_throw(failure, "save", file);
  }

  // Loads this rank's strategy state when the strategy has any. At another world size (an elastic
  // resume) the per-rank state does not carry over: it starts afresh, and the Trainer says so.
  void load_strategy_state(const std::string& path) {
    StrategyState expected;
    rank_state(expected);
    if (expected.empty()) return;
    const auto& group = options_.checkpoint_group;
    const std::string file = strategy_state_path(path, group.rank());
    if (state_.loader_world_size != 0 && state_.loader_world_size != group.size()) {
      if (options_.verbose && group.rank() == 0)
        std::printf("elastic resume: %s's per-rank state (%s) was saved by %lld ranks; it starts afresh here\n",
                    strategy_.name().c_str(), file.c_str(), static_cast<long long>(state_.loader_world_size));
      return;
    }
    std::exception_ptr failure;
    StrategyState loaded;
    try {
      const SafetensorsFile f = SafetensorsFile::load(file);
      const auto& meta = f.metadata();
      const auto entry = [&](const char* key) { return meta.count(key) ? meta.at(key) : std::string("(none)"); };
      TESSERA_CHECK(entry("format") == "tessera-strategy-state-1", IoError, "Trainer: '", file,
                    "' is not a strategy state file (format ", entry("format"), ")");
      TESSERA_CHECK(entry("train.global_step") == std::to_string(state_.global_step), IoError, "Trainer: '", file,
                    "' holds ", entry("strategy"), "'s state at step ", entry("train.global_step"), " but '", path,
                    "' is at step ", state_.global_step, " (a save was cut short between the two files); resume from "
                    "an earlier checkpoint");
      // Every entry the strategy has now must be there with its size; the file may hold more
      // (state that exists only at some steps, such as LocalSgd's mid-period values).
      std::string problems;
      for (const auto& [name, values] : expected.entries()) {
        if (!f.has(name)) problems += "\n  missing '" + name + "'";
        else if (f.info(name).shape.numel() != static_cast<std::int64_t>(values.size()))
          problems += "\n  '" + name + "' holds " + std::to_string(f.info(name).shape.numel()) + " values, not " +
                      std::to_string(values.size());
      }
      for (const auto& name : f.names()) {
        const TensorInfo& info = f.info(name);
        if (info.dtype != DType::F64) {
          problems += "\n  '" + name + "' is not float64";
          continue;
        }
        std::vector<double> v(static_cast<std::size_t>(info.shape.numel()));
        std::memcpy(v.data(), f.raw(name), v.size() * sizeof(double));
        loaded.put(name, std::span<const double>(v));
      }
      TESSERA_CHECK(problems.empty(), IoError, "Trainer: '", file, "' does not fit ", strategy_.name(), ":", problems);
    } catch (...) {
      failure = std::current_exception();
    }
    agree_or_throw(failure, "load", file);
    strategy_.load_state(loaded);
    if constexpr (detail::strategy_per_rank_optimizer_state<Strat>()) {
      detail::OptimizerStateFromRankState from{loaded};
      optimizer_.visit_state(from);
    }
  }

  // What each rank keeps beside the checkpoint: the strategy's state and, when the ranks' optimizer
  // states differ, this rank's optimizer state.
  void rank_state(StrategyState& st) {
    strategy_.save_state(st);
    if constexpr (detail::strategy_per_rank_optimizer_state<Strat>()) {
      detail::OptimizerStateToRankState to{st};
      optimizer_.visit_state(to);
    }
  }

  // All ranks of the checkpoint group learn whether every rank's part succeeded; those that did
  // throw too, naming the ranks that did not.
  void agree_or_throw(const std::exception_ptr& failure, const char* what, const std::string& file) {
    const auto& group = options_.checkpoint_group;
    if (group.size() > 1) {
      const std::string failed = detail::ranks_that_failed(group, failure != nullptr);
      if (!failure && !failed.empty())
        throw IoError(detail::cat("Trainer: rank(s) ", failed, " could not ", what, " their strategy state (their "
                                  "errors say why; this rank's is '", file, "')"));
    }
    if (failure) std::rethrow_exception(failure);
  }

  // A checkpoint's data-loader position only means something for the loader it was taken with.
  // The world size comes first: another world size is an elastic resume (check_resume_world_size
  // is the one place that decides), which keeps the global batch, so the per-rank batch size
  // changes with it; the position is then re-split from its global-sample form.
  template <BatchSource<S> Loader>
  void check_loader_matches_state(const Loader& loader) {
    const auto& o = loader.options();
    const std::string file = loaded_from_.empty() ? "the checkpoint" : "'" + loaded_from_ + "'";
    const bool resuming = state_.global_step != 0;
    const std::int64_t saved_world = state_.loader_world_size, saved_batch = state_.loader_batch_size;
    const std::int64_t o_batch = position_batch(o), o_world = position_world(o);
    if (resuming && saved_world != 0 && saved_world != o_world && saved_batch != 0) {
      const std::int64_t global = saved_batch * saved_world;
      // A global-batch loader splits any global batch over any world size.
      if (o.global_batch_size == 0) check_resume_world_size(file, saved_world, o.world_size, global);
      TESSERA_CHECK(o_batch * o_world == global, ArgumentError, "Trainer: ", file,
                    " was saved at world size ", saved_world, " with a global batch of ", global, " (", saved_world,
                    " x ", saved_batch, "); an elastic resume keeps the global batch, so at world size ", o.world_size,
                    " the loader's batch_size must be ", global / o.world_size, ", but it is ", o.batch_size,
                    " (a global batch of ", o_batch * o_world, ")");
      // Batch i of an epoch holds the same samples at every world size with this global batch.
      const std::int64_t sample = state_.loader_next_sample;
      TESSERA_CHECK(sample % global == 0, ArgumentError, "Trainer: ", file, ": the position in the epoch, sample ",
                    sample, ", is not at a global batch boundary (", global, ")");
      state_.loader_next_batch = sample / global;
      state_.loader_batch_size = o_batch;
      state_.loader_world_size = o_world;
      if (options_.verbose) {
        std::printf("elastic resume: %s was saved at world size %lld, continuing at world size %lld (%lld x %lld = "
                    "global batch %lld) in epoch %lld at sample %lld%s\n",
                    file.c_str(), static_cast<long long>(saved_world), static_cast<long long>(o.world_size),
                    static_cast<long long>(o.world_size), static_cast<long long>(o.batch_size),
                    static_cast<long long>(global), static_cast<long long>(state_.loader_epoch + 1),
                    static_cast<long long>(sample),
                    o.world_size > saved_world ? "; the new ranks keep the random generators their program seeded" : "");
        std::fflush(stdout);
      }
    }
    const std::int64_t now[] = {o_batch, static_cast<std::int64_t>(o.seed), loader.dataset_size(), o_world};
    std::int64_t* saved[] = {&state_.loader_batch_size, &state_.loader_seed, &state_.loader_samples,
                             &state_.loader_world_size};
    const char* what[] = {"batch size", "seed", "dataset size", "world size"};
    for (int i = 0; i < 4; ++i) {
      TESSERA_CHECK(*saved[i] == 0 || *saved[i] == now[i] || !resuming, ArgumentError, "Trainer: ", file,
                    ": the data-loader position was taken with ", what[i], " ", *saved[i], " but this loader has ",
                    now[i], "; resume with the same settings");
      *saved[i] = now[i];
    }
    if (state_.loader_next_sample == 0) state_.loader_next_sample = state_.loader_next_batch * o_batch * o_world;
  }

  // Ranks launched with different training settings (a learning rate, seed, batch or epoch
  // count given to one rank only) would each train on in silence: a loader seed that differs
  // makes ranks read overlapping samples and skip others, a learning rate that differs makes the
  // replicas drift apart (DataParallel's checksum finds that only at its next check, maybe after
  // the run). With a checkpoint group of more than one rank, the first fit() compares them (one
  // all_gather of two int64 when they agree) and throws AgreementError on every rank naming the
  // first setting that differs and the ranks holding each value.
  template <BatchSource<S> Loader>
  void check_settings_agree(const Loader& train) {
    CheckpointGroup group = options_.checkpoint_group;
    if (group.size() <= 1) return;
    AgreementRecord record("Trainer");
    record.add("options.epochs", options_.epochs);
    record.add("options.label_smoothing", options_.label_smoothing);
    record.add("options.stop_after_steps", options_.stop_after_steps);
    record.add("options.checkpoint_every_steps", options_.checkpoint_every_steps);
    // A rank without stop signals would not join the per-step agreement the others wait in.
    record.add("options.stop_signals", options_.stop_signals != nullptr);
    const LoaderOptions& lo = train.options();
    record.add("train loader: dataset samples", static_cast<std::int64_t>(train.dataset_size()));
    record.add("train loader: batch_size", lo.batch_size);
    record.add("train loader: shuffle", lo.shuffle);
    record.add("train loader: seed", lo.seed);
    record.add("train loader: drop_last", lo.drop_last);
    record.add("train loader: world_size", lo.world_size);
    record.add("train loader: drop_tail", lo.drop_tail);
    record.add("train loader: global_batch_size", lo.global_batch_size);
    // The learning rate at the start and at each quarter of the run: a different base rate,
    // warm-up or decay shows in one of them.
    for (int quarter = 0; quarter <= 4; ++quarter) {
      const double at = static_cast<double>(options_.epochs) * quarter / 4.0 - (quarter == 4 ? 1e-6 : 0.0);
      char at_text[32];
      std::snprintf(at_text, sizeof at_text, "%g", at);
      record.add(std::string("learning rate schedule at epoch ") + at_text, schedule_(at));
    }
    record.add("resumed at epoch", state_.epoch);
    record.add("resumed at global step", state_.global_step);
    check_agreement(group, record,
                    "every rank must be launched with the same training settings: learning rate, schedule, epochs, "
                    "batch, seed and data");
  }

  Model& model_;
  Optimizer& optimizer_;
  NoStrategy<E> none_;  // the strategy when none is given
  Strat& strategy_;
  Schedule schedule_;
  TrainOptions options_;
  CrossEntropyLoss<E> loss_;
  MetricsWriter metrics_;
  typename Model::Cache model_cache_{};
  typename CrossEntropyLoss<E>::Cache loss_cache_{};
  Batch<S> batch_, eval_batch_;
  std::array<Tensor<S, typename E::Device>, 2> device_images_;  // on_device's copies, in turn (GPU models only)
  std::size_t next_device_images_ = 0;
  Tensor<S, typename E::Device> weighted_dlogits_;  // micro_step: the loss gradient x the micro-batch's weight
  MicroStep<S> micro_step_;                          // calls micro_step (built once: no allocation per step)
  double batch_weight_ = 1.0;                         // the step's Batch::weight (this rank's share)
  std::vector<std::int64_t> stop_flags_;             // agreed_stop_signal's all_gather
  bool strategy_started_ = false;
  bool recorded_last_step_ = false;  // this (or the last) step is on the timeline
  bool trace_written_ = false;       // the timeline's window is over (and written to trace_path)
  TrainState state_;
  std::string loaded_from_;  // the checkpoint state_ came from (for messages)
  int stopped_by_ = 0;       // the stop signal fit() stopped on (agreed by all ranks), or 0
  std::int64_t correct_ = 0;
  bool settings_checked_ = false;
};

}  // namespace tessera
