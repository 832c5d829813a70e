"""Section dp_scaling: data-parallel scaling efficiency on 2 ranks (bench/dp_scaling.py), Tessera
on each communicator against PyTorch DistributedDataParallel over Gloo."""
from __future__ import annotations

import os
import statistics
from collections.abc import Sequence

from tessera_tools.report.context import MODEL_NAMES, Context
from tessera_tools.report.formatting import JsonDict, fmt_num, md_table, read_jsonl, repeats_phrase
from tessera_tools.report.plotting import PLOTS_SKIPPED, errorbar_from, pyplot, save


def run_dp_scaling(ctx: Context, data: JsonDict) -> None:
    s = ctx.settings
    for comm in ("threads", "mpi", "gloo"):  # dp_scaling.py runs all three
        ctx.binary(f"bench/dp_scaling_{comm}")
    ctx.mpirun()
    ctx.require_torch()
    path = os.path.join(ctx.raw, "dp_scaling.jsonl")
    argv = ctx.bench_script("dp_scaling.py") + ["--build", ctx.build, "--models", s.dp_models,
                                                "--rounds", str(s.dp_rounds), "--out", path]
    if s.coretypes:
        argv += ["--coretypes", s.coretypes]
    ctx.run(argv)
    data["rows"] = read_jsonl(path)
    # dp_scaling.py kills and repeats a run that hangs (PyTorch DDP's 2-process launch stalls about
    # one time in ten here); each costs its 60 s timeout, so the report counts them.
    data["retries"] = [line.strip() for line in ctx.log if "retrying:" in line]


LABELS_DP = {("tessera", "threads"): "Tessera ThreadComm", ("tessera", "mpi"): "Tessera MpiComm",
             ("tessera", "gloo"): "Tessera GlooComm", ("pytorch", "gloo"): "PyTorch DDP (Gloo)"}


def dp_summary(rows: Sequence[JsonDict]) -> dict[str, list[JsonDict]]:
    """Per model: each framework's 1-rank and 2-rank medians, the efficiency of the medians (as
    bench/dp_scaling.py prints it) and per-round efficiencies (each round's 2-rank run against the
    same round's 1-rank run) for the error bars, plus Tessera's exposed communication."""
    out: dict[str, list[JsonDict]] = {}
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        single = {fw: {r["round"]: r["images_per_second"] for r in mine if r["framework"] == fw and r["ranks"] == 1}
                  for fw in ("tessera", "pytorch")}
        entries = []
        for (fw, comm), label in LABELS_DP.items():
            multi = [r for r in mine if r["framework"] == fw and r["comm"] == comm and r["ranks"] > 1]
            if not multi or not single[fw]:
                continue
            n = multi[0]["ranks"]
            med2 = statistics.median(r["images_per_second"] for r in multi)
            med1 = statistics.median(single[fw].values())
            per_round = [r["images_per_second"] / (n * single[fw][r["round"]]) for r in multi if r["round"] in single[fw]]
            exposed = [r["exposed_comm_us_per_step"] for r in multi if "exposed_comm_us_per_step" in r]
            entries.append({"label": label, "framework": fw, "comm": comm, "ranks": n, "single": med1, "multi": med2,
                            "efficiency": med2 / (n * med1), "per_round": per_round,
                            "exposed_us": statistics.median(exposed) if exposed else None})
        out[model] = entries
    return out


