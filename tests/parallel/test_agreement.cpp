// Agreement checks (parallel/agreement.hpp) over ThreadComm: ranks built with different settings
// fail at construction, on every rank, with the same error naming the first field that differs
// and the ranks holding each value (DataParallel, Zero1, LocalSgd, Pipeline, the tensor-parallel
// layers, SyncBatchNorm); equal ranks pass and the communicator stays usable after a mismatch; the
// replica-consistency check of DataParallel and Zero1 catches ranks that step with different
// learning rates; and DataParallel's "no gradient" error lists its likely causes in order.
#include <catch2/catch.hpp>

#include <mutex>

#include "parallel/dp_equivalence.hpp"
#include "parallel/pipeline_equivalence.hpp"
#include "tessera/comm/threads.hpp"
#include "tessera/data/synthetic.hpp"
#include "tessera/optim/schedule.hpp"
#include "tessera/optim/sgd.hpp"
#include "tessera/train/trainer.hpp"
#include "tessera/models/mlp.hpp"
#include "tessera/parallel/agreement.hpp"
#include "tessera/parallel/pipeline.hpp"
#include "tessera/parallel/tensor_parallel.hpp"
#include "tessera/parallel/tensor_parallel_resnet.hpp"

using namespace tessera;

namespace {

// Runs body(comm) on `ranks` thread ranks; returns each rank's AgreementError text ("" when it
// threw none). Any other exception fails the test.
template <class Body>
std::vector<std::string> agreement_errors(int ranks, Body body) {
  ThreadWorld world(ranks);
  std::vector<std::string> errors(static_cast<std::size_t>(ranks));
  world.run([&](ThreadComm& comm) {
    try {
      body(comm);
    } catch (const AgreementError& e) {
      errors[static_cast<std::size_t>(comm.rank())] = e.what();
    }
    // After a mismatch the group is still in step: a collective works on every rank.
    std::array<std::int64_t, 1> one{1};
    comm.all_reduce(std::span<std::int64_t>(one), ReduceOp::Sum);
    REQUIRE(one[0] == comm.size());
  });
  return errors;
}

// Every rank threw, and the same text.
void check_same_on_every_rank(const std::vector<std::string>& errors) {
  for (const auto& e : errors) {
    INFO(e);
    CHECK(!e.empty());
    CHECK(e == errors.front());
  }
}
}  // namespace

TEST_CASE("AgreementRecord: canonical values, rank lists", "[parallel][agreement]") {
  AgreementRecord a("X"), b("X");
  a.add("lr", 0.05).add("n", std::int64_t{3}).add("flag", true).add("shape", Shape{64, 3, 3, 3});
  b.add("lr", 0.05000000000000001).add("n", std::int64_t{3}).add("flag", true).add("shape", Shape{64, 3, 3, 3});
  CHECK(a.fields()[0].value == "0.05");
  CHECK(b.fields()[0].value != "0.05");  // shortest round-trip text: a different double differs
  CHECK(a.fields()[2].value == "true");
  CHECK(a.fields()[3].value == "(64, 3, 3, 3)");
  CHECK(a.field_hash(0) != b.field_hash(0));
  CHECK(a.field_hash(1) == b.field_hash(1));
  AgreementRecord list("X");
  list.add_list("l", std::vector<int>{9, 8, 7});
  CHECK(list.fields()[0].value == "[9, 8, 7]");
  CHECK(Disagreement::rank_list({1}) == "rank 1");
  CHECK(Disagreement::rank_list({0, 2}) == "ranks 0, 2");
  CHECK(Disagreement::rank_list({0, 1, 2, 3, 5, 6}) == "ranks 0-3, 5, 6");
}

TEST_CASE("checksum64: bitwise, every byte counts", "[parallel][agreement]") {
  std::vector<double> x(1001);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 0.001 * static_cast<double>(i);
  const auto base = checksum64(x.data(), x.size() * sizeof(double));
  CHECK(base == checksum64(x.data(), x.size() * sizeof(double)));
  // One bit anywhere (inside the 32-byte blocks and in the tail) changes it, and so does a length.
  for (std::size_t byte : {std::size_t{0}, std::size_t{17}, std::size_t{8000}, x.size() * 8 - 1}) {
    auto y = x;
    reinterpret_cast<unsigned char*>(y.data())[byte] ^= 1;
    CHECK(checksum64(y.data(), y.size() * sizeof(double)) != base);
  }
  CHECK(checksum64(x.data(), x.size() * sizeof(double) - 1) != base);
  const double zero = 0.0, minus_zero = -0.0;
  CHECK(checksum64(&zero, 8) != checksum64(&minus_zero, 8));
}

