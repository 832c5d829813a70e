#!/usr/bin/env python3
"""Runs example 06 with --trace and checks that the trace shows the pipeline it trained.

    check_pipeline_trace.py [launcher args...] BINARY [example flags...]

The command is run as given plus --trace=<a temporary file>. From its output it reads the split
("stage s: layers conv1..pool1 ...") and the traced step's idle fraction per stage; from the trace:

  - every stage's step span is named with the units that stage trained ("train_step [conv1..pool1]"),
    so the trace is of the trained split, not a new one;
  - idle = 1 - (sum of the stage's F_i and B_i spans) / (the slowest stage's step span) equals the
    printed idle fraction (to 0.002: the trace rounds times to a nanosecond);
  - the communication lane holds each message of the schedule: M activation receives on every
    stage but the first, M gradient receives on every stage but the last, and the matching sends;
  - the trace is truthful across ranks: no receive ends before its send begins (the ranks share
    one clock zero; thread ranks each used to start their own and showed receives 12 ms early).

Exit 0 when all hold, 1 with a message naming what differs. Standard library only.
"""
import json
import os
import re
import subprocess
import sys
import tempfile


def fail(message):
    print("check_pipeline_trace: " + message, file=sys.stderr)
    sys.exit(1)


MESSAGE = re.compile(r"(send|recv) ([AG]\d+) (?:to|from) stage (\d+)")


def check_causality(events, p):
    """Every receive of replica 0's pipeline ends at or after its send begins (1 us of slack for
    the trace's rounding)."""
    sends, recvs = {}, {}
    for e in events:
        m = MESSAGE.match(e["name"]) if e["pid"] < p and e["tid"] == 1 else None
        if not m:
            continue
        kind, message, peer = m.group(1), m.group(2), int(m.group(3))
        # Keyed by (sender, receiver, message): the one traced step holds each once.
        key = (e["pid"], peer, message) if kind == "send" else (peer, e["pid"], message)
        (sends if kind == "send" else recvs)[key] = e
    if len(sends) != len(recvs) or not sends:
        fail("%d sends and %d receives in the trace do not pair up" % (len(sends), len(recvs)))
    worst = None
    for key, send in sends.items():
        if key not in recvs:
            fail("send %s from rank %d to rank %d has no receive in the trace" % (key[2], key[0], key[1]))
        recv = recvs[key]
        early = send["ts"] - (recv["ts"] + recv["dur"])  # > 0: the receive ended before the send began
        if worst is None or early > worst[0]:
            worst = (early, key)
    if worst[0] > 1.0:
        fail("receive %s on rank %d ends %.1f us before rank %d begins sending it: the ranks' clocks are not "
             "aligned" % (worst[1][2], worst[1][1], worst[0], worst[1][0]))
    print("every receive ends after its send begins (%d messages)" % len(sends))


def main():
    if len(sys.argv) < 2:
        fail("usage: check_pipeline_trace.py [launcher args...] BINARY [flags...]")
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = os.path.join(tmp, "trace.json")
        command = sys.argv[1:] + ["--trace=" + trace_path]
        run = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
        print(run.stdout)
        if run.returncode != 0:
            fail("the example exited with %d" % run.returncode)
        with open(trace_path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]

    # tools/tessera-run prefixes each line with "[rank N] ".
    output = re.sub(r"^\[rank \d+\] ", "", run.stdout, flags=re.M)
    stages = {int(s): units for s, units in re.findall(r"^\s+stage (\d+): layers (\S+\.\.\S+) ", output, re.M)}
    micro = re.search(r"global batch \d+ = \d+ x (\d+) micro-batches", output)
    idle_line = re.search(r"that step's idle fraction per stage[^:]*:((?: [0-9.]+)+)", output)
    if not stages or not micro or not idle_line:
        fail("the output lacks the stage list, the micro-batch count or the traced step's idle fractions")
    p, m = len(stages), int(micro.group(1))
    printed_idle = [float(x) for x in idle_line.group(1).split()]
    if len(printed_idle) != p:
        fail("%d idle fractions printed for %d stages" % (len(printed_idle), p))

    # Ranks 0 .. P-1 are replica 0's pipeline (rank = replica x P + stage).
    steps, busy = {}, {}
    for s in range(p):
        mine = [e for e in events if e["pid"] == s]
        step = [e for e in mine if e["cat"] == "step"]
        if len(step) != 1:
            fail("rank %d has %d step spans in the trace (1 expected)" % (s, len(step)))
        want = "train_step [%s]" % stages[s]
        if step[0]["name"] != want:
            fail("rank %d traced '%s' but trained stage %d as %s" % (s, step[0]["name"], s, stages[s]))
        steps[s] = step[0]["dur"]
        fb = [e for e in mine if e["cat"] == "compute" and re.fullmatch(r"[FB]\d+", e["name"])]
        if len(fb) != 2 * m:
            fail("rank %d has %d F/B spans, %d expected (M = %d)" % (s, len(fb), 2 * m, m))
        busy[s] = sum(e["dur"] for e in fb)
        messages = [e["name"] for e in mine if e["tid"] == 1]
        for kind, present in (("recv A", s > 0), ("recv G", s < p - 1), ("send A", s < p - 1), ("send G", s > 0)):
            count = sum(1 for n in messages if n.startswith(kind))
            if count != (m if present else 0):
                fail("rank %d: %d '%s' spans on the communication lane, %d expected" % (s, count, kind,
                                                                                       m if present else 0))
    check_causality(events, p)
    slowest = max(steps.values())
    for s in range(p):
        from_trace = 1.0 - busy[s] / slowest
        if abs(from_trace - printed_idle[s]) > 0.002:
            fail("stage %d: the trace gives idle %.4f, the example printed %.3f" % (s, from_trace, printed_idle[s]))
        print("stage %d (%s): idle %.3f in the trace, %.3f printed; %d messages" %
              (s, stages[s], 1.0 - busy[s] / slowest, printed_idle[s],
               sum(1 for e in events if e["pid"] == s and e["tid"] == 1)))
    print("check_pipeline_trace: the trace shows the trained split, its idle fractions and every message")


if __name__ == "__main__":
    main()
