// Pipeline over ThreadComm: every schedule on 2, 3 and 4 stages equals the unsplit model (loss,
// gradients, parameters after SGD steps) for an MLP, a BN-free ResNet and ResNet-20 with BN at one
// micro-batch; the 1F1B memory bound; balancing; bad input. MPI runs the same equivalence as a
// multi-process program (tests/parallel/pipeline_main.cpp).
#include <catch2/catch.hpp>

#include "support/text.hpp"
#include "parallel/pipeline_equivalence.hpp"
#include "tessera/comm/threads.hpp"
#include "tessera/optim/clip.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>

using namespace tessera;
using testing::PipeModel;

namespace {
void check_pipeline(int stages, testing::PipeCase c) {
  ThreadWorld world(stages);
  std::vector<std::vector<std::string>> failures(static_cast<std::size_t>(stages));
  world.run([&](ThreadComm& comm) { failures[comm.rank()] = testing::pipeline_equivalence<double>(comm, c); });
  for (const auto& f : failures) {
    INFO(testing::joined(f));
    CHECK(f.empty());
  }
}
}  // namespace

TEST_CASE("Pipeline: GPipe and 1F1B on 2-4 stages equal the unsplit MLP and BN-free ResNet (float64)", "[parallel]") {
  for (PipeModel model : {PipeModel::Mlp, PipeModel::PlainResNet})
    for (PipelineSchedule schedule : {PipelineSchedule::GPipe, PipelineSchedule::OneFOneB})
      for (int stages : {2, 3, 4}) {
        DYNAMIC_SECTION(testing::model_name(model) << " " << schedule_name(schedule) << " P=" << stages) {
          check_pipeline(stages, {.model = model, .micro_batches = 4, .schedule = schedule, .batch = 8, .steps = 3});
        }
      }
}

namespace {
// A zero-bubble table with each I and W joined into one B at the I's place: the same order of
// forwards and backwards as the table, runnable by a model whose backward is whole.
PipelineScheduleTable joined_backward(PipelineScheduleTable t) {
  for (auto& row : t.actions) {
    std::erase_if(row, [](const PipelineAction& a) { return a.op == PipelineOp::BackwardWeight; });
    for (auto& a : row)
      if (a.op == PipelineOp::BackwardInput) a.op = PipelineOp::Backward;
  }
  t.name += " (backward whole)";
  return t;
}
}  // namespace

// Several stages per rank: interleaved 1F1B (Loop placement, v = 2 and 3), the V placement (its
// first and last stage on rank 0, the turn at stages P - 1 and P on one rank) and a table read
// from torch's CSV, each equal to the unsplit model.
TEST_CASE("Pipeline: interleaved, V-placed and CSV tables equal the unsplit model (float64)", "[parallel][pipeline]") {
  SECTION("Interleaved1F1B") {
    check_pipeline(2, {.model = PipeModel::Mlp, .micro_batches = 4, .schedule = PipelineSchedule::Interleaved1F1B});
    check_pipeline(3, {.model = PipeModel::Mlp, .micro_batches = 6, .schedule = PipelineSchedule::Interleaved1F1B,
                       .stages_per_rank = 2, .batch = 12});
    check_pipeline(2, {.model = PipeModel::Mlp, .micro_batches = 4, .schedule = PipelineSchedule::Interleaved1F1B,
                       .stages_per_rank = 3});
    check_pipeline(2, {.model = PipeModel::PlainResNet, .micro_batches = 4, .schedule = PipelineSchedule::Interleaved1F1B});
  }
  SECTION("V placement") {
    check_pipeline(2, {.model = PipeModel::Mlp, .micro_batches = 4, .table = joined_backward(zb_v_table(2, 4))});
    check_pipeline(3, {.model = PipeModel::Mlp, .micro_batches = 3, .table = joined_backward(zb_v_table(3, 3)), .batch = 6});
    check_pipeline(2, {.model = PipeModel::PlainResNet, .micro_batches = 2, .table = joined_backward(zb_v_table(2, 2))});
  }
  SECTION("a table from CSV") {
    // Interleaved's table with two steps of rank 1 exchanged where nothing depends on them.
    auto t = parse_pipeline_csv(to_csv(interleaved_1f1b_table(2, 2, 4)), "from csv");
    check_pipeline(2, {.model = PipeModel::Mlp, .micro_batches = 4, .table = t});
    check_pipeline(2, {.model = PipeModel::Mlp, .micro_batches = 4, .table = joined_backward(zb_h1_table(2, 4))});
  }
}

