// Pipeline against the unsplit model, on any communicator: the loss and every parameter gradient
// of a P-stage pipeline step equal one process running the whole model on the whole batch, and
// after several SGD steps every stage's parameters equal the single-process run. Collective:
// every rank calls it. Returns failures as text (usable from threads and from multi-process
// programs).
#pragma once

#include <algorithm>
#include <cmath>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "tessera/comm/local.hpp"
#include "tessera/layers/activation.hpp"
#include "tessera/layers/conv2d.hpp"
#include "tessera/layers/linear.hpp"
#include "tessera/layers/pool.hpp"
#include "tessera/layers/residual.hpp"
#include "tessera/layers/sequential.hpp"
#include "tessera/losses/cross_entropy.hpp"
#include "tessera/models/mlp.hpp"
#include "tessera/models/resnet.hpp"
#include "tessera/optim/sgd.hpp"
#include "tessera/parallel/pipeline.hpp"

namespace tessera::testing {

// A residual network without BatchNorm, built as one Sequential: stem conv, three residual blocks
// (the second and third change shape through a 1x1 projection), global pool, classifier. With no
// BN, micro-batching changes nothing: the pipeline must match the unsplit model for any M.
template <class E>
using PlainBlock = Residual<Sequential<Conv2d<E>, ReLU<E>, Conv2d<E>>, Sequential<Conv2d<E>>>;
template <class E>
using PlainResNet = Sequential<Conv2d<E>, ReLU<E>, PlainBlock<E>, PlainBlock<E>, PlainBlock<E>, GlobalAvgPool<E>,
                               Linear<E>>;

template <class E>
PlainBlock<E> plain_block(std::int64_t in, std::int64_t out, std::int64_t stride, Rng& rng) {
  Sequential<Conv2d<E>, ReLU<E>, Conv2d<E>> main{Conv2d<E>(in, out, 3, rng, stride, 1), ReLU<E>(),
                                                 Conv2d<E>(out, out, 3, rng, 1, 1)};
  if (in == out && stride == 1) return PlainBlock<E>(std::move(main));
  return PlainBlock<E>(std::move(main), Sequential<Conv2d<E>>{Conv2d<E>(in, out, 1, rng, stride, 0)});
}

template <class E>
PlainResNet<E> plain_resnet(std::uint64_t seed) {
  Rng rng(seed);
  PlainResNet<E> net{Conv2d<E>(1, 4, 3, rng, 1, 1), ReLU<E>(), plain_block<E>(4, 4, 1, rng),
                     plain_block<E>(4, 8, 2, rng), plain_block<E>(8, 8, 2, rng), GlobalAvgPool<E>(),
                     Linear<E>(8, 10, rng)};
  net.set_needs_input_grad(false);
  return net;
}

enum class PipeModel { Mlp, PlainResNet, ResNet20 };

struct PipeCase {
  PipeModel model = PipeModel::Mlp;
  int micro_batches = 4;
  PipelineSchedule schedule = PipelineSchedule::OneFOneB;
  int stages_per_rank = 2;                    // Interleaved1F1B's v
  std::optional<PipelineScheduleTable> table;  // in place of `schedule`
  int batch = 8;  // global batch
  int steps = 3;
  double tolerance = 1e-12;
  // The reference runs the micro-batches one after another, accumulating gradients of loss / M:
  // with BatchNorm the statistics are then each micro-batch's, as on the pipeline's stages (and as
  // in torch.distributed.pipelining). Without BatchNorm it is the whole batch's run.
  bool reference_per_micro_batch = false;
};

inline const char* model_name(PipeModel m) {
  return m == PipeModel::Mlp ? "MLP" : m == PipeModel::PlainResNet ? "BN-free ResNet" : "ResNet-20";
}

template <class S>
Tensor<S, Cpu> pipe_images(std::int64_t n, std::int64_t size, int step) {
  Tensor<S, Cpu> x(Shape{n, 1, size, size});
  Rng rng(700 + static_cast<std::uint64_t>(step));
  for (std::int64_t k = 0; k < x.numel(); ++k) x.data()[k] = static_cast<S>(rng.normal());
  return x;
}
inline std::vector<std::int64_t> pipe_labels(std::int64_t n, int step) {
  std::vector<std::int64_t> y(static_cast<std::size_t>(n));
  Rng rng(900 + static_cast<std::uint64_t>(step));
  for (auto& l : y) l = static_cast<std::int64_t>(rng.uniform() * 10) % 10;
  return y;
}

// Returns peak in-flight micro-batches through *peak (this rank's, last step).
template <class S, class Comm, class Model>
std::vector<std::string> run_pipeline_case(Comm& comm, const PipeCase& c, Model model_pipe, Model model_ref,
                                           std::int64_t image, int* peak = nullptr) {
  using E = Env<Cpu, Comm, S>;
  std::vector<std::string> failures;
  const std::string what = std::string(model_name(c.model)) + " " + (c.table ? c.table->name : schedule_name(c.schedule)) + " P=" +
                           std::to_string(comm.size()) + " M=" + std::to_string(c.micro_batches) + " stage " +
                           std::to_string(comm.rank()) + ": ";
  Pipeline<Model> pipe(model_pipe, comm,
                       {.micro_batches = c.micro_batches, .schedule = c.schedule, .stages_per_rank = c.stages_per_rank,
                        .table = c.table});
  auto stage_params = pipe.stage_parameters();
  auto ref_params = named_tensors(model_ref);
  std::map<std::string, Parameter<S, Cpu>*> ref_by_name;
  for (auto& [name, p] : ref_params.parameters) ref_by_name[name] = p;
  Sgd<E> sgd_pipe(stage_params, {.lr = 0.05, .momentum = 0.9});
  Sgd<E> sgd_ref(ref_params, {.lr = 0.05, .momentum = 0.9});
  CrossEntropyLoss<E> loss;
  for (int step = 0; step < c.steps; ++step) {
    const auto x = pipe_images<S>(c.batch, image, step);
    const auto y = pipe_labels(c.batch, step);
    // The reference: the whole model on the whole batch, or on each micro-batch in turn.
    sgd_ref.zero_grad();
    S ref_loss = 0;
    const int parts = c.reference_per_micro_batch ? c.micro_batches : 1;
    const std::int64_t rows = c.batch / parts, per_row = x.numel() / c.batch;
    for (int part = 0; part < parts; ++part) {
      Shape part_shape = x.shape();
      part_shape[0] = rows;
      Tensor<S, Cpu> xp(part_shape);
      std::copy_n(x.data() + part * rows * per_row, rows * per_row, xp.data());
      const std::span<const std::int64_t> yp(y.data() + part * rows, static_cast<std::size_t>(rows));
      typename Model::Cache cache{};
      typename CrossEntropyLoss<E>::Cache loss_cache;
      ref_loss += loss.forward(model_ref.forward(xp, cache), yp, loss_cache) / static_cast<S>(parts);
      const Tensor<S, Cpu>& g = loss.backward(loss_cache);
      Tensor<S, Cpu> scaled(g.shape());
      for (std::int64_t k = 0; k < g.numel(); ++k) scaled.data()[k] = g.data()[k] * (S(1) / static_cast<S>(parts));  // as the pipeline scales
      model_ref.backward(parts == 1 ? g : scaled, cache);
    }
    // The pipeline; stage 0 alone reads x, the last stage alone the labels.
    sgd_pipe.zero_grad();
    const auto& table = pipe.schedule();  // the last stage's rank reads the labels (rank 0 in V placement)
    const bool first = comm.rank() == 0, last = comm.rank() == table.rank_of(table.stage_count() - 1);
    const Tensor<S, Cpu> empty;
    const S pipe_loss = pipe.train_step(first ? x : empty, last ? std::span<const std::int64_t>(y)
                                                                : std::span<const std::int64_t>());
    if (std::abs(static_cast<double>(pipe_loss - ref_loss)) > c.tolerance * std::max(1.0, std::abs(static_cast<double>(ref_loss))))
      failures.push_back(what + "step " + std::to_string(step) + " loss " + std::to_string(pipe_loss) + " vs " +
                         std::to_string(ref_loss));
    double worst_grad = 0, worst_value = 0;
    for (auto& [name, p] : stage_params.parameters) {
      const auto* r = ref_by_name.at(name);
      for (std::int64_t k = 0; k < p->grad.numel(); ++k) {
        const double scale = std::max(1.0, std::abs(static_cast<double>(r->grad.data()[k])));
        worst_grad = std::max(worst_grad, std::abs(static_cast<double>(p->grad.data()[k] - r->grad.data()[k])) / scale);
      }
    }
    if (worst_grad > c.tolerance)
      failures.push_back(what + "step " + std::to_string(step) + " gradients differ by " + std::to_string(worst_grad));
    if (stage_params.parameters.empty()) failures.push_back(what + "the stage has no parameters");
    sgd_pipe.step();
    sgd_ref.step();
    for (auto& [name, p] : stage_params.parameters) {
      const auto* r = ref_by_name.at(name);
      for (std::int64_t k = 0; k < p->value.numel(); ++k)
        worst_value = std::max(worst_value, std::abs(static_cast<double>(p->value.data()[k] - r->value.data()[k])));
    }
    if (worst_value > c.tolerance)
      failures.push_back(what + "step " + std::to_string(step) + " parameters differ by " + std::to_string(worst_value));
  }
  // predict: the whole batch through every stage in model order (around the ring twice when
  // interleaved, back to rank 0 in V placement), the unsplit model's logits on the last stage's rank.
  {
    const auto x = pipe_images<S>(c.batch, image, c.steps);
    typename Model::Cache cache{};
    const auto& want = model_ref.forward(x, cache);
    const Tensor<S, Cpu> empty;
    const auto& got = pipe.predict(comm.rank() == 0 ? x : empty);
    const auto& table = pipe.schedule();
    if (comm.rank() == table.rank_of(table.stage_count() - 1)) {
      double worst = got.shape() == want.shape() ? 0.0 : INFINITY;
      for (std::int64_t k = 0; k < want.numel() && worst < INFINITY; ++k)
        worst = std::max(worst, std::abs(static_cast<double>(got.data()[k] - want.data()[k])));
      if (worst > c.tolerance) failures.push_back(what + "predict's logits differ by " + std::to_string(worst));
    } else if (!got.empty()) {
      failures.push_back(what + "predict returned logits on a rank without the last stage");
    }
  }
  // Activation memory bound: 1F1B holds at most P - s micro-batches; GPipe all M; another table
  // what its simulation holds (stage activation sets, several per micro-batch when a rank runs
  // several stages).
  const int p = comm.size(), s = comm.rank();
  const bool formula = !c.table && (c.schedule == PipelineSchedule::OneFOneB || c.schedule == PipelineSchedule::GPipe);
  const int bound = !formula ? simulate_pipeline(pipe.schedule(), {}).peak_activations[static_cast<std::size_t>(s)]
                    : c.schedule == PipelineSchedule::OneFOneB ? std::min(c.micro_batches, p - s)
                                                               : c.micro_batches;
  if (pipe.last_step().peak_in_flight != bound)
    failures.push_back(what + "held " + std::to_string(pipe.last_step().peak_in_flight) +
                       " micro-batches at the peak, expected " + std::to_string(bound));
  if (peak) *peak = pipe.last_step().peak_in_flight;
  return failures;
}

template <class S, class Comm>
std::vector<std::string> pipeline_equivalence(Comm& comm, const PipeCase& c, int* peak = nullptr) {
  using E = Env<Cpu, Comm, S>;
  switch (c.model) {
    case PipeModel::Mlp:
      return run_pipeline_case<S>(comm, c, Mlp<E>(64, {32, 32, 24, 16, 16}, 10, 5), Mlp<E>(64, {32, 32, 24, 16, 16}, 10, 5),
                                  8, peak);
    case PipeModel::PlainResNet:
      return run_pipeline_case<S>(comm, c, plain_resnet<E>(6), plain_resnet<E>(6), 8, peak);
    case PipeModel::ResNet20:
      return run_pipeline_case<S>(comm, c, resnet20<E>({.in_channels = 1, .num_classes = 10, .seed = 7}),
                                  resnet20<E>({.in_channels = 1, .num_classes = 10, .seed = 7}), 8, peak);
  }
  return {"unknown model"};
}

}  // namespace tessera::testing

