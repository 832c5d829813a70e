#!/usr/bin/env python3
"""Runs a command that must fail with a given sentence.

    expect_failure.py [--forbid TEXT ...] "NEEDLE" COMMAND [ARGS...]

Exit 0 when COMMAND exits non-zero within 120 s and its output (stdout and stderr) contains
NEEDLE and none of the --forbid texts (what a program must not get to before failing); otherwise
1, printing what it did. Standard library only.
"""
import subprocess
import sys


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    args = sys.argv[1:]
    forbidden = []
    while len(args) >= 2 and args[0] == "--forbid":
        forbidden.append(args[1])
        args = args[2:]
    if len(args) < 2:
        print(__doc__)
        return 2
    needle, command = args[0], args[1:]
    run = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120,
                         stdin=subprocess.DEVNULL)
    print(run.stdout[-4000:])
    if run.returncode == 0:
        print(f"expect_failure: {command[0]} exited 0; expected a failure saying: {needle}")
        return 1
    if needle not in run.stdout:
        print(f"expect_failure: {command[0]} failed (exit {run.returncode}) without saying: {needle}")
        return 1
    for text in forbidden:
        if text in run.stdout:
            print(f"expect_failure: {command[0]} failed, but only after printing: {text}")
            return 1
    print(f"expect_failure: failed as expected (exit {run.returncode}), saying: {needle}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
