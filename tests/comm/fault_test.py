#!/usr/bin/env python3
"""Failure scenarios for the multi-process communicators (run by tests/meson.build).

Each scenario starts ranks of tests/comm/fault_main.cpp with a short timeout and checks that the
job ends -- never hangs -- within 2x that timeout, with an error that names the operation and
the rank, and (for Gloo) the missing peer or phase:

  kill during all_reduce / barrier   kill -9 one rank in the middle of a long loop
  stall                              one rank never calls the collective
  mismatch catalogue                 default settings (no debug mode): rank 0 calls all_reduce with
                                     another count, type or op, broadcast with another root, or
                                     broadcast where the others all_reduce; also after 100 good
                                     calls (a call the sampled check skips). Every rank must fail
                                     naming every rank's call; none may return or crash silently
  stall                              also: the warning at the stall threshold and the final error
                                     say which ranks reached the call and which did not
  join (Gloo)                        world size 3 but only ranks 0 and 1 start
  rendezvous (Gloo)                  a rank of another world size, a rank killed after it joined,
                                     and a second job in a store another job used: each named at
                                     once, not at the (120 s) timeout
  throw                              rank 1 fails with an ordinary error (a corrupt image) while the
                                     others wait in an all_reduce, under a 120 s timeout: the job
                                     must end in seconds with rank 1's error, not at the timeout
  ps (Gloo, --ps-program)            kill -9 a parameter-server worker: the server stops naming it;
                                     SIGSTOP one under a 120 s timeout: the server warns naming it

Gloo and NCCL ranks are started directly (not through tessera-run, which would stop the survivors
itself) so that each survivor's own error is observed; NCCL needs one GPU per rank (3). Under mpirun the launcher ends the job when a
rank dies, which is the MPI way; the test checks that it does so in time and names the rank.
"""
import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

TIMEOUT = 3.0  # seconds, passed as TESSERA_COMM_TIMEOUT
MPIRUN_TEARDOWN = 15.0  # seconds mpirun may take, after MPI_Abort, to kill a stalled rank
# The throw scenario: a timeout long enough that ending by it fails the check, which allows a
# few seconds for the failing rank to say its error and end the job (MPI: then mpirun's teardown).
SLOW_TIMEOUT = 120.0
THROW_LIMIT = 5.0
ORDINARY_ERROR = "shard1/img_7.png: not a PNG file"
failures = []
# The store-based backends share the scenarios: the label in the report, the class named in
# errors, and what the backend can tell (set from the command line by its entry in the backend
# list): the rank that is gone, a stall report naming the ranks that did not reach the call, a
# late count mismatch at a call the sampled check skips.
STORE_BACKEND = {"label": "", "class": "", "dead_peer": False, "stall_report": False, "late_count": False}


def check(ok, what, detail=""):
    print(("ok    " if ok else "FAIL  ") + what + ("" if ok else "\n      " + detail.replace("\n", "\n      ")))
    sys.stdout.flush()
    if not ok:
        failures.append(what)


class Rank:
    """One process with its output collected by threads (so pipes never fill up)."""

    def __init__(self, argv, env):
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.out, self.err = [], []
        self.ended_at = None
        self.threads = [threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
                        threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True)]
        for t in self.threads:
            t.start()

    @staticmethod
    def _read(stream, sink):
        for line in iter(stream.readline, b""):
            sink.append(line.decode("utf-8", "replace"))

    def text(self):
        return "".join(self.out) + "".join(self.err)

    def wait(self, deadline):
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None
        for t in self.threads:
            t.join(timeout=5)
        return self.proc.returncode

    def outcome(self, since, limit):
        """Waits until `since` + `limit` (monotonic seconds): the exit status (None if still
        running), the seconds from `since` to the end of the wait, and the output."""
        code = self.wait(since + limit)
        return code, time.monotonic() - since, self.text()

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def wait_ready(ranks, seconds=120):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(any("ready" in line for line in r.out) for r in ranks):
            return True
        if any(r.proc.poll() is not None for r in ranks):
            return False
        time.sleep(0.02)
    return False


def base_env(extra=None):
    env = dict(os.environ)
    for k in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(k, None)
    env["TESSERA_COMM_TIMEOUT"] = str(TIMEOUT)
    # One OpenMP thread per rank, as tessera-run and an MPI user set it: the ranks started here
    # directly would each spin a thread per CPU against the others.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


