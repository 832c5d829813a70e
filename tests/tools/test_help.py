"""Every command's --help: each entry point in tools/ (and each subcommand of those that have
them) exits 0 and prints a usage line naming the command. Run with this interpreter, and for the
report without matplotlib's re-execution under /usr/bin/python3 too, so --help never needs
matplotlib or numpy.

    python3 -m pytest -q tests/tools/test_help.py
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import TOOLS

# (entry point in tools/, arguments before --help, the name its usage line gives)
COMMANDS = [
    ("tessera-run", [], "tessera-run"),
    ("tessera-sbatch", [], "tessera-sbatch"),
    ("tessera-simulate", [], "tessera-simulate"),
    *[("tessera-simulate", [sub], f"tessera-simulate {sub}")
      for sub in ("dp", "pipeline", "tp", "allreduce", "profile", "fit")],
    ("tessera-report", [], "tessera-report"),
    ("tessera-report", ["plot-metrics"], "tessera-report plot-metrics"),
    ("tessera-report", ["plot-trace"], "tessera-report plot-trace"),
    ("check_headers.py", [], "check_headers.py"),
    ("check_api_docs.py", [], "check_api_docs.py"),
    ("check_compile_fail.py", [], "check_compile_fail.py"),
    ("precompile_header.py", [], "precompile_header.py"),
    ("read_checkpoint.py", [], "read_checkpoint.py"),
    ("convert_gpt2.py", [], "convert_gpt2.py"),
]


def run_help(entry: str, args: list[str], env: dict[str, str] | None = None,
             interpreter: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    argv = (interpreter if interpreter is not None else [sys.executable]) + [str(TOOLS / entry), *args, "--help"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("entry,args,name", COMMANDS, ids=[" ".join([e, *a]) for e, a, _ in COMMANDS])
def test_help(entry: str, args: list[str], name: str) -> None:
    done = run_help(entry, args)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-1000:]}"
    usage = done.stdout.splitlines()[0] if done.stdout else ""
    assert usage.startswith(f"usage: {name}"), f"usage line {usage!r}"


@pytest.mark.parametrize("args", [[], ["plot-metrics"], ["plot-trace"]])
def test_report_help_without_matplotlib(args: list[str]) -> None:
    """With the re-execution under /usr/bin/python3 switched off, an interpreter without
    matplotlib (a pyenv python3) still prints the help."""
    env = dict(os.environ, TESSERA_REPORT_NO_REEXEC="1")
    done = run_help("tessera-report", args, env=env)
    assert done.returncode == 0, done.stderr[-1000:]
    assert done.stdout.startswith("usage: tessera-report"), done.stdout[:200]
    assert "re-running" not in done.stderr


@pytest.mark.parametrize("entry", sorted({entry for entry, _, _ in COMMANDS}))
def test_entry_point_is_thin_and_executable(entry: str) -> None:
    """The commands are small scripts that call their module's main; they run by path too."""
    path = TOOLS / entry
    assert os.access(path, os.X_OK), f"{path} is not executable"
    assert len(path.read_text().splitlines()) <= 15, f"{path} is more than an entry point"
    done = subprocess.run([str(path), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-1000:]
