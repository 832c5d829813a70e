// What example 06 measures around its training, kept out of its main: the first-batch check
// against the unsplit model, each stage's idle fraction (the bubble) from per-step figures, the
// schedule asserted from the activations each stage held, and the printed cost model (bytes across
// every stage boundary, activation memory per stage) beside what was measured.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "common/device_batch.hpp"
#include "common/memory.hpp"
#include "tessera/tessera.hpp"

namespace examples {

// The first batch through the unsplit model `whole` (built from the same seed) and through the
// pipeline: equal loss and gradients, or an error. Returns the activation memory of the
// pipeline's step (the allocator's peak), measured after the reference ran, so that this thread's
// scratch already holds the largest workspace. Leaves the stage's gradients zero.
template <class Pipe, class Model, class Device, class Comm>
typename RankMemory<Device, Comm>::Bytes check_against_unsplit(Pipe& pipe, Comm& pipe_comm, RankMemory<Device, Comm>& memory,
                                                               Model& whole, const tessera::Batch<float>& b, bool report) {
  using E = typename Model::Env;
  typename Model::Cache cache{};
  tessera::CrossEntropyLoss<E> loss;
  typename tessera::CrossEntropyLoss<E>::Cache loss_cache;
  DeviceBatch<Device> images;
  const float expected = loss.forward(whole.forward(images(b.images), cache), b.labels, loss_cache);
  whole.backward(loss.backward(loss_cache), cache);
  memory.start();
  const float got = pipe.train_step(images(b.images), b.labels);
  const auto activation_bytes = memory.peak();
  std::map<std::string, tessera::Parameter<float, Device>*> reference;
  for (auto& [name, p] : tessera::named_tensors(whole).parameters) reference[name] = p;
  std::array<double, 1> worst{0};  // the largest difference over the stages
  for (auto& [name, p] : pipe.stage_parameters().parameters) {
    const auto mine = tessera::to_host(p->grad), want = tessera::to_host(reference.at(name)->grad);
    for (std::int64_t k = 0; k < mine.numel(); ++k)
      worst[0] = std::max(worst[0], static_cast<double>(std::abs(mine[k] - want[k])));
  }
  pipe_comm.all_reduce(std::span<double>(worst), tessera::ReduceOp::Max);
  TESSERA_CHECK(std::abs(got - expected) < 1e-5f && worst[0] < 1e-5, tessera::Error, "the pipeline differs from the "
                "unsplit model on the first batch: loss ", got, " vs ", expected, ", gradients by ", worst[0]);
  if (report)
    std::printf("check: first batch through the pipeline = the unsplit model (loss %.6f vs %.6f, gradients within %.1e)\n",
                got, expected, worst[0]);
  for (auto& [name, p] : pipe.stage_parameters().parameters) p->grad.zero();
  return activation_bytes;
}

// Every step's figures of this stage (record() them from the Trainer's before_step hook), to
// compare with the other stages' after training.
class PipelineSteps {
 public:
  void record(const tessera::PipelineStepStats& s) { steps_.push_back(s); }
  std::size_t size() const { return steps_.size(); }
  // The first step: a whole batch (the last one may be partial: 60,000 = 937.5 x 64).
  const tessera::PipelineStepStats& first() const {
    TESSERA_CHECK(!steps_.empty(), tessera::Error, "PipelineSteps: no step was recorded");
    return steps_.front();
  }

  // Each stage's mean idle fraction over steps [first, first + count): per step, 1 - its F/B
  // time / the slowest stage's step time (the pipeline's step). Collective over the pipeline.
  template <class Comm>
  std::vector<double> idle_fractions(Comm& pipe_comm, std::size_t first, std::size_t count) const {
    std::vector<double> mine;
    for (const auto& s : steps_) {
      mine.push_back(s.step_seconds);
      mine.push_back(s.busy_seconds);
    }
    const std::size_t n = mine.size(), stages = static_cast<std::size_t>(pipe_comm.size());
    std::vector<double> all(n * stages);
    pipe_comm.all_gather(std::span<const double>(mine), std::span<double>(all));
    std::vector<double> idle(stages, 0.0);
    const std::size_t end = std::min(first + count, steps_.size());
    for (std::size_t step = first; step < end; ++step) {
      double slowest = 0;
      for (std::size_t s = 0; s < stages; ++s) slowest = std::max(slowest, all[s * n + 2 * step]);
      for (std::size_t s = 0; s < stages; ++s) idle[s] += (1.0 - all[s * n + 2 * step + 1] / slowest) / static_cast<double>(end - first);
    }
    return idle;
  }

