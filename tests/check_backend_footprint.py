#!/usr/bin/env python3
"""What adding a communicator costs outside its folder, checked on the test-only P2pComm.

docs/adding-a-communicator.md promises that a communicator is its folder plus at most two lines
elsewhere (a name in the build's list of communicator folders, or a subdir line, and its feature
option), and that the tests come from its entry in the backend list alone. This check holds the
tree to it with tests/comm/p2p:

  1. every tracked file outside tests/comm/p2p and outside the documentation (*.md) is searched
     for the names that only P2pComm has (its folder, its class, its Env alias, its header, its
     entry's name); at most two such lines may exist;
  2. with --build-dir, the configured build's test list (meson-info/intro-tests.json) must hold
     the conformance suite at 1 to 4 ranks and DataParallel at 2 and 3 ranks on it, which nothing
     but its entry asks for.

  python3 tests/check_backend_footprint.py --root . --build-dir build
  python3 tests/check_backend_footprint.py --self-test
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import subprocess
import sys

FOLDER = "tests/comm/p2p"
# Names only this backend has: point-to-point in general ("p2p" spans, queue_p2p) is not it.
NAMES = re.compile(r"tests/comm/p2p|P2pComm|CpuP2p|comm/p2p\.hpp|'p2p'")
MAX_LINES_ELSEWHERE = 2
EXPECTED_TESTS = ["p2p-1", "p2p-2", "p2p-3", "p2p-4", "p2p-data-parallel-2", "p2p-data-parallel-3"]


def lines_elsewhere(files: dict[str, str]) -> list[str]:
    """'path:line: text' for every line naming the backend outside its folder and the docs."""
    found = []
    for path, text in sorted(files.items()):
        if path.startswith(FOLDER + "/") or path.endswith(".md") or path == "tests/check_backend_footprint.py":
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if NAMES.search(line):
                found.append(f"{path}:{number}: {line.strip()}")
    return found


def missing_tests(test_names: list[str]) -> list[str]:
    return [name for name in EXPECTED_TESTS if name not in test_names]


def tracked_files(root: pathlib.Path) -> dict[str, str]:
    names = subprocess.run(["git", "-C", str(root), "ls-files"], capture_output=True, text=True,
                           check=True).stdout.split()
    files = {}
    for name in names:
        path = root / name
        try:
            files[name] = path.read_text()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
    return files


def problems(files: dict[str, str], test_names: list[str] | None) -> list[str]:
    out = []
    elsewhere = lines_elsewhere(files)
    if len(elsewhere) > MAX_LINES_ELSEWHERE:
        out.append(f"P2pComm is named on {len(elsewhere)} lines outside {FOLDER} and the docs "
                   f"(at most {MAX_LINES_ELSEWHERE}):")
        out += ["  " + line for line in elsewhere]
    if test_names is not None:
        for name in missing_tests(test_names):
            out.append(f"the build registers no test {name}: the backend list's entry should produce it")
    return out


def self_test() -> int:
    good = {"meson.build": "communicator_folders = ['mpi']\nsubdir('tests/comm/p2p')\n",
            "tests/comm/p2p/meson.build": "cpu_backends += {'name': 'p2p'}\n",
            "docs/adding-a-communicator.md": "P2pComm " * 50,
            "include/tessera/parallel/pipeline.hpp": 'add(name, "p2p", began);\n'}
    assert problems(good, EXPECTED_TESTS) == [], problems(good, EXPECTED_TESTS)
    spread = dict(good)
    spread["tests/meson.build"] = "if b['name'] == 'p2p'\nexecutable('x', cpp_args: 'CpuP2p')\n"
    assert len(problems(spread, EXPECTED_TESTS)) == 1 + 3, problems(spread, EXPECTED_TESTS)
    assert problems(good, EXPECTED_TESTS[:-1]) == [
        "the build registers no test p2p-data-parallel-3: the backend list's entry should produce it"]
    print("self-test passed")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=pathlib.Path, default=pathlib.Path(__file__).resolve().parents[1])
    parser.add_argument("--build-dir", type=pathlib.Path, help="a configured build: check its test list too")
    parser.add_argument("--self-test", action="store_true", help="check the check on made-up trees")
    args = parser.parse_args()
    if args.self_test:
        return self_test()
    test_names = None
    if args.build_dir is not None:
        intro = args.build_dir / "meson-info" / "intro-tests.json"
        test_names = [t["name"] for t in json.loads(intro.read_text())]
    found = problems(tracked_files(args.root), test_names)
    for line in found:
        print(line)
    if not found:
        print(f"P2pComm: {len(lines_elsewhere(tracked_files(args.root)))} line(s) outside {FOLDER}; "
              f"its {len(EXPECTED_TESTS)} tests come from its entry")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
