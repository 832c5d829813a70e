"""The campaign: runs the sections one by one (a failing section is reported, the others still
run), keeps each one's record in OUT/raw/<section>.json, and writes OUT/index.md after each."""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tessera_tools.report.collectives import render_collectives, run_collectives
from tessera_tools.report.context import PROFILES, Context, SectionError
from tessera_tools.report.dp_scaling import render_dp_scaling, run_dp_scaling
from tessera_tools.report.formatting import JsonDict, anchor, fmt_seconds, md_table
from tessera_tools.report.machine import describe_machine, machine_markdown
from tessera_tools.report.overlap import render_overlap, run_overlap
from tessera_tools.report.pipeline import render_pipeline, run_pipeline
from tessera_tools.report.plotting import pyplot
from tessera_tools.report.training import render_training, run_training


@dataclass(frozen=True)
class Section:
    """One part of the report: its runner fills a data dict (kept in raw/<name>.json), its renderer
    turns that dict into markdown and plots (again with --render-only)."""
    name: str
    title: str
    runner: Callable[[Context, JsonDict], None]
    renderer: Callable[[JsonDict, str], str]
    peer: str  # what its figures are measured against


ALL_SECTIONS: list[Section] = [
    Section("training", "Training throughput against PyTorch", run_training, render_training,
            "PyTorch 1.13 at its best (bench/peer.py)"),
    Section("collectives", "Collectives bandwidth against the raw libraries", run_collectives, render_collectives,
            "MPI_* and gloo::* called directly; STREAM triad for ThreadComm"),
    Section("dp_scaling", "Data-parallel scaling against PyTorch DDP", run_dp_scaling, render_dp_scaling,
            "PyTorch DistributedDataParallel over Gloo"),
    Section("pipeline", "Pipeline bubble against the formula", run_pipeline, render_pipeline,
            "the ideal bubble (P-1)/(M+P-1)"),
    Section("overlap", "Communication/computation overlap from the timeline", run_overlap, render_overlap,
            "backward's duration (what could hide the all-reduce)"),
]


