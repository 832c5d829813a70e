"""Section training: images/s of training steps, Tessera (build/bench/train_throughput) against
PyTorch at its best (bench/compare_pytorch.py per thread count, bench/peer.py)."""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence

from tessera_tools.report.context import MODEL_NAMES, TRAIN_BATCH, Context
from tessera_tools.report.formatting import JsonDict, fmt_num, geomean, md_table
from tessera_tools.report.plotting import PLOTS_SKIPPED, errorbar_from, pyplot, save


def run_training(ctx: Context, data: JsonDict) -> None:
    s = ctx.settings
    binary = ctx.binary("bench/train_throughput")
    ctx.require_torch()
    data["models"] = s.train_models.split(",")
    data["runs"] = s.train_runs
    data["by_threads"] = {}
    for threads in s.train_threads:
        argv = ctx.bench_script("compare_pytorch.py") + ["--tessera", binary, "--models", s.train_models,
                                                         "--threads", str(threads), "--runs", str(s.train_runs)]
        if s.coretypes:
            argv += ["--coretypes", s.coretypes]
        data["by_threads"][str(threads)] = json.loads(ctx.run(argv))


def training_rows(data: JsonDict) -> list[JsonDict]:
    """One row per (model, threads): medians, run ranges and the paired ratios."""
    rows = []
    for threads, report in sorted(data.get("by_threads", {}).items(), key=lambda kv: int(kv[0])):
        for e in report["models"]:
            paired = [t / p for t, p in zip(e["tessera_runs"], e["pytorch_runs"])]
            rows.append({"model": e["model"], "threads": int(threads), "batch": TRAIN_BATCH.get(e["model"]),
                         "tessera": e["tessera_images_per_second"], "pytorch": e["pytorch_images_per_second"],
                         "tessera_runs": e["tessera_runs"], "pytorch_runs": e["pytorch_runs"], "ratio": e["ratio"],
                         "paired": paired, "tessera_config": e.get("tessera_config", {}),
                         "pytorch_config": e.get("pytorch_config", {})})
    return rows


