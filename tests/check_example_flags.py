#!/usr/bin/env python3
"""Checks that each example's README documents exactly the flags the example reads.

    check_example_flags.py README.md=BINARY [README.md=BINARY ...]

For each pair, `BINARY --help` lists the program's flags (tessera::Flags prints every flag the
program reads, so the list is never out of date). The README's section headed "## Flags" (up to
the next "## ") must name each of them as `--name`, and every `--name` it names must be one of
them: a flag added to the program and not to the README fails, and so does a README flag the
program no longer has. Every flag's --help line must also say what the flag means (the reader's
last argument, `flags.get("epochs", 5, {.min = 1}, "passes over the training set")`), not only
its default and range. Prints every difference, exits 1 if there is any. Standard library only.
"""
import re
import subprocess
import sys


# What Flags writes by itself after a flag's default: its range or choices. A line that holds only
# this (or nothing) was read without a meaning.
CONSTRAINT_ONLY = re.compile(r"^(|[<>]=? \S+|in [\[(].*|a number|one of .*|comma-separated.*|true or false.*|"
                             r"1 to \d+, or 0 for all.*|>= 1; the launcher.*|a file to (write|read) \(empty: none\))$")


def help_flags(binary):
    """The flags `binary --help` lists, and those of them whose line gives no meaning."""
    run = subprocess.run([binary, "--help"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    if run.returncode != 0 or not run.stdout.startswith("usage:"):
        raise RuntimeError("%s --help exited %d:\n%s" % (binary, run.returncode, run.stdout[-2000:]))
    flags, unexplained = set(), []
    for name, text in re.findall(r"^\s+--([a-z0-9][a-z0-9-]*)(?:=\S*)?[ \t]*(.*)$", run.stdout, re.M):
        if name == "help":
            continue
        flags.add(name)
        if CONSTRAINT_ONLY.match(text.strip()):
            unexplained.append(name)
    return flags, unexplained


def readme_flags(path):
    with open(path) as f:
        text = f.read()
    section = re.search(r"^## Flags\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    if not section:
        return None
    return set(re.findall(r"(?<![\w-])--([a-z0-9][a-z0-9-]*)", section.group(1))) - {"help"}


def main():
    problems = []
    for pair in sys.argv[1:]:
        readme, _, binary = pair.partition("=")
        try:
            program, unexplained = help_flags(binary)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            problems.append(str(e))
            continue
        for f in unexplained:
            problems.append("%s --help: --%s has no meaning (give it as the reader's last argument)" % (binary, f))
        documented = readme_flags(readme)
        if documented is None:
            problems.append("%s: no '## Flags' section (the program reads %s)" %
                            (readme, ", ".join("--" + f for f in sorted(program))))
            continue
        for f in sorted(program - documented):
            problems.append("%s: --%s is a flag of %s but not in the README's Flags section" % (readme, f, binary))
        for f in sorted(documented - program):
            problems.append("%s: the Flags section names --%s, which %s does not read" % (readme, f, binary))
        print("%s: %d flags, all documented" % (readme, len(program)) if program == documented else "")
    for p in problems:
        print("check_example_flags: " + p, file=sys.stderr)
    if problems:
        sys.exit(1)
    print("check_example_flags: every README documents exactly its program's flags")


if __name__ == "__main__":
    main()