// Zero bubble: the MLP runs I and W apart (Linear's backward_input / backward_weight), the
// BN-free ResNet its whole backward as I; both equal the unsplit model.
TEST_CASE("Pipeline: ZB-H1 and ZB-V equal the unsplit model (float64)", "[parallel][pipeline]") {
  static_assert(Pipeline<Mlp<Env<Cpu, ThreadComm, double>>>::kSplitsBackward);
  for (int p : {2, 3})
    for (int m : {p, 2 * p}) {
      DYNAMIC_SECTION("P = " << p << ", M = " << m) {
        check_pipeline(p, {.model = PipeModel::Mlp, .micro_batches = m, .schedule = PipelineSchedule::ZBH1, .batch = 2 * m});
        check_pipeline(p, {.model = PipeModel::Mlp, .micro_batches = m, .schedule = PipelineSchedule::ZBV, .batch = 2 * m});
      }
    }
  check_pipeline(4, {.model = PipeModel::Mlp, .micro_batches = 8, .schedule = PipelineSchedule::ZBH1, .batch = 16});
  check_pipeline(2, {.model = PipeModel::PlainResNet, .micro_batches = 4, .schedule = PipelineSchedule::ZBH1});
  check_pipeline(2, {.model = PipeModel::PlainResNet, .micro_batches = 4, .schedule = PipelineSchedule::ZBV});
}

TEST_CASE("Pipeline: tables it cannot run are refused on every rank before the first step", "[parallel][pipeline]") {
  ThreadWorld world(2);
  std::vector<std::string> errors(2);
  const auto refused = [&](PipelineOptions options) {
    world.run([&](ThreadComm& comm) {
      using E = Env<Cpu, ThreadComm, double>;
      Mlp<E> model(64, {32, 32, 24, 16, 16}, 10, 5);
      try {
        Pipeline<Mlp<E>> pipe(model, comm, options);
        errors[comm.rank()] = "";
      } catch (const Error& e) {
        errors[comm.rank()] = e.what();
      }
    });
    CHECK(errors[0] == errors[1]);
    return errors[0];
  };
  CHECK_THAT(refused({.micro_batches = 3, .schedule = PipelineSchedule::Interleaved1F1B}),
             Catch::Contains("3 micro-batches is not a multiple of the 2 ranks"));
  CHECK_THAT(refused({.micro_batches = 4, .table = one_f_one_b_table(3, 4)}),
             Catch::Contains("schedule '1F1B' has 3 rows (ranks), the communicator 2 ranks"));
  CHECK_THAT(refused({.micro_batches = 2, .table = one_f_one_b_table(2, 4)}),
             Catch::Contains("runs 4 micro-batches, options.micro_batches is 2"));
  auto crossed = one_f_one_b_table(2, 2);
  std::swap(crossed.actions[1][0], crossed.actions[1][1]);  // 1B0 before 1F0
  CHECK_THAT(refused({.micro_batches = 2, .table = crossed}), Catch::Contains("rank 1 runs 1B0 (action 0) before 1F0"));
}

TEST_CASE("Pipeline: more micro-batches than stages, and one micro-batch", "[parallel]") {
  for (PipelineSchedule schedule : {PipelineSchedule::GPipe, PipelineSchedule::OneFOneB}) {
    check_pipeline(2, {.model = PipeModel::Mlp, .micro_batches = 8, .schedule = schedule, .batch = 16, .steps = 2});
    check_pipeline(3, {.model = PipeModel::Mlp, .micro_batches = 1, .schedule = schedule, .batch = 6, .steps = 2});
  }
}

TEST_CASE("Pipeline: ResNet-20 with BatchNorm equals the unsplit model when the micro-batch is the batch", "[parallel]") {
  for (PipelineSchedule schedule : {PipelineSchedule::GPipe, PipelineSchedule::OneFOneB})
    for (int stages : {2, 4}) {
      DYNAMIC_SECTION(schedule_name(schedule) << " P=" << stages) {
        check_pipeline(stages, {.model = PipeModel::ResNet20, .micro_batches = 1, .schedule = schedule, .batch = 4, .steps = 2});
      }
    }
}