#include "tessera/parallel/data_parallel.hpp"

namespace tessera::testing {

// Hybrid data x pipeline parallelism on replicas x stages ranks (rank = replica * stages +
// stage): each replica is a pipeline over its own half of the global batch, and each stage's
// gradients are averaged over the replicas (its data-parallel group) only. Must equal one
// process training the whole MLP on the whole batch.
template <class S, class Comm>
std::vector<std::string> hybrid_equivalence(Comm& world, int stages, int steps = 3,
                                            PipelineSchedule schedule = PipelineSchedule::OneFOneB) {
  using E = Env<Cpu, Comm, S>;
  std::vector<std::string> failures;
  const int replicas = world.size() / stages, replica = world.rank() / stages, stage = world.rank() % stages;
  Comm pipe_comm = world.split(/*color=*/replica, /*key=*/stage);
  Comm dp_comm = world.split(/*color=*/stage, /*key=*/replica);
  Mlp<E> model(64, {32, 32, 24, 16}, 10, 5), reference(64, {32, 32, 24, 16}, 10, 5);
  using Pipe = Pipeline<Mlp<E>>;
  // ZB-H1's last rank runs W's of other micro-batches after micro-batch 1's backward: there the
  // pipeline holds every grad_ready to the step's end, and DataParallel reduces then.
  Pipe pipe(model, pipe_comm, {.micro_batches = 2, .schedule = schedule});
  DataParallel dp(pipe.stage(), dp_comm, {.average_micro_steps = false});
  auto stage_params = pipe.stage_parameters();
  auto ref_params = named_tensors(reference);
  Sgd<E> sgd(stage_params, {.lr = 0.05, .momentum = 0.9});
  Sgd<E> sgd_ref(ref_params, {.lr = 0.05, .momentum = 0.9});
  CrossEntropyLoss<E> loss;
  const std::int64_t per_replica = 4, global = per_replica * replicas;
  for (int step = 0; step < steps; ++step) {
    const auto x = pipe_images<S>(global, 8, step);
    const auto y = pipe_labels(global, step);
    sgd_ref.zero_grad();
    typename Mlp<E>::Cache cache{};
    typename CrossEntropyLoss<E>::Cache loss_cache;
    loss.forward(reference.forward(x, cache), y, loss_cache);
    reference.backward(loss.backward(loss_cache), cache);
    sgd_ref.step();
    // This replica's slice of the batch through its pipeline; then the stage's all-reduce.
    Tensor<S, Cpu> mine(Shape{per_replica, 1, 8, 8});
    std::copy_n(x.data() + replica * per_replica * 64, per_replica * 64, mine.data());
    sgd.zero_grad();
    {
      auto guard = dp.no_sync();
      pipe.train_step(mine, std::span<const std::int64_t>(y).subspan(static_cast<std::size_t>(replica * per_replica),
                                                                     static_cast<std::size_t>(per_replica)));
    }
    dp.finish();
    sgd.step();
    double worst = 0;
    std::map<std::string, Parameter<S, Cpu>*> ref_by_name;
    for (auto& [name, p] : ref_params.parameters) ref_by_name[name] = p;
    for (auto& [name, p] : stage_params.parameters)
      for (std::int64_t k = 0; k < p->value.numel(); ++k)
        worst = std::max(worst, std::abs(static_cast<double>(p->value.data()[k] - ref_by_name.at(name)->value.data()[k])));
    if (worst > 1e-12)
      failures.push_back("hybrid " + std::to_string(replicas) + "x" + std::to_string(stages) + " rank " +
                         std::to_string(world.rank()) + " step " + std::to_string(step) + ": parameters differ by " +
                         std::to_string(worst));
  }
  return failures;
}

}  // namespace tessera::testing
