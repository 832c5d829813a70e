"""tools/tessera-report without running a campaign: the pure parts and the error isolation.

    python3 -m pytest -q tests/tools/test_report.py

Checks the machine description (on this machine and on fixed /proc texts), the markdown table
writer, the trace analysis of the overlap section on a hand-made timeline, the plot-metrics
subcommand on a small synthetic JSONL (its PNG only where matplotlib is installed, else the
refusal), and that a section whose runner raises becomes an error paragraph in index.md while the
other sections are still reported.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import pytest

from conftest import ROOT
from tessera_tools.report import campaign, context, formatting, machine, metrics_plot, overlap
from tessera_tools.report.campaign import Section
from tessera_tools.report.context import Context

TOOL = str(ROOT / "tools" / "tessera-report")


def check(condition: object, message: str) -> None:
    assert condition, message


CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9B14
cpu MHz\t\t: 2600.000
cache size\t: 1024 KB
physical id\t: 0
core id\t\t: 0
flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512_bf16

processor\t: 1
model name\t: AMD EPYC 9B14
physical id\t: 0
core id\t\t: 0
flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512_bf16

processor\t: 2
model name\t: AMD EPYC 9B14
physical id\t: 0
core id\t\t: 1
flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512_bf16
"""


def test_parse_cpuinfo() -> None:
    info = machine.parse_cpuinfo(CPUINFO)
    check(info.model == "AMD EPYC 9B14", f"model {info.model!r}")
    check(info.logical_cpus == 3, f"logical cpus {info.logical_cpus}")
    check(info.physical_cores == 2, f"physical cores {info.physical_cores} (two threads share core 0)")
    check(info.sockets == 1, f"sockets {info.sockets}")
    check(info.flags == ["avx2", "fma", "avx512f", "avx512bw", "avx512_bf16"], f"flags {info.flags}")
    check(info.mhz == 2600.0, f"mhz {info.mhz}")


def test_parse_meminfo_and_dpkg() -> None:
    check(abs(machine.parse_meminfo("MemTotal:       24576000 kB\nMemFree: 1 kB\n") - 23.4375) < 1e-9, "MemTotal")
    check(machine.parse_meminfo("nothing here") is None, "no MemTotal -> None")
    pk = machine.parse_dpkg("libeigen3-dev\t3.4.0-4\ng++:amd64\t4:12.2.0-3\nbroken line\n")
    check(pk == {"libeigen3-dev": "3.4.0-4", "g++": "4:12.2.0-3"}, f"dpkg {pk}")


def test_describe_machine() -> None:
    d = machine.describe_machine(build_dir=None)
    for key in ("date", "cpu_model", "logical_cpus", "os", "kernel", "compiler", "packages", "cpu_flags"):
        check(key in d, f"missing {key}")
    check(d["cpu_model"] and d["cpu_model"] != "", "empty CPU model")
    check(d["logical_cpus"] >= 1, f"logical cpus {d['logical_cpus']}")
    if os.path.exists("/proc/meminfo"):
        check(d["memory_gib"] and d["memory_gib"] > 0, f"memory {d['memory_gib']}")
    json.dumps(d)  # it goes to raw/machine.json
    md = machine.machine_markdown(d)
    check(md.startswith("|  |  |\n|---|---|\n| CPU |"), f"machine table starts {md[:40]!r}")
    check("| Eigen |" in md and "| PyTorch |" in md and "| Date |" in md, "library rows")


def test_md_table() -> None:
    out = formatting.md_table(["model", "img/s"], [["MLP", "1,000"], ["a|b", 2]])
    expected = "| model | img/s |\n|---|---:|\n| MLP | 1,000 |\n| a\\|b | 2 |\n"
    check(out == expected, f"got {out!r}")
    out = formatting.md_table(["a", "b", "c"], [[1, 2, 3]], ["l", "c", "r"])
    check(out.splitlines()[1] == "|---|:---:|---:|", f"alignment row {out.splitlines()[1]!r}")
    with pytest.raises(ValueError):  # a short row must be refused
        formatting.md_table(["a", "b"], [[1]])


def test_analyse_trace() -> None:
    """Two steps on one rank (the first skipped as warm-up); in step 1, backward 100..300, the wait
    300..420, bucket 0 launched at 150 and done at 350, bucket 1 launched at 280 and done at 400."""
    def x(name: str, ts: float, dur: float, tid: int = 0) -> dict[str, Any]:
        return {"name": name, "ph": "X", "ts": ts, "dur": dur, "pid": 0, "tid": tid}

    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0}]
    for base in (0, 1000):
        events += [x("forward", base, 100), x("backward", base + 100, 200), x("gradient sync wait", base + 300, 120),
                   x("optimizer step", base + 420, 30),
                   x("all_reduce bucket 0 (64 KiB)", base + 150, 200, 1), x("all_reduce bucket 1 (180 KiB)", base + 280, 120, 1)]
    a = overlap.analyse_trace(events)
    check(a["steps"] == 1, f"steps {a['steps']} (the first is skipped)")
    b0, b1 = a["buckets"]
    # The wait 300..400: 300..350 was for bucket 0 (done first), 350..400 for bucket 1.
    check((b0["exposed_mean_us"], b0["hidden_mean_us"]) == (50, 150), f"bucket 0 {b0}")
    check((b1["exposed_mean_us"], b1["hidden_mean_us"]) == (50, 70), f"bucket 1 {b1}")
    check(a["wait_us_median"] == 100, f"wait {a['wait_us_median']}")
    check(abs(a["hidden_fraction"] - 220 / 320) < 1e-12, f"hidden fraction {a['hidden_fraction']}")
    check(a["step_us_median"] == 450, f"step {a['step_us_median']}")