// With BatchNorm the statistics are each micro-batch's: the reference runs the micro-batches in
// turn (PipeCase::reference_per_micro_batch). Every built-in schedule, the zero-bubble ones with
// the blocks' backward split into input and weight halves.
TEST_CASE("Pipeline: ResNet-20 with BatchNorm under every schedule equals the unsplit model on the same micro-batches",
          "[parallel][pipeline]") {
  static_assert(Pipeline<ResNet<Env<Cpu, ThreadComm, double>, BasicBlock>>::kSplitsBackward);
  for (PipelineSchedule schedule : {PipelineSchedule::GPipe, PipelineSchedule::OneFOneB, PipelineSchedule::Interleaved1F1B,
                                    PipelineSchedule::ZBH1, PipelineSchedule::ZBV})
    DYNAMIC_SECTION(schedule_name(schedule) << " P=2 M=4") {
      check_pipeline(2, {.model = PipeModel::ResNet20, .micro_batches = 4, .schedule = schedule, .batch = 8, .steps = 2,
                         .reference_per_micro_batch = true});
    }
  check_pipeline(4, {.model = PipeModel::ResNet20, .micro_batches = 8, .schedule = PipelineSchedule::ZBH1, .batch = 16,
                     .steps = 2, .reference_per_micro_batch = true});
  // float32, the 1e-6 on the weights after the steps, every schedule.
  for (PipelineSchedule schedule : {PipelineSchedule::GPipe, PipelineSchedule::OneFOneB, PipelineSchedule::Interleaved1F1B,
                                    PipelineSchedule::ZBH1, PipelineSchedule::ZBV})
    DYNAMIC_SECTION(schedule_name(schedule) << " float32") {
      ThreadWorld world(2);
      std::vector<std::vector<std::string>> failures(2);
      world.run([&](ThreadComm& comm) {
        using E = Env<Cpu, ThreadComm, float>;
        const auto make = [] { return resnet20<E>({.in_channels = 1, .num_classes = 10, .seed = 7}); };
        failures[static_cast<std::size_t>(comm.rank())] = testing::run_pipeline_case<float>(
            comm, {.model = PipeModel::ResNet20, .micro_batches = 4, .schedule = schedule, .batch = 8, .steps = 3,
                   .tolerance = 1e-6, .reference_per_micro_batch = true},
            make(), make(), 8);
      });
      for (const auto& f : failures) {
        INFO(testing::joined(f));
        CHECK(f.empty());
      }
    }
}

TEST_CASE("Pipeline: 1F1B holds at most P - s micro-batches, GPipe all M", "[parallel]") {
  ThreadWorld world(4);
  std::vector<int> gpipe(4), one_f_one_b(4);
  world.run([&](ThreadComm& comm) {
    testing::pipeline_equivalence<double>(comm, {.micro_batches = 8, .schedule = PipelineSchedule::GPipe, .batch = 16, .steps = 1},
                                          &gpipe[comm.rank()]);
    testing::pipeline_equivalence<double>(comm, {.micro_batches = 8, .schedule = PipelineSchedule::OneFOneB, .batch = 16, .steps = 1},
                                          &one_f_one_b[comm.rank()]);
  });
  for (int s = 0; s < 4; ++s) {
    CHECK(gpipe[s] == 8);
    CHECK(one_f_one_b[s] == 4 - s);
  }
}

TEST_CASE("Pipeline: balanced boundaries minimize the most expensive stage", "[parallel]") {
  CHECK(balanced_boundaries({1, 1, 1, 1}, 2) == std::vector<std::size_t>{0, 2, 4});
  CHECK(balanced_boundaries({4, 1, 1, 1, 1}, 2) == std::vector<std::size_t>{0, 1, 5});
  CHECK(balanced_boundaries({1, 2, 3, 4, 5, 6, 7, 8, 9}, 3) == std::vector<std::size_t>{0, 5, 7, 9});  // 15, 13, 17
  CHECK(balanced_boundaries({5}, 1) == std::vector<std::size_t>{0, 1});
  CHECK_THROWS_WITH(balanced_boundaries({1, 1}, 3), Catch::Contains("cannot split 2 units into 3 stages"));
  // LeNet-5's 12 units (conv1 relu pool conv2 relu pool flatten fc1 relu fc2 relu fc3) with the
  // costs that split 4 stages as conv1 | relu pool | conv2 ... : every stage must hold parameters.
  const std::vector<bool> lenet = {true, false, false, true, false, false, false, true, false, true, false, true};
  const std::vector<double> costs = {10, 6, 6, 10, 1, 1, 0, 2, 0, 1, 0, 1};
  const auto unconstrained = balanced_boundaries(costs, 4);  // every optimum makes stage 1 relu pool
  CHECK((unconstrained[1] == 1 && unconstrained[2] == 3));
  const auto bounds = balanced_boundaries(costs, 4, lenet);
  REQUIRE(bounds.size() == 5);
  for (std::size_t k = 0; k < 4; ++k)
    CHECK(std::any_of(lenet.begin() + static_cast<std::ptrdiff_t>(bounds[k]),
                      lenet.begin() + static_cast<std::ptrdiff_t>(bounds[k + 1]), [](bool t) { return t; }));
  CHECK_THROWS_WITH(balanced_boundaries(costs, 6, lenet),
                    Catch::Contains("6 stages, but only 5 of the model's 12 units hold parameters") &&
                        Catch::Contains("use at most 5 stages"));
  CHECK(balanced_boundaries({1, 1, 1}, 3, {false, false, false}) == std::vector<std::size_t>{0, 1, 2, 3});
}

