// Pipeline parallelism: the bubble and the activation memory, one MPI process per stage.
//
//   mpirun -n 2 build/bench/pipeline_mpi [--steps=12] [--batch=128] [--trace=pipeline_trace.json]
//       [--models=mlp,resnet20,timed] [--schedules=gpipe,1f1b] [--micro-batches=1,4,8,16]
//       [--timed-units=16] [--timed-ms=1] [--profile-out=PREFIX]
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
// schedule's), "resnet20" on 1x28x28 (activation-heavy, for memory), and "timed": --timed-units
// units whose forward, input and weight gradients each sleep --timed-ms (TimedUnits: stages that
// behave like devices of their own, for P above the core count).
// --profile-out=PREFIX: afterwards rank 0 writes each model's profile for tessera-simulate pipeline,
// one file PREFIX_<model>_m<M>.json per micro-batch count (bench/pipeline_validation.py uses them).
// One JSON line per (model, schedule, M, stage) from rank 0; --trace writes one 1F1B step at M = 4.
#include <algorithm>
#include <array>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "tessera/comm/mpi.hpp"
#include "tessera/tessera.hpp"
#include "tessera/parallel/pipeline.hpp"

using namespace tessera;
using E = CpuMpi;  // one MPI process per stage: a shared allocator would mix the stages' memory

namespace {

// A model whose units take fixed wall times and no CPU: each unit's forward, backward-input and
// backward-weight sleep f, i and w milliseconds (and pass x through, adding its one parameter).
// Stages then behave like devices of their own whatever the cores, so P = 4 stages on a 2-core
// machine show the schedule's own bubble; the compute-bound models above need a core per stage.
struct TimedUnits {
  using Env = E;
  using Tensor = tessera::Tensor<float>;
  struct Cache {
    std::vector<Tensor> y;
    Tensor dx;
  };
  TimedUnits(int units, double f_ms, double i_ms, double w_ms) : f_(f_ms), i_(i_ms), w_(w_ms) {
    for (int u = 0; u < units; ++u) {
      weights_.emplace_back(Shape{1});
      weights_.back().value.fill(0.5f);
    }
  }
  std::size_t unit_count() const { return weights_.size(); }
  std::string unit_name(std::size_t u) const { return "timed" + std::to_string(u); }
  std::vector<double> unit_costs() const { return std::vector<double>(weights_.size(), 1.0); }
  const Tensor& forward_units(const Tensor& x, Cache& c, std::size_t begin, std::size_t end) {
    c.y.resize(weights_.size());
    const Tensor* h = &x;
    for (std::size_t u = begin; u < end; ++u) {
      wait(f_);
      c.y[u].resize(h->shape());
      for (std::int64_t k = 0; k < h->numel(); ++k) c.y[u].data()[k] = h->data()[k] + weights_[u].value.data()[0];
      h = &c.y[u];
    }
    return *h;
  }
  const Tensor& backward_units(const Tensor& dy, Cache& c, std::size_t begin, std::size_t end) {
    backward_units_input(dy, c, begin, end);
    backward_units_weight(c, begin, end);
    return c.dx;
  }
  const Tensor& backward_units_input(const Tensor& dy, Cache& c, std::size_t begin, std::size_t end) {
    for (std::size_t u = begin; u < end; ++u) wait(i_);
    c.dx.resize(dy.shape());  // y = x + b: dL/dx = dy
    std::copy_n(dy.data(), dy.numel(), c.dx.data());
    return c.dx;
  }
  void backward_units_weight(Cache& c, std::size_t begin, std::size_t end) {
    for (std::size_t u = begin; u < end; ++u) {
      wait(w_);
      float sum = 0;  // dL/db = the sum of dy
      for (std::int64_t k = 0; k < c.dx.numel(); ++k) sum += c.dx.data()[k];
      weights_[u].grad.data()[0] += sum;
    }
  }
  template <class V>
  void visit_units(V& v, const std::string& prefix, std::size_t begin, std::size_t end) {
    for (std::size_t u = begin; u < end; ++u) v.parameter(prefix + unit_name(u) + ".bias", weights_[u]);
  }
  template <class V>
  void visit(V& v, const std::string& prefix) {
    visit_units(v, prefix, 0, unit_count());
  }

 private:
  static void wait(double ms) { std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms)); }
  double f_, i_, w_;
  std::vector<Parameter<float, Cpu>> weights_;
};

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

