// Example 08, model parallelism: ResNet-50 split into pipeline stages (--strategy=pipeline:P) or
// split across ranks layer by layer (--strategy=tensor). main.cpp parses the flags and calls in.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "08_resnet50/resnet50.hpp"

namespace resnet50_example {

namespace {

// The unsplit model, trained on rank 0 beside a model-parallel run to check it step by step.
struct Reference {
  Model model;
  NamedTensors<E> named;
  Sgd<E> sgd;
  Upload upload;
  explicit Reference(const Options& o)
      : model(make_resnet50(o)), named(named_tensors(model)), sgd(named, sgd_options(o.batch)) {}
  float step(const Batch<float>& b) {
    sgd.zero_grad();
    Model::Cache cache{};
    CrossEntropyLoss<E> loss;
    CrossEntropyLoss<E>::Cache loss_cache;
    const float l = loss.forward(model.forward(upload(b.images), cache), b.labels, loss_cache);
    model.backward(loss.backward(loss_cache), cache);
    sgd.step();
    return l;
  }
};

// Pipeline or tensor parallelism: every rank sees the same batches. step(batch) -> loss.
template <class Step>
void run_model_parallel(Comm& comm, const Options& o, const char* what, Step&& step) {
  const int rank = comm.rank();
  std::optional<Reference> reference;
  if (o.verify && rank == 0) reference.emplace(o);
  Dataset data = SyntheticImages(o.batch * 4, 3, o.image, o.image, o.classes, 7);
  DataLoader<float> loader(data, {.batch_size = o.batch, .shuffle = true, .seed = 3, .drop_last = true});
  Batch<float> b;
  double total = 0, worst = 0;
  for (std::int64_t s = 0, epoch = 0; s < o.steps; ++epoch) {
    loader.start_epoch(epoch);
    while (s < o.steps && loader.next(b)) {
      const auto t0 = std::chrono::steady_clock::now();
      const float loss = step(b);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (s > 0) total += seconds;
      if (rank == 0) {
        std::printf("step %lld: loss %.6f, %.2f s, %.1f img/s", static_cast<long long>(s + 1), loss, seconds,
                    static_cast<double>(o.batch) / seconds);
        if (reference) {
          const float expected = reference->step(b);
          worst = std::max(worst, static_cast<double>(std::abs(loss - expected)) / std::max(1.0f, std::abs(expected)));
          std::printf(" | unsplit model: loss %.6f", expected);
        }
        std::printf("\n");
        std::fflush(stdout);
      }
      ++s;
    }
  }
  if (o.steps > 1 && rank == 0)
    std::printf("steady state (%s): %.1f img/s\n", what, static_cast<double>(o.batch * (o.steps - 1)) / total);
  if (reference) {
    TESSERA_CHECK(worst < 1e-4, Error, "08_resnet50: ", what, " loss differs from the unsplit model by ", worst,
                  " (relative)");
    std::printf("verify: every step's loss equals the unsplit model's (largest relative difference %.1e)\n", worst);
  }
}

}  // namespace

void train_pipeline(Comm& comm, const Options& o, int stages) {
  TESSERA_CHECK(comm.size() == stages, ArgumentError, "08_resnet50: --strategy=pipeline:", stages, " needs ", stages,
                " ranks, got ", comm.size());
  Cpu::set_num_threads(o.threads);
  auto model = make_resnet50(o);
  // Balanced by each unit's forward + backward time on one micro-batch, measured on rank 0.
  TESSERA_CHECK(o.batch % o.micro_batches == 0, ArgumentError, "08_resnet50: --batch=", o.batch,
                " does not split into --micro-batches=", o.micro_batches);
  Tensor<float> host_sample(Shape{o.batch / o.micro_batches, 3, o.image, o.image});
  Rng rng(11);
  for (std::int64_t k = 0; k < host_sample.numel(); ++k) host_sample.data()[k] = static_cast<float>(rng.normal());
  const auto sample = to_device<Device>(host_sample);
  Pipeline pipe(model, comm, {.micro_batches = o.micro_batches, .schedule = PipelineSchedule::OneFOneB},
                comm.rank() == 0 ? &sample : nullptr);
  Sgd<E> sgd(pipe.stage_parameters(), sgd_options(o.batch));
  // Per stage: which units, how many parameters (gathered to rank 0 for the report).
  std::array<double, 3> mine{static_cast<double>(pipe.boundaries()[comm.rank()]),
                             static_cast<double>(pipe.boundaries()[comm.rank() + 1]),
                             static_cast<double>(count_parameters(pipe.stage_parameters()))};
  std::vector<double> all(3 * static_cast<std::size_t>(comm.size()));
  comm.all_gather(std::span<const double>(mine), std::span<double>(all));
  if (comm.rank() == 0) {
    std::printf("%s, pipeline over %d stages, batch %lld in %d micro-batch(es), 1F1B, %lldx%lld, %d threads per rank\n",
                model.name().c_str(), stages, static_cast<long long>(o.batch), o.micro_batches,
                static_cast<long long>(o.image), static_cast<long long>(o.image), Cpu::num_threads());
    for (int s = 0; s < stages; ++s)
      std::printf("  stage %d: %s .. %s, %.0f parameters\n", s, model.unit_name(static_cast<std::size_t>(all[3 * s])).c_str(),
                  model.unit_name(static_cast<std::size_t>(all[3 * s + 1]) - 1).c_str(), all[3 * s + 2]);
  }
  Upload upload;
  run_model_parallel(comm, o, "pipeline", [&](const Batch<float>& b) {
    sgd.zero_grad();
    const float loss = pipe.train_step(upload(b.images), b.labels);
    sgd.step();
    return loss;
  });
}

void train_tensor(Comm& comm, const Options& o) {
  Cpu::set_num_threads(o.threads);
  std::optional<TensorParallelResNet<E>> model;
  {
    auto dense = make_resnet50(o);  // split, then dropped: each rank keeps 1/p of the blocks and head
    model.emplace(dense, comm);
  }
  auto named = named_tensors(*model);
  Sgd<E> sgd(named, sgd_options(o.batch));
  if (comm.rank() == 0)
    std::printf("%s: %zu parameters on each rank (of 25.6 M in the unsplit model), batch %lld, %lldx%lld, %d threads per rank\n",
                model->name().c_str(), count_parameters(named), static_cast<long long>(o.batch),
                static_cast<long long>(o.image), static_cast<long long>(o.image), Cpu::num_threads());
  typename TensorParallelResNet<E>::Cache cache{};
  CrossEntropyLoss<E> loss;
  CrossEntropyLoss<E>::Cache loss_cache;
  Upload upload;
  run_model_parallel(comm, o, "tensor", [&](const Batch<float>& b) {
    sgd.zero_grad();
    const float l = loss.forward(model->forward(upload(b.images), cache), b.labels, loss_cache);
    model->backward(loss.backward(loss_cache), cache);
    sgd.step();
    return l;
  });
}

}  // namespace resnet50_example
