"""What tessera-run was asked to do, after its checks."""
from __future__ import annotations

from dataclasses import dataclass, field

from tessera_tools.launch.hosts import Host


@dataclass
class LaunchOptions:
    nproc: int
    command: list[str]
    hosts: list[Host] | None = None
    rsh: list[str] = field(default_factory=list)  # --rsh split into words (with --hosts only)
    store: str | None = None      # None: a fresh temporary file store
    iface: str | None = None
    timeout: str | None = None    # as written, for TESSERA_COMM_TIMEOUT
    grace: float = 5.0
    bind_to: str = "none"
    no_prefix: bool = False
    allow_mpi: bool = False
    elastic: bool = False         # a failed rank does not stop the others (an elastic program goes on)
    replace: int = 0              # --elastic: replacements to start in all, one per failed rank