def run_section(section: Section, ctx: Context) -> JsonDict:
    """Runs one section; never raises (but for Ctrl-C). Returns its record, also written to
    raw/<name>.json: status, wall time, commands, error and log tail, and the data collected so far
    (a section that failed half-way keeps what it measured)."""
    ctx.section, ctx.commands, ctx.log = section.name, [], []
    data: JsonDict = {}
    error: str | None = None
    load_before = os.getloadavg()[0]
    started_at = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    started = time.monotonic()
    print(f"\n== {section.name}: {section.title}", file=sys.stderr, flush=True)
    try:
        section.runner(ctx, data)
    except KeyboardInterrupt:
        raise
    except SectionError as e:
        error = str(e)
    except Exception:  # a bug or an unexpected output: reported in its section, the campaign goes on
        error = "unexpected error:\n" + traceback.format_exc()
    wall = time.monotonic() - started
    record: JsonDict = {"section": section.name, "title": section.title, "status": "error" if error else "ok",
              "started": started_at, "wall_seconds": wall, "load_average_1min": [load_before, os.getloadavg()[0]],
              "commands": [shlex.join(c) for c in ctx.commands], "error": error,
              "log_tail": ctx.log[-60:] if error else [], "data": data}
    os.makedirs(ctx.raw, exist_ok=True)
    with open(os.path.join(ctx.raw, f"{section.name}.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(f"== {section.name}: {'FAILED' if error else 'done'} in {fmt_seconds(wall)}", file=sys.stderr, flush=True)
    return record


def render_section(section: Section, record: JsonDict, out: str) -> str:
    """The markdown of one section; a failed runner or renderer becomes an error paragraph there."""
    md = [f"## {section.title}\n",
          f"Peer: {section.peer}. Run {record.get('started', '')}, wall time {fmt_seconds(record.get('wall_seconds'))}; "
          "load average (1 min) "
          f"{record['load_average_1min'][0]:.2f} at the start, {record['load_average_1min'][1]:.2f} at the end. "
          f"Raw data: [raw/{section.name}.json](raw/{section.name}.json).\n"]
    if record.get("error"):
        md.append(f"**This section failed** after {fmt_seconds(record.get('wall_seconds'))}:\n\n```\n"
                  f"{record['error'].strip()}\n```\n")
        if record.get("log_tail"):
            md.append("<details><summary>Last lines of its programs' output</summary>\n\n```\n" +
                      "\n".join(record["log_tail"][-30:]) + "\n```\n</details>\n")
    try:
        body = section.renderer(record.get("data") or {}, os.path.join(out, "plots"))
        if body:
            md.append(body)
    except Exception:
        md.append("**The results of this section could not be rendered:**\n\n```\n" + traceback.format_exc() + "```\n")
    if record.get("commands"):
        md.append("<details><summary>Commands run</summary>\n\n```sh\n" + "\n".join(record["commands"]) +
                  "\n```\n</details>\n")
    return "\n".join(md)


def render_index(out: str, machine: JsonDict, records: Sequence[JsonDict], sections: Sequence[Section], invocation: str,
                 total_seconds: float, kept: Sequence[str] = ()) -> None:
    """Writes out/index.md from the machine description and the sections' records; `kept` names
    sections whose records are from an earlier invocation into the same directory."""
    ran = len(records) - len(kept)
    md = ["# Tessera performance report\n",
          f"`{invocation}`: {ran} section(s) in {fmt_seconds(total_seconds)}, {machine.get('date', '')}"
          + (f"; kept from an earlier run into this directory: {', '.join(kept)} (each section says when it ran)"
             if kept else "") + ". Every figure is measured on this machine next to its peer; raw JSON beside this "
          "file in `raw/`, plots in `plots/`.\n",
          "## Machine\n", machine_markdown(machine),
          "Raw: [raw/machine.json](raw/machine.json).\n",
          "## Sections\n"]
    by_name = {s.name: s for s in sections}
    md.append(md_table(["section", "measured against", "status", "wall time"],
                       [[f"[{by_name[r['section']].title}](#{anchor(by_name[r['section']].title)})",
                         by_name[r["section"]].peer, "ok" if r["status"] == "ok" else "**failed**",
                         fmt_seconds(r["wall_seconds"])] for r in records], ["l", "l", "l", "r"]))
    for r in records:
        md.append(render_section(by_name[r["section"]], r, out))
    with open(os.path.join(out, "index.md"), "w") as f:
        f.write("\n".join(md))


def campaign(args: argparse.Namespace, sections: Sequence[Section], invocation: str) -> int:
    """Runs `sections` (or, with --render-only, rewrites index.md from OUT/raw/); `invocation` is
    the command line as the report quotes it."""
    out = os.path.abspath(args.out)
    os.makedirs(os.path.join(out, "raw"), exist_ok=True)
    build = os.path.abspath(args.build)
    if args.render_only:
        with open(os.path.join(out, "raw", "machine.json")) as f:
            machine = json.load(f)
        records = []
        for s in sections:
            path = os.path.join(out, "raw", f"{s.name}.json")
            if os.path.exists(path):
                with open(path) as f:
                    records.append(json.load(f))
        meta = machine.get("campaign", {})
        render_index(out, machine, records, sections, meta.get("invocation", invocation),
                     meta.get("wall_seconds", sum(r["wall_seconds"] for r in records)))
        print(f"wrote {os.path.join(out, 'index.md')} from {len(records)} raw section(s)", file=sys.stderr)
        return 0
    if not os.path.isdir(build):
        sys.exit(f"tessera-report: build directory {build} does not exist: `meson setup {args.build} -Dbench=true` "
                 f"then `ninja -C {args.build}`, or pass --build DIR")
    profile = "quick" if args.quick else "full" if args.full else "default"
    settings = dataclasses.replace(PROFILES[profile])
    if args.runs:
        settings.train_runs = args.runs
    if args.coretypes is not None:
        settings.coretypes = args.coretypes
    if args.timeout is None:
        args.timeout = {"quick": 300, "default": 1200, "full": 3600}[profile]
    ctx = Context(args.timeout, settings, out, build, args.python)
    started = time.monotonic()
    machine = describe_machine(build)
    machine["campaign"] = {"invocation": invocation, "profile": profile, "settings": dataclasses.asdict(settings),
                           "build": build}
    with open(os.path.join(out, "raw", "machine.json"), "w") as f:
        json.dump(machine, f, indent=1)
    # With --only, the other sections' earlier results in OUT stay in the report (rerunning one
    # failed section does not drop the rest); each section says when it ran.
    earlier: dict[str, JsonDict] = {}
    if args.only:
        for s in ALL_SECTIONS:
            path = os.path.join(out, "raw", f"{s.name}.json")
            if s not in sections and os.path.exists(path):
                with open(path) as f:
                    earlier[s.name] = json.load(f)
    fresh: dict[str, JsonDict] = {}

    def merged() -> list[JsonDict]:
        return [fresh.get(s.name) or earlier[s.name] for s in ALL_SECTIONS if s.name in fresh or s.name in earlier]

    for s in sections:
        fresh[s.name] = run_section(s, ctx)
        # index.md after each section: an interrupted campaign still leaves a report of what ran.
        render_index(out, machine, merged(), ALL_SECTIONS, invocation, time.monotonic() - started, list(earlier))
    records = merged()
    machine["campaign"]["wall_seconds"] = time.monotonic() - started
    with open(os.path.join(out, "raw", "machine.json"), "w") as f:
        json.dump(machine, f, indent=1)
    render_index(out, machine, records, ALL_SECTIONS, invocation, time.monotonic() - started, list(earlier))
    failed = [r["section"] for r in fresh.values() if r["status"] != "ok"]
    print(f"\nwrote {os.path.join(out, 'index.md')} in {fmt_seconds(time.monotonic() - started)}"
          + (f"; failed: {', '.join(failed)}" if failed else "") + ("" if pyplot() else "; plots skipped (no matplotlib)"),
          file=sys.stderr)
    return 1 if failed else 0
