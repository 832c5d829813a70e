"""Section overlap: examples/04_data_parallel --trace; per gradient bucket, how much of its
all-reduce ran hidden behind backward and how long the rank waited for it afterwards."""
from __future__ import annotations

import json
import os
import re
import statistics
import sys
from collections.abc import Sequence

from tessera_tools.report.context import ROOT, Context, SectionError
from tessera_tools.report.formatting import JsonDict, md_table, quantile
from tessera_tools.report.plotting import PLOTS_SKIPPED, pyplot, save

TESSERA_RUN = os.path.join(ROOT, "tools", "tessera-run")


def fashion_mnist_dir() -> str:
    for var in ("TESSERA_DATA_DIR", "FASHION_MNIST_DIR"):
        if os.environ.get(var):
            return os.environ[var]
    return "/usr/share/datasets/fashion-mnist"


def run_overlap(ctx: Context, data: JsonDict) -> None:
    s = ctx.settings
    data_dir = fashion_mnist_dir()
    if not os.path.exists(os.path.join(data_dir, "train-images-idx3-ubyte.gz")) and \
            not os.path.exists(os.path.join(data_dir, "train-images-idx3-ubyte")):
        raise SectionError(f"Fashion-MNIST is not in {data_dir}: `apt-get install dataset-fashion-mnist` "
                           "or set TESSERA_DATA_DIR")
    data["runs"] = []
    for comm in s.overlap_comms:
        binary = ctx.binary(f"examples/04_data_parallel_{comm}")
        for kib in s.overlap_buckets:
            trace = os.path.join(ctx.raw, f"timeline_04_{comm}_{kib}KiB.json")
            flags = ["--epochs=1", f"--limit={s.overlap_limit}", f"--bucket-kib={kib}", f"--trace={trace}",
                     "--threads=1"]
            if comm == "threads":
                argv = [binary, "--ranks=2"] + flags
            elif comm == "mpi":
                argv = [ctx.mpirun(), "--oversubscribe", "-n", "2", binary] + flags
            else:
                argv = [sys.executable, TESSERA_RUN, "--no-prefix", "-n", "2", binary] + flags
            stdout = ctx.run(argv)
            m = re.search(r"(\d+)% hidden behind backward", stdout)
            with open(trace) as f:
                events = json.load(f)["traceEvents"]
            data["runs"].append({"comm": comm, "bucket_kib": kib, "trace": os.path.relpath(trace, ctx.out),
                                 "example_hidden_percent": int(m.group(1)) if m else None,
                                 "analysis": analyse_trace(events)})


def analyse_trace(events: Sequence[JsonDict], skip_steps: int = 1) -> JsonDict:
    """Per rank and step, from a Timeline trace of 04_data_parallel: the compute spans (forward,
    backward, gradient sync wait, optimizer step) and each bucket's all-reduce span. A bucket's
    exposed time is the part of the rank's wait after backward spent on it: the wait, from its start
    to the last bucket's completion, is cut at the buckets' completion times and each piece goes to
    the bucket completing at its end (so the pieces add up to the wait, with no double counting of
    buckets queued behind each other). Hidden = the span's duration - its exposed part. The first
    `skip_steps` steps (allocations, connection set-up) are left out."""
    spans = [e for e in events if e.get("ph") == "X"]
    steps: list[JsonDict] = []
    for rank in sorted({e["pid"] for e in spans}):
        mine = sorted((e for e in spans if e["pid"] == rank), key=lambda e: e["ts"])
        compute = [e for e in mine if e["tid"] == 0]
        comm = [e for e in mine if e["tid"] == 1]
        forwards = [e for e in compute if e["name"] == "forward"]
        for i, fwd in enumerate(forwards):
            end = forwards[i + 1]["ts"] if i + 1 < len(forwards) else float("inf")
            phases = {e["name"]: e for e in compute if fwd["ts"] <= e["ts"] < end}
            wait = phases.get("gradient sync wait")
            if wait is None or "backward" not in phases:
                continue
            # A bucket belongs to the step in which it was launched: during its backward, or (a last
            # bucket reduced on the calling thread) at the start of its wait.
            buckets = [e for e in comm if fwd["ts"] <= e["ts"] < end]
            wait_start = wait["ts"]
            exposed: dict[str, float] = {}
            cursor = wait_start
            for b in sorted(buckets, key=lambda b: b["ts"] + b["dur"]):
                done = b["ts"] + b["dur"]
                exposed[b["name"]] = max(0.0, done - cursor)
                cursor = max(cursor, done)
            steps.append({"rank": rank, "step": i, "start": fwd["ts"],
                          "phases": {k: [v["ts"], v["dur"]] for k, v in phases.items()},
                          "buckets": [{"name": b["name"], "ts": b["ts"], "dur": b["dur"], "exposed": exposed[b["name"]],
                                       "hidden": b["dur"] - exposed[b["name"]]} for b in buckets],
                          "step_us": max(v["ts"] + v["dur"] for v in phases.values()) - fwd["ts"],
                          "wait_us": max(0.0, cursor - wait_start)})
    steps = [s for s in steps if s["step"] >= skip_steps]
    per_bucket: dict[str, dict[str, list[float]]] = {}
    for s in steps:
        for b in s["buckets"]:
            per_bucket.setdefault(b["name"], {"dur": [], "hidden": [], "exposed": []})
            for k in ("dur", "hidden", "exposed"):
                per_bucket[b["name"]][k].append(b[k])

    def order(name: str) -> int:
        m = re.search(r"bucket (\d+)", name)
        return int(m.group(1)) if m else 0

    buckets = []
    for name in sorted(per_bucket, key=order):
        v = per_bucket[name]
        buckets.append({"name": name, **{f"{k}_mean_us": statistics.mean(v[k]) for k in v},
                        **{f"{k}_p25_us": quantile(v[k], 0.25) for k in ("hidden", "exposed")},
                        **{f"{k}_p75_us": quantile(v[k], 0.75) for k in ("hidden", "exposed")}})
    total = sum(sum(v["dur"]) for v in per_bucket.values())
    hidden = sum(sum(v["hidden"]) for v in per_bucket.values())
    step_times = [s["step_us"] for s in steps]
    median_step = None
    if steps:  # a representative step for the timeline figure: rank 0's of median length
        rank0 = [s for s in steps if s["rank"] == min(x["rank"] for x in steps)]
        target = statistics.median([s["step_us"] for s in rank0])
        i = min(rank0, key=lambda s: abs(s["step_us"] - target))["step"]
        median_step = [s for s in steps if s["step"] == i]
    starts: dict[int, list[float]] = {}
    for s in steps:
        starts.setdefault(s["step"], []).append(s["start"])
    skews = [max(v) - min(v) for v in starts.values() if len(v) > 1]
    return {"steps": len({s["step"] for s in steps}), "ranks": len({s["rank"] for s in steps}), "buckets": buckets,
            "rank_skew_us_median": statistics.median(skews) if skews else None,
            "hidden_fraction": hidden / total if total else None, "comm_us_per_step": total / len(steps) if steps else None,
            "wait_us_median": statistics.median(s["wait_us"] for s in steps) if steps else None,
            "step_us_median": statistics.median(step_times) if steps else None,
            "phase_us_median": {k: statistics.median(s["phases"][k][1] for s in steps if k in s["phases"])
                                for k in ("forward", "backward", "gradient sync wait", "optimizer step")
                                if any(k in s["phases"] for s in steps)},
            "example_step": median_step}


