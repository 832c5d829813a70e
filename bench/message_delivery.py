#!/usr/bin/env python3
"""Does the rank's own error reach the user under mpirun, with the machine busy?

  python3 bench/message_delivery.py [--build build] [--trials 20] [--ranks 3] [--load N] [--out FILE]

Under mpirun a rank that times out calls MPI_Abort, and mpirun then kills every rank; the text the
rank printed just before travels through mpirun's output forwarding, which MPI_Abort used to
outrun (the text reached the user in 3 of 5 runs, 0 of 6 with another process busy). Each trial
here starts tests/comm/fault_mpi in its "stall" mode (40 matching all_reduces, then rank 1 sleeps
instead of joining call #42) with TESSERA_COMM_TIMEOUT=--timeout and TESSERA_ERROR_DIR set, while
--load busy processes (default: one per core) keep every core at 100 %. A trial is delivered when
mpirun's output holds the waiting ranks' error naming the call, the timeout and the rank that did
not reach it ("MpiComm all_reduce(float32 x 1000, sum) on rank 0 of 3 (call #42): timed out after
2 s; reached call #42: ranks 0, 2; not reached: rank 1 (...)"), and the error file of each waiting
rank (TESSERA_ERROR_DIR/rank<R>.txt) holds it too. Goal: every trial. JSON (one line) goes to
--out (default bench/out/message_delivery_<date>.json) with the CPU model.
"""
import argparse
import datetime
import json
import multiprocessing
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import cpu_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))




def busy(stop_after):
    # Bounded: a load process ends by itself even if the script is killed.
    end = time.monotonic() + stop_after
    x = 0
    while time.monotonic() < end:
        for _ in range(100000):
            x += 1


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--load", type=int, default=os.cpu_count() or 2, help="busy processes during the trials")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "out",
                                                      f"message_delivery_{datetime.date.today().isoformat()}.json"))
    args = parser.parse_args()
    program = os.path.join(args.build, "tests", "fault_mpi")
    mpirun = shutil.which("mpirun")
    if not os.path.exists(program) or mpirun is None:
        sys.exit(f"message_delivery.py: needs {program} (meson -Dtests=enabled -Dmpi=enabled) and mpirun")
    if args.ranks < 3:
        sys.exit("message_delivery.py: --ranks must be >= 3 (rank 1 stalls; ranks 0 and 2 report it)")
    waiting = [r for r in range(args.ranks) if r != 1]
    expected = re.compile(r"MpiComm all_reduce\(float32 x 1000, sum\) on rank (\d+) of %d \(call #42\): timed out after "
                          r"[0-9.]+ s; reached call #42: ranks [0-9, ]+; not reached: rank 1 \(" % args.ranks)
    load = [multiprocessing.Process(target=busy, args=(args.trials * (args.timeout + 30) + 60,), daemon=True)
            for _ in range(args.load)]
    for p in load:
        p.start()
    trials = []
    try:
        for t in range(args.trials):
            error_dir = tempfile.mkdtemp(prefix="tessera-errors-")
            env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
            argv = [mpirun, "--oversubscribe", "-n", str(args.ranks), "-x", f"TESSERA_COMM_TIMEOUT={args.timeout}",
                    "-x", f"TESSERA_ERROR_DIR={error_dir}", program, "stall"]
            start = time.monotonic()
            try:
                proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=env, timeout=args.timeout + 120)
                text, status = proc.stdout.decode("utf-8", "replace"), proc.returncode
            except subprocess.TimeoutExpired as e:
                text, status = (e.stdout or b"").decode("utf-8", "replace"), None
            took = time.monotonic() - start
            in_output = sorted({int(m.group(1)) for m in expected.finditer(text)})
            in_files = []
            for r in waiting:
                try:
                    with open(os.path.join(error_dir, f"rank{r}.txt")) as f:
                        if expected.search(f.read()):
                            in_files.append(r)
                except OSError:
                    pass
            shutil.rmtree(error_dir, ignore_errors=True)
            delivered = bool(in_output) and in_files == waiting
            trials.append({"status": status, "seconds": took, "ranks_in_output": in_output, "ranks_in_files": in_files,
                           "delivered": delivered})
            print(f"trial {t + 1}: {'delivered' if delivered else 'NOT delivered'} (in output: ranks {in_output}; "
                  f"error files: ranks {in_files}; status {status}, {took:.1f} s)", file=sys.stderr, flush=True)
            if not delivered:
                print(text[-3000:], file=sys.stderr)
    finally:
        for p in load:
            p.terminate()
    row = {"bench": "message_delivery", "launcher": "mpirun", "scenario": "stall (rank 1 never reaches call #42)",
           "ranks": args.ranks, "timeout_s": args.timeout, "load_processes": args.load, "trials": len(trials),
           "delivered_output_and_files": sum(t["delivered"] for t in trials),
           "in_output": sum(bool(t["ranks_in_output"]) for t in trials),
           "every_waiting_rank_in_output": sum(t["ranks_in_output"] == waiting for t in trials),
           "error_files_complete": sum(t["ranks_in_files"] == waiting for t in trials),
           "seconds_median": statistics.median(t["seconds"] for t in trials),
           "cpu": cpu_model(), "cores": os.cpu_count(), "date": datetime.date.today().isoformat()}
    print(json.dumps(row))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(json.dumps(row) + "\n")
    print(f"delivered {row['delivered_output_and_files']}/{row['trials']} under {args.load} busy processes "
          f"(goal: all)", file=sys.stderr)
    return 0 if row["delivered_output_and_files"] == row["trials"] else 1


if __name__ == "__main__":
    sys.exit(main())
