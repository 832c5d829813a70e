// Pipeline schedules as tables (parallel/pipeline_schedule.hpp): every built-in table passes the
// checks at many sizes, its simulated bubble and memory equal the formulas, tables round-trip
// torch.distributed.pipelining's CSV, and malformed tables are refused naming the action.
#include <catch2/catch.hpp>

#include <algorithm>
#include <string>

#include "tessera/parallel/pipeline_schedule.hpp"

using namespace tessera;

namespace {
// The error check_pipeline_table throws for `table`, or "" when it passes.
std::string refusal(const PipelineScheduleTable& table) {
  try {
    check_pipeline_table(table);
  } catch (const ArgumentError& e) {
    return e.what();
  }
  return "";
}
int peak(const PipelineSimulation& s) { return *std::max_element(s.peak_activations.begin(), s.peak_activations.end()); }
}  // namespace

TEST_CASE("Pipeline tables: every built-in schedule passes its checks at many sizes", "[parallel][pipeline]") {
  for (int p = 1; p <= 5; ++p)
    for (int m = 1; m <= 9; ++m) {
      INFO("P = " << p << ", M = " << m);
      for (const auto& t : {gpipe_table(p, m), one_f_one_b_table(p, m), zb_h1_table(p, m), zb_v_table(p, m)}) {
        INFO(t.name);
        CHECK(refusal(t).empty());
        CHECK(refusal(with_transfers(t)).empty());
      }
      if (m % p == 0)
        for (int v : {1, 2, 3}) {
          INFO("Interleaved1F1B, v = " << v);
          CHECK(refusal(interleaved_1f1b_table(p, v, m)).empty());
        }
    }
  // Interleaving v = 1 is 1F1B's order up to the warm-up: the same step and bubble.
  CHECK(simulate_pipeline(interleaved_1f1b_table(4, 1, 8), {}).makespan == simulate_pipeline(one_f_one_b_table(4, 8), {}).makespan);
  CHECK_THROWS_WITH(interleaved_1f1b_table(4, 2, 6), Catch::Contains("6 micro-batches is not a multiple of the 4 ranks"));
  CHECK_THROWS_WITH(pipeline_table("zb-h3", 4, 8), Catch::Contains("unknown (built in: GPipe, 1F1B"));
  CHECK(pipeline_table("zb_h1", 4, 8).name == "ZBH1");
}

// Unit costs (F = I = W = 1, a whole B = 2) at P = 4, M = 8, the case. Bubble: the mean
// over ranks of the idle share of the step.
TEST_CASE("Pipeline tables: simulated bubble and memory equal the formulas", "[parallel][pipeline]") {
  const int p = 4, m = 8;
  const PipelineOpCosts unit{};
  const auto one_f_one_b = simulate_pipeline(one_f_one_b_table(p, m), unit);
  const auto gpipe = simulate_pipeline(gpipe_table(p, m), unit);
  const auto interleaved = simulate_pipeline(interleaved_1f1b_table(p, 2, m), unit);
  const auto zb_h1 = simulate_pipeline(zb_h1_table(p, m), unit);
  const auto zb_v = simulate_pipeline(zb_v_table(p, m), unit);
  // 1F1B and GPipe: (P - 1) / (M + P - 1); interleaved with v = 2: (P - 1) / (v M + P - 1).
  CHECK(one_f_one_b.bubble_fraction() == Approx(3.0 / 11));
  CHECK(gpipe.bubble_fraction() == Approx(3.0 / 11));
  CHECK(interleaved.bubble_fraction() == Approx(3.0 / 19));
  // ZB-H1: a step of 3M + (P - 1) against 1F1B's 3 (M + P - 1): idle (P - 1) against 3 (P - 1).
  CHECK(zb_h1.makespan == 3 * m + (p - 1));
  CHECK(one_f_one_b.makespan == 3 * (m + p - 1));
  // ZB-V (stages of half the work): 2 x 3M units of work after the last rank's first forward at P - 1.
  CHECK(zb_v.makespan == 6 * m + (p - 1));
  // Memory: 1F1B's rank r holds P - r; GPipe all M; ZB-H1 P on every rank (1F1B's peak); ZB-V 2P
  // half-stages (the same bytes as P whole ones).
  CHECK(one_f_one_b.peak_activations == std::vector<int>{4, 3, 2, 1});
  CHECK(peak(gpipe) == m);
  CHECK(zb_h1.peak_activations == std::vector<int>(4, p));
  CHECK(zb_v.peak_activations == std::vector<int>(4, 2 * p));
  // Interleaved holds more: rank 0 runs (P - 1) 2 + (v - 1) P + 1 = 11 half-stages at its peak.
  CHECK(interleaved.peak_activations[0] == 11);
}