# ---------------------------------------------------------------- Gloo (ranks started directly)

def gloo_start(program, mode, size, ranks_to_start, store, extra=None):
    ranks = []
    for r in ranks_to_start:
        env = base_env({"TESSERA_RANK": str(r), "TESSERA_WORLD_SIZE": str(size), "TESSERA_STORE": "file://" + store})
        env.update(extra or {})
        ranks.append(Rank([program, mode], env))
    return ranks


def gloo_kill_scenario(program, mode, op_name):
    with tempfile.TemporaryDirectory(prefix="tessera-fault-") as store:
        ranks = gloo_start(program, mode, 3, [0, 1, 2], store)
        try:
            ready = wait_ready(ranks)
            check(ready, f"{STORE_BACKEND['label']} {mode}: all 3 ranks started", "\n".join(r.text() for r in ranks))
            if not ready:
                return
            time.sleep(0.3)  # in the middle of the loop
            killed_at = time.monotonic()
            os.kill(ranks[1].proc.pid, signal.SIGKILL)
            for r, survivor in ((0, ranks[0]), (2, ranks[2])):
                code, took, text = survivor.outcome(killed_at, 2 * TIMEOUT + 1.0)
                check(code is not None and code != 0 and took <= 2 * TIMEOUT,
                      f"{STORE_BACKEND['label']} {mode}: rank {r} exits non-zero within 2x the timeout after rank 1 is killed "
                      f"({took:.2f} s, status {code})", text)
                # The kill may land in the call check's exchange before the operation ("... call check").
                check(re.search(rf"CommError: {STORE_BACKEND['class']} {op_name}\(.*\)( call check)? on rank {r} of 3", text)
                      is not None, f"{STORE_BACKEND['label']} {mode}: rank {r}'s error names the operation and its rank", text)
                # Rank 1 is among those that give no answer; a survivor that already gave up and exited
                # (rank 0 here, often within 0.1 s) may rightly be listed before it.
                check(not STORE_BACKEND["dead_peer"]
                      or re.search(r"no answer: (rank \d+ \([^)]*\); )*rank 1 \(", text) is not None,
                      f"{STORE_BACKEND['label']} {mode}: rank {r}'s error names rank 1 as the one that is gone", text)
                print("      " + (text.strip().splitlines() or ["(no output)"])[-1])
        finally:
            for r in ranks:
                r.kill()


def gloo_ps_kill(program):
    """A killed worker must not hang the parameter server: it exits with a CommError naming rank 1."""
    with tempfile.TemporaryDirectory(prefix="tessera-fault-") as store:
        ranks = []
        for r in range(3):
            env = base_env({"TESSERA_RANK": str(r), "TESSERA_WORLD_SIZE": "3", "TESSERA_STORE": "file://" + store})
            ranks.append(Rank([program], env))
        try:
            ready = wait_ready(ranks)
            check(ready, f"{STORE_BACKEND['label']} ps: server and 2 workers started", "\n".join(r.text() for r in ranks))
            if not ready:
                return
            time.sleep(0.3)
            killed_at = time.monotonic()
            os.kill(ranks[1].proc.pid, signal.SIGKILL)
            code, took, text = ranks[0].outcome(killed_at, 2 * TIMEOUT + 1.0)
            check(code == 3 and took <= 2 * TIMEOUT and "rank 1" in text and "CommError" in text,
                  f"{STORE_BACKEND['label']} ps: the server stops within 2x the timeout with a CommError naming "
                  f"rank 1 ({took:.2f} s, status {code})", text)
            print("      " + (text.strip().splitlines() or ["(no output)"])[-1])
        finally:
            for r in ranks:
                r.kill()


