// Pipeline equivalence as a multi-process program (MPI under mpirun, Gloo under tessera-run): one
// stage per rank, GPipe and 1F1B, an MLP and a BN-free ResNet with 4 micro-batches and ResNet-20
// with BN at one micro-batch, each checked against the unsplit model on the same rank; ResNet-20
// and the GPT under interleaved 1F1B, ZB-H1 and ZB-V as well; on 4 ranks
// also 2 data-parallel replicas x 2 pipeline stages. A pipeline over a GPT's blocks (its tied wte on
// the first and the last stage) against one process, every schedule (float32, 1e-6). And the other
// model parallelism, a GPT's tensor + sequence parallelism over all ranks, against the dense GPT.
#include <algorithm>
#include <cstdio>
#include <exception>

#include "comm/program.hpp"
#include "parallel/pipeline_equivalence.hpp"
#include "parallel/pp_gpt_equivalence.hpp"
#include "parallel/tp_gpt_equivalence.hpp"

int main(int argc, char** argv) {
  using namespace tessera;
  using testing::PipeModel;
  return testing::run_ranks([&](testing::TestComm& comm) {
    const int rank = comm.rank();
    std::vector<std::string> failures;
    for (PipelineSchedule schedule : {PipelineSchedule::GPipe, PipelineSchedule::OneFOneB}) {
      for (PipeModel model : {PipeModel::Mlp, PipeModel::PlainResNet})
        for (auto& f : testing::pipeline_equivalence<double>(comm, {.model = model, .micro_batches = 4, .schedule = schedule}))
          failures.push_back(f);
      for (auto& f : testing::pipeline_equivalence<double>(
               comm, {.model = PipeModel::ResNet20, .micro_batches = 1, .schedule = schedule, .batch = 4, .steps = 2}))
        failures.push_back(f);
    }
    // Two stages per rank (the MLP has 6 units with parameters, so up to 3 ranks): interleaved
    // 1F1B, and the V placement of ZB-V's order with each backward whole.
    if (comm.size() <= 3) {
      const int p = comm.size(), m = 2 * p;
      for (auto& f : testing::pipeline_equivalence<double>(
               comm, {.micro_batches = m, .schedule = PipelineSchedule::Interleaved1F1B, .batch = 2 * m}))
        failures.push_back(f);
      PipelineScheduleTable v = zb_v_table(p, m);
      for (auto& row : v.actions) {
        std::erase_if(row, [](const PipelineAction& a) { return a.op == PipelineOp::BackwardWeight; });
        for (auto& a : row)
          if (a.op == PipelineOp::BackwardInput) a.op = PipelineOp::Backward;
      }
      for (auto& f : testing::pipeline_equivalence<double>(comm, {.micro_batches = m, .table = v, .batch = 2 * m}))
        failures.push_back(f);
    }
    // Zero bubble, the MLP's backward split into I and W: ZB-H1 (one stage per rank), ZB-V (two).
    {
      const int m = 2 * comm.size();
      for (auto& f : testing::pipeline_equivalence<double>(comm, {.micro_batches = m, .schedule = PipelineSchedule::ZBH1, .batch = 2 * m}))
        failures.push_back(f);
      if (comm.size() <= 3)
        for (auto& f : testing::pipeline_equivalence<double>(comm, {.micro_batches = m, .schedule = PipelineSchedule::ZBV, .batch = 2 * m}))
          failures.push_back(f);
    }
    // ResNet-20 with BatchNorm, 2P micro-batches, under every schedule (the reference runs the
    // same micro-batches in turn: the statistics are each micro-batch's); ZB-H1 and ZB-V split the
    // blocks' backward into input and weight halves.
    for (PipelineSchedule schedule : {PipelineSchedule::GPipe, PipelineSchedule::OneFOneB, PipelineSchedule::Interleaved1F1B,
                                      PipelineSchedule::ZBH1, PipelineSchedule::ZBV}) {
      const int m = 2 * comm.size();
      for (auto& f : testing::pipeline_equivalence<double>(
               comm, {.model = PipeModel::ResNet20, .micro_batches = m, .schedule = schedule, .batch = 2 * m, .steps = 2,
                      .reference_per_micro_batch = true}))
        failures.push_back(f);
    }
    if (comm.size() == 4) {
      for (auto& f : testing::hybrid_equivalence<double>(comm, 2)) failures.push_back(f);
      for (auto& f : testing::hybrid_equivalence<double>(comm, 2, 3, PipelineSchedule::ZBH1)) failures.push_back(f);
    }
    for (PipelineSchedule schedule : {PipelineSchedule::GPipe, PipelineSchedule::OneFOneB})
      for (auto& f : testing::pp_gpt_equivalence<float>(comm, {.micro_batches = 4, .schedule = schedule}))
        failures.push_back(f);
    // The GPT under the newer schedules: 2 stages per rank need 2P units (n_layer + 2).
    for (PipelineSchedule schedule : {PipelineSchedule::Interleaved1F1B, PipelineSchedule::ZBH1, PipelineSchedule::ZBV}) {
      const int m = 2 * comm.size();
      testing::PpGptCase k{.batch = m, .micro_batches = m, .schedule = schedule};
      k.config.n_layer = std::max<std::int64_t>(3, 2 * comm.size() - 2);
      for (auto& f : testing::pp_gpt_equivalence<float>(comm, k)) failures.push_back(f);
    }
    for (auto& f : testing::tp_gpt_equivalence<float>(comm)) failures.push_back(f);
    // Dropout: the masks are functions of global positions, so the stages and ranks stay exact.
    testing::PpGptCase pp_dropout{.micro_batches = 4, .checkpointing = true};
    pp_dropout.config.dropout = 0.2;
    for (auto& f : testing::pp_gpt_equivalence<float>(comm, pp_dropout)) failures.push_back(f);
    testing::TpGptCase tp_dropout;
    tp_dropout.config.dropout = 0.2;
    for (auto& f : testing::tp_gpt_equivalence<float>(comm, tp_dropout)) failures.push_back(f);
    for (const auto& f : failures) std::fprintf(stderr, "FAILED %s\n", f.c_str());
    std::printf("rank %d of %d (%s): pipeline (MLP, ResNet, GPT) and tensor-parallel GPT equivalence, %zu failures\n", rank, comm.size(), testing::backend_name(),
                failures.size());
    comm.barrier();
    return failures.empty() ? 0 : 1;
  }, testing::launch_options(argc, argv));
}