TEST_CASE("DataParallel: equal ranks agree; the communicator is not disturbed", "[parallel][agreement]") {
  const auto errors = agreement_errors(3, [](ThreadComm& comm) {
    auto model = lenet5<CpuThreads64>();
    DataParallel dp(model, comm, {.bucket_bytes = 16 * 1024, .first_bucket_bytes = 4096});
    for (const auto& [name, p] : dp.parameters().parameters) p->grad_ready();
    dp.finish();
  });
  for (const auto& e : errors) CHECK(e.empty());
}

TEST_CASE("DataParallel: a bucket size given to one rank only is named on every rank", "[parallel][agreement]") {
  const auto errors = agreement_errors(3, [](ThreadComm& comm) {
    auto model = lenet5<CpuThreads64>();
    DataParallel dp(model, comm, {.bucket_bytes = comm.rank() == 1 ? 16 * 1024u : 64 * 1024u});
  });
  check_same_on_every_rank(errors);
  CHECK_THAT(errors[0], Catch::StartsWith("DataParallel: ranks disagree on options.bucket_bytes: ranks 0, 2: 65536; "
                                          "rank 1: 16384"));
  CHECK_THAT(errors[0], Catch::Contains("every rank must be launched with the same settings"));
}

TEST_CASE("DataParallel: compression on one rank only is named", "[parallel][agreement]") {
  const auto errors = agreement_errors(2, [](ThreadComm& comm) {
    auto model = lenet5<CpuThreads64>();
    DataParallel dp(model, comm,
                    {.compression = comm.rank() == 1 ? GradientCompression::Fp16 : GradientCompression::None});
  });
  check_same_on_every_rank(errors);
  CHECK_THAT(errors[0], Catch::Contains("ranks disagree on options.compression: rank 0: none; rank 1: fp16"));
}

TEST_CASE("DataParallel: a parameter shape that differs is named with both shapes", "[parallel][agreement]") {
  const auto errors = agreement_errors(2, [](ThreadComm& comm) {
    auto model = lenet5<CpuThreads64>(1, 28, comm.rank() == 0 ? 10 : 12);  // another number of classes
    DataParallel dp(model, comm);
  });
  check_same_on_every_rank(errors);
  // fc3 is the 9th parameter (conv1, conv2, fc1, fc2 weight and bias first).
  CHECK_THAT(errors[0], Catch::Contains("ranks disagree on parameter[8] (fc3.weight) shape: rank 0: (10, 84); rank 1: (12, 84)"));
  CHECK_THAT(errors[0], Catch::Contains("later fields differ too"));  // fc3.bias and the bucket layout
}

TEST_CASE("DataParallel: a learning-rate-like option (top-k ratio) differing in the last digit is named",
          "[parallel][agreement]") {
  const auto errors = agreement_errors(2, [](ThreadComm& comm) {
    auto model = lenet5<CpuThreads64>();
    DataParallel dp(model, comm, {.compression = GradientCompression::TopK, .topk_ratio = comm.rank() == 0 ? 0.01 : 0.010000001});
  });
  check_same_on_every_rank(errors);
  CHECK_THAT(errors[0], Catch::Contains("ranks disagree on options.topk_ratio: rank 0: 0.01; rank 1: 0.010000001"));
}

TEST_CASE("DataParallel: one rank with an invalid option fails on every rank, not only its own", "[parallel][agreement]") {
  // Without the agreement check first, rank 1's local ArgumentError would leave rank 0 waiting
  // for a broadcast.
  const auto errors = agreement_errors(2, [](ThreadComm& comm) {
    auto model = lenet5<CpuThreads64>();
    DataParallel dp(model, comm, {.consistency_check_every = comm.rank() == 1 ? -1 : 100});
  });
  check_same_on_every_rank(errors);
  CHECK_THAT(errors[0], Catch::Contains("options.consistency_check_every: rank 0: 100; rank 1: -1"));
}

