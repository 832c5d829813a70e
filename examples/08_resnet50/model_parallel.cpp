// Example 08, model parallelism: ResNet-50 split into pipeline stages (--strategy=pipeline:P) or
// split across ranks layer by layer (--strategy=tensor). main.cpp parses the flags and calls in.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>
#include <span>
#include <string>
#include <unordered_set>
#include <vector>

#include "08_resnet50/resnet50.hpp"

namespace resnet50_example {

namespace {

// The tolerance of --verify: every step's loss (and, for the pipeline, the last step's gradients)
// must agree with the unsplit model's to this relative difference. The split runs the same
// kernels on the same numbers; only sums cut across ranks (tensor parallelism) add up in another
// order, which moves a float32 loss by about 1e-7.
constexpr double kTolerance = 1e-4;

// The unsplit model, trained on rank 0 beside a model-parallel run to check it step by step. It
// computes what the split computes: with micro_batches = M > 1 (the pipeline) it runs the batch
// as M micro-batches one after another, each normalized by BatchNorm with its own statistics,
// each loss gradient scaled by 1/M and the parameter gradients accumulated over the M, then one
// SGD step; the loss is the mean of the M micro-batch losses. That is Pipeline::train_step
// without the stages. (Run as one batch instead, BatchNorm would normalize over the whole batch
// and the losses would differ, by design, not by a bug: by 2e-2 at --batch=2 --micro-batches=2.
// See README.md.)
struct Reference {
  Model model;
  NamedTensors<E> named;
  Sgd<E> sgd;
  int micro_batches;
  Model::Cache cache{};
  CrossEntropyLoss<E> loss;
  CrossEntropyLoss<E>::Cache loss_cache;
  Tensor<float> slice;              // one micro-batch of the host batch (M > 1)
  Tensor<float, Device> loss_grad;  // d(mean loss over the batch)/d(logits) of one micro-batch
  Upload upload;
  Reference(const Options& o, int micro_batches)
      : model(make_resnet50(o)), named(named_tensors(model)), sgd(named, sgd_options(o.batch)),
        micro_batches(micro_batches) {}
  float step(const Batch<float>& b) {
    sgd.zero_grad();
    const std::int64_t m = micro_batches, per = b.images.dim(0) / m, row = b.images.numel() / b.images.dim(0);
    float sum = 0;  // summed and divided in float, in micro-batch order, as the pipeline does
    for (std::int64_t i = 0; i < m; ++i) {
      const Tensor<float>* x = &b.images;
      if (m > 1) {
        Shape shape = b.images.shape();
        shape[0] = per;
        slice.resize(shape);
        std::copy_n(b.images.data() + i * per * row, per * row, slice.data());
        x = &slice;
      }
      const auto labels = std::span<const std::int64_t>(b.labels).subspan(static_cast<std::size_t>(i * per),
                                                                          static_cast<std::size_t>(per));
      sum += loss.forward(model.forward(upload(*x), cache), labels, loss_cache);
      const auto& g = loss.backward(loss_cache);
      loss_grad.resize(g.shape());
      scale_elements(Device{}, g.data(), g.numel(), 1.0f / static_cast<float>(m), loss_grad.data());
      model.backward(loss_grad, cache);  // every layer's backward adds to its parameters' gradients
    }
    sgd.step();
    return sum / static_cast<float>(m);
  }
};

// The largest of |a - b| over a tensor, relative to the largest |b| (absolute where b is all 0).
double relative_difference(const Tensor<float>& a, const Tensor<float>& b) {
  double diff = 0, scale = 0;
  for (std::int64_t k = 0; k < b.numel(); ++k) {
    diff = std::max(diff, static_cast<double>(std::abs(a.data()[k] - b.data()[k])));
    scale = std::max(scale, static_cast<double>(std::abs(b.data()[k])));
  }
  return scale > 0 ? diff / scale : diff;
}

// --verify, pipeline: the last step's gradient of every parameter against the unsplit model's.
// Every rank holds the whole model object (its stage trains only its own units), so all ranks
// walk the same list of names: rank 0 broadcasts the reference's gradient of each, the stage that
// owns it compares, and one all_reduce(max) brings every parameter's difference to rank 0.
struct GradientCheck {
  std::size_t tensors = 0;  // 0: not compared
  double worst = 0;         // the largest difference (relative to the tensor's largest entry)
  std::string worst_name;   // the parameter that has it
};
GradientCheck gradient_difference(Comm& comm, Model& model, const NamedTensors<E>& stage, const Reference* reference) {
  auto all = named_tensors(model);
  std::unordered_set<const void*> mine;
  for (const auto& [name, p] : stage.parameters) mine.insert(p);
  std::vector<double> diff(all.parameters.size(), 0.0);
  Tensor<float> expected;
  for (std::size_t k = 0; k < all.parameters.size(); ++k) {
    const auto& [name, p] = all.parameters[k];
    if (comm.rank() == 0) expected = to_host(reference->named.parameters[k].second->grad);
    else expected.resize(p->value.shape());
    comm.broadcast(std::span<float>(expected.data(), static_cast<std::size_t>(expected.numel())), 0);
    if (mine.count(p) != 0) diff[k] = relative_difference(to_host(p->grad), expected);
  }
  comm.all_reduce(std::span<double>(diff), ReduceOp::Max);
  const auto worst = std::max_element(diff.begin(), diff.end());
  return {diff.size(), *worst, all.parameters[static_cast<std::size_t>(worst - diff.begin())].first};
}

// Pipeline or tensor parallelism: every rank sees the same batches. step(batch) -> loss. With
// --verify, rank 0 also trains `reference` (micro_batches as the split runs them) and compares;
// `why` says what a difference beyond the tolerance means, for the error message. For the
// pipeline, check_gradients(reference) then compares the last step's gradients (a collective;
// reference is null on ranks other than 0).
template <class Step, class CheckGradients>
void run_model_parallel(Comm& comm, const Options& o, const char* what, int reference_micro_batches, const char* why,
                        Step&& step, CheckGradients&& check_gradients) {
  const int rank = comm.rank();
  std::optional<Reference> reference;
  if (o.verify && rank == 0) reference.emplace(o, reference_micro_batches);
  if (reference)
    std::printf("verify: rank 0 also trains the unsplit model%s\n",
                reference_micro_batches > 1
                    ? ", micro-batch by micro-batch (BatchNorm statistics per micro-batch, as the pipeline has them)"
                    : " on the whole batch");
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
  if (!o.verify) return;
  const GradientCheck grads = check_gradients(reference ? &*reference : nullptr);  // on every rank
  if (rank != 0) return;
  TESSERA_CHECK(worst < kTolerance, Error, "08_resnet50 --verify: the ", what, " loss differs from the unsplit model's by ",
                worst, " (relative; tolerance ", kTolerance, "). ", why);
  std::printf("verify: every step's loss equals the unsplit model's (largest relative difference %.1e)\n", worst);
  if (grads.tensors == 0) return;  // not compared (tensor parallelism holds shards of the parameters)
  TESSERA_CHECK(grads.worst < kTolerance, Error, "08_resnet50 --verify: the last step's gradient of ", grads.worst_name,
                " differs from the unsplit model's by ", grads.worst, " (relative to its largest entry; tolerance ",
                kTolerance, "). ", why);
  std::printf("verify: the last step's gradients of all %zu parameters equal the unsplit model's (largest relative "
              "difference %.1e%s%s)\n",
              grads.tensors, grads.worst, grads.worst > 0 ? ", in " : "", grads.worst > 0 ? grads.worst_name.c_str() : "");
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
  const std::string m = std::to_string(o.micro_batches);
  const std::string why =
      "The unsplit model ran the same " + m + " micro-batch(es) with the same per-micro-batch BatchNorm statistics, 1/" +
      m + " loss scaling and gradient accumulation, so BatchNorm does not explain it: look for a bug in the split "
      "(stage boundaries, the activations or gradients sent between stages, the loss scaling or the gradient "
      "accumulation)";
  run_model_parallel(
      comm, o, "pipeline", o.micro_batches, why.c_str(),
      [&](const Batch<float>& b) {
        sgd.zero_grad();
        const float loss = pipe.train_step(upload(b.images), b.labels);
        sgd.step();
        return loss;
      },
      [&](const Reference* reference) { return gradient_difference(comm, model, pipe.stage_parameters(), reference); });
}

void train_tensor(Comm& comm, const Options& o) {
  Cpu::set_num_threads(o.threads);
  std::optional<TensorParallelResNet<E>> model;
  std::size_t unsplit_parameters = 0;
  {
    auto dense = make_resnet50(o);  // split, then dropped: each rank keeps 1/p of the blocks and head
    unsplit_parameters = count_parameters(named_tensors(dense));
    model.emplace(dense, comm);
  }
  auto named = named_tensors(*model);
  Sgd<E> sgd(named, sgd_options(o.batch));
  if (comm.rank() == 0)
    std::printf("%s: %zu parameters on each rank (of %zu in the unsplit model), batch %lld, %lldx%lld, %d threads per rank\n",
                model->name().c_str(), count_parameters(named), unsplit_parameters, static_cast<long long>(o.batch),
                static_cast<long long>(o.image), static_cast<long long>(o.image), Cpu::num_threads());
  typename TensorParallelResNet<E>::Cache cache{};
  CrossEntropyLoss<E> loss;
  CrossEntropyLoss<E>::Cache loss_cache;
  Upload upload;
  run_model_parallel(
      comm, o, "tensor", 1,
      "Tensor parallelism computes the unsplit model's function (each BatchNorm channel lives whole on one rank, "
      "normalized over the whole batch); only sums cut across ranks add up in another order, far below the tolerance. "
      "Look for a bug in the split (the shards, or the all-reduce / all-gather between them)",
      [&](const Batch<float>& b) {
        sgd.zero_grad();
        const float l = loss.forward(model->forward(upload(b.images), cache), b.labels, loss_cache);
        model->backward(loss.backward(loss_cache), cache);
        sgd.step();
        return l;
      },
      // Each rank holds shards of the parameters, not the unsplit model's tensors: losses only.
      [](const Reference*) { return GradientCheck{}; });
}

}  // namespace resnet50_example
