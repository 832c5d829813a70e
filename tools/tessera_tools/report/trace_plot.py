"""tessera-report plot-trace: a Chrome trace written by a Tessera Timeline (the examples' --trace)
drawn as a PNG timeline: one row per rank and lane, every span a box."""
from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

from tessera_tools.report.formatting import JsonDict
from tessera_tools.report.plotting import pyplot, save

MICRO_BATCH = r"[FBIW]\d+( \(stage \d+\))?"
TRACE_COLOURS: tuple[tuple[Callable[[JsonDict], Any], str, str], ...] = (  # (predicate on a span, colour, legend label): the first match colours it
    # A pipeline's actions, "F3" or, where a rank runs several stages, "F3 (stage 1)".
    (lambda e: re.fullmatch(MICRO_BATCH.replace("[FBIW]", "F"), e["name"]), "#4c72b0", "forward of micro-batch i (F_i)"),
    (lambda e: re.fullmatch(MICRO_BATCH.replace("[FBIW]", "B"), e["name"]), "#dd8452", "backward of micro-batch i (B_i)"),
    (lambda e: re.fullmatch(MICRO_BATCH.replace("[FBIW]", "I"), e["name"]), "#e5ae38",
     "input gradient of micro-batch i (I_i)"),
    (lambda e: re.fullmatch(MICRO_BATCH.replace("[FBIW]", "W"), e["name"]), "#17becf",
     "weight gradients of micro-batch i (W_i)"),
    (lambda e: e["name"] == "forward", "#4c72b0", "forward"),
    (lambda e: e["name"] == "backward", "#dd8452", "backward"),
    (lambda e: e["name"] == "optimizer step", "#55a868", "optimizer step"),
    (lambda e: e["name"].startswith("gradient sync wait"), "#c44e52", "waiting for the all-reduce"),
    (lambda e: e["name"].startswith("recv"), "#c44e52", "blocked in a receive"),
    (lambda e: e["name"].startswith("send"), "#55a868", "send issued"),
    (lambda e: e["name"].startswith("all_reduce bucket"), "#8172b3", "all-reduce of a bucket, launch to completion"),
    (lambda e: e["name"].startswith(("all_reduce y", "all_reduce dx", "all_gather y", "all_gather dx")), "#da8bc3",
     "a tensor-parallel layer's collective"),
    (lambda e: e["name"].startswith("average parameters"), "#8172b3", "average parameters (all-reduce)"),
    (lambda e: e["name"].startswith("reduce_scatter"), "#8c613c", "reduce-scatter of the gradients"),
    (lambda e: e["name"].startswith("all_gather parameters"), "#8172b3", "all-gather of the updated shards"),
    (lambda e: e["name"].startswith("all_reduce"), "#8172b3", "all-reduce"),
    (lambda e: e["name"] == "forward + backward", "#4c72b0", "forward + backward"),
    (lambda e: e["name"].startswith("straggler"), "#cccccc", "the straggler's sleep"),
    (lambda e: e["name"].startswith("push gradients"), "#55a868", "push of the gradients"),
    (lambda e: e["name"].startswith("pull parameters"), "#c44e52", "waiting for fresh parameters"),
    (lambda e: e["name"].startswith("apply"), "#dd8452", "a server's update"),
    (lambda e: e["name"].startswith(("broadcast", "wait for sends")), "#937860", "loss broadcast, waiting for sends"),
    (lambda e: True, "#999999", "other"),
)


def trace_events(path: str) -> tuple[list[JsonDict], dict[tuple[int, int], str]]:
    with open(path) as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    names: dict[tuple[int, int], str] = {}
    for e in events:  # thread_name metadata names the lanes
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[(e["pid"], e.get("tid", 0))] = e["args"]["name"]
    return [e for e in events if e.get("ph") == "X"], names


def trace_window(spans: Sequence[JsonDict], last_steps: int, first_ms: float = 0) -> tuple[float, float]:
    """[begin, end) in microseconds: everything, or from the start of rank 0's K-th last step
    ('train_step ...' spans of a pipeline, else the Trainer's 'forward') to the end, or the first
    first_ms milliseconds."""
    begin, end = min(e["ts"] for e in spans), max(e["ts"] + e["dur"] for e in spans)
    if last_steps:
        starts = sorted(e["ts"] for e in spans if e["pid"] == 0 and (e["cat"] == "step" or e["name"] == "forward"))
        if len(starts) >= last_steps:
            begin = starts[-last_steps]
    if first_ms:
        end = min(end, begin + first_ms * 1000.0)
    return begin, end


