#!/usr/bin/env python3
"""Keeps the product apart from the lab notebook (STYLE.md): one cited baseline per benchmark and
CPU, no stale result paths, no timings in header comments.

    check_lab_notebook.py [--root DIR]     check the tree (default: the repository holding this file)
    check_lab_notebook.py --self-test      check the checks on small in-memory trees

Exit 0 when the tree passes, 1 otherwise, with one line per problem naming the file. Standard
library only. The rules:

1. Every file under bench/baselines/ is cited by README.md or bench/README.md: by its path from
   the repository root (`bench/baselines/amd-epyc-zen5/throughput_2threads.json`) or from bench/
   (`baselines/amd-epyc-zen5/throughput_2threads.json`); a `*` in a cited path matches any
   characters within a file name. A file is also cited when a cited markdown file under
   bench/baselines/ names it by its path from that file's folder (a report's index.md naming
   `raw/training.json` and `plots/training.png`).
2. No markdown file (tracked, or new and not ignored) cites `bench/results/`, a path that resolves
   under bench/results/ from the file's own folder (`results/x.json` in bench/README.md), or a
   `bench/baselines/...` path that does not exist. A path with a placeholder
   (`bench/baselines/<cpu>/<bench>.json`) is cited only up to the placeholder. Markdown files under
   bench/baselines/ are records and are not checked for this rule: the command lines they hold
   say where they were written at the time.
3. No comment in a header (include/**, communicators/*/include/**: .hpp, .h, .cuh) quotes a timing:
   - a number followed by a time unit: ns, us, µs, ms, s, sec, seconds, min, minutes, hours, cycles;
   - a number followed by a throughput unit: img/s, images/s, samples/s, tokens/s, B/s, KB/s, MB/s,
     GB/s, MiB/s, GiB/s, bit/s, Mbit/s, Gbit/s, flop/s, GFLOP/s, TFLOP/s, GF/s, TF/s;
   - a speed ratio: `1.4x faster` (slower, longer, shorter, quicker, as long, as fast, the time,
     over), or `faster ... by 1.2x`;
   - a speed percentage: a signed one (`+12%`, `-5 %`), one followed by faster/slower/quicker/longer/
     shorter/speedup, or a share of a run (`19% of a ResNet-20 training step`; also pass, profile,
     forward, backward, inference, training, time, samples).
   Not flagged, because they are not measurements of speed: sizes (`64 KiB`), shapes
   (`(N, C, H, W)`), operation counts (`4x fewer multiply-adds`), text between double quotes (a
   paper's title, an example of a printed line), and settings: a time or throughput with timeout,
   limit, default, deadline, at most, at least or up to in the 40 characters before it or the 20
   after it on its line (`default 300 s`, `up to 200 us`, `300 s timeout`), and any on an indented
   comment line (`//` and two or more spaces: an option table, a formula, an example of output).
   Speed ratios and percentages are flagged on every line.
"""
from __future__ import annotations

import argparse
import bisect
import fnmatch
import os
import posixpath
import re
import subprocess
import sys
from dataclasses import dataclass, field

BASELINES = "bench/baselines"
RESULTS = "bench/results"
CITING = ("README.md", "bench/README.md")
HEADER_SUFFIXES = (".hpp", ".h", ".cuh")

# ---- rule 3: timings in comments ----

NUM = r"\d+(?:[.,]\d+)*(?:[ \t]*[kKM](?![A-Za-z]))?"
NUM_RANGE = rf"{NUM}(?:[ \t]*(?:-|–|to)[ \t]*{NUM})?"
TIME_UNIT = r"(?:ns|us|µs|μs|ms|s(?![ \t]*[+*/=<>^])|secs?|seconds?|mins?(?![ \t]*\()|minutes?|hours?|cycles?)"
RATE_UNIT = (r"(?:img/s|images/s|samples/s|tokens/s|[KMGT]?i?B/s|[KMG]?bit/s|[KMG]?bps|"
             r"[GT]?(?:FLOP|flop)/s|[GT]?FLOPS|[GT]F/s)")
