// DataParallel equivalence as a multi-process program (MPI under mpirun, Gloo under tessera-run):
// every rank checks that its parameters equal one process training on the whole batch and are
// bit-identical across ranks, in float64, float32, with bf16 buckets on the wire, with gradient
// accumulation, a GPT under DataParallel and ZeRO-1 (token windows, AdamW), and for ResNet-20 with SyncBatchNorm (BatchNorm running statistics included);
// ZeRO-2 and ZeRO-3 (FullyShardedDataParallel) with SGD and AdamW, LeNet-5 and ResNet-20;
// rank 1 launched with another bucket size or learning rate ending in the named agreement error on
// every rank; and the parameter server's synchronous mode against one process, its SSP and
// asynchronous modes against their bounds.
#include <cstdio>
#include <exception>

#include "comm/program.hpp"
#include "parallel/dp_equivalence.hpp"
#include "parallel/fsdp_equivalence.hpp"
#include "parallel/gpt_dp_equivalence.hpp"
#include "parallel/ps_equivalence.hpp"

int main(int argc, char** argv) {
  using namespace tessera;
  return testing::run_ranks([&](testing::TestComm& comm) {
    const int rank = comm.rank();
    std::vector<std::string> failures;
    auto add = [&](const char* what, std::vector<std::string> f) {
      for (auto& line : f) failures.push_back(std::string(what) + ": " + line);
    };
    add("float64", testing::dp_equivalence<double>(comm, {.per_rank_batch = 6, .steps = 3}));
    add("float32", testing::dp_equivalence<float>(comm, {.per_rank_batch = 8, .steps = 3, .tolerance = 1e-5}));
    add("bf16 wire", testing::dp_equivalence<double>(comm, {.per_rank_batch = 6, .steps = 3, .tolerance = 1e-3,
                                                            .compression = GradientCompression::Bf16}));
    add("accumulation", testing::dp_equivalence<double>(comm, {.per_rank_batch = 8, .steps = 2, .micro_steps = 4}));
    add("zero1 sgd", testing::strategy_equivalence<double>(comm, testing::Strategy::Zero1Sgd, {.per_rank_batch = 4, .steps = 3}));
    add("zero1 adam", testing::strategy_equivalence<double>(comm, testing::Strategy::Zero1Adam, {.per_rank_batch = 4, .steps = 3}));
    add("local sgd k=1", testing::strategy_equivalence<double>(comm, testing::Strategy::LocalSgdPeriod1, {.per_rank_batch = 4, .steps = 3}));
    add("gpt data parallel", testing::gpt_dp_equivalence<double>(comm, testing::GptDpStrategy::DataParallel));
    add("gpt zero1", testing::gpt_dp_equivalence<double>(comm, testing::GptDpStrategy::Zero1));
    add("gpt fsdp stage 2", testing::gpt_dp_equivalence<double>(comm, testing::GptDpStrategy::Fsdp2));
    add("gpt fsdp stage 3", testing::gpt_dp_equivalence<double>(comm, testing::GptDpStrategy::Fsdp3));
    add("resnet20+syncbn", testing::dp_equivalence_resnet20_sync_bn<double>(comm, {.per_rank_batch = 4, .steps = 2}));
    // ZeRO-2 and ZeRO-3 (parallel/fully_sharded.hpp): each rank's shard stepped alone, the whole
    // model gathered back equal to one process.
    using testing::FsdpOptimizer;
    for (int stage : {2, 3}) {
      const std::string name = "fsdp stage " + std::to_string(stage);
      add((name + " sgd").c_str(), testing::fsdp_equivalence<double>(comm, {.stage = stage}));
      add((name + " adamw").c_str(), testing::fsdp_equivalence<double>(comm, {.stage = stage, .optimizer = FsdpOptimizer::AdamW}));
      add((name + " resnet20+syncbn sgd").c_str(),
          testing::fsdp_equivalence<double>(comm, {.stage = stage, .per_rank_batch = 2, .steps = 2}, testing::MakeResnet20{}));
      // AdamW: 1e-12, or twice one process's distance from itself with its batches shuffled
      // (fsdp_equivalence.hpp), whichever is larger.
      add((name + " resnet20+syncbn adamw").c_str(),
          testing::fsdp_equivalence<double>(comm, {.stage = stage, .optimizer = FsdpOptimizer::AdamW, .per_rank_batch = 2,
                                                   .steps = 2, .reordered_references = 12},
                                            testing::MakeResnet20{}));
    }
    add("fsdp stage 3 micro-batches", testing::fsdp_equivalence<double>(comm, {.stage = 3, .micro_batches = 2}));
    add("fsdp stage 3 float32", testing::fsdp_equivalence<float>(comm, {.stage = 3, .optimizer = FsdpOptimizer::AdamW,
                                                                         .per_rank_batch = 8, .tolerance = 1e-5}));
    add("fsdp stage 3 bfloat16 wire",
        testing::fsdp_equivalence<float>(comm, {.stage = 3, .optimizer = FsdpOptimizer::AdamW, .per_rank_batch = 8,
                                                .param_dtype = ShardDType::BFloat16, .reduce_dtype = ShardDType::BFloat16,
                                                .tolerance = 3e-2, .at_least = 1e-7}));
    // Ranks launched with different settings end in a named error on every rank, and the
    // communicator stays usable for what follows.
    add("rank 1 with another bucket size", testing::dp_mismatch<double>(comm, testing::Mismatch::BucketSize));
    add("rank 1 with another learning rate", testing::dp_mismatch<double>(comm, testing::Mismatch::LearningRate));
    // Parameter server: synchronous mode equals one process; SSP and asynchronous modes stay
    // within their staleness bound (point-to-point polling on this backend).
    const int servers = comm.size() >= 4 ? 2 : 1;
    add("ps bsp", testing::ps_equivalence<double>(comm, {.num_servers = servers, .steps = 3}));
    add("ps ssp s=1", testing::ps_staleness_bound<double>(comm, {.num_servers = servers, .per_worker_batch = 2,
                                                                .steps = 5, .staleness_bound = 1}));
    add("ps async", testing::ps_staleness_bound<double>(
                        comm, {.num_servers = servers, .per_worker_batch = 2, .steps = 5,
                               .staleness_bound = ParameterServerOptions::kAsynchronous}));
    for (const auto& f : failures) std::fprintf(stderr, "FAILED %s\n", f.c_str());
    std::printf("rank %d of %d (%s): data-parallel equivalence, %zu failures\n", rank, comm.size(),
                testing::backend_name(), failures.size());
    comm.barrier();
    return failures.empty() ? 0 : 1;
  }, testing::launch_options(argc, argv));
}
