"""What a section's runner works with: the campaign's settings (its profile: quick, default or
full), the paths, and a way to run programs that streams their progress, keeps their output and
records each command."""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tessera_tools.paths import SOURCE_ROOT, SYSTEM_PYTHON
from tessera_tools.report.plotting import NO_REEXEC

ROOT = str(SOURCE_ROOT)
SECTIONS = ("training", "collectives", "dp_scaling", "pipeline", "overlap")


@dataclass
class Settings:
    """What each section runs and how often (see PROFILES)."""
    train_models: str
    train_threads: list[int]
    train_runs: int
    coretypes: str
    coll_ranks: str
    coll_max_bytes: int
    coll_rounds: int
    coll_round_seconds: float
    coll_ops: str
    coll_repeats: int
    dp_models: str
    dp_rounds: int
    pipe_stages: list[int]
    pipe_steps: int
    pipe_repeats: int
    overlap_comms: list[str] = field(default_factory=list)
    overlap_buckets: list[int] = field(default_factory=list)
    overlap_limit: int = 0


# What each profile runs. "default" is sized to finish in about 20 minutes on a 2-core machine
# (tools/tessera-report's brief: under 30), leaving room for a noisy neighbour; "quick" is a smoke
# test of every section (about 3 minutes); "full" adds ResNet-50, larger messages and more repeats.
PROFILES: dict[str, Settings] = {
    "quick": Settings(
        train_models="mlp", train_threads=[1], train_runs=1, coretypes="unset",
        coll_ranks="2", coll_max_bytes=256 << 10, coll_rounds=1, coll_round_seconds=0.02,
        coll_ops="all_reduce", coll_repeats=1,
        dp_models="lenet", dp_rounds=1,
        pipe_stages=[2], pipe_steps=3, pipe_repeats=1,
        overlap_comms=["threads"], overlap_buckets=[64], overlap_limit=3200,
    ),
    "default": Settings(
        train_models="mlp,lenet,resnet20", train_threads=[1, 2], train_runs=3, coretypes="",
        coll_ranks="2,4", coll_max_bytes=64 << 20, coll_rounds=3, coll_round_seconds=0.05,
        coll_ops="all_reduce,all_gather,reduce_scatter,broadcast", coll_repeats=2,
        dp_models="lenet", dp_rounds=3,
        pipe_stages=[2], pipe_steps=12, pipe_repeats=3,
        overlap_comms=["threads"], overlap_buckets=[64, 1024], overlap_limit=12800,
    ),
    "full": Settings(
        train_models="mlp,lenet,resnet20,resnet50_b8", train_threads=[1, 2], train_runs=5, coretypes="",
        coll_ranks="2,4", coll_max_bytes=256 << 20, coll_rounds=5, coll_round_seconds=0.1,
        coll_ops="all_reduce,all_gather,reduce_scatter,broadcast", coll_repeats=2,
        dp_models="lenet,resnet20", dp_rounds=5,
        pipe_stages=[2], pipe_steps=12, pipe_repeats=3,
        overlap_comms=["threads", "mpi", "gloo"], overlap_buckets=[64, 1024], overlap_limit=25600,
    ),
}

# The batch of each train_throughput / torch_throughput model (bench/train_throughput.cpp,
# bench/torch_throughput.py CONFIGS): compare_pytorch.py's JSON names the model but not its batch.
TRAIN_BATCH = {"mlp": 128, "lenet": 64, "resnet20": 64, "resnet50_b8": 8, "resnet50_b32": 32}
MODEL_NAMES = {"mlp": "MLP", "lenet": "LeNet-5", "resnet20": "ResNet-20", "resnet50_b8": "ResNet-50",
               "resnet50_b32": "ResNet-50"}



class SectionError(RuntimeError):
    """A section cannot run or a program it ran failed; the message says what and what to do."""


class Context:
    """What a section's runner needs: settings, paths, and a way to run programs that streams their
    progress to the console, keeps their output, and records each command for the raw JSON."""

    def __init__(self, timeout: float, settings: Settings, out: str, build: str, python: str) -> None:
        self.timeout, self.settings, self.out, self.build, self.python = timeout, settings, out, build, python
        self.raw = os.path.join(out, "raw")
        self.env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                        PYTHONUNBUFFERED="1")
        self.env.pop(NO_REEXEC, None)
        self.commands: list[list[str]] = []  # of the section being run
        self.log: list[str] = []  # its programs' stderr lines
        self.section = ""

    def binary(self, relative: str, target: str | None = None) -> str:
        """The path of a built program, or SectionError naming the ninja target to build it."""
        path = os.path.join(self.build, relative)
        if not os.access(path, os.X_OK):
            raise SectionError(f"{path} is not built: run `ninja -C {self.build} {target or relative}` "
                               f"(or pass --build DIR for another build directory)")
        return path

    def has_binary(self, relative: str) -> bool:
        return os.access(os.path.join(self.build, relative), os.X_OK)

    def mpirun(self) -> str:
        path = shutil.which("mpirun")
        if not path:
            raise SectionError("mpirun is not on PATH: `apt-get install openmpi-bin`")
        return path

    def run(self, argv: Sequence[str], timeout: float | None = None, env: Mapping[str, str] | None = None) -> str:
        """Runs argv in its own process group; its stderr is echoed live (prefixed with the section)
        and kept; returns its stdout. A non-zero exit or a timeout (the whole group is killed:
        mpirun's and PyTorch's spawned ranks would outlive their parent) raises SectionError with
        the last lines of stderr."""
        timeout = timeout or self.timeout
        argv = list(argv)
        self.commands.append(argv)
        print(f"[{self.section}] $ {shlex.join(argv)}", file=sys.stderr, flush=True)
        started = time.monotonic()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                env=env or self.env, start_new_session=True)
        out_chunks: list[str] = []
        err_lines: list[str] = []
        assert proc.stdout is not None and proc.stderr is not None
        stdout, stderr = proc.stdout, proc.stderr

        def pump_err() -> None:
            for line in stderr:
                err_lines.append(line.rstrip("\n"))
                print(f"[{self.section}]   {line.rstrip()}", file=sys.stderr, flush=True)

        def pump_out() -> None:
            out_chunks.append(stdout.read())

        threads = [threading.Thread(target=pump_err, daemon=True), threading.Thread(target=pump_out, daemon=True)]
        for t in threads:
            t.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            for t in threads:
                t.join()
            self.log += err_lines
            raise SectionError(f"`{shlex.join(argv)}` ran past {timeout:.0f} s (--timeout) and was killed with its "
                               f"process group. Last output:\n" + "\n".join(err_lines[-20:])) from None
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        for t in threads:
            t.join()
        self.log += err_lines
        if proc.returncode != 0:
            raise SectionError(f"`{shlex.join(argv)}` exited with status {proc.returncode} after "
                               f"{time.monotonic() - started:.1f} s. Last output:\n" + "\n".join(err_lines[-20:]))
        return "".join(out_chunks)

    def require_torch(self) -> None:
        """The PyTorch peer's interpreter is /usr/bin/python3 (the bench scripts start their PyTorch
        children with it); refuse early, with the package to install, where it has no torch."""
        python = SYSTEM_PYTHON if os.path.exists(SYSTEM_PYTHON) else self.python
        probe = subprocess.run([python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"],
                               capture_output=True)
        if probe.returncode != 0:
            raise SectionError(f"PyTorch is not importable by {python}, which the bench scripts use for the peer: "
                               f"`apt-get install python3-torch`")

    def bench_script(self, name: str) -> list[str]:
        return [self.python, os.path.join(ROOT, "bench", name)]