# A number and its unit stay on one line; a ratio or a percentage may run onto the next.
TIME_RE = re.compile(rf"(?<![\w.])(?:~[ \t]*)?{NUM_RANGE}[ \t]*{TIME_UNIT}(?![\w/])")
RATE_RE = re.compile(rf"(?<![\w.])(?:~[ \t]*)?{NUM_RANGE}[ \t]*{RATE_UNIT}(?!\w)")
RATIO_RE = re.compile(
    rf"(?<![\w.]){NUM_RANGE}[ \t]*[x×]\s+(?:faster|slower|longer|shorter|quicker|as\s+long|as\s+fast|"
    rf"the\s+time|over\s)"
    rf"|(?:faster|slower|beats?|won|gain\w*|speed\w*)\b[^.;]{{0,40}}?\bby\s+{NUM_RANGE}[ \t]*[x×](?!\w)")
PERCENT_RE = re.compile(
    rf"(?<![\w.])[+\-−][ \t]?{NUM}[ \t]*%"
    rf"|(?<![\w.]){NUM_RANGE}[ \t]*%\s+(?:faster|slower|quicker|longer|shorter|speed-?up)"
    rf"|(?<![\w.]){NUM_RANGE}[ \t]*%\s+(?:and\s+{NUM}[ \t]*%\s+)?of\s+(?:[\w'+\-]+\s+){{0,5}}?"
    rf"(?:steps?|pass(?:es)?|profiles?|forward|backward|inference|training|time|samples)\b")
SETTING_RE = re.compile(r"time-?outs?|limit|default|deadline|at most|at least|up to", re.IGNORECASE)
QUOTED_RE = re.compile(r"\"[^\"\n]*(?:\n[^\"\n]*)?\"|“[^”]*”")


@dataclass
class Comment:
    line: int      # 1-based line of the source
    text: str      # the comment's text on that line, without the // or /* */
    indented: bool  # a line comment whose text starts with two or more spaces


def comments(source: str) -> list[Comment]:
    """The comment text of each source line, skipping string and character literals."""
    out: list[Comment] = []
    i, n, line = 0, len(source), 1
    while i < n:
        c = source[i]
        if c == "\n":
            line += 1
            i += 1
        elif source.startswith("//", i):
            end = source.find("\n", i)
            end = n if end < 0 else end
            text = source[i + 2:end]
            out.append(Comment(line, text, text.startswith("  ")))
            i = end
        elif source.startswith("/*", i):
            end = source.find("*/", i + 2)
            end = n if end < 0 else end
            for k, part in enumerate(source[i + 2:end].split("\n")):
                out.append(Comment(line + k, re.sub(r"^\s*\*(?!/)", "", part), False))
            line += source.count("\n", i, end)
            i = end + 2
        elif c == "R" and source.startswith('R"', i) and (i == 0 or not (source[i - 1].isalnum() or source[i - 1] == "_")):
            m = re.match(r'R"([^()\\\s]{0,16})\(', source[i:])
            if not m:
                i += 1
                continue
            close = ")" + m.group(1) + '"'
            end = source.find(close, i + m.end())
            end = n if end < 0 else end + len(close)
            line += source.count("\n", i, end)
            i = end
        elif c in "\"'":
            j = i + 1
            while j < n and source[j] != c and source[j] != "\n":
                j += 2 if source[j] == "\\" else 1
            i = j + 1
        else:
            i += 1
    return out


def blank_quotes(block: str) -> str:
    """The text with every double-quoted span replaced by spaces (line breaks kept)."""
    return QUOTED_RE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), block)


def timing_problems(path: str, source: str) -> list[str]:
    found: list[str] = []
    cs = comments(source)
    k = 0
    while k < len(cs):  # a block: comments on consecutive lines, so quotes may span lines
        j = k + 1
        while j < len(cs) and cs[j].line == cs[j - 1].line + 1:
            j += 1
        block = cs[k:j]
        text = blank_quotes("\n".join(c.text for c in block))
        starts = [0]
        for c in block[:-1]:
            starts.append(starts[-1] + len(c.text) + 1)
        hits: dict[int, list[str]] = {}

        def add(m: re.Match[str]) -> None:
            at = bisect.bisect_right(starts, m.start()) - 1
            hits.setdefault(at, []).append(" ".join(m.group(0).split()))

        for m in list(RATIO_RE.finditer(text)) + list(PERCENT_RE.finditer(text)):
            add(m)
        for m in list(TIME_RE.finditer(text)) + list(RATE_RE.finditer(text)):
            at = bisect.bisect_right(starts, m.start()) - 1
            line_start = starts[at]
            near = text[max(line_start, m.start() - 40):min(line_start + len(block[at].text), m.end() + 20)]
            if not block[at].indented and not SETTING_RE.search(near):
                add(m)
        for at in sorted(hits):
            quoted = ", ".join(f"'{h}'" for h in dict.fromkeys(hits[at]))
            found.append(f"{path}:{block[at].line}: comment quotes a timing ({quoted}); keep the reason, "
                         f"move the figure to bench/README.md next to its baseline")
        k = j
    return found


