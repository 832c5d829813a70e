#!/usr/bin/env python3
"""A HyperparameterSearch that loses a process (issue 51): 4 Gloo ranks as 2 groups under
`tessera-run --elastic` (a rank that dies does not stop the others), tests/train/search_fault_main.cpp.

  diverged     trial 1, group 1's first, reports a NaN loss: the reference
  kill rank 3  SIGKILL to world rank 3 (group 1) while it trains trial 1: ranks 0 to 2 finish; the
               log holds all 12 records (10 trained), trial 1 "failed" with a cause naming world rank 3, every
               other trial ok (or carried) and trained by group 0 after it; every trial's
               configuration, status and score and the best are the reference's; rank 2 (the
               survivor of group 1) ends idle with its group retired
  kill rank 0  SIGKILL to the coordinator during its group's second trial: ranks 1 to 3 stop with a
               CommError naming the coordinator, within the heartbeat timeout (the communicator's,
               TESSERA_COMM_TIMEOUT) and a few seconds

No launch may hang: each has a deadline, and a marker wait is bounded.

  search_fault_test.py --program build/tests/search_fault_gloo --launcher tools/tessera-run
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

COMM_TIMEOUT = 10.0  # seconds: TESSERA_COMM_TIMEOUT, and so the search's heartbeat timeout
LAUNCH_LIMIT = 120.0  # seconds a launch may take before the test calls it a hang
failures = []


def check(ok, what, detail=""):
    print(("ok    " if ok else "FAIL  ") + what + ("" if ok else "\n      " + str(detail).replace("\n", "\n      ")))
    sys.stdout.flush()
    if not ok:
        failures.append(what)


class Launch:
    """tessera-run --elastic -n 4 PROGRAM LOG MARKERS [extra], its output collected by a thread."""

    def __init__(self, args, work, name, extra=()):
        self.log = os.path.join(work, name + ".jsonl")
        self.markers = os.path.join(work, name + ".markers")
        os.makedirs(self.markers)
        env = dict(os.environ, TESSERA_COMM_TIMEOUT=str(COMM_TIMEOUT), OMP_NUM_THREADS="1")
        cmd = [sys.executable, args.launcher, "--elastic", "-n", "4", args.program, self.log, self.markers, *extra]
        print("$ " + " ".join(cmd))
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, errors="replace", start_new_session=True)
        self.lines = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")),
                                       daemon=True)
        self.reader.start()

    def wait_marker(self, name, seconds=60.0):
        """The process id in marker `name`, once a rank has written it; None after `seconds` or
        if the launch ended first."""
        path = os.path.join(self.markers, name)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with open(path) as f:
                    text = f.read().strip()
                if text:
                    return int(text)
            except FileNotFoundError:
                pass
            time.sleep(0.02)
        return None

    def finish(self):
        """(exit status or None on a hang, seconds, output)."""
        try:
            self.proc.wait(timeout=max(0.0, self.started + LAUNCH_LIMIT - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.reader.join(timeout=5)
            return None, time.monotonic() - self.started, "".join(self.lines)
        self.reader.join(timeout=5)
        return self.proc.returncode, time.monotonic() - self.started, "".join(self.lines)

    def records(self):
        try:
            with open(self.log) as f:
                return [json.loads(line) for line in f if line.strip()]
        except (OSError, ValueError) as e:
            return [{"error": f"cannot read {self.log}: {e}"}]


def best_line(out):
    return next((l.split("] ", 1)[-1] for l in out.splitlines() if "best trial" in l), None)


def outcome(records):
    """What must not depend on which group ran a trial or how it failed."""
    return [(r.get("trial"), r.get("config"), r.get("status"), r.get("score")) for r in records]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--program", required=True)
    parser.add_argument("--launcher", required=True, help="tools/tessera-run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tessera-search-fault-") as work:
        reference = Launch(args, work, "diverged", ["--diverge=1"])
        code, took, out = reference.finish()
        print(out)
        ref = reference.records()
        check(code == 0, f"diverged: the search ends with status 0 ({took:.1f} s, status {code})", out)
        check(len(ref) == 12 and ref[1].get("status") == "failed" and "diverged" in ref[1].get("error", ""),
              "diverged: 12 trials logged (10 trained, 2 elites carried), trial 1 failed as diverged", ref)
        ref_best = best_line(out)

        killed = Launch(args, work, "kill3")
        pid = killed.wait_marker("group1.trial1.rank3")
        check(pid is not None, "kill rank 3: rank 3 starts trial 1", "".join(killed.lines))
        if pid is not None:
            time.sleep(0.2)  # in the middle of the trial's 30 steps of 20 ms
            os.kill(pid, signal.SIGKILL)
        code, took, out = killed.finish()
        print(out)
        got = killed.records()
        check(code is not None, f"kill rank 3: the launch ends, no hang ({took:.1f} s, status {code})", out)
        for r in (0, 1, 2):
            check(f"[rank {r}] rank {r} done: 12 records" in out, f"kill rank 3: rank {r} finishes the search", out)
        check("[rank 2] rank 2 done: 12 records, group retired: yes" in out,
              "kill rank 3: rank 2, the survivor of group 1, ends with its group retired", out)
        check(len(got) == 12, f"kill rank 3: 12 trials logged ({len(got)})", got)
        if len(got) == 12:
            error = got[1].get("error", "")
            check(got[1].get("status") == "failed" and got[1].get("group") == 1,
                  "kill rank 3: trial 1 (group 1) is logged failed", got[1])
            check("world rank(s) 3" in error and "world ranks 2 to 3" in error,
                  "kill rank 3: its cause names world rank 3 and the group's ranks", error)
            print("      trial 1's error: " + error)
            others = [r for r in got[2:] if r.get("status") != "carried"]
            check(all(r.get("status") == "ok" and r.get("group") == 0 for r in others) and got[0].get("status") == "ok",
                  "kill rank 3: every other trial completes, after trial 1 on group 0", got)
            check(outcome(got) == outcome(ref), "kill rank 3: every trial's configuration, status and score are the "
                  "diverged run's", f"{outcome(got)}\n!=\n{outcome(ref)}")
        check(best_line(out) is not None and best_line(out) == ref_best,
              f"kill rank 3: the best is the diverged run's ({best_line(out)} / {ref_best})")

        stopped = Launch(args, work, "kill0")
        pid = stopped.wait_marker("group0.trial2.rank0")
        check(pid is not None, "kill rank 0: the coordinator starts its group's second trial", "".join(stopped.lines))
        if pid is not None:
            time.sleep(0.2)
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
        code, took, out = stopped.finish()
        print(out)
        check(code is not None and code != 0,
              f"kill rank 0: the launch ends with a failure, no hang (status {code})", out)
        if pid is not None:
            since = time.monotonic() - killed_at
            check(since < COMM_TIMEOUT + 10, f"kill rank 0: the survivors stop within the heartbeat timeout "
                  f"({COMM_TIMEOUT:.0f} s) and 10 s ({since:.1f} s after the kill)", out)
        for r in (1, 2, 3):
            lines = [l for l in out.splitlines() if l.startswith(f"[rank {r}]") and "CommError" in l]
            check(any("the coordinator (world rank 0) stopped answering" in l for l in lines),
                  f"kill rank 0: rank {r} stops with a CommError naming the coordinator", out)
    if failures:
        print(f"{len(failures)} check(s) failed:\n  " + "\n  ".join(failures))
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