def render_dp_scaling(data: JsonDict, plots: str) -> str:
    rows = data.get("rows", [])
    if not rows:
        return ""
    summary = dp_summary(rows)
    rounds = len({r["round"] for r in rows})
    md = ["Data-parallel training steps on synthetic 1x28x28 images, 1 thread per rank, the per-rank batch fixed "
          "(`bench/dp_scaling.py`): Tessera's `DataParallel` on 2 ranks over each communicator against PyTorch "
          "`DistributedDataParallel` over Gloo, in alternating rounds. Scaling efficiency = images/s on N ranks / "
          "(N x images/s of the same framework on 1 rank without data parallelism); "
          f"{repeats_phrase(rounds, 'round')} Each round's efficiency divides by the same round's 1-rank run. Exposed communication: the time "
          "`finish()` waited after backward, per step (Tessera only).\n"]
    table = []
    for model, entries in summary.items():
        batch = next((r.get("batch_per_rank") for r in rows if r["model"] == model and "batch_per_rank" in r), "?")
        for e in entries:
            rng = f" ({min(e['per_round']):.3f}–{max(e['per_round']):.3f})" if len(e["per_round"]) > 1 else ""
            table.append([MODEL_NAMES.get(model, model), batch, e["label"], fmt_num(e["single"]),
                          f"{fmt_num(e['multi'])} ({e['ranks']} ranks)", f"**{e['efficiency']:.3f}**{rng}",
                          f"{e['exposed_us']:.0f}" if e["exposed_us"] is not None else "—"])
    md.append(md_table(["model", "batch/rank", "framework, communicator", "1 rank img/s", "N ranks img/s",
                        "efficiency (range)", "exposed comm µs/step"], table, ["l", "r", "l", "r", "r", "r", "r"]))
    text: list[str] = []
    for model, entries in summary.items():
        by = {e["label"]: e for e in entries}
        tess = [e for e in entries if e["framework"] == "tessera"]
        torch = by.get("PyTorch DDP (Gloo)")
        if not tess:
            continue
        best = max(tess, key=lambda e: e["efficiency"])
        scales = ", ".join(f"{e['efficiency']:.2f} ({e['comm']})" for e in tess)
        t = f"{MODEL_NAMES.get(model, model)}: Tessera scales at {scales}, best on {best['comm']}"
        gloo = by.get("Tessera GlooComm")
        if torch and gloo:
            t += (f"; over the same transport (Gloo) Tessera's {gloo['efficiency']:.2f} against PyTorch DDP's "
                  f"{torch['efficiency']:.2f}, and {gloo['multi'] / torch['multi']:.2f}x its 2-rank throughput "
                  f"({fmt_num(gloo['multi'])} against {fmt_num(torch['multi'])} img/s)")
        text.append(t + ".")
    md.append(" ".join(text) + "\n")
    if data.get("retries"):
        md.append(f"{len(data['retries'])} run(s) hung or failed and were repeated by `bench/dp_scaling.py` (a hung run "
                  "costs its 60 s timeout; the repeat is what is measured):\n\n```\n" + "\n".join(data["retries"]) +
                  "\n```\n")
    plt = pyplot()
    if not plt:
        md.append(PLOTS_SKIPPED)
        return "\n".join(md)
    models = list(summary)
    labels = list(LABELS_DP.values())
    colours = ["#2ca02c", "#1f77b4", "#ff7f0e", "#d62728"]
    fig, ax = plt.subplots(figsize=(max(8.5, 3.5 * len(models) + 3), 4.6))
    width = 0.8 / len(labels)
    for li, label in enumerate(labels):
        xs: list[float] = []
        ys: list[float] = []
        err: list[list[float]] = [[], []]
        for mi, model in enumerate(models):
            match = next((x for x in summary[model] if x["label"] == label), None)
            if not match:
                continue
            e = match
            xs.append(mi + (li - (len(labels) - 1) / 2) * width)
            ys.append(e["efficiency"])
            lo_hi = errorbar_from(e["efficiency"], min(e["per_round"] or [e["efficiency"]]),
                                  max(e["per_round"] or [e["efficiency"]]))
            err[0].append(lo_hi[0])
            err[1].append(lo_hi[1])
        if xs:
            bars = ax.bar(xs, ys, width, yerr=err, capsize=3, color=colours[li], label=label)
            ax.bar_label(bars, fmt="%.2f", padding=2, fontsize="x-small")
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="linear scaling (1.0)")
    ax.axhline(0.9, color="grey", linestyle=":", linewidth=1, label="target 0.9 (bench/dp_scaling.py)")
    ax.set_xticks(range(len(models)), [f"{MODEL_NAMES.get(m, m)}" for m in models])
    ax.set_ylim(0, 1.15)
    ax.set_ylabel("scaling efficiency, 2 ranks vs 1 (fraction of linear)")
    n = max(e["ranks"] for entries in summary.values() for e in entries)
    ax.set_title(f"Data-parallel scaling on {n} ranks: Tessera vs PyTorch DDP\n(median; whiskers: range over rounds)")
    if len(models) == 1:
        ax.set_xlim(-0.9, 0.9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save(fig, os.path.join(plots, "dp_scaling.png"))
    md.append("![Data-parallel scaling efficiency](plots/dp_scaling.png)\n")
    return "\n".join(md)
