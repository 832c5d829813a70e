#!/usr/bin/env python3
"""Compile-time benchmark: wall seconds and peak memory of the translation units users wait for.

  python3 bench/compile.py [--build build] [--runs 3] > bench/out/compile_<cpu>.json

Measured with the build's own compiler command lines (compile_commands.json), one compile at a
time, median of --runs:
  resnet50_cpu      examples/08_resnet50 built for CpuThreads (the CPU build of the sources
                    every backend compiles): each of its translation units (main.cpp,
                    model_parallel.cpp), the slowest as `seconds` (goal: under 15 s on 2 cores),
                    both compiled at once as `both_parallel_seconds` (what `ninja` waits for on
                    2 cores), and main.cpp without compiled kernels (`header_only_main_seconds`,
                    what a user who includes the headers without the meson build waits for)
  tessera_kernels   src/kernels_cpu.cpp, compiled once per build (kernels/cpu/compiled.hpp)
  slowest_test_tu   the slowest unit of tests/tessera_tests, a unity file of 6 sources
                    (tests/meson.build; every one is compiled once to find it, and all are
                    reported)
  umbrella_header   a file that includes tessera/tessera.hpp and nothing else
Peak memory is the compiler's maximum resident set (cc1plus included: wait4 reports the largest
of the child and its descendants). JSON on stdout, a table on stderr.
"""
import argparse
import json
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import cpu_model  # noqa: E402

# The build's command of a unit without its launcher (ccache would answer a second compile from
# its cache in 0.04 s), -o and dependency outputs: every run compiles, nothing in the build changes.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tools"))
from tessera_tools.precompile import without_outputs  # noqa: E402

GOAL_RESNET50_S = 15.0




def load_commands(build):
    path = build / "compile_commands.json"
    if not path.exists():
        sys.exit(f"compile: {path} not found; configure the build first (meson setup {build})")
    return json.loads(path.read_text())


def compile_once(args, cwd, obj):
    start = time.perf_counter()
    proc = subprocess.Popen(args + ["-o", obj], cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    err = proc.stderr.read().decode(errors="replace")
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"compile: {' '.join(args[:3])} ... failed:\n{err[:2000]}")
    return seconds, usage.ru_maxrss / 1024.0  # KiB -> MiB


def measure(args, cwd, runs):
    times, peaks = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(runs):
            s, mb = compile_once(args, cwd, os.path.join(tmp, "unit.o"))
            times.append(s)
            peaks.append(mb)
    return {"seconds": round(statistics.median(times), 2), "seconds_all": [round(t, 2) for t in times],
            "peak_mb": round(max(peaks), 1)}


