"""Section collectives: bus bandwidth per message size of ThreadComm, MpiComm and GlooComm
(bench/collectives.py, repeated), each binary timing Tessera's call and the raw library call in
alternating rounds; ThreadComm against the STREAM triad measured in the same run."""
from __future__ import annotations

import os
import shutil
import statistics
from typing import Any

from tessera_tools.report.context import Context
from tessera_tools.report.formatting import JsonDict, fmt_bytes, geomean, md_table, read_jsonl, repeats_phrase
from tessera_tools.report.plotting import PLOTS_SKIPPED, errorbar_from, pyplot, save

# (comm, op, ranks, bytes)
Key = tuple[str, str, int, int]


def run_collectives(ctx: Context, data: JsonDict) -> None:
    s = ctx.settings
    ctx.binary("bench/collectives_threads")
    only = ["threads"]
    skipped: dict[str, str] = {}
    for comm in ("mpi", "gloo"):
        if not ctx.has_binary(f"bench/collectives_{comm}"):
            skipped[comm] = f"not built: `ninja -C {ctx.build} bench/collectives_{comm}`"
        elif comm == "mpi" and not shutil.which("mpirun"):
            skipped[comm] = "mpirun not on PATH (`apt-get install openmpi-bin`)"
        else:
            only.append(comm)
    data["skipped"] = skipped
    data["settings"] = {k: getattr(s, k) for k in ("coll_ranks", "coll_max_bytes", "coll_rounds", "coll_round_seconds",
                                          "coll_ops", "coll_repeats")}
    data["repeats"] = []
    for r in range(s.coll_repeats):
        path = os.path.join(ctx.raw, f"collectives_{r}.jsonl")
        ctx.run(ctx.bench_script("collectives.py") + [
            "--build", ctx.build, "--ranks", s.coll_ranks, "--max-bytes", str(s.coll_max_bytes),
            "--rounds", str(s.coll_rounds), "--round-seconds", str(s.coll_round_seconds),
            "--ops", s.coll_ops, "--only", ",".join(only), "--out", path])
        data["repeats"].append(read_jsonl(path))


def collectives_table(data: JsonDict) -> dict[Key, dict[str, Any]]:
    """{(comm, op, ranks, bytes): {"tessera": [busbw per repeat], "raw": [...], "raw_impl": name,
    "tessera_us": [...], "raw_us": [...]}}; the raw side of a size is its fastest raw call in that
    repeat (Gloo's all_reduce has two: ring and bcube)."""
    table: dict[Key, dict[str, Any]] = {}
    for rows in data.get("repeats", []):
        groups: dict[Key, list[JsonDict]] = {}
        for row in rows:
            if row.get("bench") != "collectives":
                continue
            key = (row["comm"], row["op"], row["ranks"], row["bytes"])
            groups.setdefault(key, []).append(row)
        for key, group in groups.items():
            entry = table.setdefault(key, {"tessera": [], "raw": [], "tessera_us": [], "raw_us": [], "raw_impl": set()})
            for row in group:
                if row["impl"] == "tessera":
                    entry["tessera"].append(row["busbw_GBps"])
                    entry["tessera_us"].append(row["time_us"])
            raws = [row for row in group if row["impl"].startswith("raw")]
            if raws:
                best = min(raws, key=lambda row: row["time_us"])
                entry["raw"].append(best["busbw_GBps"])
                entry["raw_us"].append(best["time_us"])
                entry["raw_impl"].add(best["impl"].removeprefix("raw "))
    return table


def triad(data: JsonDict) -> list[float]:
    """The lower 2-thread STREAM triad reading of each repeat (before/after the ThreadComm runs)."""
    values = []
    for rows in data.get("repeats", []):
        readings = [row["GBps"] for row in rows if row.get("bench") == "stream_triad" and row.get("threads") == 2]
        if readings:
            values.append(min(readings))
    return values