def render_training(data: JsonDict, plots: str) -> str:
    rows = training_rows(data)
    if not rows:
        return ""
    md = ["Images per second of full training steps (forward, loss, backward, SGD step) on synthetic data: "
          "`build/bench/train_throughput` against the same models in PyTorch (`bench/torch_throughput.py`), "
          "run by `bench/compare_pytorch.py` in alternating runs. Each side is probed for its fastest setup first "
          "(PyTorch: malloc, OpenMP wait policy and OpenBLAS core type; Tessera: OpenBLAS core type; "
          "`bench/peer.py`). Medians of the runs; ranges are the lowest and highest run; the ratio is of the "
          "medians, its range the lowest and highest ratio of a Tessera run to the PyTorch run next to it.\n"]
    def spread(v: Sequence[float], f: Callable[[float], str] = fmt_num) -> str:
        return f" ({f(min(v))}–{f(max(v))})" if len(v) > 1 else ""

    table = []
    for r in rows:
        table.append([MODEL_NAMES.get(r["model"], r["model"]), r["batch"] or "?", r["threads"],
                      fmt_num(r["tessera"]) + spread(r["tessera_runs"]), fmt_num(r["pytorch"]) + spread(r["pytorch_runs"]),
                      f"**{r['ratio']:.2f}**" + spread(r["paired"], lambda x: f"{x:.2f}")])
    md.append(md_table(["model", "batch", "threads", "Tessera img/s (range)", "PyTorch img/s (range)",
                        "Tessera / PyTorch (range)"], table))
    # What the numbers say, from the numbers.
    best = max(rows, key=lambda r: r["ratio"])
    worst = min(rows, key=lambda r: r["ratio"])
    faster = sum(r["ratio"] > 1 for r in rows)
    def where(r: JsonDict) -> str:
        return f"{MODEL_NAMES.get(r['model'], r['model'])}, {r['threads']} thread{'s' if r['threads'] > 1 else ''}"

    if len(rows) == 1:
        text = (f"Tessera runs at {rows[0]['ratio']:.2f}x PyTorch's throughput ({where(rows[0])}).")
    else:
        text = (f"Tessera is faster than PyTorch in {faster} of {len(rows)} configurations; the ratio runs from "
                f"{worst['ratio']:.2f} ({where(worst)}) to {best['ratio']:.2f} ({where(best)}), "
                f"geometric mean {geomean([r['ratio'] for r in rows]):.2f}.")
    by = {(r["model"], r["threads"]): r for r in rows}
    threads = sorted({r["threads"] for r in rows})
    if len(threads) > 1:
        lo, hi = threads[0], threads[-1]
        ours = [by[(m, hi)]["tessera"] / by[(m, lo)]["tessera"] for m, t in by if t == lo and (m, hi) in by]
        theirs = [by[(m, hi)]["pytorch"] / by[(m, lo)]["pytorch"] for m, t in by if t == lo and (m, hi) in by]
        if ours:
            text += (f" From {lo} to {hi} threads Tessera's throughput grows {geomean(ours):.2f}x and PyTorch's "
                     f"{geomean(theirs):.2f}x (geometric means over the models).")
    spreads = [max(v) / min(v) for r in rows for v in (r["tessera_runs"], r["pytorch_runs"]) if len(v) > 1 and min(v) > 0]
    if spreads:
        widest = max(spreads)
        text += f" The widest spread between runs of one configuration is {100 * (widest - 1):.0f}%."
    md.append(text + "\n")
    configs = []
    for r in rows:
        tc, pc = r["tessera_config"], r["pytorch_config"]
        proc = pc.get("process") or {}
        configs.append([MODEL_NAMES.get(r["model"], r["model"]), r["threads"],
                        f"OPENBLAS_CORETYPE={tc.get('OPENBLAS_CORETYPE', '?')} ({tc.get('gemm', '?')})",
                        f"malloc={pc.get('malloc', '?')}, OMP_WAIT_POLICY={pc.get('OMP_WAIT_POLICY', '?')}, "
                        f"OPENBLAS_CORETYPE={pc.get('OPENBLAS_CORETYPE', '?')}, torch {proc.get('torch_version', '?')}"])
    md.append("<details><summary>Configurations chosen by the probes</summary>\n\n" +
              md_table(["model", "threads", "Tessera", "PyTorch"], configs, ["l", "r", "l", "l"]) + "\n</details>\n")
    plt = pyplot()
    if not plt:
        md.append(PLOTS_SKIPPED)
        return "\n".join(md)
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    width = 0.8 / (2 * len(threads))
    colours = {"tessera": ["#1f77b4", "#6baed6"], "pytorch": ["#d62728", "#fc9272"]}
    for ti, t in enumerate(threads):
        for si, side in enumerate(("tessera", "pytorch")):
            xs: list[float] = []
            ys: list[float] = []
            err: list[list[float]] = [[], []]
            for mi, m in enumerate(models):
                if (m, t) not in by:
                    continue
                r = by[(m, t)]
                runs = r[f"{side}_runs"]
                xs.append(mi + (2 * ti + si - (2 * len(threads) - 1) / 2) * width)
                ys.append(r[side])
                lo_hi = errorbar_from(r[side], min(runs), max(runs))
                err[0].append(lo_hi[0])
                err[1].append(lo_hi[1])
            ax1.bar(xs, ys, width, yerr=err, capsize=3, color=colours[side][ti % 2],
                    label=f"{'Tessera' if side == 'tessera' else 'PyTorch'}, {t} thread{'s' if t > 1 else ''}")
    ax1.set_yscale("log")
    # Bars on a log axis start at its bottom: put that at a power of ten below the smallest bar, so
    # bar lengths are not cut to the data's range.
    low = min(min(r["tessera_runs"] + r["pytorch_runs"]) for r in rows)
    ax1.set_ylim(bottom=10 ** math.floor(math.log10(low * 0.5)))
    thousands = plt.FuncFormatter(lambda v, _: f"{v:,.0f}")
    ax1.yaxis.set_major_formatter(thousands)
    high = max(max(r["tessera_runs"] + r["pytorch_runs"]) for r in rows)
    # Within about a decade the only major tick may be the bottom one: label the minor ticks too.
    ax1.yaxis.set_minor_formatter(thousands if high / low < 20 else plt.NullFormatter())
    ax1.set_xticks(range(len(models)), [f"{MODEL_NAMES.get(m, m)}\nbatch {TRAIN_BATCH.get(m, '?')}" for m in models])
    ax1.set_ylabel("training throughput (images/s, log scale)")
    ax1.set_title("Training throughput (median; whiskers: slowest and fastest run)")
    ax1.legend()
    width2 = 0.8 / len(threads)
    for ti, t in enumerate(threads):
        xs = []
        ys = []
        err = [[], []]
        for mi, m in enumerate(models):
            if (m, t) not in by:
                continue
            r = by[(m, t)]
            xs.append(mi + (ti - (len(threads) - 1) / 2) * width2)
            ys.append(r["ratio"])
            lo_hi = errorbar_from(r["ratio"], min(r["paired"]), max(r["paired"]))
            err[0].append(lo_hi[0])
            err[1].append(lo_hi[1])
        bars = ax2.bar(xs, ys, width2, yerr=err, capsize=3, color=colours["tessera"][ti % 2],
                       label=f"{t} thread{'s' if t > 1 else ''}")
        ax2.bar_label(bars, fmt="%.2f", padding=2, fontsize="x-small")
    ax2.axhline(1.0, color="black", linestyle="--", linewidth=1, label="parity (1.0)")
    ax2.set_xticks(range(len(models)), [MODEL_NAMES.get(m, m) for m in models])
    if len(models) < 3:  # keep one or two models' bars from filling the whole width
        for ax in (ax1, ax2):
            ax.set_xlim(-1.2, len(models) + 0.2)
    ax2.set_ylabel("Tessera / PyTorch throughput (ratio of medians)")
    ax2.set_title("Speed-up over PyTorch (whiskers: lowest and highest paired-run ratio)")
    ax2.legend(loc="lower right")
    save(fig, os.path.join(plots, "training.png"))
    md.append("![Training throughput against PyTorch](plots/training.png)\n")
    return "\n".join(md)