// The simulator's profile of a model (tools/tessera-simulate pipeline --profile): each unit's
// forward, input-gradient and weight-gradient times on one micro-batch of batch / m rows (median
// of `reps`, this process alone), scaled to the whole batch as the simulator expects (it divides
// by m again), with its gradient and output bytes. Layers in backward order.
template <class Model>
void write_profile(Model& model, std::int64_t batch, int m, Shape image, int reps, const std::string& name,
                   const std::string& path) {
  Shape shape{batch / m};
  for (int d = 0; d < image.rank(); ++d) shape.push_back(image[d]);
  Tensor<float> x(shape);
  Rng rng(5);
  for (std::int64_t k = 0; k < x.numel(); ++k) x.data()[k] = static_cast<float>(rng.normal());
  const std::size_t units = model.unit_count();
  std::vector<std::vector<double>> f(units), i(units), w(units);
  std::vector<std::int64_t> out_bytes(units), grad_bytes(units);
  auto seconds = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
  for (int rep = 0; rep < reps; ++rep) {
    typename Model::Cache c;
    std::vector<const Tensor<float>*> inputs{&x};
    for (std::size_t u = 0; u < units; ++u) {
      const auto t0 = std::chrono::steady_clock::now();
      inputs.push_back(&model.forward_units(*inputs.back(), c, u, u + 1));
      f[u].push_back(seconds(t0, std::chrono::steady_clock::now()));
      out_bytes[u] = inputs.back()->numel() * static_cast<std::int64_t>(sizeof(float)) * m;
    }
    Tensor<float> g(inputs.back()->shape(), 1.0f / static_cast<float>(inputs.back()->numel()));
    const Tensor<float>* dy = &g;
    for (std::size_t u = units; u-- > 0;) {
      const auto t0 = std::chrono::steady_clock::now();
      dy = &model.backward_units_input(*dy, c, u, u + 1);
      const auto t1 = std::chrono::steady_clock::now();
      model.backward_units_weight(c, u, u + 1);
      i[u].push_back(seconds(t0, t1));
      w[u].push_back(seconds(t1, std::chrono::steady_clock::now()));
    }
  }
  for (std::size_t u = 0; u < units; ++u) {
    NamedTensors<E> named;
    model.visit_units(named, "", u, u + 1);
    grad_bytes[u] = 0;
    for (auto& [n, p] : named.parameters) grad_bytes[u] += p->grad.numel() * static_cast<std::int64_t>(sizeof(float));
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::FILE* out = std::fopen(path.c_str(), "w");
  TESSERA_CHECK(out != nullptr, IoError, "--profile-out: cannot write '", path, "'");
  std::fprintf(out, "{\"name\": \"%s, micro-batch %lld x %d\", \"batch_per_worker\": %lld, \"optimizer_s\": 0, "
               "\"threads_per_worker\": 1, \"layers\": [\n", name.c_str(), static_cast<long long>(batch / m), m,
               static_cast<long long>(batch));
  for (std::size_t k = 0; k < units; ++k) {
    const std::size_t u = units - 1 - k;  // backward order
    const double fi = median(f[u]) * m, ii = median(i[u]) * m, wi = median(w[u]) * m;
    std::fprintf(out, "  {\"name\": \"%s\", \"forward_s\": %.9f, \"backward_s\": %.9f, \"backward_weight_s\": %.9f, "
                 "\"grad_bytes\": %lld, \"activation_bytes\": %lld}%s\n", model.unit_name(u).c_str(), fi, ii + wi, wi,
                 static_cast<long long>(grad_bytes[u]), static_cast<long long>(out_bytes[u]), k + 1 < units ? "," : "");
  }
  std::fprintf(out, "]}\n");
  std::fclose(out);
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
    const auto models = flags.list("models", "mlp,resnet20", {"mlp", "resnet20", "timed"});
    const std::string profile_out = flags.output_path("profile-out", "");
    const int timed_units = flags.get("timed-units", 16, {.min = 1});
    const double timed_ms = flags.get("timed-ms", 1.0, {.min = 0.0});
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
          } else if (model_name == "timed") {
            TimedUnits model(timed_units, timed_ms, timed_ms, timed_ms);
            r = measure(model, comm, m, schedule, batch, {16}, steps, nullptr);
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
    if (!profile_out.empty() && comm.rank() == 0) {  // after the measurements: rank 0 alone, the others wait
      for (const std::string& model_name : models)
        for (const std::string& m_text : micro_list) {
          const std::string path = profile_out + "_" + model_name + "_m" + m_text + ".json";
          const int m = std::stoi(m_text);
          if (model_name == "mlp") {
            Mlp<E> model(512, {512, 512, 512, 512, 512, 512, 512, 512}, 10, 1);
            write_profile(model, batch, m, {512}, 31, "MLP 512 -> 8 x 512 -> 10", path);
          } else if (model_name == "timed") {
            TimedUnits model(timed_units, timed_ms, timed_ms, timed_ms);
            write_profile(model, batch, m, {16}, 5, "timed units", path);
          } else {
            auto model = resnet20<E>({.in_channels = 1, .num_classes = 10, .seed = 1});
            write_profile(model, batch, m, {1, 28, 28}, 7, "ResNet-20", path);
          }
          std::fprintf(stderr, "wrote %s\n", path.c_str());
        }
    }
    comm.barrier();
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
