"""Starting the ranks, forwarding their output line by line, and stopping them: on a rank's
failure, on a signal to the launcher, or SIGKILL after the grace period."""
from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import IO, Any, BinaryIO

from tessera_tools.launch.hosts import placement, remote_argv
from tessera_tools.launch.options import LaunchOptions

# The reaper (Launcher.start_reaper): reads the ranks' process groups from its stdin, one line
# each as they start. "done" means the launcher ended the ranks itself. End of input without it
# means the launcher is gone (killed by SIGKILL, which no handler sees): SIGTERM and SIGCONT to
# every group, up to 2 s for them to end, SIGKILL to what is left, and the store directory
# (argv[1], "" for none) removed.
REAPER = """
import shutil, signal, os, sys, time
store, groups = sys.argv[1], []
for line in sys.stdin:
    if line.strip() == "done":
        sys.exit(0)
    groups.append(int(line))
for signum in (signal.SIGTERM, signal.SIGCONT):
    for g in groups:
        try:
            os.killpg(g, signum)
        except OSError:
            pass
deadline = time.monotonic() + 2
while time.monotonic() < deadline:
    alive = []
    for g in groups:
        try:
            os.killpg(g, 0)
            alive.append(g)
        except OSError:
            pass
    if not alive:
        break
    time.sleep(0.05)
for g in groups:
    try:
        os.killpg(g, signal.SIGKILL)
    except OSError:
        pass
if store:
    shutil.rmtree(store, ignore_errors=True)
"""

# Rank/size variables of other launchers. A tessera-run started inside an mpirun or Slurm job
# would otherwise hand every rank its own job step's rank and size.
FOREIGN_VARS = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")


# A rank's exit status after it saved its checkpoint on a signal (tessera::kExitStoppedForResume).
STOPPED_FOR_RESUME = 75


def describe(returncode: int) -> str:
    """How a rank ended, as words: Popen gives -S for death by signal S."""
    if returncode >= 0:
        return f"failed with exit status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = "unknown signal"
    return f"killed by signal {-returncode} ({name})"


def exit_status(returncode: int) -> int:
    return returncode if returncode >= 0 else 128 - returncode


