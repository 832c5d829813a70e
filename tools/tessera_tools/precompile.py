"""Precompile a header with exactly the flags of a reference translation unit of the same build.

A precompiled header (GCC's .gch) is only valid for compiles with the same options: GCC checks
the macros the header reads and rejects the .gch with a -Winvalid-pch warning when one differs,
but it does not check every -O or -f option, and a .gch made at -O1 and used at -O2 crashed g++
12's IPA pass. So this command takes the flags from the build's compile_commands.json, from the
entry of a reference source that meson compiles with the options of the programs that will use
the header, and compiles the header with them:

    precompile_header.py --compdb build/compile_commands.json --reference src/pch/pch_reference.p/ \\
        --header build/src/pch/tessera_pch.hpp --output build/src/pch/tessera_pch.hpp.gch \\
        --depfile build/src/pch/tessera_pch.hpp.d

It drops the reference's -c SOURCE, -o OBJECT and its -MD/-MQ/-MF dependency options (and a
ccache in front), compiles the header as `-x c++-header`, and writes a depfile for the .gch, so
that ninja remakes it when a header it includes changes. The programs then compile with
`-include build/src/pch/tessera_pch.hpp`: g++ finds the .gch beside it and uses it, or, if it is
not valid for them, says so and reads the header's text (the result is the same program).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import subprocess
import sys
from collections.abc import Sequence

# Options whose next argument is a unit's own object or dependency file, and those alone that ask
# for dependency output. -fpch-deps goes with them: g++ 12 crashes reading a precompiled header
# with it and no dependency output.
_OUTPUT_WITH_VALUE = {"-o", "-MQ", "-MF", "-MT"}
_OUTPUT_ALONE = {"-MD", "-MMD", "-fpch-deps"}
_LAUNCHERS = {"ccache", "sccache", "distcc"}


def without_outputs(command: Sequence[str]) -> list[str]:
    """A compile command without its launcher (ccache), its -o OBJECT and its dependency output
    (-MD, -MQ/-MF/-MT FILE): what compiles the same unit and writes nothing of the build's
    (bench/compile.py times units with it)."""
    args = list(command)
    while args and pathlib.Path(args[0]).name in _LAUNCHERS:
        args = args[1:]
    kept: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a in _OUTPUT_WITH_VALUE:
            skip = True
        elif not (a in _OUTPUT_ALONE or (a[:3] in ("-MF", "-MQ", "-MT") and len(a) > 3)):
            kept.append(a)
    return kept


def header_command(reference_command: list[str], header: str, output: str, depfile: str,
                   extra: Sequence[str] = ()) -> list[str]:
    """The reference's compile command, turned into one that precompiles `header` into `output`,
    with `extra` options that only the header's compile takes (clang's -fpch-instantiate-templates)."""
    args = without_outputs(reference_command)
    if "-c" not in args[:-1]:
        raise ValueError(f"the reference's command compiles no source (-c SOURCE): {' '.join(reference_command)}")
    i = args.index("-c")
    del args[i:i + 2]
    if not args:
        raise ValueError("the reference's compile command is empty")
    return [*args, *extra, "-x", "c++-header", header, "-o", output, "-MD", "-MQ", output, "-MF", depfile]


def reference_entry(compdb: pathlib.Path, reference: str) -> dict[str, str]:
    """The compile_commands.json entry whose object's path starts with `reference` (a target's
    private directory, such as src/pch/pch_reference.p/: one source per target, unlike a source's
    path, which several targets may compile)."""
    try:
        entries = json.loads(compdb.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{compdb}: cannot read the compilation database ({e})") from e
    matches = [e for e in entries if e.get("output", "").startswith(reference)]
    if len(matches) != 1:
        raise ValueError(f"{compdb}: {len(matches)} entries write an object under {reference!r}; want exactly one")
    return matches[0]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="precompile_header.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compdb", required=True, help="the build's compile_commands.json")
    ap.add_argument("--reference", required=True,
                    help="where the reference's object goes, relative to the build directory (its target's private "
                         "directory, e.g. pch/pch_reference.p/)")
    ap.add_argument("--header", required=True, help="the header to precompile")
    ap.add_argument("--output", required=True,
                    help="the precompiled header to write (the header's path plus .gch for g++, .pch for clang)")
    ap.add_argument("--depfile", required=True, help="the dependency file to write for ninja")
    ap.add_argument("--extra-arg", action="append", default=[], metavar="OPTION",
                    help="an option for the header's compile alone (repeatable), e.g. -fpch-instantiate-templates")
    args = ap.parse_args(argv)
    try:
        entry = reference_entry(pathlib.Path(args.compdb), args.reference)
        command = entry.get("arguments") or shlex.split(entry["command"])
        cmd = header_command(list(command), args.header, args.output, args.depfile, args.extra_arg)
    except ValueError as e:
        print(f"precompile_header.py: {e}", file=sys.stderr)
        return 1
    return subprocess.run(cmd, cwd=entry.get("directory") or None).returncode
