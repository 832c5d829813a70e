#!/usr/bin/env python3
"""Elastic data parallelism over Gloo, end to end: 4 ranks of examples/19_elastic_gloo under
`tools/tessera-run --elastic`; one rank is killed (kill -9, with a replacement) and, in a second
run, one is stopped past the timeout (SIGSTOP, continued after the others regrouped, no
replacement); two more kill one under ZeRO-1 and under FSDP stage 3 with replicated shards
(--zero=1, --zero=3: the dead rank's shard comes from its replica), with a replacement. Each trial must: go on without restarting the survivors (same pids), lose no step,
keep the replicas bit-identical (DataParallel compares them after every step; every member prints
its checksum after each change), end within 1 point of the uninterrupted run's test accuracy (a
short run; the full-size figure is bench/elastic_campaign.py's), and with the replacement end
with 4 ranks whose parameters equal the others' at the step it joined.

  elastic_fault_test.py --build build
"""
import argparse
import json
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import elastic_campaign  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", required=True)
    cli = ap.parse_args()
    args = argparse.Namespace(build=cli.build, timeout=2.0, settle=0.0, epochs=2, limit=4096, seed=1,
                              max_delay=0.3, budget=60.0)
    rng = random.Random(7)
    baseline = elastic_campaign.uninterrupted(args)
    print(f"uninterrupted: test accuracy {baseline:.2f}%")
    failures = []
    for fault, replace, strategy in (("kill", True, "dp"), ("stop", False, "dp"), ("kill", True, "zero1"),
                                     ("kill", True, "fsdp3")):
        args.strategy = strategy
        for attempt in range(3):  # a fault that lands after the job ended is redrawn
            r = elastic_campaign.run_trial(args, fault, replace, rng, baseline)
            if not r.get("too_late"):
                break
        shown = {k: v for k, v in r.items() if k != "output"}
        print(f"{fault} (replacement: {replace}, {strategy}): {json.dumps(shown)}")
        problems = []
        if r.get("too_late"):
            problems.append("the fault never landed mid-training")
        if r.get("hang"):
            problems.append("hung")
        if not r.get("continued"):
            problems.append("the survivors did not go on")
        if not r.get("survivors_kept"):
            problems.append("the survivors' processes changed")
        if r.get("diverged"):
            problems.append("replicas diverged")
        if r.get("steps_lost", 1) != 0:
            problems.append(f"steps lost: {r.get('steps_lost')}")
        if abs(r.get("accuracy_delta", 100)) > 1.0:
            problems.append(f"accuracy {r.get('accuracy')} vs {baseline}")
        if replace and not r.get("rejoined"):
            problems.append("the replacement did not rejoin with equal parameters")
        if problems:
            failures.append(f"{fault}: {'; '.join(problems)}\n{r.get('output', '')[-3000:]}")
    if failures:
        print("FAILED:\n" + "\n".join(failures))
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