def plot_trace(path: str, out: str, last_steps: int = 0, title: str | None = None, first_ms: float = 0) -> str:
    plt = pyplot()
    if not plt:
        raise SystemExit("tessera-report plot-trace: matplotlib is not installed for this Python "
                         "(`apt-get install python3-matplotlib`)")
    from matplotlib.patches import Patch
    spans, lane_names = trace_events(path)
    if not spans:
        raise SystemExit(f"tessera-report plot-trace: {path} holds no spans")
    begin, end = trace_window(spans, last_steps, first_ms)
    shown = [e for e in spans if e["ts"] + e["dur"] > begin and e["ts"] < end and e["cat"] != "step"]
    steps = [e for e in spans if e["cat"] == "step" and e["ts"] + e["dur"] > begin]
    rows = sorted({(e["pid"], e["tid"]) for e in spans})
    index = {r: i for i, r in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(11, 0.55 * len(rows) + 1.6))
    used: dict[str, str] = {}

    def to_ms(us: float) -> float:
        return (us - begin) / 1000.0

    for e in steps:  # a pipeline stage's whole step: an outline behind its compute row
        y = index[(e["pid"], 0)] if (e["pid"], 0) in index else index[(e["pid"], e["tid"])]
        ax.barh(y, e["dur"] / 1000.0, left=to_ms(e["ts"]), height=0.86, color="none", edgecolor="#444444",
                linewidth=0.8, linestyle="--")
    for e in shown:
        colour, label = next((c, l) for test, c, l in TRACE_COLOURS if test(e))
        used[label] = colour
        y = index[(e["pid"], e["tid"])]
        width = e["dur"] / 1000.0
        ax.barh(y, width, left=to_ms(e["ts"]), height=0.7, color=colour, edgecolor="white", linewidth=0.3)
        # Micro-batch names inside their boxes where they fit.
        if re.fullmatch(MICRO_BATCH, e["name"]) and width > (end - begin) / 1000.0 / 60:
            ax.text(to_ms(e["ts"]) + width / 2, y, e["name"].split(" ")[0], ha="center", va="center", fontsize=7,
                    color="white")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {pid} {lane_names.get((pid, tid), 'lane %d' % tid)}" for pid, tid in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, (end - begin) / 1000.0)
    ax.set_xlabel("time (ms)" + (f", the last {last_steps} step(s)" if last_steps else "")
                  + (f", the first {first_ms:g} ms" if first_ms else ""))
    handles = [Patch(color=c, label=l) for l, c in used.items()]
    if steps:
        handles.append(Patch(facecolor="none", edgecolor="#444444", linestyle="--", label="a stage's train_step"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25 if len(rows) < 6 else -0.12),
              ncol=3, fontsize="small", frameon=False)
    ax.grid(axis="y", visible=False)
    ax.set_title(title or os.path.basename(path))
    save(fig, out)
    return out


DESCRIPTION = ("Draw a Chrome trace written by a Tessera Timeline (the examples' --trace) as a PNG timeline: one "
               "row per rank and lane, every span a box.")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("trace", help="trace JSON (06_pipeline_parallel --trace, 04_data_parallel --trace, ...)")
    ap.add_argument("--out", help="PNG to write (default: the trace with .png)")
    ap.add_argument("--last-steps", type=int, default=0,
                    help="draw only the last K steps (rank 0's step or forward spans; default: everything)")
    ap.add_argument("--first-ms", type=float, default=0,
                    help="draw only the first X milliseconds (after --last-steps' start, if given)")
    ap.add_argument("--title")


def run(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if not os.path.exists(args.trace):
        ap.error(f"{args.trace}: no such file")
    out = args.out or os.path.splitext(args.trace)[0] + ".png"
    if args.first_ms < 0:
        ap.error("--first-ms must be >= 0")
    plot_trace(args.trace, out, args.last_steps, args.title, args.first_ms)
    print(f"wrote {out}")
    return 0
