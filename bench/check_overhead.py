#!/usr/bin/env python3
"""Cost of the default-on call check (comm/call_check.hpp) on small all_reduces.

  python3 bench/check_overhead.py [--build build] [--ranks 2] [--bytes 4096] [--pairs 7] [--out FILE]

For MPI (mpirun) and Gloo (tools/tessera-run) it runs bench/collectives_<backend> for one
all_reduce size in alternating pairs of jobs: one with the default check (the first 32 calls,
then every 16th; TESSERA_COMM_CHECK_EVERY unset) and one with the sampled check off
(TESSERA_COMM_CHECK_EVERY=0: only the first 32 calls, all of them in the warm-up). Each job
reports the median time of Tessera's call over its rounds; the script reports the median over
pairs of (default / off) - 1 as the overhead. Target: <= 15 % at 4 KiB.

  python3 bench/check_overhead.py --dp [--model lenet] [--steps 200] ...

The same for data-parallel training (bench/dp_scaling_<backend>, LeNet-5, 64 images per rank):
every check on as shipped (the call check, DataParallel's construction-time agreement check and
its replica checksum every 100 steps, timed steps >= 100 so the checksum is inside the timing)
against all of them off (TESSERA_COMM_CHECK_EVERY=0, --consistency-check-every=0); the overhead is
the median over pairs of (images/s off / images/s on) - 1. Target: <= 2 %.
The JSON (default bench/out/check_overhead_<date>.json) names the CPU model.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import cpu_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))




def json_rows(argv, env):
    """Runs one job; returns the JSON lines it printed (any rank, "[rank R] " prefixes removed)."""
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True, timeout=600)
    if proc.returncode != 0:
        sys.exit(f"check_overhead.py: {' '.join(argv)} exited with status {proc.returncode}: {proc.stderr[-2000:]}")
    rows = []
    for line in proc.stdout.splitlines():
        line = line.strip()
        if line.startswith("[rank"):
            line = line.split("] ", 1)[1]
        if line.startswith("{"):
            rows.append(json.loads(line))
    return rows


def tessera_us(argv, env):
    times = [r["time_us"] for r in json_rows(argv, env) if r.get("impl") == "tessera" and r.get("op") == "all_reduce"]
    if not times:
        sys.exit(f"check_overhead.py: no Tessera all_reduce row from {argv}")
    return max(times)  # the slowest rank's median: what the job waits for


def dp_images_per_second(argv, env):
    for row in json_rows(argv, env):
        if row.get("bench") == "dp_scaling":
            return row["images_per_second"]
    sys.exit(f"check_overhead.py: no dp_scaling row from {argv}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--ranks", default="2")
    parser.add_argument("--bytes", default="4096")
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--rounds", default="7")
    parser.add_argument("--round-seconds", default="0.2")
    parser.add_argument("--only", default="mpi,gloo")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "out",
                                                      f"check_overhead_{datetime.date.today().isoformat()}.json"))
    parser.add_argument("--dp", action="store_true", help="data-parallel training instead of all_reduce latency")
    parser.add_argument("--model", default="lenet")
    parser.add_argument("--steps", default="200")
    args = parser.parse_args()
    if args.dp and args.out.endswith(f"check_overhead_{datetime.date.today().isoformat()}.json"):
        args.out = args.out.replace("check_overhead_", "check_overhead_dp_")
    bench = os.path.join(args.build, "bench")
    common = ["--ops", "all_reduce", "--min-bytes", args.bytes, "--max-bytes", args.bytes, "--rounds", args.rounds,
              "--round-seconds", args.round_seconds]
    base_env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    for var in ("TESSERA_COMM_CHECK_EVERY", "TESSERA_COMM_DEBUG"):
        base_env.pop(var, None)
    results = []
    for comm in args.only.split(","):
        binary = os.path.join(bench, f"dp_scaling_{comm}" if args.dp else f"collectives_{comm}")
        if not os.path.exists(binary):
            print(f"skipping {comm}: {binary} not built", file=sys.stderr)
            continue
        for n in args.ranks.split(","):
            flags = (["--model", args.model, "--steps", args.steps, "--warmup", "5"] if args.dp else common)
            if comm == "mpi":
                argv = ["mpirun", "--oversubscribe", "-n", n, binary] + flags
            else:
                # One rank per core where they fit, as mpirun binds MPI's ranks (and dp_scaling.py Gloo's).
                bind = ["--bind-to", "core"] if int(n) <= len(os.sched_getaffinity(0)) else []
                argv = [sys.executable, os.path.join(ROOT, "tools", "tessera-run"), "--no-prefix"] + bind + ["-n", n, binary] + flags
            if args.dp:
                results.append(dp_pairs(args, comm, n, argv, base_env))
                print(json.dumps(results[-1]))
                continue
            ratios, on, off = [], [], []
            for i in range(args.pairs):
                # Alternate which goes first, so a drift in machine load does not favour one side.
                order = [("on", base_env), ("off", dict(base_env, TESSERA_COMM_CHECK_EVERY="0"))]
                if i % 2:
                    order.reverse()
                t = {name: tessera_us(argv, env) for name, env in order}
                on.append(t["on"])
                off.append(t["off"])
                ratios.append(t["on"] / t["off"])
                print(f"{comm} n={n} pair {i}: checked {t['on']:.2f} us, unchecked {t['off']:.2f} us, "
                      f"ratio {ratios[-1]:.3f}", file=sys.stderr, flush=True)
            row = {"bench": "check_overhead", "comm": comm, "ranks": int(n), "bytes": int(args.bytes),
                   "checked_us_median": statistics.median(on), "unchecked_us_median": statistics.median(off),
                   "overhead_median": statistics.median(ratios) - 1, "pairs": args.pairs,
                   "check": "first 32 calls, then every 16th", "cpu": cpu_model(), "cores": os.cpu_count(),
                   "argv": argv}
            results.append(row)
            print(json.dumps(row))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    if args.dp:
        with open(args.out, "w") as f:
            for row in results:
                f.write(json.dumps(row) + "\n")
        for row in results:
            print(f"{row['comm']} {row['ranks']} ranks, {row['model']} training: overhead "
                  f"{100 * row['overhead_median']:.2f} % (target <= 2 %)", file=sys.stderr)
        return
    with open(args.out, "w") as f:
        for row in results:
            f.write(json.dumps(row) + "\n")
    for row in results:
        print(f"{row['comm']} {row['ranks']} ranks, {row['bytes']} B all_reduce: overhead "
              f"{100 * row['overhead_median']:.1f} % (target <= 15 %)", file=sys.stderr)


def dp_pairs(args, comm, n, argv, base_env):
    """Alternating pairs of training jobs: every check on (as shipped) vs every check off."""
    off_env = dict(base_env, TESSERA_COMM_CHECK_EVERY="0")
    ratios, on, off = [], [], []
    for i in range(args.pairs):
        order = [("on", argv, base_env), ("off", argv + ["--consistency-check-every", "0"], off_env)]
        if i % 2:
            order.reverse()
        t = {name: dp_images_per_second(a, env) for name, a, env in order}
        on.append(t["on"])
        off.append(t["off"])
        ratios.append(t["off"] / t["on"])
        print(f"{comm} n={n} pair {i}: checked {t['on']:.0f} img/s, unchecked {t['off']:.0f} img/s, "
              f"overhead {100 * (ratios[-1] - 1):.2f} %", file=sys.stderr, flush=True)
    return {"bench": "check_overhead_dp", "comm": comm, "ranks": int(n), "model": args.model, "batch_per_rank": 64,
            "timed_steps": int(args.steps), "checked_images_per_second_median": statistics.median(on),
            "unchecked_images_per_second_median": statistics.median(off),
            "overhead_median": statistics.median(ratios) - 1, "pairs": args.pairs,
            "checks": "call check (first 32, then every 16th), construction agreement, replica checksum every 100 steps",
            "cpu": cpu_model(), "cores": os.cpu_count(), "argv": argv}


if __name__ == "__main__":
    main()
