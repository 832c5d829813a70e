"""Ranks on --hosts: the host list, the placement of ranks by slot, the remote command line."""
from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DEFAULT_RSH = "ssh -o BatchMode=yes {host}"
# A host name as ssh, /etc/hosts or `ip netns` spell one; no shell metacharacters, since it is
# put into the --rsh command.
HOST_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@-]*$")


@dataclass(frozen=True)
class Host:
    """One entry of --hosts: a name and how many ranks it takes."""
    name: str
    slots: int


@dataclass(frozen=True)
class Place:
    """Where one rank runs: its host, its rank among that host's ranks, and their count."""
    host: str
    local_rank: int
    local_size: int


def host_list(text: str) -> list[Host]:
    """argparse type: "h1,h2:2" -> [Host("h1", 1), Host("h2", 2)]."""
    hosts = []
    for item in text.split(","):
        name, colon, slots = item.partition(":")
        if not HOST_NAME.match(name):
            raise argparse.ArgumentTypeError(f"bad host {name!r} in {text!r}: letters, digits and _.@- only")
        if colon:
            if not slots.isdigit() or int(slots) < 1:
                raise argparse.ArgumentTypeError(f"bad slot count {slots!r} for host {name!r}: need an integer >= 1")
        hosts.append(Host(name, int(slots) if colon else 1))
    return hosts


def placement(hosts: Sequence[Host], nproc: int) -> list[Place]:
    """Where ranks 0 .. nproc-1 run, filling hosts in order."""
    out: list[Place] = []
    for host in hosts:
        take = min(host.slots, nproc - len(out))
        out += [Place(host.name, local, take) for local in range(take)]
    return out


def remote_argv(rsh: Sequence[str], host: str, env: Mapping[str, str], command: Sequence[str], cwd: str) -> list[str]:
    """The argv that starts one rank on `host`: the --rsh words with {host} filled in (or the host
    appended), then one shell command line that enters the working directory and execs the
    program with the rank's variables set."""
    words = [w.replace("{host}", host) for w in rsh]
    if not any("{host}" in w for w in rsh):
        words.append(host)
    line = (f"cd {shlex.quote(cwd)} && exec env "
            + " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(env.items())) + " "
            + " ".join(shlex.quote(a) for a in command))
    return words + [line]