def gloo_ps_stop(program):
    """A stopped worker (SIGSTOP) under a long timeout: the server warns at the stall threshold,
    naming the worker, instead of staying silent until the timeout."""
    with tempfile.TemporaryDirectory(prefix="tessera-fault-") as store:
        ranks = []
        for r in range(3):
            env = base_env({"TESSERA_RANK": str(r), "TESSERA_WORLD_SIZE": "3", "TESSERA_STORE": "file://" + store,
                            "TESSERA_COMM_TIMEOUT": str(SLOW_TIMEOUT), "TESSERA_COMM_STALL_WARNING": "2"})
            ranks.append(Rank([program], env))
        try:
            ready = wait_ready(ranks)
            check(ready, f"{STORE_BACKEND['label']} ps stop: server and 2 workers started",
                  "\n".join(r.text() for r in ranks))
            if not ready:
                return
            os.kill(ranks[1].proc.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            needle = "warning: ParameterServer server 0: worker rank 1 has sent nothing for"
            while needle not in ranks[0].text() and time.monotonic() < stopped_at + 2 + THROW_LIMIT:
                time.sleep(0.05)
            took = time.monotonic() - stopped_at
            check(needle in ranks[0].text(), f"{STORE_BACKEND['label']} ps stop: the server warns within "
                  f"{2 + THROW_LIMIT:.0f} s, naming the stopped worker rank 1 ({took:.2f} s)", ranks[0].text())
        finally:
            for r in ranks:
                r.kill()  # SIGKILL ends a stopped process too


# (mode of fault_main, rank 0's call, the other ranks' call, the call number named)
MISMATCHES = [
    ("mismatch", "all_reduce(float32 x 10, sum)", "all_reduce(float32 x 11, sum)", 1),
    ("mismatch-dtype", "all_reduce(float64 x 11, sum)", "all_reduce(float32 x 11, sum)", 1),
    ("mismatch-op", "all_reduce(float32 x 11, max)", "all_reduce(float32 x 11, sum)", 1),
    ("mismatch-root", "broadcast(float32 x 11, root 0)", "broadcast(float32 x 11, root 1)", 1),
    ("mismatch-kind", "broadcast(float32 x 11, root 0)", "all_reduce(float32 x 11, sum)", 1),
    ("mismatch-late-op", "all_reduce(float32 x 11, max)", "all_reduce(float32 x 11, sum)", 101),
]


def names_mismatch(text, mine, others, call):
    return ("ranks called different collectives" in text and f"call #{call} on this communicator" in text
            and f"rank 0: {mine}" in text and f"rank 1: {others}" in text and f"rank 2: {others}" in text)


def gloo_mismatch(program):
    for mode, mine, others, call in MISMATCHES:
        with tempfile.TemporaryDirectory(prefix="tessera-fault-") as store:
            ranks = gloo_start(program, mode, 3, [0, 1, 2], store)
            deadline = time.monotonic() + 2 * TIMEOUT + 30
            try:
                for r, rank in enumerate(ranks):
                    code = rank.wait(deadline)
                    text = rank.text()
                    check(code == 3 and names_mismatch(text, mine, others, call) and "returned despite" not in text,
                          f"{STORE_BACKEND['label']} {mode} (default settings): rank {r} fails naming call #{call} "
                          f"and every rank's version (status {code})", text)
            finally:
                for r in ranks:
                    r.kill()
    if not STORE_BACKEND["late_count"]:
        return
    # Different counts at a call the sample skips: Gloo's I/O thread enforces message sizes with an
    # exception nothing can catch; the process must still say what it was doing before it ends.
    with tempfile.TemporaryDirectory(prefix="tessera-fault-") as store:
        ranks = gloo_start(program, "mismatch-late-count", 3, [0, 1, 2], store)
        deadline = time.monotonic() + 2 * TIMEOUT + 30
        try:
            codes = [rank.wait(deadline) for rank in ranks]
            text = "".join(rank.text() for rank in ranks)
            named = ("ranks called different collectives" in text or
                     re.search(r"tessera: fatal: .*\n.*all_reduce\(float32 x 1[01], sum\) \(call #101", text) is not None)
            check(all(c is not None and c != 0 for c in codes) and named and "returned despite" not in text,
                  f"{STORE_BACKEND['label']} mismatch-late-count: every rank ends, and the failure names the call "
                  f"(statuses {codes})", text)
        finally:
            for r in ranks:
                r.kill()


def gloo_join(program):
    with tempfile.TemporaryDirectory(prefix="tessera-fault-") as store:
        start = time.monotonic()
        ranks = gloo_start(program, "join", 3, [0, 1], store)
        try:
            for r, rank in enumerate(ranks):
                code, took, text = rank.outcome(start, 2 * TIMEOUT + 5)
                check(code == 3 and "rank(s) 2 never joined" in text and took <= 2 * TIMEOUT + 2,
                      f"{STORE_BACKEND['label']} join: rank {r} fails naming the missing rank 2 ({took:.2f} s, status {code})", text)
        finally:
            for r in ranks:
                r.kill()


def wait_for_store_keys(store, count, seconds=30):
    """Until the file store holds `count` keys (FileStore names its files by a hash of the key, so
    only their number tells: a rank's join key is the first it writes)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if len([n for n in os.listdir(store) if not n.startswith(".")]) >= count:
            return True
        time.sleep(0.02)
    return False


def gloo_rendezvous(program):
    """Rendezvous faults that used to wait out the whole timeout without naming the cause: a rank
    started with another world size, a rank killed after it joined, and a second job in a store
    that another job used (its ranks would pair with the first job's keys)."""
    label = STORE_BACKEND["label"]
    slow = {"TESSERA_COMM_TIMEOUT": str(SLOW_TIMEOUT)}
    with tempfile.TemporaryDirectory(prefix="tessera-fault-") as store:
        ranks = gloo_start(program, "join", 3, [2], store, slow)  # rank 2 thinks the world has 3 ranks
        try:
            ok = wait_for_store_keys(store, 1)
            check(ok, f"{label} size mismatch: rank 2 registered", ranks[0].text())
            ranks += gloo_start(program, "join", 2, [0, 1], store, slow)  # ranks 0 and 1 think it has 2
            start = time.monotonic()
            for r, rank in zip((2, 0, 1), ranks):
                code, took, text = rank.outcome(start, THROW_LIMIT)
                check(code == 3 and "world size" in text and "TESSERA_WORLD_SIZE" in text,
                      f"{label} size mismatch: rank {r} fails within {THROW_LIMIT:.0f} s naming the two world sizes "
                      f"({took:.2f} s, status {code})", text)
        finally:
            for r in ranks:
                r.kill()
    with tempfile.TemporaryDirectory(prefix="tessera-fault-") as store:
        ranks = gloo_start(program, "join", 3, [1, 2], store, slow)
        try:
            check(wait_for_store_keys(store, 2), f"{label} killed in rendezvous: ranks 1 and 2 registered",
                  ranks[1].text())
            ranks[1].kill()  # rank 2 dies after joining; rank 0 never starts
            killed_at = time.monotonic()
            code, took, text = ranks[0].outcome(killed_at, THROW_LIMIT)
            check(code == 3 and re.search(r"rank 2 \(pid \d+ on \S+\) exited", text) is not None,
                  f"{label} killed in rendezvous: rank 1 fails within {THROW_LIMIT:.0f} s naming the exited rank 2 "
                  f"({took:.2f} s, status {code})", text)
        finally:
            for r in ranks:
                r.kill()
    gloo_loopback_across_hosts(program, slow)
    gloo_redis_password(program, slow)
    with tempfile.TemporaryDirectory(prefix="tessera-fault-") as store:
        first = gloo_start(program, "join", 2, [0, 1], store)
        codes = [r.wait(time.monotonic() + 60) for r in first]
        check(codes == [0, 0], f"{label} shared store: the first job runs ({codes})", "".join(r.text() for r in first))
        second = gloo_start(program, "join", 2, [0, 1], store, slow)
        expect_ranks_fail(second, f"{label} shared store: a second job in the same store is refused at once",
                          ["the store already holds a rank {r}", "TESSERA_STORE_PREFIX"])


def expect_ranks_fail(ranks, what, needles):
    """Every rank exits 3 within THROW_LIMIT with each of `needles` ("{r}": its rank) in its output;
    all are killed afterwards."""
    try:
        start = time.monotonic()
        for r, rank in enumerate(ranks):
            code, took, text = rank.outcome(start, THROW_LIMIT)
            check(code == 3 and all(n.format(r=r) in text for n in needles),
                  f"{what}: rank {r} fails within {THROW_LIMIT:.0f} s ({took:.2f} s, status {code})", text)
    finally:
        for rank in ranks:
            rank.kill()


def gloo_loopback_across_hosts(program, slow):
    """Ranks on two hosts where a rank's host name resolves to a loopback address (127.0.1.1 on
    many installs): its peers on the other host could never connect, and the rendezvous waited out
    the whole timeout. Two hosts are made here with a UTS namespace (`unshare --uts`, root) that
    gives rank 1 another host name; every name on this machine resolves to 127.0.0.1 or not at
    all, so both ranks listen on loopback. Skipped without unshare or root."""
    label = STORE_BACKEND["label"]
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        print(f"note: {label} loopback across hosts not run (needs unshare and root)")
        return
    with tempfile.TemporaryDirectory(prefix="tessera-fault-") as store:
        ranks = gloo_start(program, "join", 2, [0], store, slow)
        env = base_env(dict(slow, TESSERA_RANK="1", TESSERA_WORLD_SIZE="2", TESSERA_STORE="file://" + store))
        ranks.append(Rank([unshare, "--uts", "sh", "-c", 'hostname tessera-other-host && exec "$0" "$@"', program,
                           "join"], env))
        expect_ranks_fail(ranks, f"{label} loopback across hosts: named with TESSERA_GLOO_IFACE",
                          ["2 hosts", "loopback", "TESSERA_GLOO_IFACE"])


def gloo_redis_password(program, slow):
    """A Redis store that wants a password (tessera-sbatch --store redis starts one): a rank without
    TESSERA_REDIS_PASSWORD, or with a wrong one, fails at once saying so. Skipped without redis-server."""
    label = STORE_BACKEND["label"]
    server = shutil.which("redis-server")
    if server is None:
        print(f"note: {label} Redis password not run (needs redis-server)")
        return
    with tempfile.TemporaryDirectory(prefix="tessera-redis-") as d:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with open(os.path.join(d, "redis.conf"), "w") as f:
            f.write("requirepass right-password\n")
        redis = subprocess.Popen([server, os.path.join(d, "redis.conf"), "--port", str(port), "--bind", "127.0.0.1",
                                  "--save", "", "--appendonly", "no", "--dir", d],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            up = False
            while not up and time.monotonic() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", port), 0.2).close()
                    up = True
                except OSError:
                    time.sleep(0.05)
            check(up, f"{label} Redis password: redis-server starts within 10 s", "")
            if not up:
                return
            cases = [({}, "NOAUTH", "set TESSERA_REDIS_PASSWORD"),
                     ({"TESSERA_REDIS_PASSWORD": "wrong"}, "refused the password in TESSERA_REDIS_PASSWORD", "")]
            for extra, first, second in cases:
                env = base_env(dict(slow, TESSERA_RANK="0", TESSERA_WORLD_SIZE="1",
                                    TESSERA_STORE=f"redis://127.0.0.1:{port}", **extra))
                if not extra:
                    env.pop("TESSERA_REDIS_PASSWORD", None)  # one set by the caller's shell
                rank = Rank([program, "join"], env)
                try:
                    code, took, text = rank.outcome(time.monotonic(), THROW_LIMIT)
                    check(code == 3 and first in text and second in text,
                          f"{label} Redis password {'wrong' if extra else 'missing'}: fails at once saying so "
                          f"({took:.2f} s, status {code})", text)
                finally:
                    rank.kill()
        finally:
            redis.kill()
            redis.wait()


def gloo_stall(program):
    with tempfile.TemporaryDirectory(prefix="tessera-fault-") as store:
        ranks = gloo_start(program, "stall", 3, [0, 1, 2], store)
        try:
            if not wait_ready(ranks):
                check(False, f"{STORE_BACKEND['label']} stall: ranks started", "\n".join(r.text() for r in ranks))
                return
            start = time.monotonic()
            for r in (0, 2):
                code, took, text = ranks[r].outcome(start, 2 * TIMEOUT + 1)
                check(code == 3 and took <= 2 * TIMEOUT and f"all_reduce(float32 x 1000, sum) on rank {r} of 3" in text,
                      f"{STORE_BACKEND['label']} stall: rank {r} times out naming the operation ({took:.2f} s, status {code})", text)
                if STORE_BACKEND["stall_report"]:
                    check(re.search(rf"warning: .*all_reduce\(float32 x 1000, sum\) on rank {r} of 3 \(call #42\) has "
                                    r"waited .*reached call #42: ranks 0, 2; not reached: rank 1 \(last entered call #41", text)
                          is not None, f"{STORE_BACKEND['label']} stall: rank {r} warns at the stall threshold naming rank 1 "
                                        "as missing", text)
                    # Rank 0 and 2 time out within milliseconds of each other; the one that exits first resets
                    # its pair with the other, which may then fail on that reset instead of its own timer. Either
                    # way the error must still name rank 1 as the rank that never reached the call.
                    check(re.search(r"CommError: .*([Tt]imed out|Connection reset|Connection closed|Read error)"
                                    r".*not reached: rank 1 \(", text) is not None,
                          f"gloo stall: rank {r}'s error names rank 1 as the one that did not reach the call", text)
        finally:
            for r in ranks:
                r.kill()


# ---------------------------------------------------------------- MPI (under mpirun)

def gloo_throw(program):
    with tempfile.TemporaryDirectory(prefix="tessera-fault-") as store:
        ranks = gloo_start(program, "throw", 3, [0, 1, 2], store, {"TESSERA_COMM_TIMEOUT": str(SLOW_TIMEOUT)})
        label = STORE_BACKEND["label"]
        try:
            start = time.monotonic()
            code = ranks[1].wait(start + 60)
            text = ranks[1].text()
            check(code == 1 and ORDINARY_ERROR in text, f"{label} throw: rank 1 exits 1 with its error (status {code})", text)
            failed_at = time.monotonic()
            for r in (0, 2):
                code = ranks[r].wait(failed_at + THROW_LIMIT)
                took = time.monotonic() - failed_at
                check(code is not None and code != 0,
                      f"{label} throw: rank {r} stops within {THROW_LIMIT:.0f} s of rank 1's error, not at the "
                      f"{SLOW_TIMEOUT:.0f} s timeout ({took:.2f} s, status {code})", ranks[r].text())
        finally:
            for r in ranks:
                r.kill()


def mpi_job(mpirun, program, mode, extra=None, timeout=TIMEOUT):
    argv = [mpirun, "--oversubscribe", "-n", "3"]
    for k, v in (extra or {}).items():
        argv += ["-x", f"{k}={v}"]
    argv += ["-x", f"TESSERA_COMM_TIMEOUT={timeout}", program, mode]
    return Rank(argv, base_env(extra))


def mpi_throw(mpirun, program):
    job = mpi_job(mpirun, program, "throw", timeout=SLOW_TIMEOUT)
    try:
        limit = THROW_LIMIT + MPIRUN_TEARDOWN
        code, took, text = mpi_run_to_end(job, limit)
        check(code is not None and code != 0 and took <= limit,
              f"mpi throw: rank 1's ordinary error ends the job within {limit:.0f} s, not at the {SLOW_TIMEOUT:.0f} s "
              f"timeout ({took:.2f} s, status {code})", text)
        check(re.search(r"rank 1 failed: .*" + re.escape(ORDINARY_ERROR), text) is not None,
              "mpi throw: the job's output names rank 1 and its error", text)
    finally:
        job.kill()


def wait_mpi_ready(job, seconds=60):
    deadline = time.monotonic() + seconds
    while sum("ready" in line for line in job.out) < 3 and time.monotonic() < deadline and job.proc.poll() is None:
        time.sleep(0.02)


def mpi_run_to_end(job, limit):
    """Once all 3 ranks are ready: the job's exit status (None if it outlived `limit` + 1 s), the
    seconds it took from then, and its output."""
    wait_mpi_ready(job)
    return job.outcome(time.monotonic(), limit + 1)


def mpi_kill_scenario(mpirun, program, mode):
    job = mpi_job(mpirun, program, mode)
    try:
        wait_mpi_ready(job)
        pids = {int(m.group(1)): int(m.group(2)) for line in job.out
                for m in [re.search(r"rank (\d+) ready pid (\d+)", line)] if m}
        check(len(pids) == 3, f"mpi {mode}: all 3 ranks started", job.text())
        if len(pids) != 3:
            return
        time.sleep(0.3)
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        code, took, text = job.outcome(killed_at, 2 * TIMEOUT + 1)
        check(code is not None and code != 0 and took <= 2 * TIMEOUT,
              f"mpi {mode}: the job ends within 2x the timeout after rank 1 is killed ({took:.2f} s, status {code})",
              text)
        check(re.search(r"rank 1 with PID \d+ .*exited on signal 9", text, re.S) is not None,
              f"mpi {mode}: mpirun names the failed rank 1", text)
    finally:
        job.kill()


def mpi_stall(mpirun, program):
    job = mpi_job(mpirun, program, "stall")
    try:
        # The watchdog fires at the timeout (the message below shows it did); the rest is
        # MPI_Abort and mpirun killing the stalled rank, which on a loaded 2-core machine has
        # taken over 4 s. Not hanging is the point, so mpirun gets a generous margin.
        limit = TIMEOUT + MPIRUN_TEARDOWN
        code, took, text = mpi_run_to_end(job, limit)
        check(code is not None and code != 0 and took <= limit,
              f"mpi stall: the job ends within the timeout + {MPIRUN_TEARDOWN:.0f} s for mpirun's teardown "
              f"({took:.2f} s, status {code})", text)
        check(re.search(r"MpiComm all_reduce\(float32 x 1000, sum\) on rank [02] of 3 \(call #42\): timed out after 3 s; "
                        r"reached call #42: ranks 0, 2; not reached: rank 1 \(", text)
              is not None, "mpi stall: the watchdog names the operation, the rank, the timeout and the missing rank 1", text)
        check(re.search(r"warning: MpiComm all_reduce\(float32 x 1000, sum\) on rank [02] of 3 \(call #42\) has waited "
                        r".*not reached: rank 1", text) is not None,
              "mpi stall: a warning at the stall threshold names the missing rank 1", text)
    finally:
        job.kill()


def mpi_mismatch(mpirun, program):
    for mode, mine, others, call in MISMATCHES:
        job = mpi_job(mpirun, program, mode)
        try:
            code = job.wait(time.monotonic() + 60)
            text = job.text()
            check(code is not None and code != 0 and names_mismatch(text, mine, others, call)
                  and "returned despite" not in text,
                  f"mpi {mode} (default settings): the job fails naming call #{call} and every rank's version "
                  f"(status {code})", text)
            reporting = sorted(set(re.findall(r"MpiComm call check on rank (\d+)", text)))
            check(reporting == ["0", "1", "2"], f"mpi {mode}: every rank reports it (ranks {reporting})", text)
        finally:
            job.kill()
    job = mpi_job(mpirun, program, "mismatch-late-count")
    try:
        code = job.wait(time.monotonic() + 60)
        text = job.text()
        named = "ranks called different collectives" in text or "MPI_ERR_TRUNCATE" in text
        check(code is not None and code != 0 and named and "returned despite" not in text,
              f"mpi mismatch-late-count: the job fails with a Tessera error naming the call (status {code})", text)
    finally:
        job.kill()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", required=True, help="the backend's name in the backend list (meson.build)")
    parser.add_argument("--class-name", required=True, help="the communicator class its errors name (GlooComm)")
    parser.add_argument("--launch", choices=["mpirun", "store"], required=True,
                        help="mpirun: the ranks run under mpirun, which ends the job when one dies; store: each rank "
                             "is started directly and meets the others through a file store")
    parser.add_argument("--program", required=True, help="tests/comm/fault_main.cpp built for the backend")
    parser.add_argument("--mpirun", default="mpirun")
    parser.add_argument("--ps-program", help="parallel/ps_fault_main.cpp built for the backend: a parameter-server "
                                             "worker killed")
    parser.add_argument("--names-dead-peer", action="store_true", help="errors name the rank that is gone")
    parser.add_argument("--stall-report", action="store_true",
                        help="a stall warns at the threshold naming the ranks that did not reach the call")
    parser.add_argument("--late-count", action="store_true",
                        help="a count mismatch at a call the sampled check skips still names the call")
    parser.add_argument("--join", action="store_true", help="a rank that never joins the rendezvous is named")
    parser.add_argument("--rendezvous", action="store_true",
                        help="a rank of another world size, one killed after joining, and a second job in a used store "
                             "are named at once")
    args = parser.parse_args()
    if args.launch == "mpirun":
        mpi_kill_scenario(args.mpirun, args.program, "allreduce")
        mpi_kill_scenario(args.mpirun, args.program, "barrier")
        mpi_stall(args.mpirun, args.program)
        mpi_mismatch(args.mpirun, args.program)
        mpi_throw(args.mpirun, args.program)
    else:
        STORE_BACKEND.update(label=args.backend, dead_peer=args.names_dead_peer, stall_report=args.stall_report,
                             late_count=args.late_count, **{"class": args.class_name})
        gloo_kill_scenario(args.program, "allreduce", "all_reduce")
        gloo_kill_scenario(args.program, "barrier", "barrier")
        gloo_stall(args.program)
        gloo_mismatch(args.program)
        gloo_throw(args.program)
        if args.join:
            gloo_join(args.program)
        if args.rendezvous:
            gloo_rendezvous(args.program)
        if args.ps_program:
            gloo_ps_kill(args.ps_program)
            gloo_ps_stop(args.ps_program)
    print(f"{len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