 private:
  std::vector<tessera::PipelineStepStats> steps_;
};

// stages: the pipeline's ranks (P); the table may give each several model stages (interleaved
// 1F1B v, ZB-V 2).
struct PipelineShape {
  int stages = 1, replicas = 1, micro_batches = 1;
  std::int64_t batch = 0;  // global
  tessera::PipelineScheduleTable table;  // the pipeline's (Pipeline::schedule())
  tessera::PipelineSimulation ideal = tessera::simulate_pipeline(table, {});  // F, I and W of one unit each
  // Micro-batches whose activations rank s holds at once, from the table: all M under GPipe,
  // min(M, P - s) under 1F1B (the formulas equal the simulation; tests/parallel/test_pipeline_schedule.cpp).
  int slots(int s) const { return ideal.peak_activations.at(static_cast<std::size_t>(s)); }
  bool one_stage_per_rank() const { return table.stages_per_rank == 1; }
  const char* bound() const {
    if (table.name == "GPipe") return "GPipe: all M";
    if (table.name == "1F1B") return "1F1B: at most P - s";
    return "the table's simulation";
  }
};

// The run's shape and each stage's layers, as the trace checker reads them
// (tests/check_pipeline_trace.py).
template <class Model, class Pipe>
void print_split(const char* title, Model& model, Pipe& pipe, const PipelineShape& shape) {
  std::printf("%s, %d stage(s) x %d replica(s), %s, global batch %lld = %d x %d micro-batches of %lld\n", title,
              shape.stages, shape.replicas, shape.table.name.c_str(), static_cast<long long>(shape.batch),
              shape.replicas, shape.micro_batches,
              static_cast<long long>(shape.batch / shape.replicas / shape.micro_batches));
  std::string units;
  for (std::size_t u = 0; u < model.unit_count(); ++u) units += (u ? " " : "") + model.unit_name(u);
  const auto& t = pipe.schedule();
  for (int s = 0; s < t.stage_count(); ++s) {
    std::printf("  stage %d: layers %s..%s of %zu (%s)", s, model.unit_name(pipe.boundaries()[s]).c_str(),
                model.unit_name(pipe.boundaries()[s + 1] - 1).c_str(), model.unit_count(), units.c_str());
    if (t.stages_per_rank > 1) std::printf(" on rank %d", t.rank_of(s));
    std::printf("\n");
  }
}

// Bytes per step across each stage boundary, by formula and as sent in the first step (`all`:
// every stage's report_pipeline fields; bytes sent forward at 1, backward at 2).
template <class Pipe>
void report_traffic(Pipe& pipe, const PipelineShape& shape, const std::vector<std::int64_t>& values,
                    const std::vector<double>& all, std::size_t fields) {
  const auto field = [&](int s, std::size_t f) { return all[fields * static_cast<std::size_t>(s) + f]; };
  const int p = shape.stages, m = shape.micro_batches;
  const std::int64_t per_pipeline = shape.batch / shape.replicas;
  if (!shape.one_stage_per_rank()) {
    // Several stages per rank: what each rank sends, over every boundary it sits on (none between
    // two of its own stages: handed over in memory). Forward: samples x bytes per sample + a
    // 64-byte header per micro-batch; backward the same values without headers.
    const auto& t = shape.table;
    for (int r = 0; r < p; ++r) {
      double formula = 0;
      for (int k = 0; k + 1 < t.stage_count(); ++k) {
        const std::int64_t per_sample = values[pipe.boundaries()[static_cast<std::size_t>(k) + 1] - 1] * 4;
        if (t.rank_of(k) == r && t.rank_of(k + 1) != r) formula += static_cast<double>(per_pipeline * per_sample) + 64.0 * m;
        if (t.rank_of(k + 1) == r && t.rank_of(k) != r) formula += static_cast<double>(per_pipeline * per_sample);
      }
      std::printf("cost: rank %d sends per step %.1f KiB by formula, %.1f KiB sent in the first step\n", r,
                  formula / 1024, (field(r, 1) + field(r, 2)) / 1024);
    }
    return;
  }
  // Bytes per step across boundary s: the pipeline's samples' activations there go forward and
  // their gradients come back, 2 x samples x (bytes per sample at the boundary), plus a 64-byte
  // shape header per micro-batch. Bytes per sample: one sample through the units before it.
  for (int s = 0; s + 1 < p; ++s) {
    const std::int64_t per_sample = values[pipe.boundaries()[static_cast<std::size_t>(s) + 1] - 1] * 4;
    const double formula = 2.0 * static_cast<double>(per_pipeline * per_sample) + 64.0 * m;
    std::printf("cost: stage %d <-> %d per step: 2 x %lld samples x %lld B + %d x 64 B headers = %.1f KiB by formula, "
                "%.1f KiB sent in the first step\n", s, s + 1, static_cast<long long>(per_pipeline),
                static_cast<long long>(per_sample), m, formula / 1024, (field(s, 1) + field(s + 1, 2)) / 1024);
  }
}

// Activation memory per stage, by formula and as measured (`all`: requested bytes at 3, blocks at 4).
template <class Pipe, class Comm>
void report_activation_memory(Comm& world, Pipe& pipe, const PipelineShape& shape, const std::vector<std::int64_t>& values,
                              const std::vector<double>& all, std::size_t fields, int ranks_per_process) {
  const auto field = [&](int s, std::size_t f) { return all[fields * static_cast<std::size_t>(s) + f]; };
  const int p = shape.stages;
  const std::int64_t micro = shape.batch / shape.replicas / shape.micro_batches;
  if (!shape.one_stage_per_rank()) {  // the formula below is a stage's; print what each rank held
    for (int s = 0; s < p; ++s) {
      std::printf("memory: rank %d: %d stage activation sets at the peak", s, shape.slots(s));
      if (ranks_per_process == 1) std::printf(" | %.1f KiB in the first step", field(s, 3) / 1024);
      std::printf("\n");
    }
    if (ranks_per_process > 1)  // thread ranks share one allocator: only their sum is measured
      std::printf("memory: all %d ranks: %.1f KiB, the peak of this process's allocator in the first step\n",
                  world.size(), field(0, 3) * ranks_per_process / 1024);
    return;
  }
  // Activation memory per stage: one set per micro-batch slot, each (samples per micro-batch) x 4 B
  // x the values a sample leaves there: every unit's output, the stage's input, and the gradients
  // crossing its boundaries. Measured: the allocator's peak during the first step, in bytes
  // requested (and in its rounded blocks). The peak also holds one micro-batch's gradients in
  // flight, and lacks outputs freed early (a convolution's, once the ReLU after it has run).
  std::printf("memory: activations per stage = slots x %lld samples x (unit outputs + input + boundary gradients) x "
              "4 B | allocator's peak in the first step\n", static_cast<long long>(micro));
  double total = 0;
  for (int s = 0; s < p; ++s) {
    const auto first = pipe.boundaries()[static_cast<std::size_t>(s)], end = pipe.boundaries()[static_cast<std::size_t>(s) + 1];
    std::int64_t outputs = 0;
    for (auto u = first; u < end; ++u) outputs += values[u];
    const std::int64_t input = first == 0 ? 28 * 28 : values[first - 1];
    const std::int64_t gradients = (s > 0 ? input : 0) + (s + 1 < p ? values[end - 1] : 0);
    const double formula = static_cast<double>(shape.slots(s) * micro * (outputs + input + gradients)) * 4.0;
    total += formula;
    std::printf("memory: stage %d: %d x %lld x (%lld + %lld + %lld) x 4 B = %.1f KiB", s, shape.slots(s),
                static_cast<long long>(micro), static_cast<long long>(outputs), static_cast<long long>(input),
                static_cast<long long>(gradients), formula / 1024);
    if (ranks_per_process == 1)
      std::printf(" | %.1f KiB (%.2fx; %.1f KiB in blocks)\n", field(s, 3) / 1024, field(s, 3) / formula, field(s, 4) / 1024);
    else
      std::printf("\n");
  }
  // Thread ranks share one allocator: only all stages together can be measured (this replica's and
  // the others', which hold the same again), and their peaks need not coincide.
  if (ranks_per_process > 1) {
    const double requested = field(0, 3) * ranks_per_process;
    std::printf("memory: all %d ranks = %d replica(s) x %.1f KiB = %.1f KiB by formula | %.1f KiB, the peak of this "
                "process's allocator (%.2fx; its thread ranks share it)\n", world.size(), shape.replicas, total / 1024,
                shape.replicas * total / 1024, requested / 1024, requested / (shape.replicas * total));
  }
}

// The schedule asserted on every rank of the pipeline (a 1F1B run as GPipe, or the reverse, fails
// here), then, on world rank 0, the bubble, the bytes across each boundary and the activation
// memory per stage, each by formula beside the measured figure.
template <class Device, class Model, class Pipe, class Comm>
void report_pipeline(Comm& world, Comm& pipe_comm, Model& model, Pipe& pipe, const PipelineShape& shape,
                     const std::vector<double>& idle, const tessera::PipelineStepStats& measured,
                     typename RankMemory<Device, Comm>::Bytes activation_bytes, int ranks_per_process) {
  const std::vector<double> mine{static_cast<double>(measured.peak_in_flight),
                                 static_cast<double>(measured.bytes_sent_forward),
                                 static_cast<double>(measured.bytes_sent_backward), activation_bytes.requested,
                                 activation_bytes.blocks};
  constexpr std::size_t kFields = 5;  // per stage, in `all`
  std::vector<double> all(kFields * static_cast<std::size_t>(pipe_comm.size()));
  pipe_comm.all_gather(std::span<const double>(mine), std::span<double>(all));
  const auto field = [&](int s, std::size_t f) { return all[kFields * static_cast<std::size_t>(s) + f]; };
  const std::string schedule = shape.table.name;
  for (int s = 0; s < shape.stages; ++s)
    TESSERA_CHECK(static_cast<int>(field(s, 0)) == shape.slots(s), tessera::Error, "stage ", s, " held the activations "
                  "of ", field(s, 0), " micro-batches at once; the ", schedule, " schedule holds ", shape.slots(s));
  if (world.rank() != 0) return;
  const bool classic = schedule == "GPipe" || schedule == "1F1B";
  std::printf("check: every stage held the activations of as many micro-batches as %s allows at most (%s) ok\n",
              schedule.c_str(), schedule == "GPipe" ? "M" : schedule == "1F1B" ? "min(M, P - s)" : "its table's simulation");
  const int p = shape.stages, m = shape.micro_batches;
  if (classic)
    std::printf("bubble: ideal (P-1)/(M+P-1) = %.3f; measured idle fraction per stage:",
                static_cast<double>(p - 1) / static_cast<double>(m + p - 1));
  else
    std::printf("bubble: ideal (the %s table with F, I, W of equal cost) = %.3f; measured idle fraction per rank:",
                schedule.c_str(), shape.ideal.bubble_fraction());
  for (double f : idle) std::printf(" %.3f", f);
  std::printf("\nmicro-batches of activations held at the peak per stage:");
  for (int s = 0; s < p; ++s) std::printf(" %.0f", field(s, 0));
  std::printf(" (%s)\n", shape.bound());
  const auto values = unit_output_values_per_sample<Device>(model, tessera::Shape{1, 1, 28, 28});
  report_traffic(pipe, shape, values, all, kFields);
  report_activation_memory(world, pipe, shape, values, all, kFields, ranks_per_process);
}

// The traced step's idle fraction per stage, beside the path of its timeline.
template <class Comm>
void report_traced_step(Comm& world, Comm& pipe_comm, const PipelineSteps& steps, std::size_t step, const std::string& path) {
  const auto traced = steps.idle_fractions(pipe_comm, step, 1);
  if (world.rank() != 0) return;
  std::printf("timeline of one step: %s; that step's idle fraction per stage (1 - F/B time / slowest stage's step):",
              path.c_str());
  for (double f : traced) std::printf(" %.3f", f);
  std::printf("\n");
}

}  // namespace examples
