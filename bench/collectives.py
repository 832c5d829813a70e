#!/usr/bin/env python3
"""Runs the collectives benchmark for every communicator built and summarizes it.

  python3 bench/collectives.py [--build build] [--ranks 2,4] [--max-bytes 268435456]
                               [--rounds 5] [--round-seconds 0.1] [--out FILE]

ThreadComm, MpiComm (under mpirun) and GlooComm (under tools/tessera-run with a fresh file
store) each run bench/collectives_<backend>.cpp on 2 and 4 ranks; every binary times Tessera's call and the
raw library call for the same sizes in alternating rounds (see collectives.hpp). All rows go to
one JSON file (default bench/out/collectives_<date>.json), and a summary is printed:

  * MPI and Gloo all_reduce: Tessera's time / the raw call's time for every size >= 1 MiB
    (target: <= 1.05). For Gloo the raw call is the faster of gloo::allreduce's ring and bcube at
    that size (GlooComm runs its own sync-pair path up to 4 MiB and the ring above).
  * ThreadComm all_reduce on 2 ranks: busbw / STREAM triad (2 threads) measured in the same run
    (target: >= 0.5).
"""
import argparse
import datetime
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(argv, env=None):
    print("$ " + " ".join(argv), file=sys.stderr, flush=True)
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=None, env=env, text=True)
    if proc.returncode != 0:
        sys.exit(f"collectives.py: {argv[0]} exited with status {proc.returncode}")
    rows = []
    for line in proc.stdout.splitlines():
        line = line.strip()
        if line.startswith("[rank"):
            line = line.split("] ", 1)[1]
        if line.startswith("{"):
            rows.append(json.loads(line))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--max-bytes", default=str(256 << 20))
    parser.add_argument("--rounds", default="5")
    parser.add_argument("--round-seconds", default="0.1")
    parser.add_argument("--only", default="threads,mpi,gloo", help="comma list of communicators to run")
    parser.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter,broadcast")
    parser.add_argument("--min-bytes", default=str(4 << 10))
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "out",
                                                      f"collectives_{datetime.date.today().isoformat()}.json"))
    args = parser.parse_args()
    common = ["--min-bytes", args.min_bytes, "--max-bytes", args.max_bytes, "--rounds", args.rounds,
              "--round-seconds", args.round_seconds, "--ops", args.ops]
    ranks = [int(r) for r in args.ranks.split(",")]
    only = args.only.split(",")
    bench = os.path.join(args.build, "bench")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    rows = []
    if "threads" in only:
        rows += run([os.path.join(bench, "collectives_threads"), "--ranks", args.ranks] + common, env)
    if "mpi" in only and os.path.exists(os.path.join(bench, "collectives_mpi")):
        for n in ranks:
            rows += run(["mpirun", "--oversubscribe", "-n", str(n), os.path.join(bench, "collectives_mpi")] + common, env)
    if "gloo" in only and os.path.exists(os.path.join(bench, "collectives_gloo")):
        for n in ranks:
            rows += run([sys.executable, os.path.join(ROOT, "tools", "tessera-run"), "--no-prefix", "-n", str(n),
                         os.path.join(bench, "collectives_gloo")] + common, env)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} rows to {args.out}", file=sys.stderr)
    summarize(rows)


def find(rows, **match):
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def summarize(rows):
    print("\nall_reduce, Tessera vs the raw library call (time ratio; <= 1.05 is the target at >= 1 MiB)")
    print(f"{'comm':6} {'n':>2} {'bytes':>11} {'tessera us':>11} {'raw us':>11} {'ratio':>6}  raw call")
    worst = {}
    for comm in ("mpi", "gloo"):
        for t in find(rows, bench="collectives", comm=comm, op="all_reduce", impl="tessera"):
            if comm == "mpi":
                raw_name = "raw MPI_Allreduce"
            else:
                both = [r for name in ("ring", "bcube") for r in find(
                    rows, bench="collectives", comm=comm, op="all_reduce", impl="raw gloo::allreduce " + name,
                    ranks=t["ranks"], bytes=t["bytes"])]
                raw_name = min(both, key=lambda r: r["time_us"])["impl"] if both else ""
            raw = find(rows, bench="collectives", comm=comm, op="all_reduce", impl=raw_name, ranks=t["ranks"],
                       bytes=t["bytes"])
            if not raw:
                continue
            ratio = t["time_us"] / raw[0]["time_us"]
            print(f"{comm:6} {t['ranks']:>2} {t['bytes']:>11} {t['time_us']:>11.1f} {raw[0]['time_us']:>11.1f} "
                  f"{ratio:>6.3f}  {raw_name}")
            if t["bytes"] >= 1 << 20:
                key = (comm, t["ranks"])
                worst[key] = max(worst.get(key, 0), ratio)
    for (comm, n), ratio in sorted(worst.items()):
        print(f"  {comm} on {n} ranks: worst ratio at >= 1 MiB = {ratio:.3f} ({'meets' if ratio <= 1.05 else 'misses'} <= 1.05)")
    triads = find(rows, bench="stream_triad", threads=2)
    if triads:
        triad = min(t["GBps"] for t in triads)  # the lower of the before/after readings: conservative
        print(f"\nThreadComm all_reduce on 2 ranks vs STREAM triad with 2 threads ({triad:.2f} GB/s, lower of two readings)")
        print(f"{'bytes':>11} {'busbw GB/s':>11} {'/ triad':>8}")
        for t in find(rows, bench="collectives", comm="threads", op="all_reduce", ranks=2):
            print(f"{t['bytes']:>11} {t['busbw_GBps']:>11.2f} {t['busbw_GBps'] / triad:>8.2f}")


if __name__ == "__main__":
    main()
