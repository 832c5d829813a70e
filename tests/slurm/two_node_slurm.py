"""A private, real Slurm of two compute nodes on this machine, for tests: each node a Linux
network namespace with its own address and host name, as separate hosts have.

    tsn-<pid>-sw    the switch: a bridge br0 with ports p0, p1, p2 (tests/net/netns_test.py's Network)
    tsn-<pid>-0     "head", 10.77.0.1: slurmctld, and every client command the test runs
    tsn-<pid>-1     "node1", 10.77.0.2: slurmd -N node1 (host name node1: a UTS namespace)
    tsn-<pid>-2     "node2", 10.77.0.3: slurmd -N node2

munged runs outside the namespaces: its socket is a file, which every namespace reaches, as the
nodes share the file system (the socket, spool and log folders, the programs, the job logs), as
cluster nodes share NFS; each node's TmpFS, where srun --mpi=pmix works, is a folder of its own,
as a node's /tmp is. The root namespace gets no address on the bridge: the test reaches Slurm
through wrapper scripts (bin/sbatch, bin/scontrol, ...) that run the real command inside "head";
env() puts them first on PATH. A wrapper runs its command with the PATH the test had, so jobs do
not inherit the wrappers: inside a job, srun and scontrol run on the node, as on a cluster.

    with TwoNodeSlurm(tmpdir) as slurm:
        subprocess.run(["sbatch", ...], env=slurm.env())
        slurm.take_down("node2")

Raises Unavailable where namespaces or Slurm cannot be used (the test then exits 77). stop()
kills the daemons and everything left in the namespaces, then deletes them.
"""
from __future__ import annotations

import os
import pathlib
import shlex
import socket
import subprocess
import sys
from typing import Any

from local_slurm import LocalSlurm, Unavailable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "net"))
import netns_test  # noqa: E402

NODES = ("node1", "node2")
# Fast enough for a test, slow enough for a loaded 2-core machine: slurmctld pings the nodes
# every SlurmdTimeout / 3 s, a ping fails after MessageTimeout s, and a node that has not
# answered for SlurmdTimeout s is marked DOWN; processes that ignore SIGTERM get SIGKILL
# KillWait s later.
SLURMD_TIMEOUT = 6
MESSAGE_TIMEOUT = 3
KILL_WAIT = 5


def enter(ns: str) -> list[str]:
    """Runs a command in network namespace `ns`. Not `ip netns exec`, which also mounts a sysfs of
    its own over /sys, hiding /sys/fs/cgroup, without which slurmd does not start."""
    return ["nsenter", f"--net=/run/netns/{ns}"]


