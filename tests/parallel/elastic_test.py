#!/usr/bin/env python3
"""Elastic resume over a process backend: checkpoints taken mid-epoch at 2 and 4 ranks (DataParallel,
Zero1, and FullyShardedDataParallel's directory of per-rank shards) resume at 1 and 4, and at 2, each ending where an uninterrupted run ends (the program compares and exits 1
otherwise; tests/parallel/elastic_main.cpp); resuming at 3 ranks, which cannot split the global
batch of 16, fails naming the file, both world sizes and the batch.

  elastic_test.py --program build/tests/elastic_mpi --mpirun /usr/bin/mpirun
  elastic_test.py --program build/tests/elastic_gloo --launcher tools/tessera-run
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--program", required=True)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--mpirun", help="run ranks with this mpirun (--oversubscribe)")
    group.add_argument("--launcher", help="run ranks with this tessera-run")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per launch")
    args = parser.parse_args()

    def launch(n, *program_args):
        if args.mpirun:
            cmd = [args.mpirun, "--oversubscribe", "-n", str(n), args.program, *program_args]
        else:
            cmd = [sys.executable, args.launcher, "-n", str(n), args.program, *program_args]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                               stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            print(f"TIMEOUT after {args.timeout} s: {' '.join(cmd)}\n{e.stdout or ''}{e.stderr or ''}")
            return 124, ""
        print(f"$ {' '.join(cmd)}  -> exit {p.returncode}")
        out = p.stdout + p.stderr
        sys.stdout.write(out)
        return p.returncode, out

    failures = []
    work = tempfile.mkdtemp(prefix="tessera-elastic-")
    try:
        for saved, resumes in ((2, (1, 4)), (4, (2,))):
            prefix = os.path.join(work, f"n{saved}")
            rc, _ = launch(saved, "save", prefix)
            if rc != 0:
                failures.append(f"save at {saved} ranks: exit {rc}")
                continue
            for m in resumes:
                rc, out = launch(m, "resume", prefix)
                lines = [l for l in out.splitlines() if f" {saved} -> {m} " in l]
                if rc != 0 or len(lines) != 3:
                    failures.append(f"resume {saved} -> {m}: exit {rc}, {len(lines)} result lines (want 3)")
        # 3 ranks cannot split 16: the ranks fail with the message (every rank, which the ThreadComm
        # test checks; a launcher stops the others once the first has exited).
        prefix = os.path.join(work, "n2")
        rc, out = launch(3, "resume", prefix, "--per-rank-batch=5")
        want = (f"'{prefix}.dp.safetensors' was saved by a run at world size 2 (2 ranks) with a global batch of 16 "
                f"(8 per rank); this run has world size 3, which does not divide the global batch 16")
        if rc == 0 or want not in out:
            failures.append(f"resume 2 -> 3: exit {rc}, and the output lacks the refusal: {want}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for f in failures:
        print("FAILED", f)
    print("elastic resume:", "ok" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