TEST_CASE("Pipeline tables: actions and CSV round-trip torch.distributed.pipelining's format", "[parallel][pipeline]") {
  CHECK(to_string(PipelineAction{2, PipelineOp::Forward, 5}) == "2F5");
  CHECK(to_string(PipelineAction{0, PipelineOp::SendBackward, 13}) == "0SEND_B13");
  CHECK(parse_pipeline_action(" 12I7 ") == PipelineAction{12, PipelineOp::BackwardInput, 7});
  CHECK(parse_pipeline_action("3RECV_F0") == PipelineAction{3, PipelineOp::RecvForward, 0});
  CHECK(parse_pipeline_action("1FULL_BACKWARD2") == PipelineAction{1, PipelineOp::Backward, 2});
  CHECK_THROWS_WITH(parse_pipeline_action("0X1"), Catch::Contains("unknown operation 'X'"));
  CHECK_THROWS_WITH(parse_pipeline_action("F1"), Catch::Contains("no stage number"));
  CHECK_THROWS_WITH(parse_pipeline_action("1F"), Catch::Contains("no micro-batch number"));
  for (const auto& t : {one_f_one_b_table(3, 5), interleaved_1f1b_table(2, 3, 4), zb_h1_table(4, 8), zb_v_table(3, 6)})
    for (const auto& table : {t, with_transfers(t)}) {
      INFO(to_csv(table));
      const auto back = parse_pipeline_csv(to_csv(table), "round trip");
      CHECK(back.actions == table.actions);
      CHECK(back.ranks == table.ranks);
      CHECK(back.stages_per_rank == table.stages_per_rank);
      CHECK(back.micro_batches == table.micro_batches);
      CHECK(back.placement == table.placement);
      CHECK(refusal(back).empty());
    }
  // torch 2.5's spelling: B for the input gradient when W's follow; main's late-2024 BW for a whole one.
  const auto older = parse_pipeline_csv("0F0,0B0,0W0\n1F0,1B0,1W0\n", "torch 2.5");
  CHECK(older.actions[0][1] == PipelineAction{0, PipelineOp::BackwardInput, 0});
  CHECK(refusal(older).empty());
  CHECK(parse_pipeline_action("3BW1") == PipelineAction{3, PipelineOp::Backward, 1});
  CHECK_THROWS_WITH(parse_pipeline_action("1UNSHARD"), Catch::Contains("no micro-batch number"));
  // Empty cells (torch pads short rows) and Windows line ends are read as nothing.
  const auto padded = parse_pipeline_csv("0F0,,0B0\r\n1F0,1B0,\n\n", "padded");
  CHECK(padded.actions[0].size() == 2);
  CHECK(padded.actions[1].size() == 2);
  CHECK(refusal(padded).empty());
  CHECK_THROWS_WITH(parse_pipeline_csv("0F0,0Q0\n", "bad"), Catch::Contains("row 1 (rank 0), cell 2"));
  CHECK_THROWS_WITH(parse_pipeline_csv("0F0,1F0\n1F1,0F1\n", "misplaced"),
                    Catch::Contains("row 1 (rank 0) runs 1F0, but stage 1 belongs to rank 1 under loop placement"));
}