# ---- rules 1 and 2: baselines and citations ----

PATH_TOKEN = re.compile(r"[\w.\-/*]*(?:baselines|results)/[\w.\-/*]*")


@dataclass
class Tree:
    markdown: dict[str, str]            # repository-relative path -> text
    headers: dict[str, str]
    baselines: list[str]                # every file under bench/baselines, repository-relative
    paths: set[str] = field(default_factory=set)  # every existing file and folder

    def exists(self, path: str) -> bool:
        return path.rstrip("/") in self.paths


def with_parents(files: list[str]) -> set[str]:
    out = set()
    for f in files:
        out.add(f)
        d = posixpath.dirname(f)
        while d:
            out.add(d)
            d = posixpath.dirname(d)
    return out


def resolve(md_path: str, token: str) -> str | None:
    """The repository-relative path a citation in md_path names, or None if it leaves the tree."""
    for anchor in (BASELINES + "/", RESULTS + "/"):
        at = token.find(anchor)
        if at >= 0 and (at == 0 or token[at - 1] == "/"):
            return token[at:]
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(md_path), token))
    return None if joined.startswith("..") else joined


def citations(md_path: str, text: str) -> list[str]:
    out = []
    for m in PATH_TOKEN.finditer(text):
        token = m.group(0).rstrip(".,;:")
        if token.startswith("/") and BASELINES not in token and RESULTS not in token:
            continue
        target = resolve(md_path, token)
        if target is not None:
            out.append(target)
    return out


def matches(pattern: str, files: list[str]) -> list[str]:
    if "*" not in pattern:
        return [pattern] if pattern in files else []
    return [f for f in files if fnmatch.fnmatchcase(f, pattern) and f.count("/") == pattern.count("/")]


def citation_problems(tree: Tree) -> list[str]:
    problems: list[str] = []
    for md, text in sorted(tree.markdown.items()):
        if md.startswith(BASELINES + "/"):
            continue
        for target in citations(md, text):
            if target == RESULTS or target.startswith(RESULTS + "/"):
                problems.append(f"{md}: cites {target}, which was replaced by bench/baselines/ "
                                f"(cite the baseline, or say when it was measured: git keeps the history)")
            elif "baselines/" in target and not target.startswith(BASELINES + "/") and not tree.exists(target):
                problems.append(f"{md}: cites {target}, which does not exist (baselines are under {BASELINES}/)")
            elif target.startswith(BASELINES + "/") or target == BASELINES:
                if "*" in target:
                    if not matches(target, tree.baselines):
                        problems.append(f"{md}: cites {target}, which matches no file")
                elif not tree.exists(target):
                    problems.append(f"{md}: cites {target}, which does not exist")

    cited: set[str] = set()
    for md in CITING:
        for target in citations(md, tree.markdown.get(md, "")):
            if target.startswith(BASELINES + "/"):
                cited.update(matches(target, tree.baselines))
    frontier = [f for f in cited if f.endswith(".md")]
    while frontier:  # files a cited report names by their path from its folder
        md = frontier.pop()
        folder = posixpath.dirname(md) + "/"
        text = tree.markdown.get(md, "")
        for f in tree.baselines:
            if f not in cited and f.startswith(folder) and f[len(folder):] in text:
                cited.add(f)
                if f.endswith(".md"):
                    frontier.append(f)
    for f in sorted(set(tree.baselines) - cited):
        problems.append(f"{f}: not cited by README.md or bench/README.md "
                        f"(cite it where its figures are used, or git rm it)")
    return problems


def check(tree: Tree) -> list[str]:
    problems = citation_problems(tree)
    for path, source in sorted(tree.headers.items()):
        problems += timing_problems(path, source)
    return problems


# ---- the tree on disk ----

