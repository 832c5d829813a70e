// 06_pipeline_parallel: LeNet-5 on Fashion-MNIST split into P pipeline stages, one per rank, each
// batch cut into M micro-batches, GPipe or 1F1B; optionally R data-parallel replicas of the whole
// pipeline (hybrid). One source, one binary per communicator:
//
//   build/examples/06_pipeline_parallel_threads --stages=2 --micro-batches=4
//   mpirun -n 2 build/examples/06_pipeline_parallel_mpi --schedule=gpipe
//   build/examples/06_pipeline_parallel_threads --stages=2 --replicas=2     4 ranks: 2 x 2
//   tools/tessera-run -n 2 build/examples/06_pipeline_parallel_nccl          one stage per GPU
//
// Flags: --epochs=3 --batch=64 (global) --micro-batches=4 --schedule=1f1b|gpipe --lr=0.05
// --threads=1 --seed=1 --limit=N --data-dir=DIR --trace=trace.json (one step's schedule as a
// Chrome trace), --replicas=1, and for the threads build --stages=2.
//
// It checks itself first: on the first batch, the pipeline's loss and every stage's gradients
// must equal the unsplit model's (every rank builds the whole model from the same seed, so it
// can compute the reference too), and it stops with an error if they do not.
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <string>

#include "tessera/tessera.hpp"
#include "tessera/build_env.hpp"
#include "common/device_batch.hpp"
#include "common/fashion_mnist_data.hpp"
#include "common/memory.hpp"

using namespace tessera;

