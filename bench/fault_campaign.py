#!/usr/bin/env python3
"""Fault campaign: kill -9 or SIGSTOP a random rank at a random time of real data-parallel training.

  python3 bench/fault_campaign.py [--build build] [--backends mpi,gloo] [--ranks 2,3]
                                  [--faults kill,stop] [--trials 100] [--timeout 3] [--out FILE]

Each trial starts examples/04_data_parallel_<backend> (LeNet-5 on Fashion-MNIST, long enough
that the fault lands mid-training) the way a user does: `mpirun -n N` for MPI, `tools/tessera-run
-n N` for Gloo, with TESSERA_COMM_TIMEOUT=<timeout>. After a random delay (uniform in
[--min-delay, --max-delay] seconds from the start, so faults land in start-up, rendezvous and
training) it sends SIGKILL or SIGSTOP to a random rank's process, then waits for the job to end.
Per trial it records:

  hang          the job had not ended 2 x timeout + --grace seconds after the fault (it is then
                killed; goal: 0)
  in_time       the job ended within 2 x timeout of the fault (goal: 100 %)
  op_named      the output names a collective of a Tessera communicator ("MpiComm all_reduce(",
                "GlooComm barrier()", ...), or a survivor says it had not called one yet (the fault
                came during start-up; goal: 100 %)
  peer_named    the output names the faulted rank as the one that died, stopped or is missing
                ("no answer: rank 1", "not reached: rank 1", "(peer: rank 1)", mpirun's "rank 1
                with PID", tessera-run's "rank 1 ..."; goal: 100 %)

A trial whose fault came after the job ended by itself (too late), or whose victim ended between
being found and being signalled, is counted apart and redrawn.
Results go to one JSON line per (backend, ranks, fault) in --out (default
bench/out/fault_campaign_<date>.json), with the CPU model; a table is printed at the end.
This is a benchmark-style script, not a test: it runs for a long time (about 8 s per trial).
"""
import argparse
import datetime
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import cpu_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The operation a survivor was in, or, when the fault came before any collective (a rank killed
# while the others still load data), the survivor saying so.
OP_RE = re.compile(r"(MpiComm|GlooComm|NcclComm) (all_reduce|broadcast|all_gather|reduce_scatter|barrier|split)\(|"
                   r"had not called a collective yet")




class Job:
    """The launcher process, its output collected by a thread."""

    def __init__(self, argv, env):
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.lines = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in iter(self.proc.stdout.readline, b""):
            self.lines.append(line.decode("utf-8", "replace"))

    def text(self):
        self.reader.join(timeout=2)
        return "".join(self.lines)

    def kill_all(self):
        try:
            os.killpg(self.proc.pid, signal.SIGCONT)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def descends_from(pid, ancestor):
    for _ in range(16):
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
    return False


def rank_pids(launcher_pid, program_name):
    """PIDs of the rank processes under the launcher, by rank (read from their environment)."""
    pids = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            if not cmd or os.path.basename(cmd[0].decode(errors="replace")) != program_name:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            if not descends_from(int(entry), launcher_pid):
                continue
            rank = env.get(b"OMPI_COMM_WORLD_RANK") or env.get(b"TESSERA_RANK")
            if rank is not None:
                pids[int(rank)] = int(entry)
        except (OSError, ValueError):
            continue
    return pids


def trial(args, backend, n, fault, rng):
    program = os.path.join(args.build, "examples", f"04_data_parallel_{backend}")
    batch = 64 if 64 % n == 0 else 96  # a global batch every rank count here divides
    flags = ["--epochs=1000", f"--limit={args.limit}", f"--batch={batch}"]
    env = dict(os.environ, TESSERA_COMM_TIMEOUT=str(args.timeout), OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    if backend == "mpi":
        argv = ["mpirun", "--oversubscribe", "-n", str(n), "-x", f"TESSERA_COMM_TIMEOUT={args.timeout}", program] + flags
    else:
        argv = [sys.executable, os.path.join(ROOT, "tools", "tessera-run"), "-n", str(n), program] + flags
    job = Job(argv, env)
    delay = rng.uniform(args.min_delay, args.max_delay)
    victim = rng.randrange(n)
    start = time.monotonic()
    pids = {}
    while time.monotonic() - start < delay and job.proc.poll() is None:
        time.sleep(0.02)
        if len(pids) < n:
            pids = rank_pids(job.proc.pid, os.path.basename(program))
    if job.proc.poll() is not None or victim not in pids:
        text = job.text()
        job.kill_all()
        return {"too_late": True, "text": text[-2000:]}
    try:
        os.kill(pids[victim], signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    except ProcessLookupError:  # the rank ended between the look-up and the signal: redraw
        text = job.text()
        job.kill_all()
        return {"too_late": True, "text": text[-2000:]}
    faulted = time.monotonic()
    limit = 2 * args.timeout + args.grace
    while job.proc.poll() is None and time.monotonic() - faulted < limit:
        time.sleep(0.02)
    took = time.monotonic() - faulted
    hang = job.proc.poll() is None
    if hang:
        job.kill_all()
    text = job.text()
    job.kill_all()  # a stopped rank the launcher left behind
    # The victim may follow survivors that already gave up and exited: "no answer: rank 0 (...); rank 1 (...)".
    peer_patterns = [rf"(no answer|not reached): (rank \d+ \([^)]*\); )*rank {victim} \(", rf"\(peer: rank {victim}\)",
                     rf"process rank {victim} with PID", rf"tessera-run: rank {victim} ", rf"rank\(s\) {victim} never joined"]
    return {
        "too_late": False, "victim": victim, "delay_s": round(delay, 3), "took_s": round(took, 3), "hang": hang,
        "in_time": not hang and took <= 2 * args.timeout, "status": job.proc.returncode,
        "op_named": OP_RE.search(text) is not None,
        "peer_named": any(re.search(p, text) for p in peer_patterns),
        "text": text[-3000:],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--backends", default="mpi,gloo")
    parser.add_argument("--ranks", default="2,3")
    parser.add_argument("--faults", default="kill,stop")
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--grace", type=float, default=30.0, help="seconds past 2 x timeout before a trial is a hang")
    parser.add_argument("--min-delay", type=float, default=0.5)
    parser.add_argument("--max-delay", type=float, default=5.0)
    parser.add_argument("--limit", type=int, default=4096, help="training images per epoch")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--failures-dir", help="write the output of every failed trial here")
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows already in --out and run only the (backend, ranks, fault) not there")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "out",
                                                      f"fault_campaign_{datetime.date.today().isoformat()}.json"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows = []
    if args.resume and os.path.exists(args.out):
        with open(args.out) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    done = {(r["backend"], r["ranks"], r["fault"]) for r in rows}

    def save():  # after every (backend, ranks, fault): a long campaign keeps what it measured
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    for backend in args.backends.split(","):
        program = os.path.join(args.build, "examples", f"04_data_parallel_{backend}")
        if not os.path.exists(program):
            print(f"skipping {backend}: {program} not built", file=sys.stderr)
            continue
        for n in (int(r) for r in args.ranks.split(",")):
            for fault in args.faults.split(","):
                if (backend, n, fault) in done:
                    continue
                results, too_late = [], 0
                while len(results) < args.trials:
                    r = trial(args, backend, n, fault, rng)
                    if r["too_late"]:
                        too_late += 1
                        if too_late > args.trials:
                            sys.exit(f"fault_campaign.py: {backend} jobs end before the fault; last output:\n{r['text']}")
                        continue
                    results.append(r)
                    ok = not r["hang"] and r["in_time"] and r["op_named"] and r["peer_named"]
                    ended = "hang" if r["hang"] else "ended in %.2f s" % r["took_s"]
                    print(f"{backend} n={n} {fault} #{len(results)}: rank {r['victim']} at {r['delay_s']} s -> {ended}, "
                          f"op {'named' if r['op_named'] else 'NOT named'}, "
                          f"peer {'named' if r['peer_named'] else 'NOT named'}", file=sys.stderr, flush=True)
                    if not ok and args.failures_dir:
                        os.makedirs(args.failures_dir, exist_ok=True)
                        with open(os.path.join(args.failures_dir, f"{backend}_{n}_{fault}_{len(results)}.txt"), "w") as f:
                            f.write(json.dumps({k: v for k, v in r.items() if k != "text"}) + "\n" + r["text"])
                took = [r["took_s"] for r in results if not r["hang"]]
                row = {"bench": "fault_campaign", "backend": backend, "ranks": n, "fault": fault, "trials": len(results),
                       "timeout_s": args.timeout, "hangs": sum(r["hang"] for r in results),
                       "in_time": sum(r["in_time"] for r in results), "op_named": sum(r["op_named"] for r in results),
                       "peer_named": sum(r["peer_named"] for r in results), "faults_too_late_redrawn": too_late,
                       "exit_s_median": statistics.median(took) if took else None, "exit_s_max": max(took) if took else None,
                       "cpu": cpu_model(), "cores": os.cpu_count()}
                rows.append(row)
                save()
                print(json.dumps(row), flush=True)
    save()
    print(f"\n{'backend':8} {'n':>2} {'fault':6} {'trials':>6} {'hangs':>6} {'<=2xT':>7} {'op':>7} {'peer':>7} {'median s':>9}",
          file=sys.stderr)
    for r in rows:
        t = r["trials"]
        print(f"{r['backend']:8} {r['ranks']:>2} {r['fault']:6} {t:>6} {r['hangs']:>6} {r['in_time']:>3}/{t:<3} "
              f"{r['op_named']:>3}/{t:<3} {r['peer_named']:>3}/{t:<3} {r['exit_s_median'] or 0:>9.2f}", file=sys.stderr)


if __name__ == "__main__":
    main()
