"""A private, real Slurm on this machine, for tests: munged, slurmctld and slurmd with their own
key, socket, ports, state and logs under one temporary directory, and one node (this host, at
127.0.0.1) with more CPUs than the box has (config_overrides), so that 4-task jobs fit on 2 cores.

    with LocalSlurm(tmpdir) as slurm:
        subprocess.run(["sbatch", ...], env=slurm.env())

Raises Unavailable when Slurm or munge is missing or will not start (the test then exits 77).
Every wait is bounded; stop() kills the daemons whatever state they are in.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "sinfo", "scancel")


class Unavailable(Exception):
    """Slurm cannot run here: a missing program, or daemons that do not come up."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def find(program: str) -> str | None:
    for folder in ("/usr/sbin", "/usr/bin", "/sbin"):
        candidate = pathlib.Path(folder) / program
        if candidate.exists():
            return str(candidate)
    return shutil.which(program)


class LocalSlurm:
    def __init__(self, root: str | pathlib.Path, cpus: int = 4, cred_expire: int = 10) -> None:
        self.root = pathlib.Path(root)
        self.cpus = cpus
        # cred_expire is also how long Slurm holds a requeued job before starting it again
        # (default 120 s); 10 s keeps the requeue test short.
        self.cred_expire = cred_expire
        self.node = socket.gethostname().split(".")[0]
        self.processes: list[subprocess.Popen[bytes]] = []
        self.paths: dict[str, Any] = {p: find(p) for p in DAEMONS + CLIENTS}  # None: not installed

    def env(self) -> dict[str, str]:
        """The environment that points sbatch, srun, squeue and scontrol at this Slurm."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def __enter__(self) -> LocalSlurm:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def command(self, client: str) -> list[str]:
        """How this test runs a client command (sinfo, scancel, ...)."""
        return [self.paths[client]]

    def start(self) -> None:
        missing = [p for p, path in self.paths.items() if path is None]
        if missing:
            raise Unavailable(f"not installed: {', '.join(missing)} (Debian: slurm-wlm munge)")
        if os.geteuid() != 0:
            raise Unavailable("the local Slurm runs its daemons as root; not root here")
        munge = self.root / "munge"
        for d in (munge, self.root / "state", self.root / "spool", self.root / "tmp"):
            d.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)
        munge.chmod(0o755)  # munged wants the socket's folder reachable by everyone
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.munge_socket = munge / "socket"
        self._spawn([self.paths["munged"], "--foreground", "--force", f"--key-file={key}",
                     f"--socket={self.munge_socket}", f"--pid-file={munge / 'pid'}", f"--seed-file={munge / 'seed'}",
                     f"--log-file={munge / 'log'}"], "munged")
        self._wait(lambda: self.munge_socket.exists(), 10, "munged's socket", munge / "log")

        self.conf = self.root / "slurm.conf"
        (self.root / "plugstack.conf").write_text("")
        self.conf.write_text("\n".join(self._conf_lines()) + "\n")
        env = self.env()
        self._start_daemons(env)
        nodes = len(self.node_names())

        def nodes_idle() -> bool:
            done = subprocess.run(self.command("sinfo") + ["-h", "-N", "-o", "%T"], env=env, capture_output=True,
                                  text=True, timeout=10)
            return done.returncode == 0 and done.stdout.split() == ["idle"] * nodes
        self._wait(nodes_idle, 30, "the nodes to be idle", self.root / "slurmctld.log")

    def node_names(self) -> list[str]:
        return [self.node]

    def _start_daemons(self, env: dict[str, str]) -> None:
        self._spawn([self.paths["slurmctld"], "-D", "-i", "-f", str(self.conf)], "slurmctld", env)
        self._spawn([self.paths["slurmd"], "-D", "-f", str(self.conf), "-N", self.node], "slurmd", env)

    def _conf_lines(self) -> list[str]:
        return self._common_conf_lines() + [
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            f"SlurmdSpoolDir={self.root / 'spool'}",
            f"SlurmdPidFile={self.root / 'slurmd.pid'}",
            f"SlurmdLogFile={self.root / 'slurmd.log'}",
            # srun --mpi=pmix makes /tmp/spmix_appdir_<uid>_<job>.<step>, and job ids start at 1 in
            # every fresh Slurm: one left in /tmp by a killed run fails the next run's launch.
            f"TmpFS={self.root / 'tmp'}",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=4000 State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
        ]

    def _common_conf_lines(self) -> list[str]:
        r = self.root
        return [
            "ClusterName=tesseratest",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire={self.cred_expire}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmctldLogFile={r / 'slurmctld.log'}",
            f"PlugStackConfig={r / 'plugstack.conf'}",
            # No cgroups in a container: track processes by parent id, bind nothing.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MinJobAge=600",  # finished jobs stay visible to scontrol for the test's checks
        ]

    def _spawn(self, command: Sequence[str], name: str, env: dict[str, str] | None = None) -> None:
        log = open(self.root / f"{name}.stdout", "w")
        self.processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                               stdin=subprocess.DEVNULL, start_new_session=True))

    def _wait(self, ready: Callable[[], Any], seconds: float, what: str, log: pathlib.Path) -> None:
        deadline = time.monotonic() + seconds
        while not ready():
            for p in self.processes:
                if p.poll() is not None:
                    program: str = p.args[0]  # type: ignore[index, assignment]  # a list: _spawn's command
                    raise Unavailable(f"{program} exited with {p.returncode} while waiting for {what}; "
                                      f"see {log} and {self.root}/*.stdout")
            if time.monotonic() > deadline:
                raise Unavailable(f"no {what} after {seconds} s; see {log}")
            time.sleep(0.2)

    def stop(self) -> None:
        # Cancel what is left first, so no slurmstepd or rank outlives its daemons.
        # munged and slurmctld must answer for that; slurmd of a node taken down need not.
        if len(self.processes) >= 2 and all(p.poll() is None for p in self.processes[:2]):
            subprocess.run(self.command("scancel") + ["--full", "--partition=debug"], env=self.env(),
                           capture_output=True, timeout=10)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                queue = subprocess.run(self.command("squeue") + ["-h"], env=self.env(), capture_output=True,
                                       text=True, timeout=10)
                if queue.returncode != 0 or not queue.stdout.strip():
                    break
                time.sleep(0.3)
        for p in reversed(self.processes):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for p in self.processes:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.processes = []
