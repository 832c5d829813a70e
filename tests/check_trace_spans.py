#!/usr/bin/env python3
"""Runs an example with --trace and checks the spans its trace files hold, per rank.

    check_trace_spans.py --ranks N --expect RULE [--expect RULE ...] -- COMMAND [ARGS...]

COMMAND (launcher included) is run with --trace=<a temporary directory>/trace.json appended; it
must exit 0. A program that trains more than once writes one file per run, trace.<tag>.json
(examples/common/trace_files.hpp). Each RULE is checked on every rank 0..N-1 of a file:

  FILE:PREFIX=COUNT       exactly COUNT spans whose name starts with PREFIX
  FILE:PREFIX>=COUNT      at least COUNT of them
  FILE:PREFIX==PREFIX2    as many spans starting with PREFIX as with PREFIX2

A RULE may start with "R1,R2,...@" to apply to those ranks only (a parameter server's workers,
say). FILE is the tag ("dp" for trace.dp.json) or "." for trace.json itself. Collective spans (names
starting with all_reduce, all_gather, reduce_scatter or average) must sit on the communication
lane (tid 1).

Exit 0 when every rule holds, 1 with a message naming the file, rank and rule. Standard library only.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

COMMUNICATION = ("all_reduce", "all_gather", "reduce_scatter", "average")


def fail(message):
    print("check_trace_spans: " + message, file=sys.stderr)
    sys.exit(1)


def spans_by_rank(path):
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"cannot read {path}: {e}")
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    ranks = {}
    for e in events:
        if e.get("ph") != "X":
            continue
        if e["name"].startswith(COMMUNICATION) and e.get("tid", 0) != 1:
            fail(f"{os.path.basename(path)}: rank {e['pid']}'s collective '{e['name']}' is on lane {e.get('tid')}, "
                 "not the communication lane (1)")
        ranks.setdefault(e["pid"], []).append(e["name"])
    return ranks


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--expect", action="append", required=True, help="RULE (see above); repeatable")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        fail("no command given")
    rules = []
    for rule in args.expect:
        m = re.fullmatch(r"(?:([0-9,]+)@)?([^:@]+):(.+?)(==|>=|=)(.+)", rule)
        if not m:
            fail(f"rule '{rule}' is not [RANKS@]FILE:PREFIX=COUNT, ...>=COUNT or ...==PREFIX2")
        only, tag, prefix, op, value = m.groups()
        ranks = [int(r) for r in only.split(",") if r] if only else list(range(args.ranks))
        if any(r < 0 or r >= args.ranks for r in ranks):
            fail(f"rule '{rule}' names a rank outside 0..{args.ranks - 1}")
        rules.append((ranks, tag, prefix, op, value))
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        run = subprocess.run(command + ["--trace=" + trace], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, timeout=600)
        print(run.stdout)
        if run.returncode != 0:
            fail(f"the example exited with {run.returncode}")
        files = {}
        for rule_ranks, tag, prefix, op, value in rules:
            path = trace if tag == "." else os.path.join(tmp, f"trace.{tag}.json")
            if path not in files:
                files[path] = spans_by_rank(path)
            ranks = files[path]
            for rank in rule_ranks:
                names = ranks.get(rank)
                if not names:
                    fail(f"{os.path.basename(path)}: no spans of rank {rank}")
                count = sum(n.startswith(prefix) for n in names)
                if op == "==":
                    want = sum(n.startswith(value) for n in names)
                    ok = count == want
                    what = f"as many as '{value}' ({want})"
                else:
                    want = int(value)
                    ok = count == want if op == "=" else count >= want
                    what = f"{'exactly' if op == '=' else 'at least'} {want}"
                if not ok:
                    fail(f"{os.path.basename(path)}, rank {rank}: {count} spans starting with '{prefix}', expected {what}")
                print(f"check_trace_spans: {os.path.basename(path)}, rank {rank}: {count} x '{prefix}' ({what}): ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