TEST_CASE("Pipeline tables: malformed tables are refused naming the action", "[parallel][pipeline]") {
  SECTION("a receive without its send") {
    auto t = with_transfers(one_f_one_b_table(2, 2));
    auto& row = t.actions[0];
    row.erase(std::find(row.begin(), row.end(), PipelineAction{0, PipelineOp::SendForward, 1}));
    CHECK_THAT(refusal(t), Catch::Contains("rank 0 never runs 0SEND_F1"));
  }
  SECTION("a W before its I") {
    auto t = zb_h1_table(2, 3);
    auto& row = t.actions[1];
    const auto i = std::find(row.begin(), row.end(), PipelineAction{1, PipelineOp::BackwardInput, 0});
    const auto w = std::find(row.begin(), row.end(), PipelineAction{1, PipelineOp::BackwardWeight, 0});
    std::iter_swap(i, w);
    CHECK_THAT(refusal(t), Catch::Contains("rank 1 runs 1W0 (action 1) before 1I0 (action 4)"));
  }
  SECTION("a deadlock") {
    // Rank 0 waits for stage 1's backward of micro-batch 0 before it sends micro-batch 1 forward,
    // while rank 1 wants micro-batch 1's forward before that backward.
    PipelineScheduleTable t = gpipe_table(2, 2);
    t.name = "crossed";
    t.actions[0] = {{0, PipelineOp::Forward, 0}, {0, PipelineOp::Backward, 0}, {0, PipelineOp::Forward, 1},
                    {0, PipelineOp::Backward, 1}};
    t.actions[1] = {{1, PipelineOp::Forward, 0}, {1, PipelineOp::Forward, 1}, {1, PipelineOp::Backward, 0},
                    {1, PipelineOp::Backward, 1}};
    CHECK_THAT(refusal(t), Catch::Contains("'crossed' deadlocks") &&
                               Catch::Contains("rank 0 at action 1 (0B0) waits for 1B0 (rank 1, action 2)") &&
                               Catch::Contains("rank 1 at action 1 (1F1) waits for 0F1 (rank 0, action 2)"));
  }
  SECTION("missing, doubled and misplaced actions") {
    auto t = one_f_one_b_table(2, 3);
    t.actions[1].pop_back();
    CHECK_THAT(refusal(t), Catch::Contains("rank 1 never runs 1B2"));
    t = one_f_one_b_table(2, 3);
    t.actions[0].push_back({0, PipelineOp::Forward, 1});
    CHECK_THAT(refusal(t), Catch::Contains("0F1 appears twice"));
    t = one_f_one_b_table(2, 3);
    t.actions[0][0].stage = 1;
    CHECK_THAT(refusal(t), Catch::Contains("stage 1 runs on rank 1 (loop placement), not on rank 0"));
    t = one_f_one_b_table(2, 3);
    t.actions[0].push_back({0, PipelineOp::BackwardWeight, 0});
    CHECK_THAT(refusal(t), Catch::Contains("runs both 0B0 and 0W0"));
    t = one_f_one_b_table(2, 3);
    t.actions[0].push_back({0, PipelineOp::Forward, 7});
    CHECK_THAT(refusal(t), Catch::Contains("micro-batch 7 does not exist"));
    t = with_transfers(zb_v_table(2, 2));  // stages 1 and 2 share rank 1 in V placement
    t.actions[1].insert(t.actions[1].begin(), {1, PipelineOp::SendForward, 0});
    CHECK_THAT(refusal(t), Catch::Contains("stages 1 and 2 are both on rank 1, nothing to transfer"));
  }
}

// The simulator's Python port (tools/tessera_tools/simulate/schedules.py) builds the same tables:
// both are pinned to these files, compared cell by cell here and in tests/tools/test_simulate.py.
TEST_CASE("Pipeline tables: the built-in schedules equal the golden tables the simulator shares", "[parallel][pipeline]") {
  struct Golden {
    const char* name;
    int ranks, micro_batches, stages_per_rank;
    const char* file;
  };
  const Golden goldens[] = {
      {"GPipe", 2, 4, 1, "gpipe_p2_m4.csv"},        {"1F1B", 2, 4, 1, "1f1b_p2_m4.csv"},
      {"1F1B", 4, 8, 1, "1f1b_p4_m8.csv"},          {"1F1B", 3, 5, 1, "1f1b_p3_m5.csv"},
      {"Interleaved1F1B", 2, 4, 2, "interleaved1f1b_p2_m4_v2.csv"},
      {"Interleaved1F1B", 4, 8, 2, "interleaved1f1b_p4_m8_v2.csv"},
      {"Interleaved1F1B", 3, 6, 3, "interleaved1f1b_p3_m6_v3.csv"},
      {"ZBH1", 2, 4, 1, "zbh1_p2_m4.csv"},          {"ZBH1", 4, 8, 1, "zbh1_p4_m8.csv"},
      {"ZBH1", 3, 5, 1, "zbh1_p3_m5.csv"},          {"ZBV", 2, 4, 2, "zbv_p2_m4.csv"},
      {"ZBV", 4, 8, 2, "zbv_p4_m8.csv"},            {"ZBV", 3, 6, 2, "zbv_p3_m6.csv"},
      {"ZBV", 4, 3, 2, "zbv_p4_m3.csv"},
  };
  for (const Golden& g : goldens) {
    INFO(g.file);
    const std::string path = std::string(TESSERA_REFERENCE_DATA_DIR) + "/../parallel/pipeline_tables/" + g.file;
    const PipelineScheduleTable built = pipeline_table(g.name, g.ranks, g.micro_batches, g.stages_per_rank);
    CHECK(to_csv(built) == to_csv(read_pipeline_csv(path)));
    CHECK(read_pipeline_csv(path).placement == built.placement);
  }
}
