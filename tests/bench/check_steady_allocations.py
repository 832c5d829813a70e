#!/usr/bin/env python3
"""A steady step allocates nothing: every heap allocation (malloc and its family, interposed by
bench/alloc_counter.hpp, so OpenMP's, OpenBLAS's and Eigen's count too) made during the timed
training steps of MLP, LeNet-5, ResNet-20 and a small GPT (each step's batch taken from the
DataLoader or TokenLoader first, as Trainer::fit does), during the timed ResNet-50 inference forwards at
batch 1 and 2, and during the timed forward + backward pairs of fused attention (a GPT block's),
must be zero. Run on 2 threads, where the kernels split work over a team, and on 1
(OMP_NUM_THREADS=1, one rank per core), where every parallel region must be skipped, not entered
alone: libomp allocates for each region it serializes.

    check_steady_allocations.py TRAIN_THROUGHPUT INFERENCE_THROUGHPUT ATTENTION

The benchmarks' JSON is read for the counts, never their times (this is not a timed test).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys


def run(cmd: list[str], threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if done.returncode != 0:
        raise SystemExit(f"FAILED: {' '.join(cmd)} exited {done.returncode}:\n{done.stderr}")
    return json.loads(done.stdout)


def main() -> int:
    if len(sys.argv) != 4:
        print(__doc__)
        return 2
    train, inference, attention = sys.argv[1], sys.argv[2], sys.argv[3]
    failures: list[str] = []

    def check(report: dict, key: str, what: str, name) -> None:
        for r in report["results"]:
            count = r[key]
            print(f"{name(r)}: {count} allocations in {r['steps']} timed {what}")
            if count != 0:
                failures.append(f"{name(r)}: {count} allocations in {r['steps']} steady {what}")

    for threads in (2, 1):
        check(run([train, "--models=mlp,lenet,resnet20,gpt", f"--threads={threads}", "--warmup=2", "--steps=3",
                   "--loader"], threads),
              "allocations_in_timed_steps", "training steps",
              lambda r: f"{r['model']} training, {threads} thread(s)")
        check(run([inference, "--batches=1,2", f"--threads={threads}", "--warmup=2", "--steps=2"], threads),
              "allocations_in_timed_forwards", "forwards",
              lambda r: f"resnet50 inference b{r['batch']}, {threads} thread(s)")
        # The attention program prints one result, not a list: wrapped as one.
        check({"results": [run([attention, "--t=256", "--heads=4", f"--threads={threads}", "--warmup=2",
                                 "--steps=3"], threads)]},
              "allocations_in_timed_steps", "forward + backward pairs",
              lambda r: f"attention T=256, {threads} thread(s)")
    if failures:
        print("FAILED: a steady step allocated:\n  " + "\n  ".join(failures) +
              "\n(perf probe -x libc.so.6 malloc, then perf record -e probe_libc:malloc --call-graph dwarf, finds them)")
        return 1
    print("ok: no allocation in any steady step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
