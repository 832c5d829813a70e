#!/usr/bin/env python3
"""Runs the commands of every example README's "## Exercises" section, as a student would.

    check_readme_exercises.py --source-dir . --build-dir build [--list]

A command is an inline code span that starts with `build/examples/`, `tools/tessera-run ` or
`build/idx-to-image-folder ` (11's exercises convert their images first): build/ is this build
directory, tools/ the source tree's. The commands of one README run in
order in one fresh temporary directory (the traces and checkpoints they write land there, so a
`--resume=c.safetensors` finds the file an earlier command saved), with OMP_NUM_THREADS=1 unless set,
--jobs READMEs at a time, and must exit 0 within --timeout seconds: an exercise that fails as
written (04's --trace, 06's --stages=4 and 13's --periods=64 did) is a broken lesson. A command whose program this build
lacks (a backend not configured here) is skipped, and said so; a README's exercise that names no
program at all is not run.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile
import time

SPAN = re.compile(r"`([^`]+)`")
PREFIXES = ("build/examples/", "tools/tessera-run ", "build/idx-to-image-folder ")


def exercises(readme: pathlib.Path) -> str:
    """The text of the README's "## Exercises" section ("" when it has none)."""
    text = readme.read_text()
    start = text.find("\n## Exercises")
    if start < 0:
        return ""
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def commands(source: pathlib.Path) -> list[tuple[str, str]]:
    """(example, command) for every runnable span, in README order."""
    found = []
    for readme in sorted((source / "examples").glob("*/README.md")):
        # A span may wrap over a line break in the Markdown source.
        section = re.sub(r"\s*\n\s*", " ", exercises(readme))
        for span in SPAN.findall(section):
            if span.startswith(PREFIXES):
                found.append((readme.parent.name, span.strip()))
    return found


def resolve(words: list[str], source: pathlib.Path, build: pathlib.Path) -> list[str] | None:
    """The command with its paths made absolute; None when a program is not built here."""
    out = []
    for w in words:
        if w.startswith("build/"):
            path = build / w[len("build/"):]
            if not path.exists():
                return None
            out.append(str(path))
        elif w == "tools/tessera-run":
            out += [sys.executable, str(source / "tools" / "tessera-run")]
        else:
            out.append(w)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source-dir", required=True, type=pathlib.Path)
    parser.add_argument("--build-dir", required=True, type=pathlib.Path)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="READMEs whose commands run at the same time (default: the CPU count)")
    parser.add_argument("--list", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--only", action="append", default=[], metavar="PREFIX",
                        help="only the examples whose folder name starts with PREFIX (09, 11_image): repeatable")
    args = parser.parse_args()
    source, build = args.source_dir.resolve(), args.build_dir.resolve()
    found = [(e, c) for e, c in commands(source) if not args.only or e.startswith(tuple(args.only))]
    if not found:
        print("no exercise commands found: the READMEs' Exercises sections name no build/examples/ program")
        return 1
    if args.list:
        for example, command in found:
            print(f"{example}: {command}")
        return 0
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    groups: dict[str, list[str]] = {}
    for example, command in found:
        groups.setdefault(example, []).append(command)

    def run_group(example: str) -> tuple[list[str], int, int]:
        """One README's commands, in order, in one fresh directory: (report lines, failed, skipped)."""
        lines: list[str] = []
        failed = skipped = 0
        with tempfile.TemporaryDirectory(prefix="tessera-exercise-") as cwd:
            for command in groups[example]:
                argv = resolve(shlex.split(command), source, build)
                if argv is None:
                    lines.append(f"skip  {example}: {command} (its program is not built here)")
                    skipped += 1
                    continue
                start = time.monotonic()
                try:
                    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                                          timeout=args.timeout, stdin=subprocess.DEVNULL)
                    status: int | str = done.returncode
                    output = done.stdout + done.stderr
                except subprocess.TimeoutExpired as e:
                    status = f"timeout after {args.timeout:.0f} s"
                    output = str(e.stdout or "") + str(e.stderr or "")
                seconds = time.monotonic() - start
                if status == 0:
                    lines.append(f"ok    {example}: {command} ({seconds:.1f} s)")
                else:
                    failed += 1
                    lines.append(f"FAIL  {example}: {command} (exit {status}, {seconds:.1f} s); its last lines:")
                    lines += [f"      {line}" for line in output.strip().splitlines()[-15:]]
        return lines, failed, skipped

    # READMEs are independent (each has its own directory), so --jobs of them run at once: most
    # commands train at one thread (OMP_NUM_THREADS=1), and one at a time would leave a core idle.
    # Each README's report prints when it finishes, its commands in README order.
    failed = skipped = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for lines, group_failed, group_skipped in pool.map(run_group, groups):
            print("\n".join(lines), flush=True)
            failed += group_failed
            skipped += group_skipped
    print(f"{len(found) - failed - skipped} exercise commands ran as written, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