TEST_CASE("Pipeline: costs measured on rank 0 give every rank the same split", "[parallel]") {
  using E = CpuThreads64;
  ThreadWorld world(2);
  std::vector<std::vector<std::size_t>> bounds(2);
  world.run([&](ThreadComm& comm) {
    auto model = resnet20<E>({.in_channels = 1, .num_classes = 10, .seed = 1});
    const auto sample = testing::pipe_images<double>(4, 8, 0);
    const auto before = named_tensors(model);
    std::vector<double> running_mean(before.buffers.front().second->data(),
                                     before.buffers.front().second->data() + before.buffers.front().second->numel());
    Pipeline<decltype(model)> pipe(model, comm, {.micro_batches = 2}, comm.rank() == 0 ? &sample : nullptr);
    bounds[comm.rank()] = pipe.boundaries();
    // Measuring left the BatchNorm statistics and the gradients as they were.
    const auto& after = *before.buffers.front().second;
    for (std::int64_t k = 0; k < after.numel(); ++k) REQUIRE(after.data()[k] == running_mean[static_cast<std::size_t>(k)]);
    for (const auto& [name, p] : before.parameters)
      for (std::int64_t k = 0; k < p->grad.numel(); ++k) REQUIRE(p->grad.data()[k] == 0.0);
  });
  CHECK(bounds[0] == bounds[1]);
  CHECK(bounds[0].size() == 3);
}

TEST_CASE("Pipeline: bad boundaries and a batch that does not split are named", "[parallel]") {
  using E = CpuThreads64;
  ThreadWorld world(1);
  world.run([](ThreadComm& comm) {
    Mlp<E> model(64, {16}, 10);
    CHECK_THROWS_WITH((Pipeline<Mlp<E>>(model, comm, {.boundaries = {0, 1}})),
                      Catch::Contains("boundaries must be 2 unit indices from 0 to 2"));
    CHECK_THROWS_WITH((Pipeline<Mlp<E>>(model, comm, {.micro_batches = 0})),
                      Catch::Contains("micro_batches=0 must be at least 1"));
    Pipeline<Mlp<E>> pipe(model, comm, {.micro_batches = 4});
    const auto x = testing::pipe_images<double>(6, 8, 0);
    const auto y = testing::pipe_labels(6, 0);
    CHECK_THROWS_WITH(pipe.train_step(x, y), Catch::Contains("does not split into 4 equal micro-batches"));
    const auto x8 = testing::pipe_images<double>(8, 8, 0);
    CHECK_THROWS_WITH(pipe.train_step(x8, y), Catch::Contains("6 labels on the last stage for a batch of 8"));
  });
}

TEST_CASE("Hybrid: 2 data-parallel replicas x 2 pipeline stages equal one process on the global batch", "[parallel]") {
  ThreadWorld world(4);
  std::vector<std::vector<std::string>> failures(4);
  for (PipelineSchedule schedule : {PipelineSchedule::OneFOneB, PipelineSchedule::ZBH1}) {
    INFO(schedule_name(schedule));
    world.run([&](ThreadComm& comm) { failures[comm.rank()] = testing::hybrid_equivalence<double>(comm, 2, 3, schedule); });
    for (const auto& f : failures) {
      INFO(testing::joined(f));
      CHECK(f.empty());
    }
  }
}