namespace {

struct Options {
  std::int64_t epochs = 3, batch = 64, limit = 0;
  int micro_batches = 4, threads = 1, stages = 2, replicas = 1;
  bool stages_given = false;  // under a launcher, --stages not given means "as many as it started"
  double lr = 0.05;
  std::uint64_t seed = 1;
  std::string schedule = "1f1b", data_dir, trace;
};

using E = BuildEnv;  // CpuThreads, CpuMpi, CpuGloo or CudaNccl: chosen by the build, nowhere else
using Device = E::Device;
using Comm = E::Comm;
using Model = LeNet5<E>;

// The first batch through the unsplit model and through the pipeline: equal loss and gradients.
// Also measures the activation memory of the pipeline's first step (see train()), after the
// reference has run, so that this thread's scratch already holds the largest workspace.
template <class Pipe>
examples::RankMemory<Device, Comm>::Bytes check_against_unsplit(Pipe& pipe, Comm& pipe_comm,
                                                                examples::RankMemory<Device, Comm>& memory,
                                                                const Batch<float>& b, std::uint64_t seed, bool report) {
  auto whole = lenet5<E>(1, 28, 10, seed);
  Model::Cache cache{};
  CrossEntropyLoss<E> loss;
  CrossEntropyLoss<E>::Cache loss_cache;
  examples::DeviceBatch<Device> images;
  const float expected = loss.forward(whole.forward(images(b.images), cache), b.labels, loss_cache);
  whole.backward(loss.backward(loss_cache), cache);
  memory.start();
  const float got = pipe.train_step(images(b.images), b.labels);
  const auto activation_bytes = memory.peak();
  std::map<std::string, Parameter<float, Device>*> reference;
  for (auto& [name, p] : named_tensors(whole).parameters) reference[name] = p;
  double worst = 0;
  for (auto& [name, p] : pipe.stage_parameters().parameters) {
    const auto mine = to_host(p->grad), want = to_host(reference.at(name)->grad);
    for (std::int64_t k = 0; k < mine.numel(); ++k)
      worst = std::max(worst, static_cast<double>(std::abs(mine[k] - want[k])));
  }
  std::array<double, 1> all{worst};  // the largest difference over the stages
  pipe_comm.all_reduce(std::span<double>(all), ReduceOp::Max);
  worst = all[0];
  TESSERA_CHECK(std::abs(got - expected) < 1e-5f && worst < 1e-5, Error, "06_pipeline_parallel: the pipeline differs "
                "from the unsplit model on the first batch: loss ", got, " vs ", expected, ", gradients by ", worst);
  if (report)
    std::printf("check: first batch through the pipeline = the unsplit model (loss %.6f vs %.6f, gradients within %.1e)\n",
                got, expected, worst);
  for (auto& [name, p] : pipe.stage_parameters().parameters) p->grad.zero();
  return activation_bytes;
}

void train(Comm& world, const Options& o, int stages) {
  TESSERA_CHECK(world.size() % stages == 0, ArgumentError, "06_pipeline_parallel: ", world.size(),
                " ranks do not form replicas of ", stages, " stages");
  const int replicas = world.size() / stages, replica = world.rank() / stages, stage = world.rank() % stages;
  // The global batch splits evenly over the replicas and each replica's share into the
  // micro-batches, or it is refused here, before the data is read: never silently rounded.
  TESSERA_CHECK(o.batch % replicas == 0, ArgumentError, "--batch=", o.batch,
                " (the global batch) does not split over ", replicas, " replicas");
  TESSERA_CHECK((o.batch / replicas) % o.micro_batches == 0, ArgumentError, "--batch=", o.batch,
                " over ", replicas, " replica(s) is ", o.batch / replicas, " per replica, which does not split into ",
                "--micro-batches=", o.micro_batches);
  Cpu::set_num_threads(o.threads);
  // Rank = replica x stages + stage: my pipeline, and the same stage in the other replicas.
  Comm pipe_comm = world.split(replica, stage);
  Comm dp_comm = world.split(stage, replica);
  const bool reporter = world.rank() == stages - 1;  // the last stage of replica 0 holds the loss

  auto [train_set, test_set] = examples::load_normalized_fashion_mnist(o.data_dir, o.limit);

  auto model = lenet5<E>(1, 28, 10, o.seed);  // every rank builds all of it; each runs its stage
  Timeline timeline(world);
  const auto schedule = o.schedule == "gpipe" ? PipelineSchedule::GPipe : PipelineSchedule::OneFOneB;
  DataLoader<float> loader(train_set, {.batch_size = o.batch / replicas, .shuffle = true, .seed = o.seed, .rank = replica,
                                       .world_size = replicas, .drop_tail = true});
  DataLoader<float> test_loader(test_set, {.batch_size = 500, .shuffle = false});
  Batch<float> batch;
  loader.start_epoch(0);
  TESSERA_CHECK(loader.next(batch), Error, "06_pipeline_parallel: no training data");
  // Balance: rank 0 times each layer's forward + backward on one micro-batch and the layers are
  // split to even out the stages' times (conv layers cost far more than their few parameters say).
  const std::int64_t micro = batch.images.dim(0) / o.micro_batches;
  Tensor<float> host_sample(Shape{micro, 1, 28, 28});
  std::copy_n(batch.images.data(), host_sample.numel(), host_sample.data());
  const auto sample = to_device<Device>(host_sample);
  examples::DeviceBatch<Device> images;
  Pipeline pipe(model, pipe_comm, {.micro_batches = o.micro_batches, .schedule = schedule},
                pipe_comm.rank() == 0 ? &sample : nullptr);
  Sgd<E> sgd(pipe.stage_parameters(), {.lr = o.lr, .momentum = 0.9});
  const CosineLr lr_schedule{o.lr, static_cast<double>(o.epochs), 0.0};

  if (world.rank() == 0) {
    std::printf("06_pipeline_parallel: LeNet-5, %d stage(s) x %d replica(s), %s, global batch %lld = %d x %d micro-batches "
                "of %lld\n", stages, replicas, schedule_name(schedule), static_cast<long long>(o.batch), replicas,
                o.micro_batches, static_cast<long long>(o.batch / replicas / o.micro_batches));
    for (int s = 0; s < stages; ++s) {
      const auto first = pipe.boundaries()[static_cast<std::size_t>(s)], end = pipe.boundaries()[static_cast<std::size_t>(s) + 1];
      std::printf("  stage %d: layers %s..%s of LeNet-5's 12 (conv1 relu pool conv2 relu pool flatten fc1 relu fc2 relu fc3)\n",
                  s, model.unit_name(first).c_str(), model.unit_name(end - 1).c_str());
    }
  }
  // Activation memory, measured: a stage keeps one set of buffers per micro-batch slot
  // (Pipeline::activation_slots) from its first step on, reused by every later step; the
  // allocator's peak during that first step (the check's) above what was in use before it.
  const auto unit_values = examples::unit_output_values_per_sample<Device>(model, Shape{1, 1, 28, 28});
  examples::RankMemory<Device, Comm> memory(world);
  const auto activation_bytes = check_against_unsplit(pipe, pipe_comm, memory, batch, o.seed, world.rank() == 0);
  // Hybrid: each stage's gradients are averaged over the replicas holding the same stage (after
  // the check, whose backward must not reach these hooks).
  std::optional<DataParallel<E>> dp;
  if (replicas > 1) dp.emplace(pipe.stage(), dp_comm, DataParallelOptions{.average_micro_steps = false});
  // One step's forward and backward: the pipeline's micro-batches accumulate the gradients with
  // DataParallel's hooks held back (no_sync), then one all-reduce over the replicas (finish).
  auto pipeline_step = [&](Batch<float>& b) {
    float loss;
    {
      std::optional<DataParallel<E>::NoSync> guard;
      if (dp) guard.emplace(dp->no_sync());
      loss = pipe.train_step(images(b.images), b.labels);
    }
    if (dp) dp->finish();
    return loss;
  };

  double idle_sum = 0;
  std::int64_t idle_steps = 0;
  for (std::int64_t epoch = 0; epoch < o.epochs; ++epoch) {
    sgd.set_lr(lr_schedule(static_cast<double>(epoch)));
    model.set_mode(Mode::Train);
    loader.start_epoch(epoch);
    const auto started = std::chrono::steady_clock::now();
    double loss_sum = 0;
    std::int64_t steps = 0;
    while (loader.next(batch)) {
      sgd.zero_grad();
      const float loss = pipeline_step(batch);
      sgd.step();
      loss_sum += loss;
      ++steps;
      if (steps > 1) {  // step 1 warms caches up
        // Idle against the whole pipeline's step (the slowest stage's), not this stage's own.
        std::array<double, 1> step_time{pipe.last_step().step_seconds};
        pipe_comm.all_reduce(std::span<double>(step_time), ReduceOp::Max);
        idle_sum += 1.0 - pipe.last_step().busy_seconds / step_time[0];
        ++idle_steps;
      }
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    // Test accuracy: forward through the stages, counted on the last one.
    model.set_mode(Mode::Eval);
    test_loader.start_epoch(0);
    std::array<double, 2> correct{0, 0};
    Batch<float> test_batch;
    while (test_loader.next(test_batch)) {
      const auto& logits = pipe.predict(images(test_batch.images));
      if (stage == stages - 1) correct[0] += static_cast<double>(count_correct(logits, test_batch.labels));
      correct[1] += static_cast<double>(test_batch.labels.size());
    }
    // The global loss: each pipeline returns its replica's mean loss; average over the replicas.
    std::array<double, 1> mean_loss{loss_sum / static_cast<double>(steps)};
    dp_comm.all_reduce(std::span<double>(mean_loss), ReduceOp::Avg);
    if (reporter)
      std::printf("epoch %lld: train loss %.4f%s | test acc %.2f%% | %.1f s, %.0f img/s (all ranks)\n",
                  static_cast<long long>(epoch + 1), mean_loss[0], replicas > 1 ? " (all replicas)" : "",
                  100 * correct[0] / correct[1], seconds, static_cast<double>(steps * o.batch) / seconds);
    std::fflush(stdout);
    if (epoch + 1 == o.epochs && reporter) std::printf("final test accuracy: %.2f%%\n", 100 * correct[0] / correct[1]);
  }

  // The bubble: each stage's measured idle fraction against (P - 1) / (M + P - 1).
  std::vector<double> mine{idle_steps ? idle_sum / static_cast<double>(idle_steps) : 0.0,
                           static_cast<double>(pipe.last_step().peak_in_flight),
                           static_cast<double>(pipe.last_step().bytes_sent_forward),
                           static_cast<double>(pipe.last_step().bytes_sent_backward), activation_bytes.requested,
                           activation_bytes.blocks};
  std::vector<double> all(mine.size() * static_cast<std::size_t>(pipe_comm.size()));
  pipe_comm.all_gather(std::span<const double>(mine), std::span<double>(all));
  constexpr std::size_t kFields = 6;  // per stage, in `all`
  // The schedule, asserted: the most micro-batches whose activations a stage held at once is M
  // under GPipe and min(M, P - s) under 1F1B, so a 1F1B run as GPipe (or the reverse) fails here,
  // on every rank of the pipeline (each has every stage's figure).
  for (int s = 0; s < stages; ++s) {
    const int expected = schedule == PipelineSchedule::GPipe ? o.micro_batches : std::min(o.micro_batches, stages - s);
    const auto held = static_cast<int>(all[kFields * static_cast<std::size_t>(s) + 1]);
    TESSERA_CHECK(held == expected, Error, "06_pipeline_parallel: stage ", s, " held the activations of ", held,
                  " micro-batches at once; the ", o.schedule, " schedule holds ", expected);
  }
  if (world.rank() == 0)
    std::printf("check: every stage held the activations of as many micro-batches as %s allows at most (%s) ok\n",
                o.schedule.c_str(), schedule == PipelineSchedule::GPipe ? "M" : "min(M, P - s)");
  if (world.rank() == 0) {
    const double ideal = static_cast<double>(stages - 1) / static_cast<double>(o.micro_batches + stages - 1);
    std::printf("bubble: ideal (P-1)/(M+P-1) = %.3f; measured idle fraction per stage:", ideal);
    for (int s = 0; s < stages; ++s) std::printf(" %.3f", all[kFields * static_cast<std::size_t>(s)]);
    std::printf("\nmicro-batches of activations held at the peak per stage:");
    for (int s = 0; s < stages; ++s) std::printf(" %.0f", all[kFields * static_cast<std::size_t>(s) + 1]);
    std::printf(" (%s)\n", schedule == PipelineSchedule::GPipe ? "GPipe: all M" : "1F1B: at most P - s");
    // Bytes per step across each stage boundary: the batch's activations there go forward and
    // their gradients come back, 2 x (samples per pipeline) x (bytes per sample at the boundary),
    // plus a 64-byte shape header per micro-batch. Bytes per sample: one sample through the
    // units before the boundary.
    model.set_mode(Mode::Eval);
    Model::Cache probe_cache{};
    Tensor<float> one_sample(Shape{1, 1, 28, 28});
    one_sample.zero();
    const auto probe = to_device<Device>(one_sample);
    const std::int64_t per_pipeline = o.batch / replicas;
    for (int s = 0; s + 1 < stages; ++s) {
      const auto end = pipe.boundaries()[static_cast<std::size_t>(s) + 1];
      const std::int64_t per_sample = model.forward_units(probe, probe_cache, 0, end).numel() * 4;
      const double formula = 2.0 * static_cast<double>(per_pipeline * per_sample) + 64.0 * o.micro_batches;
      const double measured = all[kFields * static_cast<std::size_t>(s) + 2] + all[kFields * static_cast<std::size_t>(s + 1) + 3];
      std::printf("cost: stage %d <-> %d per step: 2 x %lld samples x %lld B + %d x 64 B headers = %.1f KiB by formula, "
                  "%.1f KiB sent in the last step\n", s, s + 1, static_cast<long long>(per_pipeline),
                  static_cast<long long>(per_sample), o.micro_batches, formula / 1024, measured / 1024);
    }
    // Activation memory per stage: one set per micro-batch slot (GPipe all M, 1F1B at most
    // P - s), each of (samples per micro-batch) x 4 B x the values a sample leaves there: every
    // unit's output, the stage's input, and the gradients that cross its boundaries (the one it
    // receives for its output and the one it sends for its input). Measured: the allocator's peak
    // during the first step, in bytes requested (and in its rounded blocks). The peak also holds
    // one micro-batch's gradients in flight, and lacks the outputs freed early (a convolution's,
    // once the ReLU after it has run: ReLU's backward reads only its own output).
    const std::int64_t micro = o.batch / replicas / o.micro_batches;
    double total = 0;
    std::printf("memory: activations per stage = slots x %lld samples x (unit outputs + input + boundary gradients) x "
                "4 B | allocator's peak in the first step\n", static_cast<long long>(micro));
    for (int s = 0; s < stages; ++s) {
      const auto first = pipe.boundaries()[static_cast<std::size_t>(s)], end = pipe.boundaries()[static_cast<std::size_t>(s) + 1];
      std::int64_t outputs = 0;
      for (auto u = first; u < end; ++u) outputs += unit_values[u];
      const std::int64_t input = first == 0 ? 28 * 28 : unit_values[first - 1];
      const std::int64_t gradients = (s > 0 ? input : 0) + (s + 1 < stages ? unit_values[end - 1] : 0);
      const int slots = schedule == PipelineSchedule::GPipe ? o.micro_batches : std::min(o.micro_batches, stages - s);
      const double formula = static_cast<double>(slots * micro * (outputs + input + gradients)) * 4.0;
      total += formula;
      std::printf("memory: stage %d: %d x %lld x (%lld + %lld + %lld) x 4 B = %.1f KiB", s, slots,
                  static_cast<long long>(micro), static_cast<long long>(outputs), static_cast<long long>(input),
                  static_cast<long long>(gradients), formula / 1024);
      const double requested = all[kFields * static_cast<std::size_t>(s) + 4], blocks = all[kFields * static_cast<std::size_t>(s) + 5];
      if (memory.ranks_per_process() == 1)
        std::printf(" | %.1f KiB (%.2fx; %.1f KiB in blocks)\n", requested / 1024, requested / formula, blocks / 1024);
      else
        std::printf("\n");
    }
    // Thread ranks share one allocator: only all stages together can be measured (those of this
    // replica and of the others, which hold the same again), and their peaks need not coincide.
    if (memory.ranks_per_process() > 1) {
      const double requested = all[kFields - 2] * memory.ranks_per_process();
      std::printf("memory: all %d ranks = %d replica(s) x %.1f KiB = %.1f KiB by formula | %.1f KiB, the peak of this "
                  "process's allocator (%.2fx; its thread ranks share it)\n", world.size(), replicas, total / 1024,
                  replicas * total / 1024, requested / 1024, requested / (replicas * total));
    }
  }
  // One more step, of the pipeline just trained (same split, same schedule), with the timeline on:
  // written as a Chrome trace, with this step's idle fractions printed to compare with it.
  if (!o.trace.empty()) {
    pipe.set_timeline(&timeline);
    model.set_mode(Mode::Train);
    loader.start_epoch(0);
    loader.next(batch);
    sgd.zero_grad();
    pipeline_step(batch);
    pipe.set_timeline(nullptr);
    std::array<double, 1> step_time{pipe.last_step().step_seconds};
    pipe_comm.all_reduce(std::span<double>(step_time), ReduceOp::Max);
    std::vector<double> idle{1.0 - pipe.last_step().busy_seconds / step_time[0]};
    std::vector<double> idles(static_cast<std::size_t>(pipe_comm.size()));
    pipe_comm.all_gather(std::span<const double>(idle), std::span<double>(idles));
    timeline.write(world, o.trace);
    if (world.rank() == 0) {
      std::printf("timeline of one step: %s; that step's idle fraction per stage (1 - F/B time / slowest stage's step):",
                  o.trace.c_str());
      for (double f : idles) std::printf(" %.3f", f);
      std::printf("\n");
    }
  }
}

Options parse(int argc, char** argv) {
  Flags flags(argc, argv);
  Options o;
  o.epochs = flags.get("epochs", o.epochs, {.min = 1});
  o.batch = flags.get("batch", o.batch, {.min = 1});
  o.micro_batches = flags.get("micro-batches", o.micro_batches, {.min = 1});
  o.schedule = flags.choice("schedule", o.schedule, {"1f1b", "gpipe"});
  o.lr = flags.get("lr", o.lr, {.above = 0});
  o.threads = flags.threads("threads", o.threads);
  o.stages = flags.get("stages", o.stages, {.min = 1, .max = 4096});  // the max keeps stages x replicas an int
  o.replicas = flags.get("replicas", o.replicas, {.min = 1, .max = 4096});
  o.stages_given = flags.has("stages");
  // Ranks of the threads build share this process's cores (a process backend runs one rank here).
  check_thread_budget(SharedMemoryCommunicator<Comm> ? std::int64_t{o.stages} * o.replicas : 1,
                      "--stages x --replicas", o.threads, "--threads");
  o.seed = static_cast<std::uint64_t>(flags.get("seed", std::int64_t{1}));
  o.limit = flags.get("limit", o.limit, {.min = 0});
  o.data_dir = flags.get("data-dir", std::string());
  o.trace = flags.output_path("trace", o.trace);
  flags.finish();
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    // Threads: --stages x --replicas ranks are spawned here. A process backend (mpirun,
    // tools/tessera-run) brings its own world, and every rank is a stage unless --replicas says
    // how many pipelines there are.
    launch<E>(
        [&](Comm& comm) {
          TESSERA_CHECK(comm.size() % o.replicas == 0, ArgumentError, comm.size(),
                        " ranks do not split into --replicas=", o.replicas, " pipelines of equal length");
          train(comm, o, comm.size() / o.replicas);
        },
        {.ranks = SharedMemoryCommunicator<Comm> || o.stages_given ? o.stages * o.replicas : 0});
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "06_pipeline_parallel: %s\n", e.what());
    return 1;
  }
}
