"""tessera-run: start N ranks of a Tessera program, like `torchrun --standalone`: on this machine,
or on a list of hosts through a remote-exec command (ssh, or `ip netns exec` for namespaces).

Standard library only, so that it runs with the system python3 and no virtual environment.
Modules: cli (options and their checks), hosts (placement on --hosts), guards (checks before any
rank starts: MPI programs, rank count, open files), ranks (starting, forwarding, stopping)."""
from __future__ import annotations

from tessera_tools.launch.cli import main

__all__ = ["main"]
