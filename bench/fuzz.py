#!/usr/bin/env python3
"""Runs every fuzz harness of tests/fuzz for 1,000,000 executions and records the result.

  python3 bench/fuzz.py [--runs 1000000] [--targets idx,json] [--build build-fuzz] [--out FILE]

scripts/fuzz.sh builds the libFuzzer harnesses (clang, ASan + UBSan) and runs each from its seed
corpus with a fixed seed (-seed=1) for --runs executions. This script adds the machine (CPU model
from /proc/cpuinfo, clang version) and writes one JSON file (default
bench/out/fuzz_<date>.json) with, per target: executions, seconds, crashes, leaks, timeouts,
out-of-memory reports and the corpus size reached. The goal is 0 of each; a failing input is kept
under <build>/artifacts/ (tests/fuzz/README.md says how to reproduce it). Not a timing benchmark:
executions per second depend on whatever else the machine runs.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from bench_common import cpu_model  # noqa: E402




def clang_version():
    for cxx in (os.environ.get("CXX_FUZZ"), "clang++", "clang++-14"):
        if not cxx:
            continue
        try:
            out = subprocess.run([cxx, "--version"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            if out.returncode == 0:
                return out.stdout.splitlines()[0].strip()
        except OSError:
            continue
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--targets", default=None, help="comma-separated, e.g. idx,json (default: all)")
    parser.add_argument("--build", default=os.path.join(ROOT, "build-fuzz"))
    parser.add_argument("--seconds", type=int, default=3600, help="cap per target")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    clang = clang_version()
    if clang is None:
        sys.exit("fuzz.py: no clang++ (Debian: apt-get install clang libclang-rt-14-dev)")
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as report:
        argv = [os.path.join(ROOT, "scripts", "fuzz.sh"), "--runs", str(args.runs), "--seconds", str(args.seconds),
                "--build", args.build, "--report", report.name]
        if args.targets:
            argv += ["--targets", args.targets]
        print("$ " + " ".join(argv), file=sys.stderr, flush=True)
        status = subprocess.run(argv).returncode
        if status not in (0, 1):
            sys.exit(f"fuzz.py: scripts/fuzz.sh exited with status {status}")
        targets = [json.loads(line) for line in report.read().splitlines() if line.strip()]

    totals = {k: sum(t[k] for t in targets) for k in ("executions", "crashes", "leaks", "timeouts", "ooms")}
    result = {
        "benchmark": "fuzz",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "runs_per_target": args.runs,
        "libfuzzer_flags": "-seed=1 -timeout=10 -rss_limit_mb=2560 -max_len=4096",
        "sanitizers": "address,undefined (-fno-sanitize-recover=undefined), -O1 -g",
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "clang": clang,
        "targets": targets,
        "totals": totals,
    }
    out = args.out or os.path.join(ROOT, "bench", "out", f"fuzz_{datetime.date.today().isoformat()}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(json.dumps(result, indent=2))
    print(f"fuzz.py: {len(targets)} targets, {totals['executions']} executions, {totals['crashes']} crashes, "
          f"{totals['leaks']} leaks, {totals['timeouts']} timeouts, {totals['ooms']} out-of-memory; wrote {out}",
          file=sys.stderr)
    return 0 if status == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