class TwoNodeSlurm(LocalSlurm):
    def __init__(self, root: str | pathlib.Path, cpus: int = 4, cred_expire: int = 10) -> None:
        super().__init__(root, cpus, cred_expire)
        self.net: Any = netns_test.Network(len(NODES) + 1)  # untyped: netns_test has no annotations
        self.head = self.net.hosts[0]
        self.namespaces = dict(zip(NODES, self.net.hosts[1:]))
        self.addresses = {name: self.net.address(i + 1) for i, name in enumerate(NODES)}
        self.bin = self.root / "bin"
        self.host = socket.gethostname().split(".")[0]  # slurmctld's, in "head"
        self.down: set[str] = set()  # nodes taken down (take_down) and not brought back

    def node_names(self) -> list[str]:
        return list(NODES)

    def port(self, node: str) -> int:
        """The switch port of a node's link (for its byte counters: self.net.port_bytes)."""
        return NODES.index(node) + 1

    def env(self) -> dict[str, str]:
        return dict(super().env(), PATH=f"{self.bin}:{os.environ.get('PATH', '')}")

    def command(self, client: str) -> list[str]:
        return [str(self.bin / client)]

    def start(self) -> None:
        why = netns_test.can_run()
        if why:
            raise Unavailable(why)
        if any(path is None for path in self.paths.values()):
            super().start()  # raises Unavailable naming what is missing
        netns_test.remove_stale_namespaces()
        self.net.up()
        self.bin.mkdir(parents=True, exist_ok=True)
        for client in ("sbatch", "srun", "squeue", "scontrol", "sinfo", "scancel"):
            wrapper = self.bin / client
            wrapper.write_text("#!/bin/sh\n# The client command inside the head namespace, with the test's own PATH.\n"
                               f"exec {' '.join(enter(self.head))} env PATH={shlex.quote(os.environ.get('PATH', ''))} "
                               f"{shlex.quote(self.paths[client])} \"$@\"\n")
            wrapper.chmod(0o755)
        super().start()

    def _start_daemons(self, env: dict[str, str]) -> None:
        self._spawn([*enter(self.head), self.paths["slurmctld"], "-D", "-i", "-f", str(self.conf)],
                    "slurmctld", env)
        for name in self.namespaces:
            (self.root / f"spool-{name}").mkdir(exist_ok=True)
            (self.root / f"tmp-{name}").mkdir(exist_ok=True)
            self._start_slurmd(name, env)

    def _start_slurmd(self, name: str, env: dict[str, str]) -> None:
        # Its own host name too, as a real node has (Open MPI and Gloo tell hosts apart by it).
        self._spawn([*enter(self.namespaces[name]), "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                     name, self.paths["slurmd"], "-D", "-f", str(self.conf), "-N", name], f"slurmd-{name}", env)

    def _conf_lines(self) -> list[str]:
        r = self.root
        nodes = [f"NodeName={name} NodeAddr={self.addresses[name]} CPUs={self.cpus} RealMemory=4000 State=UNKNOWN"
                 for name in NODES]
        return self._common_conf_lines() + [
            # Each daemon in its own namespace: the standard ports cannot clash.
            f"SlurmctldHost={self.host}({self.net.address(0)})",
            "SlurmctldPort=6817",
            "SlurmdPort=6818",
            f"SlurmdSpoolDir={r}/spool-%n",
            f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmdLogFile={r}/slurmd-%n.log",
            # A /tmp of its own per node, as nodes have: srun --mpi=pmix makes its folders there,
            # named by job and step only (one /tmp: "File exists" on the second node).
            f"TmpFS={r}/tmp-%n",
            f"SlurmdTimeout={SLURMD_TIMEOUT}",
            f"MessageTimeout={MESSAGE_TIMEOUT}",
            f"KillWait={KILL_WAIT}",
            *nodes,
            f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP",
        ]

    def take_down(self, node: str) -> None:
        """The node fails as a powered-off host does: its link goes down first (no goodbye reaches
        anyone: no TCP reset, no message to slurmctld), then every process in it is killed (slurmd,
        the job's slurmstepd and ranks), so that none writes to the shared file system afterwards."""
        ns = self.namespaces[node]
        netns_test.run(["ip", "-n", ns, "link", "set", "eth0", "down"])
        netns_test.kill_namespace_processes(ns)
        self.down.add(node)

    def bring_back(self, node: str, seconds: float = 60) -> None:
        """A node taken down comes back, as a host that is powered on again: its link up, a new
        slurmd, which registers with slurmctld (ReturnToService=2 then makes the node usable). A
        node that was not taken down is left as it is."""
        if node not in self.down:
            return
        self.down.discard(node)
        netns_test.run(["ip", "-n", self.namespaces[node], "link", "set", "eth0", "up"])
        # The slurmd taken down is dead (killed with the namespace's processes); its entry goes.
        self.processes = [p for p in self.processes if p.poll() is None]
        env = self.env()
        self._start_slurmd(node, env)

        def idle() -> bool:
            done = subprocess.run(self.command("sinfo") + ["-h", "-N", "-n", node, "-o", "%T"], env=env,
                                  capture_output=True, text=True, timeout=10)
            return done.returncode == 0 and done.stdout.split() == ["idle"]
        self._wait(idle, seconds, f"{node} to be idle again", self.root / "slurmctld.log")

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            self.net.down()  # also kills whatever still runs in the namespaces