SYNTHETIC = [
    {"run": "small batch", "epoch": 1, "test_accuracy": 0.80, "train_loss": 0.9},
    {"run": "small batch", "epoch": 2, "test_accuracy": 0.85, "train_loss": 0.6},
    {"run": "small batch", "epoch": 3, "test_accuracy": 0.88, "train_loss": 0.4},
    {"run": "large batch", "epoch": 1, "test_accuracy": 0.10, "train_loss": 2.3},
    {"run": "large batch", "epoch": 2, "test_accuracy": 0.60, "train_loss": 1.2},
    {"run": "large batch", "epoch": 3, "test_accuracy": 0.70, "train_loss": 0.8},
    {"run": "large batch", "epoch": 3, "test_accuracy": 0.74, "train_loss": 0.7},  # a repeat at one x
]


def test_metrics_plan() -> None:
    plan = metrics_plot.metrics_plan(SYNTHETIC)
    x, panels, series = plan.x, plan.panels, plan.series
    check((x, panels, series) == ("epoch", [["test_accuracy"], ["train_loss"]], "run"), f"plan {(x, panels, series)}")
    s = metrics_plot.metrics_series(SYNTHETIC, "epoch", "test_accuracy", "run")
    check(s["large batch"][-1] == (3, 0.72, 0.70, 0.74, 2), f"aggregated point {s['large batch'][-1]}")
    check([p[0] for p in s["small batch"]] == [1, 2, 3], "sorted by x")
    with pytest.raises(ValueError, match="not a numeric column"):  # a string x column must be refused
        metrics_plot.metrics_plan(SYNTHETIC, x="run")


def test_plot_metrics_subcommand() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.jsonl")
        with open(path, "w") as f:
            f.write("\n".join(json.dumps(r) for r in SYNTHETIC) + "\n")
        png = os.path.join(tmp, "run.png")
        p = subprocess.run([sys.executable, TOOL, "plot-metrics", path, "--out", png], capture_output=True, text=True,
                           timeout=120)
        if p.returncode != 0 and "matplotlib is not installed" in p.stderr:
            pytest.skip("matplotlib is not installed: the refusal was checked, the plot was not")
        check(p.returncode == 0, f"exit {p.returncode}: {p.stderr[-500:]}")
        with open(png, "rb") as f:
            head = f.read(8)
        check(head == b"\x89PNG\r\n\x1a\n", "not a PNG")
        check(os.path.getsize(png) > 10_000, f"PNG of {os.path.getsize(png)} bytes: too small to hold a plot")
        bad = subprocess.run([sys.executable, TOOL, "plot-metrics", path, "--y", "nope"], capture_output=True, text=True,
                             timeout=120)
        check(bad.returncode != 0 and "--y nope" in bad.stderr, f"unknown column: {bad.returncode} {bad.stderr[-300:]}")


def test_section_error_isolation() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ctx = Context(60, context.PROFILES["quick"], tmp, os.path.join(tmp, "no-build"), sys.executable)

        def boom(ctx: Context, data: dict[str, Any]) -> None:
            data["partial"] = 1
            raise RuntimeError("boom happened")

        def fine(ctx: Context, data: dict[str, Any]) -> None:
            data["x"] = 42

        def missing(ctx: Context, data: dict[str, Any]) -> None:
            ctx.binary("bench/train_throughput")

        def failing_program(ctx: Context, data: dict[str, Any]) -> None:
            ctx.run([sys.executable, "-c", "import sys; print('the last words', file=sys.stderr); sys.exit(3)"])

        def bad_render(data: dict[str, Any], plots: str) -> str:
            raise KeyError("no such field")

        sections = [Section("boom", "Boom section", boom, lambda d, p: f"partial={d.get('partial')}", "none"),
                    Section("fine", "Fine section", fine, lambda d, p: f"fine section rendered x={d['x']}", "none"),
                    Section("missing", "Missing binary", missing, lambda d, p: "", "none"),
                    Section("failing", "Failing program", failing_program, lambda d, p: "", "none"),
                    Section("badrender", "Bad render", fine, bad_render, "none")]
        records = [campaign.run_section(s, ctx) for s in sections]
        check([r["status"] for r in records] == ["error", "ok", "error", "error", "ok"],
              f"statuses {[r['status'] for r in records]}")
        campaign.render_index(tmp, {"date": "today", "cpu_model": "test CPU", "logical_cpus": 1}, records, sections,
                            "tools/tessera-report --test", 1.0)
        with open(os.path.join(tmp, "index.md")) as f:
            md = f.read()
        check("**This section failed**" in md and "boom happened" in md, "error paragraph of the raising runner")
        check("partial=1" in md, "a failed section keeps the data it collected")
        check("fine section rendered x=42" in md, "the healthy section is still rendered")
        check(f"ninja -C {os.path.join(tmp, 'no-build')} bench/train_throughput" in md, "the missing binary names its target")
        check("exited with status 3" in md and "the last words" in md, "a failing program's status and last output")
        check("could not be rendered" in md and "no such field" in md, "a renderer's failure is isolated too")
        with open(os.path.join(tmp, "raw", "boom.json")) as f:
            raw = json.load(f)
        check(raw["status"] == "error" and "boom happened" in raw["error"] and raw["wall_seconds"] >= 0, f"raw {raw}")
