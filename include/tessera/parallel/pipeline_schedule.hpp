// Pipeline schedules as data: a table of actions per rank, the order in which each rank runs its
// forwards and backwards. The pipeline's executor runs any table that check_pipeline_table
// accepts; the built-in schedules are functions that write one; a table round-trips the CSV of
// torch.distributed.pipelining, so a schedule written there runs here.
//
//   auto table = interleaved_1f1b_table(/*ranks=*/4, /*stages_per_rank=*/2, /*micro_batches=*/8);
//   check_pipeline_table(table);            // throws, naming the bad action, before any step
//   std::string csv = to_csv(table);        // rank r's actions on row r: "0F0,0F1,,,0B0,..."
//   auto same = parse_pipeline_csv(csv);    // placement and sizes read from the actions
//   auto sim = simulate_pipeline(table, {.forward = 1, .backward_input = 1, .backward_weight = 1});
//
// Vocabulary (P ranks, v stages per rank, S = P v stages, M micro-batches). A stage is one
// contiguous run of the model's units; stage k feeds stage k + 1. An action names its stage, an
// operation and a micro-batch, written as torch writes it: "2F5" is stage 2's forward of
// micro-batch 5. The operations:
//   F  forward.
//   B  full backward: the input gradient (sent to stage k - 1) and the weight gradients at once.
//   I  backward input only: dL/dx of the stage's input, what stage k - 1 waits for.
//   W  backward weight only: the stage's parameter gradients, which nothing downstream waits
//      for, so a schedule can move it into time that would otherwise be idle (zero bubble).
//   SEND_F, RECV_F, SEND_B, RECV_B: explicit transfers (torch's "compute_comms" tables). On a
//      receive the stage is the receiver ("1RECV_F3": stage 1 receives stage 0's activations of
//      micro-batch 3); on a send, the sender ("0SEND_F3").
// A table without transfers (torch's "compute_only") is the usual form: the executor sends each
// result right after computing it and receives just before it is needed. A table with transfers
// is checked action by action (every transfer matches its computation, in a possible order).
//
// Placement: which rank runs which stage. Loop (Megatron's interleaving): stage k on rank k mod P,
// so rank r holds stages r, r + P, ... V (ZB-V): v = 2, stage k on rank k for k < P and on rank
// 2P - 1 - k after, so the last stage (the loss) sits on rank 0 beside the first.
//
// Memory: a stage keeps a micro-batch's activations from its F until its B, or until its W when
// the backward is split (W needs the stage's inputs and output gradients). simulate_pipeline
// counts these per rank, as the executor's measurements do.
#pragma once

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/core/linkage.hpp"

namespace tessera {

enum class PipelineOp : std::uint8_t {
  Forward,         // F
  Backward,        // B: input and weight gradients at once
  BackwardInput,   // I
  BackwardWeight,  // W
  SendForward,     // SEND_F: the stage's output, to stage + 1
  RecvForward,     // RECV_F: stage - 1's output, into this stage
  SendBackward,    // SEND_B: the gradient of the stage's input, to stage - 1
  RecvBackward,    // RECV_B: stage + 1's input gradient, into this stage
};

struct PipelineAction {
  int stage = 0;
  PipelineOp op = PipelineOp::Forward;
  int micro_batch = 0;
  friend bool operator==(const PipelineAction&, const PipelineAction&) = default;
};

enum class StagePlacement { Loop, V };

struct PipelineScheduleTable {
  std::string name;  // "GPipe", "1F1B", "Interleaved1F1B", "ZBH1", "ZBV", or where it was read from
  int ranks = 1;
  int stages_per_rank = 1;
  int micro_batches = 1;
  StagePlacement placement = StagePlacement::Loop;
  std::vector<std::vector<PipelineAction>> actions;  // [rank]: what the rank runs, in order

