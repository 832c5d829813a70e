"""Section pipeline: build/bench/pipeline_bubble under mpirun, repeated: each stage's idle
fraction against the ideal bubble (P-1)/(M+P-1), GPipe and 1F1B."""
from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from typing import Any

from tessera_tools.report.context import MODEL_NAMES, Context
from tessera_tools.report.formatting import JsonDict, json_lines, md_table, repeats_phrase
from tessera_tools.report.plotting import PLOTS_SKIPPED, errorbar_from, pyplot, save

# (model, schedule, stages P, micro-batches M)
Key = tuple[str, str, int, int]


def run_pipeline(ctx: Context, data: JsonDict) -> None:
    s = ctx.settings
    binary = ctx.binary("bench/pipeline_bubble")
    mpirun = ctx.mpirun()
    data["rows"], data["settings"] = [], {k: getattr(s, k) for k in ("pipe_stages", "pipe_steps", "pipe_repeats")}
    data["cpus"] = len(os.sched_getaffinity(0))
    for repeat in range(s.pipe_repeats):
        for p in s.pipe_stages:
            argv = [mpirun, "--oversubscribe", "-n", str(p), binary, f"--steps={s.pipe_steps}"]
            if repeat == 0 and p == s.pipe_stages[0]:
                # One 1F1B step at M = 4 as a Chrome trace, for a look in ui.perfetto.dev.
                data["trace"] = "raw/pipeline_trace.json"
                argv.append(f"--trace={os.path.join(ctx.raw, 'pipeline_trace.json')}")
            for row in json_lines(ctx.run(argv)):
                row["repeat"] = repeat
                data["rows"].append(row)


def pipeline_summary(rows: Sequence[JsonDict]) -> dict[Key, dict[str, Any]]:
    """{(model, schedule, P, M): {"formula", "per_repeat": [mean idle over stages], "stages": {s: [idle]},
    "alloc": {s: bytes of the first repeat}, "step_ms": [...]}}"""
    out: dict[Key, dict[str, Any]] = {}
    groups: dict[tuple[str, str, int, int, int], list[JsonDict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["schedule"], r["stages"], r["micro_batches"], r["repeat"]), []).append(r)
    for (model, schedule, p, m, repeat), g in groups.items():  # the program's order: GPipe, then 1F1B
        e = out.setdefault((model, schedule, p, m), {"formula": (p - 1) / (m + p - 1), "per_repeat": [], "stages": {},
                                                     "alloc": {}, "step_ms": []})
        e["per_repeat"].append(statistics.mean(r["idle_fraction"] for r in g))
        e["step_ms"].append(g[0]["step_ms"])
        for r in g:
            e["stages"].setdefault(r["stage"], []).append(r["idle_fraction"])
            e["alloc"].setdefault(r["stage"], r["step_alloc_bytes"])
    return out


