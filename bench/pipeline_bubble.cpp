// Pipeline parallelism: the bubble and the activation memory, one MPI process per stage.
//
//   mpirun -n 2 build/bench/pipeline_mpi [--steps=12] [--batch=128] [--trace=pipeline_trace.json]
//       [--models=mlp,resnet20] [--schedules=gpipe,1f1b] [--micro-batches=1,4,8,16]
//
// For each model, schedule (GPipe, 1F1B, Interleaved1F1B with 2 stages per rank, ZBH1, ZBV) and
// number of micro-batches M, it runs training steps and reports per rank:
//   - the idle fraction of a step (1 - this rank's compute time / the slowest rank's step time;
//     median over the steps after the first) against the ideal bubble: the schedule's table
//     simulated with F, I and W of equal cost (a whole B two), which for GPipe and 1F1B is
//     (P-1)/(M+P-1); stages are balanced by per-layer costs measured on rank 0;
//   - the micro-batches of activations held at the peak and the bytes the step allocated on top of
//     what existed before it (CachingAllocator's high-water mark over the first step: the
//     per-micro-batch activation slots, received inputs, loss caches and scratch).
// Models: "mlp", 512 -> 8 x 512 -> 10 (8 equal units, so 2 stages balance and the bubble is the
// schedule's), and "resnet20" on 1x28x28 (activation-heavy, for memory).
// One JSON line per (model, schedule, M, stage) from rank 0; --trace writes one 1F1B step at M = 4.
#include <algorithm>
#include <array>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "tessera/comm/mpi.hpp"
#include "tessera/tessera.hpp"
#include "tessera/parallel/pipeline.hpp"

using namespace tessera;
using E = CpuMpi;  // one MPI process per stage: a shared allocator would mix the stages' memory