def short_bucket(name: str) -> str:
    """'all_reduce bucket 2 (60 KiB)' -> 'bucket 2'."""
    m = re.search(r"bucket (\d+)", name)
    return f"bucket {m.group(1)}" if m else name


def render_overlap(data: JsonDict, plots: str) -> str:
    runs = data.get("runs", [])
    if not runs:
        return ""
    for r in runs:  # re-analysed from the trace where it is there (--render-only after a change here)
        path = os.path.join(os.path.dirname(plots), r["trace"])
        if os.path.exists(path):
            with open(path) as f:
                r["analysis"] = analyse_trace(json.load(f)["traceEvents"])
    md = ["Communication/computation overlap in `examples/04_data_parallel` (LeNet-5, Fashion-MNIST, 2 ranks, "
          "1 thread each, global batch 64), from its `--trace` timeline: each gradient bucket's all-reduce is a span "
          "from launch (when its last gradient was ready in backward) to the moment the rank saw it complete (at a "
          "later gradient hook or in `finish()`). *Exposed* is the part of the "
          "rank's wait after backward spent on that bucket, *hidden* the rest of the span, which ran while backward "
          "still computed (it includes waiting for the other rank to reach the same bucket). Means over steps and "
          "ranks after the first step; whiskers the interquartile range over steps.\n"]
    table = []
    for r in runs:
        a = r["analysis"]
        for b in a["buckets"]:
            table.append([r["comm"], f"{r['bucket_kib']} KiB", b["name"], f"{b['dur_mean_us']:.0f}",
                          f"{b['hidden_mean_us']:.0f}", f"{b['exposed_mean_us']:.0f}",
                          f"{100 * b['hidden_mean_us'] / b['dur_mean_us']:.0f}%" if b["dur_mean_us"] else ""])
    md.append(md_table(["comm", "--bucket-kib", "bucket", "all-reduce µs", "hidden µs", "exposed µs", "hidden"], table,
                       ["l", "l", "l", "r", "r", "r", "r"]))
    summary = []
    for r in runs:
        a = r["analysis"]
        ph = a["phase_us_median"]
        summary.append([r["comm"], f"{r['bucket_kib']} KiB", len(a["buckets"]), a["steps"],
                        f"{a['step_us_median'] / 1000:.2f}", f"{ph.get('backward', 0) / 1000:.2f}",
                        f"{a['wait_us_median']:.0f}",
                        f"**{100 * a['hidden_fraction']:.0f}%**" if a["hidden_fraction"] is not None else "",
                        f"{r['example_hidden_percent']}%" if r["example_hidden_percent"] is not None else "",
                        f"{a['rank_skew_us_median']:.0f}" if a.get("rank_skew_us_median") is not None else "",
                        f"[trace]({r['trace']})"])
    md.append(md_table(["comm", "--bucket-kib", "buckets", "steps", "step ms (median)", "backward ms",
                        "wait after backward µs (median)", "all-reduce time hidden", "example's own figure (rank 0)",
                        "ranks' step starts apart µs (median)", "timeline"], summary,
                       ["l", "l"] + ["r"] * 8 + ["l"]))
    text: list[str] = []
    for r in runs:
        a = r["analysis"]
        if a["hidden_fraction"] is None:
            continue
        text.append(f"{r['comm']}, {r['bucket_kib']} KiB buckets ({len(a['buckets'])} bucket(s)): "
                    f"{100 * a['hidden_fraction']:.0f}% of the all-reduce time is hidden behind backward; the rank "
                    f"waits a median {a['wait_us_median']:.0f} µs after backward, "
                    f"{100 * a['wait_us_median'] / a['step_us_median']:.1f}% of a {a['step_us_median'] / 1000:.2f} ms step")
        skew = a.get("rank_skew_us_median")
        if skew is not None:
            # The spans and the wait include the other rank arriving late (ranks out of step: cores
            # shared with other work), which no overlap can hide; the skew shows how far apart they run.
            text[-1] += f"; the ranks start their steps a median {skew:.0f} µs apart"
        text[-1] += "."
    md.append(" ".join(text) + "\n")
    plt = pyplot()
    if not plt:
        md.append(PLOTS_SKIPPED)
        return "\n".join(md)
    # Timeline of one representative step of the first run with several buckets.
    shown = next((r for r in runs if len(r["analysis"]["buckets"]) > 1), runs[0])
    step = shown["analysis"]["example_step"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5.2), gridspec_kw={"width_ratios": [3, 2]})
    if step:
        colours = {"forward": "#9ecae1", "backward": "#3182bd", "gradient sync wait": "#d62728",
                   "optimizer step": "#a1d99b"}
        bucket_colours = ["#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf", "#7f7f7f"]
        t0 = min(s["start"] for s in step)
        lanes: list[str] = []
        seen: set[str] = set()
        for s in sorted(step, key=lambda s: s["rank"]):
            y_compute, y_comm = len(lanes), len(lanes) + 1
            lanes += [f"rank {s['rank']} compute", f"rank {s['rank']} all-reduce"]
            for name, (ts, dur) in s["phases"].items():
                ax1.barh(y_compute, dur / 1000, left=(ts - t0) / 1000, color=colours.get(name, "grey"),
                         edgecolor="white", label=None if name in seen else name)
                seen.add(name)
            nb = max(1, len(s["buckets"]))
            for bi, b in enumerate(s["buckets"]):
                # Each bucket on its own sub-row of the lane: queued buckets overlap in time.
                label = re.sub(r"all_reduce ", "all-reduce ", b["name"])
                ax1.barh(y_comm - 0.4 + (bi + 0.5) * 0.8 / nb, b["dur"] / 1000, left=(b["ts"] - t0) / 1000,
                         height=0.8 / nb,
                         color=bucket_colours[bi % len(bucket_colours)], edgecolor="black", linewidth=0.4,
                         label=None if label in seen else label)
                seen.add(label)
        ax1.set_yticks(range(len(lanes)), lanes)
        ax1.invert_yaxis()
        ax1.set_xlabel("time since the first rank's forward of this step began (ms)")
        ax1.set_title(f"One step of median length, {shown['comm']}, --bucket-kib={shown['bucket_kib']}")
        ax1.legend(fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4)
    groups = [(r, b) for r in runs for b in r["analysis"]["buckets"]]
    xs = range(len(groups))
    for side, colour, off in (("hidden", "#31a354", -0.2), ("exposed", "#d62728", 0.2)):
        ys = [b[f"{side}_mean_us"] for _, b in groups]
        err = [[max(0.0, y - b[f"{side}_p25_us"]) for y, (_, b) in zip(ys, groups)],
               [max(0.0, b[f"{side}_p75_us"] - y) for y, (_, b) in zip(ys, groups)]]
        ax2.bar([x + off for x in xs], ys, 0.4, yerr=err, capsize=3, color=colour,
                label=f"{side} ({'ran during backward' if side == 'hidden' else 'waited for after backward'})")
    ax2.set_xticks(list(xs), [f"{r['comm']} {r['bucket_kib']} KiB\n{short_bucket(b['name'])}" for r, b in groups],
                   fontsize="x-small")
    ax2.set_xlabel("communicator, --bucket-kib, bucket (in launch order)")
    ax2.set_ylabel("all-reduce time per step (µs, mean)")
    ax2.set_title("Hidden vs exposed all-reduce time per bucket\n(mean over steps; whiskers: interquartile range)")
    ax2.legend(fontsize="x-small")
    save(fig, os.path.join(plots, "overlap.png"))
    md.append("![Communication/computation overlap](plots/overlap.png)\n")
    return "\n".join(md)
