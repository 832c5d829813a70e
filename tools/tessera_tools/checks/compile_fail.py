"""Negative-compilation tests: each source must FAIL to compile, and the compiler's output must
contain every `// expect: <text>` line of the source (the sentence that names the fix), in at most
`// max-lines: N` lines when the source gives that limit. The count leaves out the include chain
("In file included from ..."), which clang repeats above every error and g++ prints once: what is
bounded is what a user reads past to find the sentence. Prints the first error sentence of each,
so the test log shows what a user would read. Exit 1 if any source compiled, or failed without its
sentence, or said it in too many lines."""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import re
import subprocess
from collections.abc import Sequence


# "In file included from a.hpp:3:" and g++'s continuation lines "                 from b.hpp:5,".
_INCLUDE_CHAIN = re.compile(r"^(In file included from |\s+from \S+:\d+[,:]$)")


def check(source: pathlib.Path, base: list[str]) -> tuple[str, bool]:
    """One source's report (its lines for the log) and whether it failed as it must."""
    text = source.read_text()
    expects = re.findall(r"^// expect: (.+)$", text, re.M)
    limit = re.search(r"^// max-lines: (\d+)$", text, re.M)
    if not expects:
        return f"FAILED {source.name}: no '// expect:' line, so nothing would be checked", False
    r = subprocess.run([*base, str(source)], capture_output=True, text=True, timeout=300)
    out = r.stderr + r.stdout
    lines = out.strip().splitlines()
    counted = [l for l in lines if not _INCLUDE_CHAIN.match(l)]
    problems = []
    if r.returncode == 0:
        problems.append("compiled, but must not")
    problems += [f"output lacks '{e}'" for e in expects if e not in out]
    if limit and len(counted) > int(limit.group(1)):
        problems.append(f"{len(counted)} lines of compiler output (the include chain aside), more than {limit.group(1)}")
    said = next((l[l.index("error:"):] for l in lines if "error:" in l), "(no error line)")
    report = [f"{'ok' if not problems else 'FAILED':6} {source.name}: {len(counted)} lines; {said}"]
    if problems:
        report.append("       " + "; ".join(problems))
        report += ["       | " + l for l in lines[:40]]
    return "\n".join(report), not problems


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="check_compile_fail.py", description=__doc__)
    ap.add_argument("--compiler", default="c++")
    ap.add_argument("--include", action="append", default=[], help="an include directory")
    ap.add_argument("--flag", action="append", default=[], help="an extra compiler flag")
    ap.add_argument("sources", nargs="+")
    args = ap.parse_args(argv)
    sources = [pathlib.Path(s) for s in args.sources]
    base = [args.compiler, "-std=c++20", "-fopenmp", "-fsyntax-only", *args.flag, *[f"-I{d}" for d in args.include]]
    # Each source is one compiler process: as many at a time as there are cores (the checks are
    # independent), reported in the order given.
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        reports = list(pool.map(lambda source: check(source, base), sources))
    failed = 0
    for report, ok in reports:
        print(report)
        failed += 0 if ok else 1
    print(f"{len(args.sources) - failed} of {len(args.sources)} negative-compilation tests passed")
    return 1 if failed else 0