def markdown_files(root: str) -> list[str]:
    try:
        listed = subprocess.run(["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard",
                                 "--", "*.md"], capture_output=True, check=True).stdout.decode()
        return sorted({p for p in listed.split("\0") if p and os.path.isfile(os.path.join(root, p))})
    except (OSError, subprocess.CalledProcessError):
        found = []
        for d, dirs, files in os.walk(root):
            dirs[:] = [x for x in dirs if not (x.startswith(".") or x.startswith("build") or x in ("subprojects", "__pycache__"))]
            found += [os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/") for f in files if f.endswith(".md")]
        return sorted(found)


def files_under(root: str, top: str) -> list[str]:
    found = []
    for d, dirs, files in os.walk(os.path.join(root, top)):
        dirs.sort()
        found += [os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/") for f in sorted(files)]
    return found


def read(root: str, path: str) -> str:
    with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
        return f.read()


def load(root: str) -> Tree:
    header_paths = [p for p in files_under(root, "include") if p.endswith(HEADER_SUFFIXES)]
    communicators = os.path.join(root, "communicators")
    if os.path.isdir(communicators):
        for name in sorted(os.listdir(communicators)):
            header_paths += [p for p in files_under(root, f"communicators/{name}/include") if p.endswith(HEADER_SUFFIXES)]
    baselines = files_under(root, BASELINES)
    markdown = markdown_files(root)
    markdown += [p for p in baselines if p.endswith(".md") and p not in markdown]
    for p in CITING:
        if p not in markdown and os.path.isfile(os.path.join(root, p)):
            markdown.append(p)
    paths = with_parents(baselines + markdown)
    if os.path.isdir(os.path.join(root, RESULTS)):
        paths |= with_parents(files_under(root, RESULTS))
    return Tree({p: read(root, p) for p in markdown}, {p: read(root, p) for p in header_paths}, baselines, paths)


# ---- self-test ----

GOOD_HEADER = """\
// Lamb<E> (You et al. 2019, "Large Batch Optimization for Deep
// Learning: Training BERT in 76 minutes"). x (N, C, H, W) -> y (N, C_out, H', W').
// Winograd: 4x fewer multiply-adds; F(2x2, 3x3) saves 2.25x. Blocks of 64 KiB to 4 MiB.
//   TESSERA_COMM_TIMEOUT=<seconds>   timeout of every blocking operation (default 300 s, like
//                                    torch.distributed's 5 minutes for Gloo)
//   rank 1 (last entered call #56, and finished it 31.0 s ago: busy outside this communicator)
// Nothing arrived: back off from spinning, up to 200 us. A time limit of 10 s per test; a 300 s timeout.
// Each stage s runs units [b_s, b_{s+1}); 2 s + 1 rows. Prints "loss 0.41 acc 85% 5230 img/s".
const char* label = "took 12 ms, 1.4x faster";  // the string is code, not a comment
/* A block comment that explains why, with no figure. */
"""

BAD_COMMENTS = {
    "us": "// gathered 16 columns at a time. LeNet-5's second layer: 183 -> 84 us per batch of 64.\n",
    "ratio": "// such layers ran 1.04-1.14x faster at 2 threads once im2col was shared\n",
    "signed percent": "// 2 threads: 27.6k before, 31.0k after (+11%).\n",
    "share of a step": "// row, 7, 4 or 2 tiles of 16 lanes, and took 19% of a ResNet-20 training step.\n",
    "throughput": "// the 2 cores of this VM: 27.3k, 26.1k, 28.6k images/s spinning\n",
    "GF/s": "// threads: 24 GF/s against Eigen's 107 on a (2048, 512) x (512, 49) product).\n",
    "block comment": "int x = 0; /* measured at 3.9 ms per all_reduce\n   of 244 KB */\n",
    "by ratio": "// beat Eigen's gebp by 1.13-1.25x on one core\n",
    "cycles": "// Scalar, such a row cost ~20 cycles per window.\n",
    "setting word too far": "// with the loop around it (7 cycles a row, measured); each 16 columns (at most 32)\n",
    "ratio across lines": "// MPI_Iallreduce + MPI_Test took 2.1x the\n// time of MPI_Allreduce at 1 MiB.\n",
}


def tree_of(files: dict[str, str]) -> Tree:
    baselines = [p for p in files if p.startswith(BASELINES + "/")]
    markdown = {p: t for p, t in files.items() if p.endswith(".md")}
    headers = {p: t for p, t in files.items() if p.endswith(HEADER_SUFFIXES)}
    return Tree(markdown, headers, baselines, with_parents(list(files)))


def good_files() -> dict[str, str]:
    return {
        "README.md": "Training (`bench/baselines/amd-epyc-zen5/throughput_2threads.json`).\n",
        "bench/README.md": ("Layout: `bench/baselines/<cpu>/<bench>.json`. One thread: "
                            "`baselines/amd-epyc-zen5/throughput_1thread.json`; the report: "
                            "[index](baselines/amd-epyc/report/index.md). Older runs: commit history.\n"),
        "docs/simulator.md": "![plot](../bench/baselines/amd-epyc/report/plots/a.png)\n",
        "examples/05/README.md": "![accuracy](results/05.png), an example's own results folder.\n",
        "bench/baselines/amd-epyc-zen5/throughput_2threads.json": "{}",
        "bench/baselines/amd-epyc-zen5/throughput_1thread.json": "{}",
        "bench/baselines/amd-epyc/report/index.md": ("`--out bench/results/report` (a record)\n"
                                                     "[raw](raw/a.json) ![plot](plots/a.png)\n"),
        "bench/baselines/amd-epyc/report/raw/a.json": "{}",
        "bench/baselines/amd-epyc/report/plots/a.png": "",
        "examples/05/results/05.png": "",
        "include/tessera/good.hpp": GOOD_HEADER,
    }


def self_test() -> int:
    failures: list[str] = []
    cases = 1
    good = check(tree_of(good_files()))
    if good:
        failures.append("the passing tree failed:\n  " + "\n  ".join(good))

    def expect(name: str, files: dict[str, str], where: str, says: str) -> None:
        nonlocal cases
        cases += 1
        problems = check(tree_of(files))
        if not any(p.startswith(where) and says in p for p in problems):
            failures.append(f"{name}: expected a problem in {where} saying '{says}', got {problems}")

    # (case, file -> text added to the passing tree, where the problem is, what it says)
    broken_trees: list[tuple[str, dict[str, str], str, str]] = [
        ("uncited baseline", {"bench/baselines/amd-epyc/old_run.json": "{}"},
         "bench/baselines/amd-epyc/old_run.json", "not cited"),
        ("bench/results cited", {"README.md": "Older: `bench/results/throughput_2026-11-28-evening.json`.\n"},
         "README.md", "bench/results/throughput_2026-11-28-evening.json"),
        ("relative results/ in bench/README.md", {"bench/README.md": "Raw JSON: `results/dp_scaling_2026-11-22.json`.\n"},
         "bench/README.md", "bench/results/dp_scaling"),
        ("missing baseline cited", {"docs/reliability.md": "(`bench/baselines/amd-epyc/fault_campaign.json`)\n"},
         "docs/reliability.md", "does not exist"),
        ("baselines path outside bench/",
         {"README.md": "Wrongly relative: `baselines/amd-epyc-zen5/throughput_2threads.json`.\n"},
         "README.md", "baselines are under bench/baselines/"),
        ("glob matching nothing", {"bench/README.md": "Every bf16 run: `baselines/amd-epyc/bf16_*.json`.\n"},
         "bench/README.md", "matches no file"),
        ("file beside a cited report, not named by it", {"bench/baselines/amd-epyc/report/raw/b.json": "{}"},
         "bench/baselines/amd-epyc/report/raw/b.json", "not cited"),
    ]
    for name, added, where, says in broken_trees:
        files = good_files()
        for path, text in added.items():
            files[path] = files.get(path, "") + text
        expect(name, files, where, says)

    for name, comment in BAD_COMMENTS.items():
        files = good_files()
        files["include/tessera/bad.hpp"] = "#pragma once\n" + comment
        expect(f"header timing ({name})", files, "include/tessera/bad.hpp:2:", "quotes a timing")
    files = good_files()
    files["communicators/gloo/include/tessera/comm/gloo.hpp"] = "// 0.2 ms instead of 4 ms between compute phases\n"
    expect("communicator header", files, "communicators/gloo/include/tessera/comm/gloo.hpp:1:", "quotes a timing")

    for f in failures:
        print("check_lab_notebook --self-test: " + f)
    if failures:
        return 1
    print(f"check_lab_notebook --self-test: {cases} cases behave (1 passing tree, {cases - 1} failing ones)")
    return 0


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=os.path.dirname(here), help="repository root (default: %(default)s)")
    parser.add_argument("--self-test", action="store_true", help="run the checks over small in-memory trees")
    args = parser.parse_args()
    if args.self_test:
        return self_test()
    problems = check(load(args.root))
    for p in problems:
        print(p)
    if problems:
        print(f"check_lab_notebook: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print("check_lab_notebook: baselines cited, no stale result paths, no timings in header comments")
    return 0


if __name__ == "__main__":
    sys.exit(main())