def source_name(entry):
    """The source's path inside the repository (compile_commands.json has it relative to the build)."""
    path = pathlib.Path(entry["directory"], entry["file"]).resolve()
    root = pathlib.Path(__file__).resolve().parent.parent
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def command_for(entries, source_suffix, output_part):
    for e in entries:
        if e["file"].endswith(source_suffix) and output_part in e.get("output", e["command"]):
            return shlex.split(e["command"]), e["directory"]
    return None, None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    build = pathlib.Path(args.build).resolve()
    entries = load_commands(build)

    resnet_cmd, resnet_dir = command_for(entries, "examples/08_resnet50/main.cpp", "08_resnet50_threads")
    if resnet_cmd is None:
        sys.exit("compile: no 08_resnet50_threads compile command; configure with -Dexamples=enabled")
    results = {}
    units = {}
    for source in ("main.cpp", "model_parallel.cpp"):
        cmd, cwd = command_for(entries, "examples/08_resnet50/" + source, "08_resnet50_threads")
        if cmd is None:
            sys.exit(f"compile: no compile command for examples/08_resnet50/{source}")
        units[source] = (without_outputs(cmd), cwd)
    print("measuring 08_resnet50 (CpuThreads), each unit and both at once ...", file=sys.stderr)
    per_unit = {name: measure(cmd, cwd, args.runs) for name, (cmd, cwd) in units.items()}
    slowest_unit = max(per_unit, key=lambda k: per_unit[k]["seconds"])
    both = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.runs):
            start = time.perf_counter()
            procs = [subprocess.Popen(cmd + ["-o", os.path.join(tmp, f"{i}.o")], cwd=cwd, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL) for i, (cmd, cwd) in enumerate(units.values())]
            if any(p.wait() != 0 for p in procs):
                sys.exit("compile: 08_resnet50 failed to compile")
            both.append(time.perf_counter() - start)
    main_cmd, main_dir = units["main.cpp"]
    header_only = [a for a in main_cmd if a != "-DTESSERA_COMPILED_KERNELS"]
    results["resnet50_cpu"] = {
        "seconds": per_unit[slowest_unit]["seconds"], "file": "examples/08_resnet50/" + slowest_unit,
        "peak_mb": max(u["peak_mb"] for u in per_unit.values()), "units": per_unit,
        "both_parallel_seconds": round(statistics.median(both), 2),
        "compiled_kernels": "-DTESSERA_COMPILED_KERNELS" in main_cmd,
        "header_only_main_seconds": measure(header_only, main_dir, args.runs)["seconds"],
        "goal_seconds": GOAL_RESNET50_S}
    results["resnet50_cpu"]["meets_goal"] = results["resnet50_cpu"]["seconds"] < GOAL_RESNET50_S
    kernels_cmd, kernels_dir = command_for(entries, "src/kernels_cpu.cpp", "tessera_kernels")
    if kernels_cmd is not None:
        print("measuring the compiled kernels (once per build) ...", file=sys.stderr)
        results["tessera_kernels"] = measure(without_outputs(kernels_cmd), kernels_dir, args.runs)

    tests = [e for e in entries if "tessera_tests.p" in e.get("output", e["command"])]
    if tests:
        print(f"compiling the {len(tests)} test sources once to find the slowest ...", file=sys.stderr)
        once = {}
        with tempfile.TemporaryDirectory() as tmp:
            for e in tests:
                s, mb = compile_once(without_outputs(shlex.split(e["command"])), e["directory"], os.path.join(tmp, "t.o"))
                once[source_name(e)] = {"seconds": round(s, 2), "peak_mb": round(mb, 1)}
        slowest = max(once, key=lambda k: once[k]["seconds"])
        entry = next(e for e in tests if source_name(e) == slowest)
        print(f"measuring the slowest, {slowest} ...", file=sys.stderr)
        results["slowest_test_tu"] = {"file": slowest,
                                      **measure(without_outputs(shlex.split(entry["command"])), entry["directory"], args.runs)}
        results["test_tus_once"] = once

    # tessera.hpp alone, with the 08 command's flags (include paths, -O, -march).
    with tempfile.TemporaryDirectory() as tmp:
        unit = pathlib.Path(tmp) / "umbrella.cpp"
        unit.write_text('#include "tessera/tessera.hpp"\nint main() { return 0; }\n')
        base = without_outputs(resnet_cmd)
        source_index = next(i for i, a in enumerate(base) if a.endswith("examples/08_resnet50/main.cpp"))
        base[source_index] = str(unit)
        print("measuring tessera.hpp alone ...", file=sys.stderr)
        results["umbrella_header"] = measure(base, resnet_dir, args.runs)

    compiler = subprocess.run([without_outputs(resnet_cmd)[0], "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    report = {"benchmark": "compile", "cpu": cpu_model(), "cores": os.cpu_count(), "compiler": compiler,
              "runs": args.runs, "build": str(build), "results": results}
    for name in ("resnet50_cpu", "tessera_kernels", "slowest_test_tu", "umbrella_header"):
        if name in results:
            r = results[name]
            print(f"{name:18} {r['seconds']:7.2f} s  {r['peak_mb']:8.1f} MB  {r.get('file', '')}", file=sys.stderr)
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
