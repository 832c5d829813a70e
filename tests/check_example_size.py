#!/usr/bin/env python3
"""Checks that the examples stay lessons: no function in examples/ longer than --max-function
lines, and no example main.cpp longer than --max-main lines.

    check_example_size.py [--max-function=60] [--max-main=150] [--except=EXAMPLE,...] EXAMPLES_DIR

A function is a definition at namespace or class scope: a line that opens a parameter list and
whose body's braces close on a later line at the same indentation; its length counts every line
from its signature to its closing brace (comments and blank lines included, as a reader scrolls
them). Lambdas count as part of the function around them. --except names examples whose main.cpp
may be longer (their functions are still checked). Prints the longest function and main and every
one over its limit; exits 1 if there is any. Standard library only.
"""
import argparse
import os
import re
import sys

SIGNATURE = re.compile(r"^( {0,2})(?!(?:if|for|while|switch|return|else|do|case|namespace|struct|class|enum|using|"
                       r"template|static_assert|#)\b)[A-Za-z_~][^;=]*\(")


def functions(path):
    """(length, first line, signature) of every function defined in the file."""
    lines = open(path, encoding="utf-8").read().split("\n")
    found, i = [], 0
    while i < len(lines):
        m = SIGNATURE.match(lines[i])
        if not m or lines[i].lstrip().startswith("//"):
            i += 1
            continue
        # The body opens on the signature's line or one of the next few (a wrapped parameter list).
        j = i
        while j < len(lines) and j < i + 6 and not lines[j].rstrip().endswith("{"):
            if lines[j].rstrip().endswith(";"):
                break
            j += 1
        if j >= len(lines) or not lines[j].rstrip().endswith("{"):
            i += 1
            continue
        indent = m.group(1)
        k = j + 1
        while k < len(lines) and not re.match("^" + indent + r"}", lines[k]):
            k += 1
        found.append((k - i + 1, i + 1, lines[i].strip()[:70]))
        i = k + 1
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-function", type=int, default=60)
    parser.add_argument("--max-main", type=int, default=150)
    parser.add_argument("--except", dest="excepted", default="", help="examples whose main.cpp may be longer")
    parser.add_argument("examples")
    args = parser.parse_args()
    problems, longest, longest_main = [], (0, "", 0, ""), (0, "")
    for root, _, files in sorted(os.walk(args.examples)):
        for name in sorted(files):
            if not name.endswith((".cpp", ".hpp")):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, args.examples)
            for length, line, signature in functions(path):
                if length > longest[0]:
                    longest = (length, rel, line, signature)
                if length > args.max_function:
                    problems.append("%s:%d: %s is %d lines (at most %d)" % (rel, line, signature, length,
                                                                           args.max_function))
            excepted = set(filter(None, args.excepted.split(",")))
            if name == "main.cpp" and os.path.basename(root) not in excepted:
                count = len(open(path, encoding="utf-8").read().rstrip("\n").split("\n"))
                longest_main = max(longest_main, (count, rel))
                if count > args.max_main:
                    problems.append("%s is %d lines (at most %d)" % (rel, count, args.max_main))
    print("longest function: %s:%d, %s, %d lines (at most %d)" % (longest[1], longest[2], longest[3], longest[0],
                                                                  args.max_function))
    print("longest main: %s, %d lines (at most %d)" % (longest_main[1], longest_main[0], args.max_main))
    for p in problems:
        print("check_example_size: " + p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