  int stage_count() const { return ranks * stages_per_rank; }
  int rank_of(int stage) const {
    if (placement == StagePlacement::Loop) return stage % ranks;
    return stage < ranks ? stage : 2 * ranks - 1 - stage;
  }
  // The stages rank r runs, in model order.
  std::vector<int> stages_of(int rank) const {
    std::vector<int> stages;
    for (int k = 0; k < stage_count(); ++k)
      if (rank_of(k) == rank) stages.push_back(k);
    return stages;
  }
  // Whether any backward is split into I and W.
  bool splits_backward() const;
  // Whether the table lists its transfers (torch's compute_comms form).
  bool has_transfers() const;
  // The table without its transfer actions (the executor derives them).
  PipelineScheduleTable compute_only() const;
};

// The compute-only table with its transfers written out (torch's compute_comms form): each
// receive just before the computation that needs it, each send just after the one that made it.
PipelineScheduleTable with_transfers(const PipelineScheduleTable& table);

bool is_compute(PipelineOp op);
std::string to_string(PipelineOp op);
std::string to_string(const PipelineAction& a);
// "2F5", "0SEND_F3", ...; throws ArgumentError naming the text. Accepts torch's older names too.
PipelineAction parse_pipeline_action(std::string_view text);
std::string to_string(StagePlacement p);

// ---- Built-in schedules (compute only) ----
// GPipe: every forward, then every backward. Each stage holds all M micro-batches at its peak.
PipelineScheduleTable gpipe_table(int ranks, int micro_batches);
// 1F1B (PipeDream-flush): rank r runs min(P - 1 - r, M) forwards, then one forward and one
// backward in turn, then the remaining backwards; it holds at most P - r micro-batches.
PipelineScheduleTable one_f_one_b_table(int ranks, int micro_batches);
// Interleaved 1F1B (Megatron-LM; Narayanan et al. 2021): v stages per rank in Loop placement, the
// micro-batches taken in rounds of P. Rank r's k-th forward runs stage (k / P mod v) P + r on
// micro-batch (k / (P v)) P + k mod P, its backwards the same rounds with the stages reversed;
// it starts with (P - 1 - r) 2 + (v - 1) P forwards. The bubble is (P - 1) / (v M + P - 1) of the
// step with equal stages, v times less than 1F1B's. Needs M a multiple of P.
PipelineScheduleTable interleaved_1f1b_table(int ranks, int stages_per_rank, int micro_batches);
// Zero bubble (Qi et al., ICLR 2024), the backward split into I and W:
// ZB-H1: 1F1B's order with each B split into I and W, rank r's W of micro-batch i run after its I
// of micro-batch i + r (the rest at the end): the backward wave travels at I's pace, and each rank
// fills the wait for it with the W's it holds back. Rank r then holds up to min(P, M)
// micro-batches, the same peak as 1F1B's rank 0. With F, I and W of equal cost the bubble is
// (P - 1) F against 1F1B's (P - 1) (F + I + W): a third (step (M + 1/3 (P - 1)) 3F against
// (M + P - 1) 3F).
PipelineScheduleTable zb_h1_table(int ranks, int micro_batches);
// ZB-V: two stages per rank in V placement, F and I as soon as they can run, W into idle time,
// under the same memory as 1F1B's first rank (P micro-batches of the whole model's activations,
// 2P of a half-stage); nearly no bubble when F, I and W cost the same.
PipelineScheduleTable zb_v_table(int ranks, int micro_batches);
// By name: "GPipe", "1F1B", "Interleaved1F1B", "ZBH1", "ZBV" (case-insensitive, '-' and '_'
// ignored). stages_per_rank is read by Interleaved1F1B only (ZBV always has 2).
PipelineScheduleTable pipeline_table(std::string_view schedule, int ranks, int micro_batches, int stages_per_rank = 2);

// ---- Checks ----
// Every stage's F of every micro-batch exactly once, and its backward exactly once (one B, or one
// I and one W); each action on the rank that holds its stage; F before its backward, I before its
// W; transfers (when listed) each matching a computation; and the table runs to the end with
// blocking receives and asynchronous sends (no deadlock). Throws ArgumentError naming the table,
// the rank, the action's position and the action.
void check_pipeline_table(const PipelineScheduleTable& table);

// ---- Simulation ----
// Per-operation costs (any unit). A full B costs backward_input + backward_weight. transfer is
// added between a computation and one on another rank that needs its result.
struct PipelineOpCosts {
  double forward = 1, backward_input = 1, backward_weight = 1, transfer = 0;
};
struct PipelineSimulation {
  double makespan = 0;                 // the step, from the first action to the last
  std::vector<double> busy;            // [rank]: time computing
  std::vector<int> peak_activations;   // [rank]: most (stage, micro-batch) activation sets held
  std::vector<std::vector<double>> start, end;  // [rank][action]: of the compute-only table
  // Mean over ranks of the idle share of the step: the bubble.
  double bubble_fraction() const;
};
// Runs the table in time with `costs` (each rank in its order, each action as soon as its inputs
// exist). The table must pass check_pipeline_table.
PipelineSimulation simulate_pipeline(const PipelineScheduleTable& table, const PipelineOpCosts& costs);

// ---- CSV (torch.distributed.pipelining's _dump_csv / _load_csv) ----
// Row r: rank r's actions, comma-separated, in order.
std::string to_csv(const PipelineScheduleTable& table);
// The stage count, micro-batch count and placement are read from the actions (each rank's stages
// must be Loop's or V's); `name` labels errors. Throws ArgumentError naming the row and cell.
PipelineScheduleTable parse_pipeline_csv(std::string_view csv, std::string name = "csv");
PipelineScheduleTable read_pipeline_csv(const std::string& path);
void write_pipeline_csv(const PipelineScheduleTable& table, const std::string& path);


#if TESSERA_HEADER_DEFINITIONS

namespace detail {
inline constexpr std::array<std::pair<PipelineOp, std::string_view>, 8> kPipelineOpNames = {{
    {PipelineOp::Forward, "F"},
    {PipelineOp::Backward, "B"},
    {PipelineOp::BackwardInput, "I"},
    {PipelineOp::BackwardWeight, "W"},
    {PipelineOp::SendForward, "SEND_F"},
    {PipelineOp::RecvForward, "RECV_F"},
    {PipelineOp::SendBackward, "SEND_B"},
    {PipelineOp::RecvBackward, "RECV_B"},
}};

// What a stage holds for micro-batch i between its F and the end of its backward, and which
// action ends it.
inline bool ends_backward(PipelineOp op) { return op == PipelineOp::Backward || op == PipelineOp::BackwardWeight; }
inline bool sends_input_gradient(PipelineOp op) { return op == PipelineOp::Backward || op == PipelineOp::BackwardInput; }

struct TableIndex {  // (stage, micro-batch) -> the rank's position of each kind of action, -1 if absent
  int stages = 0, micro_batches = 0;
  std::vector<std::array<int, 8>> at;
  TableIndex(int s, int m) : stages(s), micro_batches(m), at(static_cast<std::size_t>(s * m)) {
    for (auto& a : at) a.fill(-1);
  }
  int& of(int stage, PipelineOp op, int i) {
    return at[static_cast<std::size_t>(stage * micro_batches + i)][static_cast<std::size_t>(op)];
  }
};

inline std::string where(const PipelineScheduleTable& t, int rank, std::size_t position, const PipelineAction& a) {
  return "pipeline schedule '" + t.name + "': rank " + std::to_string(rank) + ", action " + std::to_string(position) +
         " (" + to_string(a) + ")";
}

inline std::string normalized_schedule_name(std::string_view name) {
  std::string out;
  for (const char c : name)
    if (c != '-' && c != '_' && c != ' ') out += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

inline PipelineScheduleTable empty_table(std::string name, int ranks, int stages_per_rank, int micro_batches,
                                         StagePlacement placement) {
  TESSERA_CHECK(ranks >= 1, ArgumentError, "pipeline schedule ", name, ": ", ranks, " ranks (at least 1)");
  TESSERA_CHECK(micro_batches >= 1, ArgumentError, "pipeline schedule ", name, ": ", micro_batches,
                " micro-batches (at least 1)");
  TESSERA_CHECK(stages_per_rank >= 1, ArgumentError, "pipeline schedule ", name, ": ", stages_per_rank,
                " stages per rank (at least 1)");
  PipelineScheduleTable t;
  t.name = std::move(name);
  t.ranks = ranks;
  t.stages_per_rank = stages_per_rank;
  t.micro_batches = micro_batches;
  t.placement = placement;
  t.actions.resize(static_cast<std::size_t>(ranks));
  return t;
}

// The zero-bubble schedules, written by running the pipeline in time with F, I and W costing one
// unit each: whenever a rank is free it runs, among what it can run then, an I (the rank below
// waits for it), else an F if it holds fewer than cap[r] micro-batches, else a W (the only work
// nothing waits for: it fills what would be idle time); the oldest micro-batch first, the later
// stage first between equals. The order each rank ran is the table. Since it was produced by
// running every rank to the end, it cannot deadlock.
PipelineScheduleTable greedy_zero_bubble(PipelineScheduleTable t, const std::vector<int>& cap);
}  // namespace detail

TESSERA_LINKAGE bool PipelineScheduleTable::splits_backward() const {
  for (const auto& row : actions)
    for (const auto& a : row)
      if (a.op == PipelineOp::BackwardInput || a.op == PipelineOp::BackwardWeight) return true;
  return false;
}

TESSERA_LINKAGE bool PipelineScheduleTable::has_transfers() const {
  for (const auto& row : actions)
    for (const auto& a : row)
      if (!is_compute(a.op)) return true;
  return false;
}

TESSERA_LINKAGE PipelineScheduleTable PipelineScheduleTable::compute_only() const {
  PipelineScheduleTable t = *this;
  for (auto& row : t.actions) std::erase_if(row, [](const PipelineAction& a) { return !is_compute(a.op); });
  return t;
}

TESSERA_LINKAGE PipelineScheduleTable with_transfers(const PipelineScheduleTable& table) {
  PipelineScheduleTable t = table.compute_only();
  const int last = t.stage_count() - 1;
  for (int r = 0; r < t.ranks; ++r) {
    std::vector<PipelineAction> row;
    for (const PipelineAction& a : t.actions[static_cast<std::size_t>(r)]) {
      const bool from_below = a.stage > 0 && t.rank_of(a.stage - 1) != r;
      const bool from_above = a.stage < last && t.rank_of(a.stage + 1) != r;
      const bool input_gradient = detail::sends_input_gradient(a.op);
      if (a.op == PipelineOp::Forward && from_below) row.push_back({a.stage, PipelineOp::RecvForward, a.micro_batch});
      if (input_gradient && from_above) row.push_back({a.stage, PipelineOp::RecvBackward, a.micro_batch});
      row.push_back(a);
      if (a.op == PipelineOp::Forward && from_above) row.push_back({a.stage, PipelineOp::SendForward, a.micro_batch});
      if (input_gradient && from_below) row.push_back({a.stage, PipelineOp::SendBackward, a.micro_batch});
    }
    t.actions[static_cast<std::size_t>(r)] = std::move(row);
  }
  return t;
}

TESSERA_LINKAGE bool is_compute(PipelineOp op) {
  return op == PipelineOp::Forward || op == PipelineOp::Backward || op == PipelineOp::BackwardInput ||
         op == PipelineOp::BackwardWeight;
}

TESSERA_LINKAGE std::string to_string(PipelineOp op) {
  for (const auto& [o, name] : detail::kPipelineOpNames)
    if (o == op) return std::string(name);
  return "?";
}

TESSERA_LINKAGE std::string to_string(const PipelineAction& a) {
  return std::to_string(a.stage) + to_string(a.op) + std::to_string(a.micro_batch);
}

TESSERA_LINKAGE std::string to_string(StagePlacement p) { return p == StagePlacement::Loop ? "loop" : "V"; }

TESSERA_LINKAGE PipelineAction parse_pipeline_action(std::string_view text) {
  // <stage><op><micro-batch>: digits, letters and '_', digits, as torch's _Action.from_str reads
  // them (which also takes a missing micro-batch, for actions of whole stages such as UNSHARD that
  // a pipeline of this library has no use for: refused here by name).
  std::string_view rest = text;
  while (!rest.empty() && std::isspace(static_cast<unsigned char>(rest.front()))) rest.remove_prefix(1);
  while (!rest.empty() && std::isspace(static_cast<unsigned char>(rest.back()))) rest.remove_suffix(1);
  auto fail = [&](const std::string& why) {
    return ArgumentError("pipeline action '" + std::string(text) + "': " + why +
                         " (expected <stage><op><micro-batch>, e.g. 2F5 or 0SEND_F3; op one of F, B, I, W, SEND_F, "
                         "RECV_F, SEND_B, RECV_B)");
  };
  std::size_t digits = 0;
  while (digits < rest.size() && std::isdigit(static_cast<unsigned char>(rest[digits]))) ++digits;
  std::size_t tail = rest.size();
  while (tail > digits && std::isdigit(static_cast<unsigned char>(rest[tail - 1]))) --tail;
  if (digits == 0) throw fail("no stage number at the start");
  if (tail == rest.size()) throw fail("no micro-batch number at the end");
  if (tail == digits) throw fail("no operation between the stage and the micro-batch");
  PipelineAction a;
  const auto number = [&](std::string_view digits_text, int& out, const char* what) {
    const auto [end, ec] = std::from_chars(digits_text.data(), digits_text.data() + digits_text.size(), out);
    if (ec != std::errc() || end != digits_text.data() + digits_text.size()) throw fail(std::string(what) + " out of range");
  };
  number(rest.substr(0, digits), a.stage, "stage");
  number(rest.substr(tail), a.micro_batch, "micro-batch");
  const std::string_view op = rest.substr(digits, tail - digits);
  static constexpr std::array<std::pair<std::string_view, PipelineOp>, 5> kLongNames = {{
      {"BW", PipelineOp::Backward},  // main's name for the whole backward in late 2024
      {"FORWARD", PipelineOp::Forward},
      {"FULL_BACKWARD", PipelineOp::Backward},
      {"BACKWARD_INPUT", PipelineOp::BackwardInput},
      {"BACKWARD_WEIGHT", PipelineOp::BackwardWeight},
  }};
  for (const auto& [o, name] : detail::kPipelineOpNames)
    if (op == name) return a.op = o, a;
  for (const auto& [name, o] : kLongNames)
    if (op == name) return a.op = o, a;
  throw fail("unknown operation '" + std::string(op) + "'");
}

TESSERA_LINKAGE PipelineScheduleTable gpipe_table(int ranks, int micro_batches) {
  auto t = detail::empty_table("GPipe", ranks, 1, micro_batches, StagePlacement::Loop);
  for (int r = 0; r < ranks; ++r) {
    for (int i = 0; i < micro_batches; ++i) t.actions[r].push_back({r, PipelineOp::Forward, i});
    for (int i = 0; i < micro_batches; ++i) t.actions[r].push_back({r, PipelineOp::Backward, i});
  }
  return t;
}

TESSERA_LINKAGE PipelineScheduleTable one_f_one_b_table(int ranks, int micro_batches) {
  auto t = detail::empty_table("1F1B", ranks, 1, micro_batches, StagePlacement::Loop);
  for (int r = 0; r < ranks; ++r) {
    auto& row = t.actions[static_cast<std::size_t>(r)];
    const int warmup = std::min(ranks - 1 - r, micro_batches);
    for (int i = 0; i < warmup; ++i) row.push_back({r, PipelineOp::Forward, i});
    for (int i = 0; i < micro_batches - warmup; ++i) {
      row.push_back({r, PipelineOp::Forward, warmup + i});
      row.push_back({r, PipelineOp::Backward, i});
    }
    for (int i = micro_batches - warmup; i < micro_batches; ++i) row.push_back({r, PipelineOp::Backward, i});
  }
  return t;
}

TESSERA_LINKAGE PipelineScheduleTable interleaved_1f1b_table(int ranks, int stages_per_rank, int micro_batches) {
  auto t = detail::empty_table("Interleaved1F1B", ranks, stages_per_rank, micro_batches, StagePlacement::Loop);
  TESSERA_CHECK(micro_batches % ranks == 0, ArgumentError, "pipeline schedule Interleaved1F1B: ", micro_batches,
                " micro-batches is not a multiple of the ", ranks,
                " ranks (the micro-batches go through each rank's stages in rounds of one per rank)");
  const int p = ranks, v = stages_per_rank, total = micro_batches * v;
  // k-th forward (backward) of a rank: which of its stages, and which micro-batch.
  auto chunk = [&](int k, bool forward) {
    const int c = (k / p) % v;
    return forward ? c : v - 1 - c;
  };
  auto micro = [&](int k) { return (k / (p * v)) * p + k % p; };
  for (int r = 0; r < p; ++r) {
    auto& row = t.actions[static_cast<std::size_t>(r)];
    const int warmup = std::min((p - 1 - r) * 2 + (v - 1) * p, total);
    int f = 0, b = 0;
    auto forward = [&] {
      row.push_back({chunk(f, true) * p + r, PipelineOp::Forward, micro(f)});
      ++f;
    };
    auto backward = [&] {
      row.push_back({chunk(b, false) * p + r, PipelineOp::Backward, micro(b)});
      ++b;
    };
    while (f < warmup) forward();
    while (f < total) forward(), backward();
    while (b < total) backward();
  }
  return t;
}

TESSERA_LINKAGE PipelineScheduleTable zb_h1_table(int ranks, int micro_batches) {
  PipelineScheduleTable t = one_f_one_b_table(ranks, micro_batches);
  t.name = "ZBH1";
  for (int r = 0; r < ranks; ++r) {
    auto& row = t.actions[static_cast<std::size_t>(r)];
    std::vector<PipelineAction> split;
    int weights = 0;  // W_0 .. W_{weights-1} placed
    for (const PipelineAction& a : row) {
      if (a.op != PipelineOp::Backward) {
        split.push_back(a);
        continue;
      }
      split.push_back({r, PipelineOp::BackwardInput, a.micro_batch});
      if (a.micro_batch >= r) split.push_back({r, PipelineOp::BackwardWeight, weights++});  // W lags r I's behind
    }
    while (weights < micro_batches) split.push_back({r, PipelineOp::BackwardWeight, weights++});
    row = std::move(split);
  }
  return t;
}

TESSERA_LINKAGE PipelineScheduleTable zb_v_table(int ranks, int micro_batches) {
  auto t = detail::empty_table("ZBV", ranks, 2, micro_batches, StagePlacement::V);
  return detail::greedy_zero_bubble(std::move(t), std::vector<int>(static_cast<std::size_t>(ranks), 2 * ranks));
}

TESSERA_LINKAGE PipelineScheduleTable pipeline_table(std::string_view schedule, int ranks, int micro_batches,
                                                     int stages_per_rank) {
  const std::string n = detail::normalized_schedule_name(schedule);
  if (n == "gpipe") return gpipe_table(ranks, micro_batches);
  if (n == "1f1b") return one_f_one_b_table(ranks, micro_batches);
  if (n == "interleaved1f1b") return interleaved_1f1b_table(ranks, stages_per_rank, micro_batches);
  if (n == "zbh1") return zb_h1_table(ranks, micro_batches);
  if (n == "zbv") return zb_v_table(ranks, micro_batches);
  throw ArgumentError("pipeline schedule '" + std::string(schedule) +
                      "': unknown (built in: GPipe, 1F1B, Interleaved1F1B, ZBH1, ZBV; or a table from a CSV file)");
}

namespace detail {
// The actions another action needs done first, as (stage, op, micro-batch) with whether the need
// crosses ranks (then it is a transfer: `transfer` time is added in the simulation).
struct PipelineNeed {
  PipelineAction action;
  bool crosses_ranks;
};
inline std::vector<PipelineNeed> pipeline_needs(const PipelineScheduleTable& t, const PipelineAction& a, bool transfers) {
  const int last = t.stage_count() - 1, r = t.rank_of(a.stage);
  std::vector<PipelineNeed> needs;
  const auto backward_of = [&](int stage, int i) {  // whichever backward the stage runs: B or I
    return PipelineAction{stage, PipelineOp::Backward, i};  // resolved to I by the caller's index
  };
  switch (a.op) {
    case PipelineOp::Forward:
      if (a.stage > 0) {
        if (t.rank_of(a.stage - 1) == r) needs.push_back({{a.stage - 1, PipelineOp::Forward, a.micro_batch}, false});
        else if (transfers) needs.push_back({{a.stage, PipelineOp::RecvForward, a.micro_batch}, false});
        else needs.push_back({{a.stage - 1, PipelineOp::Forward, a.micro_batch}, true});
      }
      break;
    case PipelineOp::Backward:
    case PipelineOp::BackwardInput:
      needs.push_back({{a.stage, PipelineOp::Forward, a.micro_batch}, false});
      if (a.stage < last) {
        if (t.rank_of(a.stage + 1) == r) needs.push_back({backward_of(a.stage + 1, a.micro_batch), false});
        else if (transfers) needs.push_back({{a.stage, PipelineOp::RecvBackward, a.micro_batch}, false});
        else needs.push_back({backward_of(a.stage + 1, a.micro_batch), true});
      }
      break;
    case PipelineOp::BackwardWeight: needs.push_back({{a.stage, PipelineOp::BackwardInput, a.micro_batch}, false}); break;
    case PipelineOp::SendForward: needs.push_back({{a.stage, PipelineOp::Forward, a.micro_batch}, false}); break;
    case PipelineOp::RecvForward: needs.push_back({{a.stage - 1, PipelineOp::SendForward, a.micro_batch}, true}); break;
    case PipelineOp::SendBackward: needs.push_back({backward_of(a.stage, a.micro_batch), false}); break;
    case PipelineOp::RecvBackward: needs.push_back({{a.stage + 1, PipelineOp::SendBackward, a.micro_batch}, true}); break;
  }
  return needs;
}

// Runs the table (which passed the structural checks) in time: each rank its actions in order,
// each as soon as what it needs has ended. Returns start and end per action, or throws
// ArgumentError describing the deadlock.
struct PipelineRun {
  std::vector<std::vector<double>> start, end;
};
// unit_steps: every action takes one step, a whole B too (torch's grid; to_csv), transfers none.
inline PipelineRun run_pipeline_table(const PipelineScheduleTable& t, const PipelineOpCosts& costs, bool unit_steps = false) {
  const bool transfers = t.has_transfers();
  const auto ranks = static_cast<std::size_t>(t.ranks);
  // Where each (stage, op, micro-batch) is: rank and position.
  std::map<std::tuple<int, int, int>, std::pair<int, std::size_t>> at;
  for (std::size_t r = 0; r < ranks; ++r)
    for (std::size_t k = 0; k < t.actions[r].size(); ++k) {
      const auto& a = t.actions[r][k];
      at[{a.stage, static_cast<int>(a.op), a.micro_batch}] = {static_cast<int>(r), k};
    }
  const auto locate = [&](PipelineAction a) -> std::pair<int, std::size_t> {
    if (a.op == PipelineOp::Backward && !at.count({a.stage, static_cast<int>(PipelineOp::Backward), a.micro_batch}))
      a.op = PipelineOp::BackwardInput;  // the stage splits its backward: the input gradient is I's
    const auto it = at.find({a.stage, static_cast<int>(a.op), a.micro_batch});
    return it == at.end() ? std::pair<int, std::size_t>{-1, 0} : it->second;
  };
  const auto cost = [&](PipelineOp op) {
    if (unit_steps) return 1.0;
    switch (op) {
      case PipelineOp::Forward: return costs.forward;
      case PipelineOp::Backward: return costs.backward_input + costs.backward_weight;
      case PipelineOp::BackwardInput: return costs.backward_input;
      case PipelineOp::BackwardWeight: return costs.backward_weight;
      default: return 0.0;
    }
  };
  PipelineRun run;
  run.start.resize(ranks);
  run.end.resize(ranks);
  std::vector<std::size_t> next(ranks, 0);
  std::vector<double> clock(ranks, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (std::size_t r = 0; r < ranks; ++r)
      for (; next[r] < t.actions[r].size(); ++next[r]) {
        const auto& a = t.actions[r][next[r]];
        double ready = clock[r];
        bool blocked = false;
        for (const auto& need : pipeline_needs(t, a, transfers)) {
          const auto [nr, nk] = locate(need.action);
          if (nr < 0 || nk >= next[static_cast<std::size_t>(nr)]) {
            blocked = true;
            break;
          }
          ready = std::max(ready, run.end[static_cast<std::size_t>(nr)][nk] + (need.crosses_ranks ? costs.transfer : 0.0));
        }
        if (blocked) break;
        run.start[r].push_back(ready);
        run.end[r].push_back(ready + cost(a.op));
        clock[r] = run.end[r].back();
        progress = true;
      }
  }
  std::string stuck;
  for (std::size_t r = 0; r < ranks; ++r) {
    if (next[r] == t.actions[r].size()) continue;
    const auto& a = t.actions[r][next[r]];
    std::string waits;
    for (const auto& need : pipeline_needs(t, a, transfers)) {
      const auto [nr, nk] = locate(need.action);
      if (nr >= 0 && nk < next[static_cast<std::size_t>(nr)]) continue;
      PipelineAction named = need.action;
      if (nr >= 0) named = t.actions[static_cast<std::size_t>(nr)][nk];
      waits = to_string(named) + (nr >= 0 ? " (rank " + std::to_string(nr) + ", action " + std::to_string(nk) + ")" : " (nowhere in the table)");
      break;
    }
    stuck += std::string(stuck.empty() ? "" : "; ") + "rank " + std::to_string(r) + " at action " +
             std::to_string(next[r]) + " (" + to_string(a) + ") waits for " + waits;
  }
  if (!stuck.empty())
    throw ArgumentError("pipeline schedule '" + t.name + "' deadlocks (receives block, sends do not): " + stuck);
  return run;
}
}  // namespace detail

TESSERA_LINKAGE void check_pipeline_table(const PipelineScheduleTable& t) {
  const std::string who = "pipeline schedule '" + t.name + "'";
  TESSERA_CHECK(t.ranks >= 1 && t.stages_per_rank >= 1 && t.micro_batches >= 1, ArgumentError, who, ": ", t.ranks,
                " ranks, ", t.stages_per_rank, " stages per rank, ", t.micro_batches,
                " micro-batches (each at least 1)");
  TESSERA_CHECK(t.placement == StagePlacement::Loop || t.stages_per_rank == 2, ArgumentError, who,
                ": V placement holds 2 stages per rank, not ", t.stages_per_rank);
  TESSERA_CHECK(t.actions.size() == static_cast<std::size_t>(t.ranks), ArgumentError, who, ": ", t.actions.size(),
                " rows of actions for ", t.ranks, " ranks");
  const int stages = t.stage_count(), m = t.micro_batches, last = stages - 1;
  const bool transfers = t.has_transfers();
  detail::TableIndex index(stages, m);
  for (int r = 0; r < t.ranks; ++r) {
    const auto& row = t.actions[static_cast<std::size_t>(r)];
    for (std::size_t k = 0; k < row.size(); ++k) {
      const PipelineAction& a = row[k];
      const std::string here = detail::where(t, r, k, a);
      TESSERA_CHECK(a.stage >= 0 && a.stage < stages, ArgumentError, here, ": stage ", a.stage, " does not exist (",
                    stages, " stages: ", t.ranks, " ranks x ", t.stages_per_rank, ")");
      TESSERA_CHECK(a.micro_batch >= 0 && a.micro_batch < m, ArgumentError, here, ": micro-batch ", a.micro_batch,
                    " does not exist (", m, " micro-batches)");
      TESSERA_CHECK(t.rank_of(a.stage) == r, ArgumentError, here, ": stage ", a.stage, " runs on rank ",
                    t.rank_of(a.stage), " (", to_string(t.placement), " placement), not on rank ", r);
      int& slot = index.of(a.stage, a.op, a.micro_batch);
      TESSERA_CHECK(slot < 0, ArgumentError, here, ": ", to_string(a), " appears twice (also action ", slot, ")");
      slot = static_cast<int>(k);
      // A transfer exists only between stages on two ranks.
      if (a.op == PipelineOp::SendForward || a.op == PipelineOp::RecvBackward) {
        TESSERA_CHECK(a.stage < last, ArgumentError, here, ": the last stage has no next stage to exchange with");
        TESSERA_CHECK(t.rank_of(a.stage + 1) != r, ArgumentError, here, ": stages ", a.stage, " and ", a.stage + 1,
                      " are both on rank ", r, ", nothing to transfer");
      }
      if (a.op == PipelineOp::RecvForward || a.op == PipelineOp::SendBackward) {
        TESSERA_CHECK(a.stage > 0, ArgumentError, here, ": the first stage has no previous stage to exchange with");
        TESSERA_CHECK(t.rank_of(a.stage - 1) != r, ArgumentError, here, ": stages ", a.stage - 1, " and ", a.stage,
                      " are both on rank ", r, ", nothing to transfer");
      }
    }
  }
  // Every stage and micro-batch: one F, and one B or one I with one W; each after what it needs on
  // its own rank.
  for (int s = 0; s < stages; ++s)
    for (int i = 0; i < m; ++i) {
      const int r = t.rank_of(s);
      const auto name = [&](PipelineOp op) { return to_string(PipelineAction{s, op, i}); };
      const auto missing = [&](const std::string& what) {
        return ArgumentError(who + ": rank " + std::to_string(r) + " never runs " + what);
      };
      const int f = index.of(s, PipelineOp::Forward, i), b = index.of(s, PipelineOp::Backward, i),
                in = index.of(s, PipelineOp::BackwardInput, i), w = index.of(s, PipelineOp::BackwardWeight, i);
      if (f < 0) throw missing(name(PipelineOp::Forward) + " (stage " + std::to_string(s) + "'s forward of micro-batch " + std::to_string(i) + ")");
      if (b >= 0 && (in >= 0 || w >= 0))
        throw ArgumentError(who + ": rank " + std::to_string(r) + " runs both " + name(PipelineOp::Backward) + " and " +
                            name(in >= 0 ? PipelineOp::BackwardInput : PipelineOp::BackwardWeight) +
                            ": a backward is either whole (B) or split (I then W)");
      if (b < 0 && in < 0) throw missing(name(PipelineOp::Backward) + " or " + name(PipelineOp::BackwardInput) + " (stage " + std::to_string(s) + "'s backward of micro-batch " + std::to_string(i) + ")");
      if (in >= 0 && w < 0) throw missing(name(PipelineOp::BackwardWeight) + " (the weight gradient after " + name(PipelineOp::BackwardInput) + ")");
      if (w >= 0 && in < 0) throw missing(name(PipelineOp::BackwardInput) + " (the input gradient before " + name(PipelineOp::BackwardWeight) + ")");
      const int backward = b >= 0 ? b : in;
      const auto order = [&](int first, int then, PipelineOp first_op, PipelineOp then_op) {
        TESSERA_CHECK(first < then, ArgumentError, who, ": rank ", r, " runs ", name(then_op), " (action ", then,
                      ") before ", name(first_op), " (action ", first, ")");
      };
      order(f, backward, PipelineOp::Forward, b >= 0 ? PipelineOp::Backward : PipelineOp::BackwardInput);
      if (w >= 0) order(in, w, PipelineOp::BackwardInput, PipelineOp::BackwardWeight);
      if (!transfers) continue;
      // Transfers listed: each edge between two ranks has its four, each on the right side of its
      // computation.
      const auto need = [&](PipelineOp op, int stage) {
        const int k = index.of(stage, op, i);
        if (k < 0)
          throw ArgumentError(who + ": rank " + std::to_string(t.rank_of(stage)) + " never runs " +
                              to_string(PipelineAction{stage, op, i}) + " (the table lists its transfers, so every one between two ranks must be there)");
        return k;
      };
      if (s < last && t.rank_of(s + 1) != r) {
        order(f, need(PipelineOp::SendForward, s), PipelineOp::Forward, PipelineOp::SendForward);
        order(need(PipelineOp::RecvBackward, s), backward, PipelineOp::RecvBackward,
              b >= 0 ? PipelineOp::Backward : PipelineOp::BackwardInput);
      }
      if (s > 0 && t.rank_of(s - 1) != r) {
        order(need(PipelineOp::RecvForward, s), f, PipelineOp::RecvForward, PipelineOp::Forward);
        order(backward, need(PipelineOp::SendBackward, s), b >= 0 ? PipelineOp::Backward : PipelineOp::BackwardInput,
              PipelineOp::SendBackward);
      }
    }
  detail::run_pipeline_table(t, {});  // throws on a deadlock
}

TESSERA_LINKAGE double PipelineSimulation::bubble_fraction() const {
  if (makespan <= 0 || busy.empty()) return 0;
  double idle = 0;
  for (const double b : busy) idle += 1.0 - b / makespan;
  return idle / static_cast<double>(busy.size());
}

TESSERA_LINKAGE PipelineSimulation simulate_pipeline(const PipelineScheduleTable& table, const PipelineOpCosts& costs) {
  const PipelineScheduleTable t = table.compute_only();
  const auto run = detail::run_pipeline_table(t, costs);
  PipelineSimulation sim;
  sim.start = run.start;
  sim.end = run.end;
  const auto ranks = static_cast<std::size_t>(t.ranks);
  sim.busy.assign(ranks, 0);
  sim.peak_activations.assign(ranks, 0);
  double first = std::numeric_limits<double>::infinity(), finish = 0;
  for (std::size_t r = 0; r < ranks; ++r) {
    int held = 0;
    for (std::size_t k = 0; k < t.actions[r].size(); ++k) {
      const PipelineOp op = t.actions[r][k].op;
      sim.busy[r] += run.end[r][k] - run.start[r][k];
      first = std::min(first, run.start[r][k]);
      finish = std::max(finish, run.end[r][k]);
      if (op == PipelineOp::Forward) sim.peak_activations[r] = std::max(sim.peak_activations[r], ++held);
      if (detail::ends_backward(op)) --held;
    }
  }
  sim.makespan = finish > first ? finish - first : 0;
  return sim;
}

TESSERA_LINKAGE PipelineScheduleTable detail::greedy_zero_bubble(PipelineScheduleTable t, const std::vector<int>& cap) {
  const int stages = t.stage_count(), m = t.micro_batches, last = stages - 1;
  const auto ranks = static_cast<std::size_t>(t.ranks);
  const auto at = [m](int s, int i) { return static_cast<std::size_t>(s * m + i); };
  std::vector<double> f_end(static_cast<std::size_t>(stages * m), -1), i_end(f_end.size(), -1);
  std::vector<char> w_done(f_end.size(), 0);
  std::vector<int> next_forward(static_cast<std::size_t>(stages), 0), held(ranks, 0);
  std::vector<double> clock(ranks, 0);
  std::vector<int> remaining(ranks, 0);
  std::vector<std::vector<int>> mine(ranks);
  for (std::size_t r = 0; r < ranks; ++r) {
    mine[r] = t.stages_of(static_cast<int>(r));
    std::reverse(mine[r].begin(), mine[r].end());  // later stages first between equals
    remaining[r] = 3 * m * static_cast<int>(mine[r].size());
  }
  const auto done_by = [](double end, double now) { return end >= 0 && end <= now; };
  for (;;) {
    std::size_t r = ranks;
    for (std::size_t q = 0; q < ranks; ++q)
      if (remaining[q] > 0 && (r == ranks || clock[q] < clock[r])) r = q;
    if (r == ranks) break;
    const double now = clock[r];
    // The oldest runnable micro-batch of each kind, the later stage between equals.
    PipelineAction pick{-1, PipelineOp::Forward, m};
    const auto consider = [&](PipelineOp op) {
      for (const int s : mine[r])
        for (int i = 0; i < m; ++i) {
          bool ok = false;
          if (op == PipelineOp::BackwardInput)
            ok = done_by(f_end[at(s, i)], now) && i_end[at(s, i)] < 0 && (s == last || done_by(i_end[at(s + 1, i)], now));
          else if (op == PipelineOp::Forward)
            ok = i == next_forward[static_cast<std::size_t>(s)] && held[r] < cap[r] &&
                 (s == 0 || done_by(f_end[at(s - 1, i)], now));
          else
            ok = done_by(i_end[at(s, i)], now) && !w_done[at(s, i)];
          if (ok && i < pick.micro_batch) pick = {s, op, i};
          if (ok) break;
        }
      return pick.stage >= 0;
    };
    if (consider(PipelineOp::BackwardInput) || consider(PipelineOp::Forward) || consider(PipelineOp::BackwardWeight)) {
      const double end = now + 1;
      const std::size_t k = at(pick.stage, pick.micro_batch);
      if (pick.op == PipelineOp::Forward) f_end[k] = end, ++next_forward[static_cast<std::size_t>(pick.stage)], ++held[r];
      else if (pick.op == PipelineOp::BackwardInput) i_end[k] = end;
      else w_done[k] = 1, --held[r];
      t.actions[r].push_back(pick);
      clock[r] = end;
      --remaining[r];
      continue;
    }
    // Nothing to run now: wait for the next end of an F or I anywhere, or for another rank to move.
    double wake = std::numeric_limits<double>::infinity();
    for (std::size_t k = 0; k < f_end.size(); ++k) {
      if (f_end[k] > now) wake = std::min(wake, f_end[k]);
      if (i_end[k] > now) wake = std::min(wake, i_end[k]);
    }
    bool others_move = false;  // another rank may still run something (at `now` or later)
    for (std::size_t q = 0; q < ranks; ++q)
      if (q != r && remaining[q] > 0) {
        others_move = true;
        if (clock[q] > now) wake = std::min(wake, clock[q]);
      }
    // Every action lasts one unit, so nothing started at `now` or later ends before now + 1.
    if (wake == std::numeric_limits<double>::infinity() && others_move) wake = now + 1;
    TESSERA_CHECK(wake < std::numeric_limits<double>::infinity() && wake <= 4.0 * (3 * m * stages + 1), ArgumentError,
                  "pipeline schedule ", t.name, ": no order of ", m, " micro-batches fits the memory limit of ",
                  cap[r], " micro-batches on rank ", r);
    clock[r] = wake;
  }
  return t;
}

TESSERA_LINKAGE std::string to_csv(const PipelineScheduleTable& t) {
  // A compute-only table goes on torch's grid: each action in the step it would start if every
  // action took one step (a whole B too), blank cells where a rank waits, as torch's own schedules
  // dump theirs. torch's lock-step runtime (PipelineScheduleMulti) posts a rank's receives from its
  // neighbours' cells of the same step, so a table it loads must be aligned so; its newer runtime
  // and parse_pipeline_csv read the order alone. A table with transfers, or one that cannot run,
  // is written compact.
  std::vector<std::vector<double>> steps;
  if (!t.has_transfers()) {
    try {
      steps = detail::run_pipeline_table(t, {}, /*unit_steps=*/true).start;
    } catch (const ArgumentError&) {
      steps.clear();
    }
  }
  std::string out;
  for (std::size_t r = 0; r < t.actions.size(); ++r) {
    const auto& row = t.actions[r];
    std::vector<std::string> cells;
    for (std::size_t k = 0; k < row.size(); ++k) {
      const auto step = steps.empty() ? k : static_cast<std::size_t>(std::lround(steps[r][k]));
      if (cells.size() <= step) cells.resize(step + 1);  // blank cells: the rank waits
      cells[step] = to_string(row[k]);
    }
    for (std::size_t c = 0; c < cells.size(); ++c) out += (c ? "," : "") + cells[c];
    out += '\n';
  }
  return out;
}

TESSERA_LINKAGE PipelineScheduleTable parse_pipeline_csv(std::string_view csv, std::string name) {
  PipelineScheduleTable t;
  t.name = std::move(name);
  std::size_t line_start = 0;
  int line_number = 0;
  while (line_start < csv.size()) {
    std::size_t line_end = csv.find('\n', line_start);
    if (line_end == std::string_view::npos) line_end = csv.size();
    std::string_view line = csv.substr(line_start, line_end - line_start);
    line_start = line_end + 1;
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    auto& row = t.actions.emplace_back();
    std::size_t cell_start = 0;
    for (int cell = 1; cell_start <= line.size(); ++cell) {
      std::size_t cell_end = line.find(',', cell_start);
      if (cell_end == std::string_view::npos) cell_end = line.size();
      const std::string_view text = line.substr(cell_start, cell_end - cell_start);
      cell_start = cell_end + 1;
      if (text.find_first_not_of(" \t") == std::string_view::npos) continue;  // an empty cell: nothing at that step
      try {
        row.push_back(parse_pipeline_action(text));
      } catch (const ArgumentError& e) {
        throw ArgumentError("pipeline schedule '" + t.name + "': row " + std::to_string(line_number) + " (rank " +
                            std::to_string(line_number - 1) + "), cell " + std::to_string(cell) + ": " + e.what());
      }
    }
  }
  while (!t.actions.empty() && t.actions.back().empty()) t.actions.pop_back();  // trailing blank lines
  // torch 2.5 wrote the input gradient as B when the table also had W's (2.6 on: I, and B the
  // whole backward). A table with W's and no I is of that kind.
  bool has_i = false, has_w = false;
  for (const auto& row : t.actions)
    for (const auto& a : row) has_i = has_i || a.op == PipelineOp::BackwardInput, has_w = has_w || a.op == PipelineOp::BackwardWeight;
  if (has_w && !has_i)
    for (auto& row : t.actions)
      for (auto& a : row)
        if (a.op == PipelineOp::Backward) a.op = PipelineOp::BackwardInput;
  TESSERA_CHECK(!t.actions.empty(), ArgumentError, "pipeline schedule '", t.name, "': no actions");
  t.ranks = static_cast<int>(t.actions.size());
  int stages = 0, m = 0;
  for (const auto& row : t.actions)
    for (const auto& a : row) stages = std::max(stages, a.stage + 1), m = std::max(m, a.micro_batch + 1);
  TESSERA_CHECK(stages % t.ranks == 0, ArgumentError, "pipeline schedule '", t.name, "': ", stages,
                " stages over ", t.ranks, " ranks (each rank must hold as many)");
  t.stages_per_rank = stages / t.ranks;
  t.micro_batches = m;
  // Placement: the one under which every action sits on its own row.
  for (const StagePlacement p : {StagePlacement::Loop, StagePlacement::V}) {
    t.placement = p;
    if (p == StagePlacement::V && t.stages_per_rank != 2) continue;
    bool fits = true;
    for (int r = 0; r < t.ranks && fits; ++r)
      for (const auto& a : t.actions[static_cast<std::size_t>(r)]) fits = fits && t.rank_of(a.stage) == r;
    if (fits) return t;
  }
  t.placement = StagePlacement::Loop;
  for (int r = 0; r < t.ranks; ++r)
    for (const auto& a : t.actions[static_cast<std::size_t>(r)])
      TESSERA_CHECK(t.rank_of(a.stage) == r, ArgumentError, "pipeline schedule '", t.name, "': row ", r + 1,
                    " (rank ", r, ") runs ", to_string(a), ", but stage ", a.stage,
                    " belongs to rank ", t.rank_of(a.stage), " under loop placement",
                    t.stages_per_rank == 2 ? " and to rank " + std::to_string(a.stage < t.ranks ? a.stage : 2 * t.ranks - 1 - a.stage) + " under V placement" : std::string(),
                    " (stage k runs on rank k mod P, or for 2 stages per rank also k < P ? k : 2P - 1 - k)");
  return t;
}

TESSERA_LINKAGE PipelineScheduleTable read_pipeline_csv(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TESSERA_CHECK(in.good(), IoError, "pipeline schedule: cannot open '", path, "'");
  std::ostringstream text;
  text << in.rdbuf();
  return parse_pipeline_csv(text.str(), path);
}

TESSERA_LINKAGE void write_pipeline_csv(const PipelineScheduleTable& t, const std::string& path) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  TESSERA_CHECK(out.good(), IoError, "pipeline schedule: cannot write '", path, "'");
  out << to_csv(t);
  out.close();
  TESSERA_CHECK(out.good(), IoError, "pipeline schedule: writing '", path, "' failed");
}

#endif  // TESSERA_HEADER_DEFINITIONS

}  // namespace tessera