namespace {

struct Result {
  double idle = 0, step_ms = 0, peak_in_flight = 0, step_bytes = 0, slots = 0, ideal = 0;
};

PipelineSchedule parse_schedule(const std::string& name) {
  for (PipelineSchedule s : {PipelineSchedule::GPipe, PipelineSchedule::OneFOneB, PipelineSchedule::Interleaved1F1B,
                             PipelineSchedule::ZBH1, PipelineSchedule::ZBV}) {
    std::string lower = schedule_name(s);
    std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    if (lower == name) return s;
  }
  throw ArgumentError("--schedules: '" + name + "' is not a schedule");
}

template <class Model>
Result measure(Model& model, E::Comm& comm, int micro_batches, PipelineSchedule schedule, std::int64_t batch,
               Shape image, int steps, Timeline* timeline) {
  Shape shape{batch};
  for (int d = 0; d < image.rank(); ++d) shape.push_back(image[d]);
  Tensor<float> x(shape);
  Rng rng(5);
  for (std::int64_t k = 0; k < x.numel(); ++k) x.data()[k] = static_cast<float>(rng.normal());
  // Stages balanced by the per-layer cost measured on rank 0 on one micro-batch.
  Shape micro_shape = shape;
  micro_shape[0] = batch / micro_batches;
  Tensor<float> sample(micro_shape);
  std::copy_n(x.data(), sample.numel(), sample.data());
  Pipeline pipe(model, comm, {.micro_batches = micro_batches, .schedule = schedule, .timeline = timeline},
                                comm.rank() == 0 ? &sample : nullptr);
  Sgd<E> sgd(pipe.stage_parameters(), {.lr = 0.01, .momentum = 0.9});
  std::vector<std::int64_t> labels(static_cast<std::size_t>(batch));
  for (std::size_t k = 0; k < labels.size(); ++k) labels[k] = static_cast<std::int64_t>(k % 10);
  Result r;
  std::vector<double> idle, ms;
  for (int step = 0; step < steps; ++step) {
    const auto before = Cpu::allocator().stats().bytes_in_use;
    if (step == 0) Cpu::allocator().reset_peak();
    sgd.zero_grad();
    comm.barrier();  // every stage starts the step together, so idle time is the schedule's
    pipe.train_step(x, labels);
    sgd.step();
    if (step == 0) {
      r.step_bytes = static_cast<double>(Cpu::allocator().stats().peak_bytes_in_use - before);
      continue;
    }
    // Idle against the whole pipeline's step (the slowest stage's), not this stage's own: the
    // last stage finishes its part early and would otherwise look busy.
    std::array<double, 1> step_time{pipe.last_step().step_seconds};
    comm.all_reduce(std::span<double>(step_time), ReduceOp::Max);
    idle.push_back(1.0 - pipe.last_step().busy_seconds / step_time[0]);
    ms.push_back(step_time[0] * 1e3);
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  };
  r.idle = median(idle);
  r.step_ms = median(ms);
  r.peak_in_flight = pipe.last_step().peak_in_flight;
  r.slots = pipe.activation_slots();
  r.ideal = simulate_pipeline(pipe.schedule(), {}).bubble_fraction();
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Flags flags(argc, argv);
    const int steps = flags.get("steps", 12, {.min = 2});  // the first step is not in the medians
    // Split into 1, 4, 8 and 16 micro-batches below: a multiple of 16, or refused.
    const std::int64_t batch = flags.get("batch", std::int64_t{128}, {.min = 16});
    TESSERA_CHECK(batch % 16 == 0, ArgumentError, "--batch=", batch, ": must be a multiple of 16 (it is split into 1, 4, "
                  "8 and 16 micro-batches)");
    const std::string trace = flags.output_path("trace", "");
    const auto models = flags.list("models", "mlp,resnet20", {"mlp", "resnet20"});
    const auto schedules = flags.list("schedules", "gpipe,1f1b", {"gpipe", "1f1b", "interleaved1f1b", "zbh1", "zbv"});
    const auto micro_list = flags.list("micro-batches", "1,4,8,16", {"1", "2", "4", "8", "16"});
    flags.finish();
    auto comm = E::Comm::from_env();
    Cpu::set_num_threads(1);
    const int p = comm.size();
    for (const std::string& model_name : models) {
      for (const std::string& schedule_text : schedules) {
        const PipelineSchedule schedule = parse_schedule(schedule_text);
        for (const std::string& m_text : micro_list) {
          const int m = std::stoi(m_text);
          // Interleaving takes the micro-batches in rounds of one per rank.
          if (schedule == PipelineSchedule::Interleaved1F1B && m % p != 0) continue;
          Result r;
          if (model_name == "mlp") {
            Mlp<E> model(512, {512, 512, 512, 512, 512, 512, 512, 512}, 10, 1);
            r = measure(model, comm, m, schedule, batch, {512}, steps, nullptr);
          } else {
            auto model = resnet20<E>({.in_channels = 1, .num_classes = 10, .seed = 1});
            r = measure(model, comm, m, schedule, batch, {1, 28, 28}, std::max(4, steps / 3), nullptr);
          }
          std::array<double, 6> mine{r.idle, r.step_ms, r.peak_in_flight, r.step_bytes, r.slots, r.ideal};
          std::vector<double> all(mine.size() * static_cast<std::size_t>(p));
          comm.all_gather(std::span<const double>(mine), std::span<double>(all));
          if (comm.rank() == 0)
            for (int s = 0; s < p; ++s) {
              const double* v = all.data() + mine.size() * static_cast<std::size_t>(s);
              std::printf("{\"bench\": \"pipeline\", \"model\": \"%s\", \"schedule\": \"%s\", \"stages\": %d, "
                          "\"micro_batches\": %d, \"batch\": %lld, \"stage\": %d, \"idle_fraction\": %.4f, "
                          "\"ideal_bubble\": %.4f, \"step_ms\": %.3f, \"peak_in_flight\": %.0f, \"activation_slots\": %.0f, "
                          "\"step_alloc_bytes\": %.0f}\n",
                          model_name.c_str(), schedule_name(schedule), p, m, static_cast<long long>(batch), s, v[0],
                          v[5], v[1], v[2], v[4], v[3]);
              std::fflush(stdout);
            }
        }
      }
    }
    if (!trace.empty()) {
      Timeline timeline(comm);
      Mlp<E> model(512, {512, 512, 512, 512, 512, 512, 512, 512}, 10, 1);
      measure(model, comm, 4, PipelineSchedule::OneFOneB, batch, {512}, 2, &timeline);
      timeline.write(comm, trace);
      if (comm.rank() == 0) std::fprintf(stderr, "wrote %s\n", trace.c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pipeline bench: %s\n", e.what());
    return 1;
  }
}