def render_pipeline(data: JsonDict, plots: str) -> str:
    rows = data.get("rows", [])
    if not rows:
        return ""
    summary = pipeline_summary(rows)
    repeats = len({r["repeat"] for r in rows})
    md = ["Pipeline parallelism under `mpirun -n P build/bench/pipeline_bubble`: one MPI process (one thread) per "
          "stage, global batch 128 split into M micro-batches, stages balanced by measured per-layer costs. A stage's "
          "idle fraction is 1 - its compute time / the pipeline's step time (median over the steps after the first); "
          "the pipeline's bubble is the mean over its stages, compared with the ideal (P-1)/(M+P-1) of equal stages. "
          f"{repeats_phrase(repeats)}\n"]
    if any(p > data.get("cpus", p) for p in data.get("settings", {}).get("pipe_stages", [])):
        md.append(f"*P is above this machine's {data['cpus']} CPUs: stages share cores, so idle time also counts "
                  "waiting for a core.*\n")
    table = []
    for (model, schedule, p, m), e in summary.items():
        measured = statistics.median(e["per_repeat"])
        stages = " / ".join(f"{statistics.median(v):.3f}" for _, v in sorted(e["stages"].items()))
        alloc = " / ".join(f"{v / (1 << 20):.1f}" for _, v in sorted(e["alloc"].items()))
        table.append([MODEL_NAMES.get(model, model), schedule, p, m, f"{e['formula']:.3f}", f"**{measured:.3f}**",
                      f"{measured - e['formula']:+.3f}", stages, f"{statistics.median(e['step_ms']):.1f}", alloc])
    md.append(md_table(["model", "schedule", "P", "M", "ideal", "measured bubble", "excess", "idle per stage",
                        "step ms", "first-step alloc MiB per stage"], table,
                       ["l", "l", "r", "r", "r", "r", "r", "l", "r", "l"]))
    excess = {k: statistics.median(e["per_repeat"]) - e["formula"] for k, e in summary.items()}
    text: list[str] = []
    for model in dict.fromkeys(k[0] for k in summary):
        ex = {k: v for k, v in excess.items() if k[0] == model}
        worst = max(ex, key=lambda k: abs(ex[k]))
        text.append(f"{MODEL_NAMES.get(model, model)}: the measured bubble is {statistics.mean(ex.values()):+.3f} off the "
                    f"formula on average, furthest at M = {worst[3]} ({worst[1]}, {ex[worst]:+.3f}).")
        gaps = [abs(statistics.median(summary[(model, "GPipe", p, m)]["per_repeat"]) -
                    statistics.median(summary[(model, "1F1B", p, m)]["per_repeat"]))
                for (mo, sc, p, m) in summary if mo == model and sc == "GPipe" and (model, "1F1B", p, m) in summary]
        if gaps:
            text.append(f"GPipe and 1F1B differ by at most {max(gaps):.3f} in idle fraction.")
        ms = [k for k in summary if k[0] == model and k[1] == "GPipe" and (model, "1F1B", k[2], k[3]) in summary]
        if ms:
            k = max(ms, key=lambda k: k[3])
            g, o = summary[k]["alloc"].get(0), summary[(model, "1F1B", k[2], k[3])]["alloc"].get(0)
            if g and o:
                text.append(f"At M = {k[3]}, 1F1B's first step allocates {o / g:.2f} of GPipe's memory on stage 0.")
    md.append(" ".join(text) + "\n")
    if data.get("trace"):
        md.append(f"Trace of one 1F1B step (M = 4, MLP) for chrome://tracing or ui.perfetto.dev: [{data['trace']}]({data['trace']}).\n")
    plt = pyplot()
    if not plt:
        md.append(PLOTS_SKIPPED)
        return "\n".join(md)
    panels = sorted({(k[0], k[2]) for k in summary}, key=lambda mp: (mp[1], mp[0] != "mlp", mp[0]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    colours = {"GPipe": "#1f77b4", "1F1B": "#ff7f0e"}
    for ax, (model, p) in zip(axes[0], panels):
        m_values = sorted({k[3] for k in summary if k[0] == model and k[2] == p})
        curve = [1 + i * (max(m_values) - 1) / 100 for i in range(101)]
        ax.plot(curve, [(p - 1) / (m + p - 1) for m in curve], color="black", linewidth=1.2,
                label=f"ideal (P-1)/(M+P-1), P = {p}")
        for si, schedule in enumerate(("GPipe", "1F1B")):
            keys = [k for k in summary if k[0] == model and k[1] == schedule and k[2] == p]
            if not keys:
                continue
            keys.sort(key=lambda k: k[3])
            offset = (si - 0.5) * 0.12  # side by side at each M, so the whiskers do not overlap
            xs = [k[3] * (1 + offset) for k in keys]
            ys = [statistics.median(summary[k]["per_repeat"]) for k in keys]
            err = list(zip(*[errorbar_from(y, min(summary[k]["per_repeat"]), max(summary[k]["per_repeat"]))
                             for y, k in zip(ys, keys)]))
            ax.errorbar(xs, ys, yerr=err if repeats > 1 else None, color=colours[schedule], marker="o", capsize=3,
                        linestyle="none", label=f"{schedule}, measured (mean of stages)")
            for stage in sorted(summary[keys[0]]["stages"]):
                ax.scatter(xs, [statistics.median(summary[k]["stages"][stage]) for k in keys], color=colours[schedule],
                           marker="v^<>"[stage % 4], s=14, alpha=0.45,
                           label=f"{schedule}, stage {stage}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(m_values, [str(m) for m in m_values])
        ax.set_xlabel("micro-batches per step M (log2)")
        ax.set_ylabel("idle fraction of the step (bubble)")
        ax.set_ylim(0, max(0.6, ax.get_ylim()[1]))
        ax.set_title(f"{MODEL_NAMES.get(model, model)}, P = {p} stages")
        ax.legend(fontsize="x-small")
    fig.suptitle("Pipeline bubble: measured against the formula" + ("; whiskers: range over repeats" if repeats > 1 else ""))
    save(fig, os.path.join(plots, "pipeline.png"))
    md.append("![Pipeline bubble against the formula](plots/pipeline.png)\n")
    return "\n".join(md)