TEST_CASE("Zero1 and LocalSgd: a model or period that differs is named", "[parallel][agreement]") {
  auto zero = agreement_errors(2, [](ThreadComm& comm) {
    auto model = lenet5<CpuThreads64>(1, comm.rank() == 0 ? 28 : 32);  // fc1 sees another input size: 16x5x5 or 16x6x6
    Zero1 z(model, comm);
  });
  check_same_on_every_rank(zero);
  CHECK_THAT(zero[0], Catch::StartsWith("Zero1: ranks disagree on parameter[4] (fc1.weight) shape: rank 0: (120, 400); rank 1: (120, 576)"));
  auto local = agreement_errors(3, [](ThreadComm& comm) {
    auto model = lenet5<CpuThreads64>();
    LocalSgd l(model, comm, {.period = comm.rank() == 2 ? 8 : 4});
  });
  check_same_on_every_rank(local);
  CHECK_THAT(local[0], Catch::StartsWith("LocalSgd: ranks disagree on options.period: ranks 0, 1: 4; rank 2: 8"));
}

TEST_CASE("Pipeline: a schedule or micro-batch count that differs between stages is named", "[parallel][agreement]") {
  auto schedule = agreement_errors(2, [](ThreadComm& comm) {
    Mlp<CpuThreads64> model(64, {16}, 10);
    Pipeline<Mlp<CpuThreads64>> pipe(model, comm,
                          {.schedule = comm.rank() == 0 ? PipelineSchedule::GPipe : PipelineSchedule::OneFOneB});
  });
  check_same_on_every_rank(schedule);
  CHECK_THAT(schedule[0], Catch::StartsWith("Pipeline: ranks disagree on options.schedule: rank 0: GPipe; rank 1: 1F1B"));
  auto micro = agreement_errors(3, [](ThreadComm& comm) {
    Mlp<CpuThreads64> model(64, {16, 16}, 10);
    Pipeline<Mlp<CpuThreads64>> pipe(model, comm, {.micro_batches = comm.rank() == 1 ? 8 : 4});
  });
  check_same_on_every_rank(micro);
  CHECK_THAT(micro[0], Catch::Contains("options.micro_batches: ranks 0, 2: 4; rank 1: 8"));
  // Unit costs given on one rank only: that rank would skip the cost broadcast the others wait in.
  auto costs = agreement_errors(2, [](ThreadComm& comm) {
    Mlp<CpuThreads64> model(64, {16}, 10);
    PipelineOptions o;
    if (comm.rank() == 1) o.unit_costs = {1.0, 2.0};
    Pipeline<Mlp<CpuThreads64>> pipe(model, comm, o);
  });
  check_same_on_every_rank(costs);
  CHECK_THAT(costs[0], Catch::Contains("options.unit_costs: rank 0: []; rank 1: [1, 2]"));
}

TEST_CASE("Tensor parallel: layers built from different seeds or options are named", "[parallel][agreement]") {
  auto seed = agreement_errors(2, [](ThreadComm& comm) {
    Rng rng(comm.rank() == 0 ? 3 : 4);
    ColumnParallelLinear<CpuThreads64> layer(8, 16, rng, comm);
  });
  check_same_on_every_rank(seed);
  CHECK_THAT(seed[0], Catch::StartsWith("ColumnParallelLinear: ranks disagree on dense checksum of parameter weight: "
                                        "rank 0: 0x"));
  CHECK_THAT(seed[0], Catch::Contains("from the same seed"));
  auto option = agreement_errors(2, [](ThreadComm& comm) {
    Rng rng(3);
    RowParallelLinear<CpuThreads64> layer(8, 4, rng, comm, /*input_is_parallel=*/comm.rank() == 1);
  });
  check_same_on_every_rank(option);
  CHECK_THAT(option[0], Catch::Contains("ranks disagree on input_is_parallel: rank 0: false; rank 1: true"));
  auto sizes = agreement_errors(2, [](ThreadComm& comm) {
    Rng rng(3);
    TensorParallelMlp<CpuThreads64> mlp(8, comm.rank() == 0 ? 16 : 32, 4, rng, comm);
  });
  check_same_on_every_rank(sizes);
  CHECK_THAT(sizes[0], Catch::Contains("ColumnParallelLinear: ranks disagree on out_features: rank 0: 16; rank 1: 32"));
  auto resnet = agreement_errors(2, [](ThreadComm& comm) {
    auto dense = ResNet<CpuThreads64, Bottleneck>({1, 1}, {4, 8}, true,
                                       {.in_channels = 1, .num_classes = 8, .seed = comm.rank() == 0 ? 3u : 5u});
    TensorParallelResNet<CpuThreads64> tp(dense, comm);
  });
  check_same_on_every_rank(resnet);
  CHECK_THAT(resnet[0], Catch::StartsWith("TensorParallelResNet: ranks disagree on dense checksum of parameter conv1.weight"));
}