TEST_CASE("Pipeline: a failing stage stops the others instead of leaving them waiting", "[parallel]") {
  using E = CpuThreads64;
  ThreadWorld world(3);
  // The last stage gets the wrong number of labels and throws; stages 0 and 1 are blocked in
  // receives at that moment and must be woken with the error, not wait for the timeout.
  const auto started = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(world.run([](ThreadComm& comm) {
                      Mlp<E> model(64, {16, 16}, 10);
                      Pipeline<Mlp<E>> pipe(model, comm, {.micro_batches = 2});
                      const auto x = testing::pipe_images<double>(8, 8, 0);
                      const auto y = testing::pipe_labels(comm.rank() == 2 ? 5 : 8, 0);
                      pipe.train_step(x, y);
                    }),
                    Catch::Contains("5 labels on the last stage for a batch of 8"));
  CHECK(std::chrono::steady_clock::now() - started < std::chrono::seconds(10));
}

// Clipping after a zero-bubble step: the gradients are final when train_step returns (every W ran
// inside it), so the stages' norm summed over the pipeline group is the one-process norm, and each
// stage scales as one process does. A NaN on one stage makes every stage refuse alike.
TEST_CASE("Pipeline: clip_grad_norm over the stages after ZB-H1 equals one process's", "[parallel][pipeline]") {
  using E = Env<Cpu, ThreadComm, double>;
  const auto x = testing::pipe_images<double>(8, 8, 0);
  const auto y = testing::pipe_labels(8, 0);
  // One process, and torch's formula by hand.
  Mlp<E> reference(64, {32, 32, 24, 16, 16}, 10, 5);
  auto ref_params = named_tensors(reference);
  {
    typename Mlp<E>::Cache cache{};
    CrossEntropyLoss<E> loss;
    typename CrossEntropyLoss<E>::Cache lc;
    loss.forward(reference.forward(x, cache), y, lc);
    reference.backward(loss.backward(lc), cache);
  }
  double sum = 0;
  for (auto& [name, p] : ref_params.parameters)
    for (std::int64_t k = 0; k < p->grad.numel(); ++k) sum += p->grad.data()[k] * p->grad.data()[k];
  const double max_norm = 0.05, total = std::sqrt(sum);
  REQUIRE(total > max_norm);  // so it clips
  const double first_before = ref_params.parameters[0].second->grad.data()[0];
  CHECK(clip_grad_norm(ref_params, max_norm) == Approx(total).epsilon(1e-14));
  CHECK(ref_params.parameters[0].second->grad.data()[0] == Approx(first_before * max_norm / (total + 1e-6)).epsilon(1e-14));
  CHECK(clip_grad_norm(ref_params, 1e9) == Approx(max_norm * total / (total + 1e-6)).epsilon(1e-12));  // under the bound: unchanged
  CHECK_THROWS_WITH(clip_grad_norm(ref_params, 1.0, {.norm_type = 1.0}), Catch::Contains("only the 2-norm"));

  ThreadWorld world(2);
  std::vector<std::string> failures(2), errors(2);
  world.run([&](ThreadComm& comm) {
    Mlp<E> model(64, {32, 32, 24, 16, 16}, 10, 5);
    Pipeline<Mlp<E>> pipe(model, comm, {.micro_batches = 4, .schedule = PipelineSchedule::ZBH1});
    const Tensor<double, Cpu> empty;
    pipe.train_step(comm.rank() == 0 ? x : empty, comm.rank() == 1 ? std::span<const std::int64_t>(y) : std::span<const std::int64_t>());
    const double norm = clip_grad_norm(pipe.norm_parameters(), max_norm, comm);
    if (std::abs(norm - total) > 1e-12 * total) failures[comm.rank()] += "norm " + std::to_string(norm) + " vs " + std::to_string(total);
    std::map<std::string, Parameter<double, Cpu>*> want;
    for (auto& [name, p] : ref_params.parameters) want[name] = p;
    for (auto& [name, p] : pipe.stage_parameters().parameters)
      for (std::int64_t k = 0; k < p->grad.numel(); ++k)
        if (std::abs(p->grad.data()[k] - want.at(name)->grad.data()[k]) > 1e-15) {
          failures[comm.rank()] += " " + name + " differs";
          break;
        }
    if (comm.rank() == 1) pipe.stage_parameters().parameters[0].second->grad.data()[3] = std::nan("");
    try {
      clip_grad_norm(pipe.norm_parameters(), max_norm, comm, {.error_if_nonfinite = true});
    } catch (const ArgumentError& e) {
      errors[comm.rank()] = e.what();
    }
  });
  CHECK(failures[0].empty());
  CHECK(failures[1].empty());
  INFO(failures[0] << failures[1]);
  CHECK_THAT(errors[0], Catch::Contains("holds a NaN or an infinity"));
  CHECK_THAT(errors[1], Catch::Contains("holds a NaN or an infinity"));
}
