// Example 18's report: memory per rank and collective elements per step of DataParallel, ZeRO-2 and
// ZeRO-3 next to their formulas, and the checks the example makes of them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>

namespace examples {

// One strategy's run, per rank (on a threads build: the process's figures over its ranks).
struct FsdpRun {
  double kept = 0;   // bytes the model and the strategy keep once built (before the first step)
  double state = 0;  // bytes the optimizer's first step allocated: its state
  double built = 0;  // the most bytes in use while the model and the strategy were built
  double peak = 0;   // the most bytes in use at once while training (model, strategy, state, a step's)
  double loss = 0;   // this rank's loss on its last batch
  std::int64_t collective_elements = 0;  // elements into this rank's collectives in the last step (FSDP's count)
};

// Formulas per rank, in bytes, for psi parameters of b bytes over n ranks and AdamW (two moments):
//   kept:  DataParallel 3 psi b (values, gradients, the buckets' copy); stage 2 psi b + 2 psi b / n
//          (the values, and the shard's values and gradients); stage 3 2 psi b / n
//   state: DataParallel 2 psi b; stages 2 and 3 2 psi b / n
inline double fsdp_kept_formula(int stage, double psi_bytes, int n) {
  return stage == 0 ? 3 * psi_bytes : stage == 2 ? psi_bytes + 2 * psi_bytes / n : 2 * psi_bytes / n;
}
inline double fsdp_state_formula(int stage, double psi_bytes, int n) { return stage == 0 ? 2 * psi_bytes : 2 * psi_bytes / n; }

// Prints the table (on `print`) and returns whether every check holds: the losses of stages 2 and
// 3 within `loss_tolerance` (relative) of DataParallel's, every kept and state figure within 5% of
// its formula, and, at 4 ranks or more, stage 3's peak at most 0.35x DataParallel's.
inline bool report_fsdp(bool print, int ranks, std::int64_t parameters, const FsdpRun (&runs)[3], double loss_tolerance) {
  const char* names[3] = {"DataParallel", "ZeRO-2", "ZeRO-3"};
  const int stages[3] = {0, 2, 3};
  const double psi = static_cast<double>(parameters) * 4, mb = 1e6, n = ranks;
  // Ring algorithms: an all_reduce sends 2 (n - 1) / n of its elements, all_gather and
  // reduce_scatter (n - 1) / n each; stage 3 gathers every unit twice (forward and backward).
  const double wire[3] = {2 * (n - 1) / n * parameters, 2 * (n - 1) / n * parameters, 3 * (n - 1) / n * parameters};
  bool figures_ok = true;
  if (print)
    std::printf("\n%-13s %8s %22s %22s %10s %11s %16s %12s\n", "per rank", "built MB", "kept (formula) MB",
                "AdamW state (formula)", "peak MB", "peak / DP", "sent per step", "last loss");
  for (int k = 0; k < 3; ++k) {
    const FsdpRun& r = runs[k];
    const double kept_formula = fsdp_kept_formula(stages[k], psi, ranks), state_formula = fsdp_state_formula(stages[k], psi, ranks);
    const bool kept_ok = std::abs(r.kept / kept_formula - 1) <= 0.05, state_ok = std::abs(r.state / state_formula - 1) <= 0.05;
    const bool loss_ok = std::abs(r.loss - runs[0].loss) <= loss_tolerance * std::max(1.0, std::abs(runs[0].loss));
    figures_ok = figures_ok && kept_ok && state_ok && loss_ok;
    if (print)
      std::printf("%-13s %8.1f %9.1f (%7.1f) %s %9.1f (%7.1f) %s %10.1f %11.3f %10.2f M el. %12.5f%s\n", names[k],
                  r.built / mb, r.kept / mb,
                  kept_formula / mb, kept_ok ? "ok" : "!!", r.state / mb, state_formula / mb, state_ok ? "ok" : "!!",
                  r.peak / mb, r.peak / runs[0].peak, wire[k] / 1e6, r.loss, loss_ok ? "" : "  (differs from DataParallel's)");
  }
  const double ratio = runs[2].peak / runs[0].peak;
  const bool ratio_ok = ranks < 4 || ratio <= 0.35;
  if (print) {
    std::printf("built: the whole model exists on every rank until the strategy shards it (values and gradients, "
                "2 psi b); peak: while training\n"
                "sent per step: elements each rank sends with ring collectives (ZeRO-3 counted %.2f M into its "
                "collectives: each unit's N s_u gathered twice and reduce-scattered once)\n",
                static_cast<double>(runs[2].collective_elements) / 1e6);
    std::printf("check: kept and state figures within 5%% of their formulas, stages 2 and 3 end at DataParallel's loss "
                "(within %.0e) %s\n", loss_tolerance, figures_ok ? "ok" : "FAIL");
    if (ranks >= 4)
      std::printf("check: ZeRO-3's peak %.3f of DataParallel's at %d ranks (at most 0.35) %s\n", ratio, ranks,
                  ratio_ok ? "ok" : "FAIL");
  }
  return figures_ok && ratio_ok;
}

}  // namespace examples