TEST_CASE("convert_sync_batch_norm: ranks converting different models are named", "[parallel][agreement]") {
  const auto errors = agreement_errors(2, [](ThreadComm& comm) {
    ResNet<CpuThreads64, BasicBlock> model({1}, {comm.rank() == 0 ? 16 : 8}, false, {.in_channels = 1, .num_classes = 10});
    convert_sync_batch_norm(model, comm);
  });
  check_same_on_every_rank(errors);
  CHECK_THAT(errors[0], Catch::Contains("convert_sync_batch_norm: ranks disagree on batch_norm[0] (bn1) channels: rank 0: 16; rank 1: 8"));
}

namespace {
// Trains LeNet-5 under DataParallel with SGD at lr(rank) for `steps` steps (each rank on its own
// shard); returns each rank's AgreementError text and the synchronized steps that completed.
struct Diverged {
  std::vector<std::string> errors;
  std::vector<int> steps_done;
};
template <class Lr>
Diverged train_with_lr(int ranks, int steps, int check_every, Lr lr) {
  Diverged out{std::vector<std::string>(static_cast<std::size_t>(ranks)), std::vector<int>(static_cast<std::size_t>(ranks), 0)};
  const testing::DpData<double> data(4 * ranks * steps);
  ThreadWorld world(ranks);
  world.run([&](ThreadComm& comm) {
    auto model = lenet5<CpuThreads64>();
    DataParallel dp(model, comm, {.consistency_check_every = check_every});
    Sgd<CpuThreads64> sgd(dp.parameters(), {.lr = lr(comm.rank()), .momentum = 0.9});
    try {
      for (int step = 0; step < steps; ++step) {
        sgd.zero_grad();
        testing::forward_backward<double>(model, data, (step * ranks + comm.rank()) * 4, 4);
        sgd.step();  // finishes the all-reduce first, and with it the periodic check
        ++out.steps_done[static_cast<std::size_t>(comm.rank())];
      }
    } catch (const AgreementError& e) {
      out.errors[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  return out;
}
}  // namespace

TEST_CASE("DataParallel: replicas stepping with different learning rates are caught within N steps", "[parallel][agreement]") {
  // Checks at steps 1, 4, 7: step 1's update already differs, so the check at step 4 throws.
  const auto run = train_with_lr(3, 8, 3, [](int rank) { return rank == 2 ? 0.1 : 0.05; });
  check_same_on_every_rank(run.errors);
  for (int done : run.steps_done) CHECK(done == 3);
  CHECK_THAT(run.errors[0], Catch::StartsWith("DataParallel: the replicas' parameters are no longer identical at the start "
                                              "of synchronized step 4 (checked every 3 steps; equal at step 1): "
                                              "parameter conv1.weight: ranks 0, 1: checksum 0x"));
  CHECK_THAT(run.errors[0], Catch::Contains("; rank 2: checksum 0x"));
  CHECK_THAT(run.errors[0], Catch::Contains("(the first of 10 that differ)"));
  CHECK_THAT(run.errors[0], Catch::Contains("a learning rate, schedule or optimizer setting that differs between ranks"));
}

TEST_CASE("DataParallel: equal replicas pass every check; 0 turns the check off", "[parallel][agreement]") {
  const auto same = train_with_lr(2, 7, 2, [](int) { return 0.05; });
  for (const auto& e : same.errors) CHECK(e.empty());
  const auto off = train_with_lr(2, 4, 0, [](int rank) { return rank == 0 ? 0.05 : 0.1; });
  for (const auto& e : off.errors) CHECK(e.empty());
}

TEST_CASE("DataParallel: check_replica_consistency() on demand names a parameter edited on one rank", "[parallel][agreement]") {
  const auto errors = agreement_errors(2, [](ThreadComm& comm) {
    auto model = lenet5<CpuThreads64>();
    DataParallel dp(model, comm, {.consistency_check_every = 0});
    dp.check_replica_consistency();  // equal after the broadcast
    if (comm.rank() == 1) dp.parameters().parameters[5].second->value.data()[3] += 1e-12;  // fc1.bias
    dp.check_replica_consistency();
  });
  check_same_on_every_rank(errors);
  CHECK_THAT(errors[0], Catch::Contains("after 0 synchronized steps: parameter fc1.bias: rank 0: checksum"));
}

TEST_CASE("Zero1: ranks stepping with different learning rates are named", "[parallel][agreement]") {
  const auto errors = agreement_errors(2, [](ThreadComm& comm) {
    auto model = lenet5<CpuThreads64>();
    Zero1 zero(model, comm, {.consistency_check_every = 5});
    Sgd<CpuThreads64> sgd(zero.shard_parameters(), {.lr = comm.rank() == 0 ? 0.05 : 0.1});
    zero.zero_grad();
    zero.step(sgd);
  });
  check_same_on_every_rank(errors);
  CHECK_THAT(errors[0], Catch::StartsWith("Zero1: ranks disagree on optimizer.lr: rank 0: 0.05; rank 1: 0.1 (at step 1:"));
}

TEST_CASE("DataParallel: the no-gradient error lists the likely causes, most likely first", "[parallel][agreement]") {
  ThreadWorld world(1);
  world.run([](ThreadComm& comm) {
    auto model = lenet5<CpuThreads64>();
    DataParallel dp(model, comm);
    for (const auto& [name, p] : dp.parameters().parameters)
      if (name != "fc1.weight") p->grad_ready();
    std::string error;
    try {
      dp.finish();
    } catch (const ArgumentError& e) {
      error = e.what();
    }
    INFO(error);
    CHECK_THAT(error, Catch::Contains("no gradient in this step for: fc1.weight (likely causes, most likely first: "));
    const auto custom = error.find("a custom layer whose backward does not call grad_ready()");
    const auto unused = error.find("a parameter this forward did not use");
    const auto skipped = error.find("a backward pass that ended early on this rank");
    CHECK(custom != std::string::npos);
    CHECK(unused != std::string::npos);
    CHECK(skipped != std::string::npos);
    CHECK(custom < unused);
    CHECK(unused < skipped);
    CHECK_THAT(error, Catch::Contains("find_unused_parameters"));
    CHECK_THROWS_WITH(dp.finish(), Catch::Contains("finish() without a backward pass since the last step (this rank skipped backward"));
  });
}

namespace {
// A Trainer on each rank of a small data-parallel MLP; `setup(rank, lr, seed)` picks per-rank
// settings the way flags given to one rank only would.
template <class Setup>
std::vector<std::string> trainer_errors(Setup setup) {
  return agreement_errors(3, [&](ThreadComm& comm) {
    double lr = 0.05;
    std::uint64_t seed = 1;
    std::int64_t epochs = 2;
    setup(comm.rank(), lr, seed, epochs);
    Mlp<CpuThreads64> model(100, {16}, 4, 3);
    const SyntheticImages data(48, 1, 10, 10, 4, 5);
    DataLoader<double> loader(data, {.batch_size = 4, .seed = seed, .rank = comm.rank(), .world_size = comm.size()});
    DataParallel dp(model, comm);
    Sgd<CpuThreads64> sgd(dp.parameters(), {.lr = lr});
    Trainer trainer(model, sgd, ConstantLr{lr},
                    {.epochs = epochs, .verbose = false, .checkpoint_group = CheckpointGroup(comm)});
    trainer.fit(loader);
  });
}
}  // namespace

TEST_CASE("Trainer: a learning rate, seed or epoch count given to one rank only is named before any step",
          "[parallel][agreement]") {
  CHECK(trainer_errors([](int, double&, std::uint64_t&, std::int64_t&) {}) == std::vector<std::string>(3));
  auto errors = trainer_errors([](int rank, double& lr, std::uint64_t&, std::int64_t&) {
    if (rank == 2) lr = 0.1;
  });
  check_same_on_every_rank(errors);
  CHECK_THAT(errors[0], Catch::StartsWith("Trainer: ranks disagree on learning rate schedule at epoch 0: ranks 0, 1: "
                                          "0.05; rank 2: 0.1"));
  CHECK_THAT(errors[0], Catch::Contains("same training settings"));
  errors = trainer_errors([](int rank, double&, std::uint64_t& seed, std::int64_t&) {
    if (rank == 0) seed = 7;
  });
  check_same_on_every_rank(errors);
  CHECK_THAT(errors[0], Catch::StartsWith("Trainer: ranks disagree on train loader: seed: rank 0: 7; ranks 1, 2: 1"));
  errors = trainer_errors([](int rank, double&, std::uint64_t&, std::int64_t& epochs) {
    if (rank == 1) epochs = 3;
  });
  check_same_on_every_rank(errors);
  CHECK_THAT(errors[0], Catch::StartsWith("Trainer: ranks disagree on options.epochs: ranks 0, 2: 2; rank 1: 3"));
}