class Output:
    """Writes whole lines to the launcher's stdout/stderr, one writer at a time, so that lines
    from different ranks never mix and each appears as soon as it is complete."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def write(self, stream: BinaryIO, data: bytes) -> None:
        with self.lock:
            try:
                stream.write(data)
                stream.flush()
            except (BrokenPipeError, ValueError):
                pass  # nobody reads any more; keep draining the rank's pipe so it never blocks

    def log(self, message: str) -> None:
        self.write(sys.stderr.buffer, f"tessera-run: {message}\n".encode())

    def forward(self, pipe: IO[bytes], stream: BinaryIO, prefix: bytes) -> None:
        with pipe:
            for line in iter(pipe.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"  # the last line of a rank that ended without a newline
                self.write(stream, prefix + line.decode("utf-8", "replace").encode("utf-8"))


def omp_threads_per_rank(env: dict[str, str], nproc: int, remote: bool, bound: bool) -> int | None:
    """OpenMP threads for each of `nproc` ranks on this machine when the user set none (as torchrun
    sets OMP_NUM_THREADS): the launcher's CPUs shared out, at least 1. Left alone: a value the user
    gave, one rank (it may use every core), and ranks on other hosts (whose cores are not known
    here). Each rank's OpenMP runtime would otherwise start a thread per CPU: 4 ranks on 2 cores
    ran 8 spinning threads, and a 4-rank equivalence test took 15 s instead of 2."""
    if "OMP_NUM_THREADS" in env or nproc <= 1 or remote:
        return None
    return 1 if bound else max(1, len(os.sched_getaffinity(0)) // nproc)


class Launcher:
    def __init__(self, options: LaunchOptions, store: str | None) -> None:
        self.options = options
        self.store = store
        self.out = Output()
        self.procs: list[subprocess.Popen[bytes]] = []  # index = rank
        self.threads: list[threading.Thread] = []       # output forwarders and waiters
        self.exits: queue.Queue[tuple[int, int]] = queue.Queue()  # (rank, returncode) as ranks end
        self.signum: int | None = None  # first signal the launcher received
        self.stopping = False           # stop() has begun
        self.hurry = False              # a signal while stopping: do not wait out the grace period
        self.temp_dir: str | None = None  # the store directory this launch made (removed at the end)
        self.reaper: subprocess.Popen[bytes] | None = None
        # What spawn() worked out once, for spawn_rank (a replacement is started the same way).
        self.base_env: dict[str, str] = {}
        self.places: list[Any] | None = None
        self.cpus: list[int] | None = None
        self.own_cpus: set[int] | None = None

    def on_usr1(self, signum: int, _frame: FrameType | None) -> None:
        """SIGUSR1 goes on to every running rank (a Tessera program given --checkpoint then saves
        it at the next step and exits 75); the launcher itself carries on."""
        for rank in self.running():
            self.signal_group(rank, signum)

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.signum is not None or self.stopping:
            self.hurry = True
        if self.signum is None:
            self.signum = signum

    def spawn(self) -> None:
        o = self.options
        n = o.nproc
        base = {k: v for k, v in os.environ.items() if k not in FOREIGN_VARS}
        base.update(TESSERA_WORLD_SIZE=str(n), TESSERA_LOCAL_WORLD_SIZE=str(n), TESSERA_STORE=self.store or "")
        # Keys of this launch apart from any other job's in the same store (a shared --store
        # directory or Redis server): the ranks refuse a store that already holds their rank.
        base.setdefault("TESSERA_STORE_PREFIX", f"run-{socket.gethostname()}-{os.getpid()}-{time.time_ns()}")
        if o.iface is not None:
            base["TESSERA_GLOO_IFACE"] = o.iface
        if o.timeout is not None:
            base["TESSERA_COMM_TIMEOUT"] = o.timeout
        threads = omp_threads_per_rank(base, n, o.hosts is not None, o.bind_to == "core")
        if threads is not None:
            base["OMP_NUM_THREADS"] = str(threads)
            self.out.log(f"OMP_NUM_THREADS is not set: {threads} OpenMP thread{'s' if threads > 1 else ''} per rank "
                         f"({len(os.sched_getaffinity(0))} CPUs / {n} ranks); set OMP_NUM_THREADS to choose")
        places = placement(o.hosts, n) if o.hosts else None
        own_cpus = os.sched_getaffinity(0) if o.bind_to == "core" else None
        cpus = sorted(own_cpus) if own_cpus else None
        self.base_env, self.places, self.cpus, self.own_cpus = base, places, cpus, own_cpus
        for rank in range(n):
            if self.signum is not None:
                break  # interrupted while starting: run() stops the ranks started so far
            self.spawn_rank(rank)

    def spawn_rank(self, rank: int, joining: bool = False) -> None:
        """Starts slot `rank`'s process: the launch's own, or (joining) a replacement that joins
        the running group (TESSERA_ELASTIC_JOIN=1, the same TESSERA_RANK)."""
        o = self.options
        env = dict(self.base_env, TESSERA_RANK=str(rank), TESSERA_LOCAL_RANK=str(rank))
        if joining:
            env["TESSERA_ELASTIC_JOIN"] = "1"
        argv = o.command
        if self.places is not None:
            place = self.places[rank]
            env.update(TESSERA_LOCAL_RANK=str(place.local_rank), TESSERA_LOCAL_WORLD_SIZE=str(place.local_size))
            argv = remote_argv(o.rsh, place.host, {k: v for k, v in env.items() if k.startswith("TESSERA_")},
                               o.command, os.getcwd())
        # A child inherits the CPU set of the thread that forks it: this (main) thread takes
        # the rank's CPU for the fork and its own set back after, so the rank is bound
        # before any thread of it starts.
        if self.cpus and self.own_cpus:
            os.sched_setaffinity(0, {self.cpus[rank]})
        try:
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
        finally:
            if self.cpus and self.own_cpus:
                os.sched_setaffinity(0, self.own_cpus)
        if joining:
            self.procs[rank] = proc
        else:
            self.procs.append(proc)
        self.tell_reaper(proc.pid)  # its own process group: start_new_session
        prefix = b"" if o.no_prefix else f"[rank {rank}] ".encode()
        assert proc.stdout is not None and proc.stderr is not None
        for pipe, stream in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
            self.start_thread(self.out.forward, pipe, stream, prefix)
        self.start_thread(self.wait_for, rank, proc)

    def start_reaper(self) -> None:
        """A watcher in a session of its own that outlives a launcher killed by SIGKILL (which no
        handler sees): told each rank's process group as it starts, it stops them and removes the
        temporary store when its input ends without "done" (both were left behind)."""
        self.reaper = subprocess.Popen([sys.executable, "-c", REAPER, self.temp_dir or ""], stdin=subprocess.PIPE,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                       start_new_session=True)

    def tell_reaper(self, pid: int) -> None:
        if self.reaper is not None and self.reaper.stdin is not None:
            try:
                self.reaper.stdin.write(f"{pid}\n".encode())
                self.reaper.stdin.flush()
            except OSError:
                pass  # the reaper is gone: nothing to tell

    def stop_reaper(self) -> None:
        if self.reaper is None:
            return
        try:
            assert self.reaper.stdin is not None
            self.reaper.stdin.write(b"done\n")
            self.reaper.stdin.close()
            self.reaper.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.reaper.kill()
            self.reaper.wait()

    def wait_for(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        self.exits.put((rank, proc.wait()))

    def start_thread(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self.threads.append(thread)

    def running(self) -> list[int]:
        return [r for r, p in enumerate(self.procs) if p.returncode is None]

    def signal_group(self, rank: int, signum: int) -> None:
        try:
            os.killpg(self.procs[rank].pid, signum)  # the rank leads its own group
        except (ProcessLookupError, PermissionError):
            pass  # already gone

    def stop(self, ranks: list[int]) -> None:
        """SIGTERM the groups of `ranks`, then SIGKILL those still running after the grace period.
        SIGCONT follows SIGTERM: a stopped rank (SIGSTOP, SIGTSTP, a debugger gone) keeps a SIGTERM
        pending until it runs again, so its handler would never flush or clean up, and only the
        SIGKILL after the grace period would end it. Sent after SIGTERM, not before, so that the
        continued rank meets the pending SIGTERM at once instead of computing on first (as
        systemd does for the services it stops)."""
        self.stopping = True
        for rank in ranks:
            self.signal_group(rank, signal.SIGTERM)
            self.signal_group(rank, signal.SIGCONT)
        deadline = time.monotonic() + self.options.grace
        while self.running() and time.monotonic() < deadline and not self.hurry:
            time.sleep(0.05)
        left = self.running()
        if left:
            self.out.log(f"sending SIGKILL to rank{'s' if len(left) > 1 else ''} "
                         f"{', '.join(map(str, left))} (still running {self.options.grace:g} s "
                         f"after SIGTERM)")
            for rank in left:
                self.signal_group(rank, signal.SIGKILL)

    def stop_message(self) -> str:
        left = self.running()
        return f"; stopping ranks {', '.join(map(str, left))}" if left else ""

    def run(self) -> int:
        self.start_reaper()
        try:
            try:
                self.spawn()
            except OSError as error:
                self.out.log(f"cannot start rank {len(self.procs)}: {error}{self.stop_message()}")
                self.stop(self.running())
                return 2
            return self.wait_ranks()
        finally:
            self.stop_reaper()

    def wait_ranks(self) -> int:
        status: int | None = None
        skipped, ended, stopped, succeeded = False, 0, 0, 0
        started = len(self.procs)
        replacements = self.options.replace
        while ended < started and status is None:
            if self.signum is not None:
                name = signal.Signals(self.signum).name
                self.out.log(f"received {name}{self.stop_message()}")
                status = 128 + self.signum
                break
            try:
                rank, returncode = self.exits.get(timeout=0.1)
            except queue.Empty:
                continue  # wake up now and then to notice signals
            ended += 1
            if returncode == 0:
                succeeded += 1
            elif returncode == 77:
                skipped = True
            elif returncode == STOPPED_FOR_RESUME:
                stopped += 1  # not a failure: the others are finishing their checkpoint too
            elif returncode != 0 and self.options.elastic and (self.running() or succeeded):
                # With --elastic a rank's failure is the group's business while others run; one
                # that fails after the group finished (a stopped rank, continued and left out) too.
                if not self.running():
                    self.out.log(f"rank {rank} {describe(returncode)} after the others finished (--elastic)")
                elif replacements > 0 and self.signum is None:
                    replacements -= 1
                    self.out.log(f"rank {rank} {describe(returncode)}; the others go on (--elastic); starting a "
                                 f"replacement for it ({replacements} more allowed)")
                    try:
                        self.spawn_rank(rank, joining=True)
                        started += 1
                    except OSError as error:
                        self.out.log(f"cannot start a replacement for rank {rank}: {error}")
                else:
                    self.out.log(f"rank {rank} {describe(returncode)}; the others go on (--elastic)")
            elif returncode != 0:
                self.out.log(f"rank {rank} {describe(returncode)}{self.stop_message()}")
                status = exit_status(returncode)
        if status is not None:
            self.stop(self.running())
        for proc in self.procs:
            proc.wait()
        # Output still buffered in the pipes is forwarded before exiting; a background
        # child that outlived its rank and holds a pipe open is not waited for.
        deadline = time.monotonic() + 2
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if status is not None:
            return status
        if stopped:
            self.out.log(f"{'every rank' if stopped == len(self.procs) else f'{stopped} of {len(self.procs)} ranks'} "
                         f"stopped on a signal with its checkpoint saved (exit {STOPPED_FOR_RESUME}): run again with "
                         f"--resume to continue")
            return STOPPED_FOR_RESUME
        return 77 if skipped else 0