def render_collectives(data: JsonDict, plots: str) -> str:
    table = collectives_table(data)
    md = ["Bus bandwidth of `all_reduce`, `all_gather`, `reduce_scatter` and `broadcast` of float32 buffers "
          "(nccl-tests' busbw: algbw x 2(n-1)/n for all_reduce, x (n-1)/n for all_gather and reduce_scatter), run by "
          "`bench/collectives.py`. Each binary times Tessera's call and the raw library call (`MPI_*`, `gloo::*`) on "
          "the same buffers in alternating rounds; ThreadComm has no library underneath and is compared with the "
          f"STREAM triad of the same run. The whole benchmark ran "
          f"{repeats_phrase(len(data.get('repeats', [])), 'time').replace('1 time', 'once')}\n"]
    for comm, why in data.get("skipped", {}).items():
        md.append(f"- {comm}: skipped, {why}.\n")
    if not table:
        return "\n".join(md)
    sizes = sorted({k[3] for k in table})
    shown = [b for b in sizes if b >= 64 << 10] or sizes  # below 64 KiB latency dominates: in the JSON and plot
    rows: list[list[object]] = []
    comm_order = {"threads": 0, "mpi": 1, "gloo": 2}
    op_order = {"all_reduce": 0, "all_gather": 1, "reduce_scatter": 2, "broadcast": 3}
    for comm, op, ranks in sorted({k[:3] for k in table}, key=lambda k: (op_order.get(k[1], 9), comm_order.get(k[0], 9), k[2])):
        cells = []
        for b in shown:
            e = table.get((comm, op, ranks, b))
            if not e or not e["tessera"]:
                cells.append("")
            elif e["raw"]:
                cells.append(f"{statistics.median(e['tessera']):.2f} / {statistics.median(e['raw']):.2f}")
            else:
                cells.append(f"{statistics.median(e['tessera']):.2f}")
        raw_impls: set[str] = set().union(*(table[k]["raw_impl"] for k in table if k[:3] == (comm, op, ranks)))
        raw_name = ("fastest of " + ", ".join(sorted(raw_impls))) if len(raw_impls) > 1 else "".join(raw_impls)
        rows.append([op, comm, ranks, raw_name or "— (STREAM triad)"] + cells)
    md.append("busbw in GB/s, **Tessera / raw library** (one number: ThreadComm, no library):\n")
    md.append(md_table(["op", "comm", "ranks", "raw call"] + [fmt_bytes(b) for b in shown], rows,
                       ["l", "l", "r", "l"] + ["r"] * len(shown)))
    # Tessera's time over the raw call's, per backend: the overhead of going through Tessera.
    text = []
    for comm in ("mpi", "gloo"):
        ratios = [(statistics.median(e["tessera_us"]) / statistics.median(e["raw_us"]), k)
                  for k, e in table.items() if k[0] == comm and e["raw_us"] and e["tessera_us"]]
        if not ratios:
            continue
        big = [r for r in ratios if r[1][3] >= 1 << 20]
        worst = max(big or ratios)
        text.append(f"{'MpiComm' if comm == 'mpi' else 'GlooComm'}'s time over the raw library's is "
                    f"{geomean([r for r, _ in ratios]):.2f} (geometric mean over {len(ratios)} op/size/rank points; "
                    f"below 1: Tessera faster); its worst point"
                    f"{' at 1 MiB or more' if big else ''} is {worst[0]:.2f}x ({worst[1][1]}, {worst[1][2]} ranks, "
                    f"{fmt_bytes(worst[1][3])}).")
    tri = triad(data)
    threads = [(statistics.median(e["tessera"]), k) for k, e in table.items()
               if k[0] == "threads" and k[1] == "all_reduce" and k[2] == 2 and e["tessera"]]
    if tri and threads:
        peak, k = max(threads)
        t = statistics.median(tri)
        text.append(f"ThreadComm's 2-rank all_reduce peaks at {peak:.1f} GB/s busbw ({fmt_bytes(k[3])}), "
                    f"{peak / t:.2f} of the 2-thread STREAM triad ({t:.1f} GB/s).")
    if text:
        md.append(" ".join(text) + "\n")
    plt = pyplot()
    if not plt:
        md.append(PLOTS_SKIPPED)
        return "\n".join(md)
    ops = [op for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast") if any(k[1] == op for k in table)]
    rank_counts = sorted({k[2] for k in table})
    fig, axes = plt.subplots(len(rank_counts), len(ops), figsize=(max(7.0, 4.4 * len(ops)), 3.8 * len(rank_counts)), squeeze=False)
    sizes_all = sorted({k[3] for k in table})
    colours = {"threads": "#2ca02c", "mpi": "#1f77b4", "gloo": "#ff7f0e"}
    names = {"threads": "ThreadComm", "mpi": "MpiComm", "gloo": "GlooComm"}
    for ri, n in enumerate(rank_counts):
        for oi, op in enumerate(ops):
            ax = axes[ri][oi]
            for comm in ("threads", "mpi", "gloo"):
                keys = sorted(k for k in table if k[0] == comm and k[1] == op and k[2] == n)
                for side, style, label in (("tessera", "-", f"Tessera {names[comm]}"),
                                           ("raw", "--", f"raw {'MPI' if comm == 'mpi' else 'Gloo'}")):
                    pts = [(k[3], table[k][side]) for k in keys if table[k][side]]
                    if not pts:
                        continue
                    xs = [p[0] for p in pts]
                    ys = [statistics.median(p[1]) for p in pts]
                    err = list(zip(*[errorbar_from(statistics.median(v), min(v), max(v)) for _, v in pts]))
                    ax.errorbar(xs, ys, yerr=err if len(data["repeats"]) > 1 else None, color=colours[comm],
                                linestyle=style, marker="o" if side == "tessera" else "x", markersize=4, capsize=2,
                                label=label)
            if op == "all_reduce" and tri and n == 2:
                ax.axhline(statistics.median(tri), color="grey", linestyle=":", label="STREAM triad, 2 threads")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")  # GlooComm over TCP and ThreadComm in memory are 100x apart
            # Ticks at the measured sizes only (every 4x; all powers of 2 crowd the axis).
            ticks = sizes_all if len(sizes_all) <= 6 else sizes_all[::2]
            ax.set_xticks(ticks, [fmt_bytes(b).replace(" ", "") for b in ticks], fontsize="small")
            ax.minorticks_off()
            ax.set_xlabel("message size (bytes, log2)")
            ax.set_ylabel("bus bandwidth (GB/s, log)")
            ax.set_title(f"{op}, {n} ranks")
    # One legend for all panels, below them: the same lines appear in each.
    legend: dict[str, Any] = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=min(len(legend), 6))
    whiskers = "; whiskers: range over repeats" if len(data["repeats"]) > 1 else ""
    fig.suptitle(f"Collectives: Tessera (solid) against the raw library (dashed), median{whiskers}")
    save(fig, os.path.join(plots, "collectives.png"), rect=(0, 0.07 if len(rank_counts) < 2 else 0.05, 1, 1))
    md.append("![Collectives bandwidth per size and backend](plots/collectives.png)\n")
    return "\n".join(md)
