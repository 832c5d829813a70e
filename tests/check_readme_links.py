#!/usr/bin/env python3
"""Checks the relative links of the READMEs and docs: every target exists, and every link to a
line of code names the code it points to.

    check_readme_links.py [--fix] [PATH ...]

PATH is a repository root (its README.md, docs/*.md and examples/*/README.md are checked) or a
markdown file; by default, the repository that holds this script. A link is [text](target) or
![alt](target) outside fenced code blocks; targets with a scheme (https:, mailto:) are not
checked. For a relative target:

  - the file or directory must exist (relative to the markdown file);
  - #heading on a markdown file must be one of its headings (GitHub's anchors: lower case,
    punctuation dropped, spaces as dashes, -1, -2, ... on repeats);
  - #Lnn (or #Lnn-Lmm) names a line of code, and the rule is: the link text is the identifier
    in backticks, [`on_grad_ready`](../../include/tessera/parallel/data_parallel.hpp#L439),
    optionally qualified by its class or namespace, [`Pipeline::step`](...#L282), and line nn's
    code (outside comments and string literals) contains that identifier (for `A::B`: B) as a
    whole word. It may be the definition or the line the prose means, such as the
    `if constexpr (kRunsModel)` line for `kRunsModel`.

A problem is one line on stderr: the README's file:line, the link, what is wrong and, for a
line anchor, the line that would be right: the identifier's definition (a function, method,
class, struct, enum, concept, namespace, variable, alias or macro; for `A::B`, B's first
definition inside A's body, else an out-of-line A::B) or, where the file defines none, its
first occurrence in code.

With --fix, every #Lnn link whose line does not contain its identifier is rewritten to that
line, and each move is printed; links whose line does contain it are left alone (a line chosen
by hand stays). Problems --fix cannot mend (a missing file, link text that is not one
identifier, an identifier the file lacks) are reported as without it.

Exit status: 0 when every link is right (with --fix: after the moves), 1 when a problem
remains, 2 for a usage error (a PATH that does not exist). Standard library only.
"""
import argparse
import glob
import os
import re
import sys
import urllib.parse

LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^()\s<>]+(?:\([^()\s]*\)[^()\s<>]*)*)>?"
                  r"(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.*?[^`])\1(?!`)", re.S)
FENCE = re.compile(r"^\s{0,3}(```+|~~~+)")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:|^//")
LINE_ANCHOR = re.compile(r"^L(\d+)(?:-L?\d+)?$")
IDENT = r"[A-Za-z_]\w*"
LINK_TEXT = re.compile(r"^`(" + IDENT + r"(?:::" + IDENT + r")*)`$")
CPP_EXTENSIONS = (".hpp", ".h", ".hh", ".cpp", ".cc", ".cxx", ".cu", ".cuh", ".inl", ".ipp")
# Words after which a name is used, not defined ("return f(x);", "else g();", "new T(...)").
NOT_A_TYPE = {"return", "else", "case", "goto", "throw", "new", "delete", "co_return", "co_yield", "co_await",
              "sizeof", "alignof", "decltype", "typeid", "if", "for", "while", "switch", "do", "not", "and", "or",
              "using", "friend", "operator", "static_assert", "namespace", "public", "private", "protected"}
TYPE_KEYWORDS = r"(?:class|struct|union|enum(?:\s+class|\s+struct)?|namespace|concept)"


# ---- markdown ----

def blank_fences(text):
    """The text with fenced code blocks blanked (lengths and line breaks kept)."""
    out, fence = [], None
    for line in text.split("\n"):
        m = FENCE.match(line)
        if fence is None:
            if m:
                fence = m.group(1)[0] * len(m.group(1))
            out.append(line if fence is None else " " * len(line))
        else:
            if m and m.group(1).startswith(fence):
                fence = None
            out.append(" " * len(line))
    return "\n".join(out)


def blank_code_spans(text):
    """The text with the contents of inline code spans replaced by x (so `operator[](i)` is no
    link); lengths and line breaks are kept, so positions in it are positions in the text."""
    return CODE_SPAN.sub(lambda m: m.group(1) + re.sub(r"[^\n]", "x", m.group(2)) + m.group(1), text)


def heading_anchors(path):
    """GitHub's anchors of a markdown file's headings."""
    anchors, seen = set(), {}
    for line in blank_fences(open(path, encoding="utf-8").read()).split("\n"):
        m = re.match(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        title = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))  # a link's text stays
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else "%s-%d" % (slug, n))
    return anchors


# ---- code ----

def code_lines(path):
    """Each line of a source file with comments and the contents of string and character
    literals blanked (C and C++ files; other files as they are)."""
    lines = open(path, encoding="utf-8", errors="replace").read().split("\n")
    if not path.endswith(CPP_EXTENSIONS):
        return lines
    out, in_block = [], False
    for line in lines:
        code, i, n = [], 0, len(line)
        while i < n:
            c = line[i]
            if in_block:
                if line.startswith("*/", i):
                    in_block = False
                    code.append("  ")
                    i += 2
                else:
                    code.append(" ")
                    i += 1
            elif line.startswith("//", i):
                break
            elif line.startswith("/*", i):
                in_block = True
                code.append("  ")
                i += 2
            elif c == '"' or (c == "'" and not (i > 0 and re.match(r"[0-9A-Fa-f]", line[i - 1]))):
                j = i + 1
                while j < n and line[j] != c:
                    j += 2 if line[j] == "\\" else 1
                code.append(c + " " * (min(j, n) - i - 1) + (c if j < n else ""))
                i = j + 1
            else:
                code.append(c)
                i += 1
        out.append("".join(code))
    return out


def word_at(code, name):
    return re.search(r"(?<![\w])" + re.escape(name) + r"(?![\w])", code) is not None


def strip_template_header(code):
    """The line without a leading template <...> (so template <class E> defines no class E)."""
    m = re.match(r"^\s*template\s*<", code)
    if not m:
        return code
    depth, i = 1, m.end()
    while i < len(code) and depth:
        depth += {"<": 1, ">": -1}.get(code[i], 0)
        i += 1
    return code[i:]


def defines(code, name, qualifier=None):
    """Whether this line of code defines `name` (with qualifier: also out-of-line qualifier::name)."""
    n = re.escape(name)
    body = strip_template_header(code)
    if re.search(r"\b" + TYPE_KEYWORDS + r"\s+(?:\[\[[^\]]*\]\]\s*)?" + n + r"\b(?!\s*;)", body):
        return True
    if re.search(r"^\s*#\s*define\s+" + n + r"\b", code) or re.search(r"\busing\s+" + n + r"\s*=", body):
        return True
    for m in re.finditer(r"(?<![\w])" + n + r"(?![\w])", body):
        after = body[m.end():].lstrip()
        if not after or after.startswith("::") or after[0] not in "(={[;,:":
            continue  # a qualifier (name::), or not followed by a parameter list or an initializer
        prefix = body[:m.start()]
        q = re.search(r"((?:" + IDENT + r"(?:<[^<>]*>)?::)+)\s*$", prefix)
        if q:
            if qualifier is not None and not q.group(1).rstrip(":").endswith(qualifier):
                continue
            prefix = prefix[:q.start()]
        elif prefix.rstrip().endswith("::"):
            prefix = prefix.rstrip()[:-2]
        # What precedes the name must be a type alone: words, ::, <...> (commas inside), *, &,
        # attributes; none of the words a use follows (return, else, new, ...).
        if not re.fullmatch(r"\s*(?:\[\[[^\]]*\]\]\s*)*[\w\s:<>,*&]*", prefix):
            continue
        words = re.findall(IDENT, prefix)
        tail = prefix.rstrip()
        if words and not any(w in NOT_A_TYPE for w in words) and re.search(r"[\w>*&]$", tail):
            return True
    return False


def body_range(code, start):
    """(start, end) line indexes of the braces opened at or after line `start`."""
    depth, opened = 0, False
    for i in range(start, len(code)):
        for c in code[i]:
            if c == "{":
                depth += 1
                opened = True
            elif c == "}":
                depth -= 1
            elif c == ";" and not opened:
                return None  # a declaration without a body
        if opened and depth <= 0:
            return (start, i)
    return (start, len(code) - 1) if opened else None


def expected_line(code, ident):
    """1-based line of ident's definition (see the module docstring), or None if absent."""
    parts = ident.split("::")
    name = parts[-1]
    if len(parts) > 1:
        outer = parts[-2]
        for i, line in enumerate(code):
            if defines(line, outer) and re.search(r"\b" + TYPE_KEYWORDS + r"\s", strip_template_header(line)):
                rng = body_range(code, i)
                if rng:
                    for j in range(rng[0] + 1, rng[1] + 1):
                        if defines(code[j], name):
                            return j + 1
        for i, line in enumerate(code):
            if re.search(re.escape(outer) + r"(?:<[^<>]*>)?::" + re.escape(name) + r"\b", line) and \
                    defines(line, name, qualifier=outer):
                return i + 1
        for i, line in enumerate(code):
            if re.search(re.escape(outer) + r"::" + re.escape(name) + r"\b", line):
                return i + 1
        return None
    for i, line in enumerate(code):
        if defines(line, name):
            return i + 1
    for i, line in enumerate(code):
        if word_at(line, name):
            return i + 1
    return None


# ---- the check ----

def check_file(md, root, fix, problems, moves, cache):
    text = open(md, encoding="utf-8").read()
    scan = blank_code_spans(blank_fences(text))
    rel_md = os.path.relpath(md, root) if root else md
    edits, count = [], 0
    for m in LINK.finditer(scan):
        link_text, target = text[m.start(1):m.end(1)], text[m.start(2):m.end(2)]
        if SCHEME.match(target):
            continue
        count += 1
        line_no = scan.count("\n", 0, m.start()) + 1
        where = "%s:%d: %s" % (rel_md, line_no, text[m.start():m.end()].replace("\n", " "))
        path_part, _, anchor = target.partition("#")
        path = os.path.normpath(os.path.join(os.path.dirname(md), urllib.parse.unquote(path_part))) if path_part else md
        if not os.path.exists(path) or (path_part.endswith("/") and not os.path.isdir(path)):
            problems.append("%s: %s does not exist" % (where, os.path.relpath(path, root) if root else path))
            continue
        if not anchor:
            continue
        la = LINE_ANCHOR.match(anchor)
        if la is None:
            if path.endswith(".md"):
                if anchor not in heading_anchors(path):
                    problems.append("%s: #%s is not a heading of %s" % (where, anchor, os.path.basename(path)))
            else:
                problems.append("%s: #%s: a link into code takes a line anchor, #L<line>" % (where, anchor))
            continue
        t = LINK_TEXT.match(link_text.strip())
        if t is None:
            problems.append("%s: a link to a line must be named by the identifier there, in backticks: "
                            "[`name`](%s)" % (where, target))
            continue
        ident = t.group(1)
        name = ident.split("::")[-1]
        if path not in cache:
            cache[path] = (code_lines(path), open(path, encoding="utf-8", errors="replace").read().split("\n"))
        code, raw = cache[path]
        nn = int(la.group(1))
        if 1 <= nn <= len(code) and word_at(code[nn - 1], name):
            continue
        right = expected_line(code, ident)
        have = ("line %d is %r, whose code lacks `%s`" % (nn, raw[nn - 1].strip()[:80], name)) if 1 <= nn <= len(code) \
            else "line %d is past the end of %s (%d lines)" % (nn, os.path.basename(path), len(code))
        if right is None:
            problems.append("%s: %s, and `%s` does not occur in %s" % (where, have, ident, os.path.basename(path)))
            continue
        shown = raw[right - 1].strip()
        if fix:
            start = m.start(2) + target.index("#") + 1
            edits.append((start, m.start(2) + len(target), "L%d" % right))
            moves.append("%s:%d: `%s` #L%d -> #L%d: %s" % (rel_md, line_no, ident, nn, right, shown[:80]))
        else:
            problems.append("%s: %s; the right line is %d: %s" % (where, have, right, shown[:80]))
    if edits:
        for start, end, new in sorted(edits, reverse=True):
            text = text[:start] + new + text[end:]
        with open(md, "w", encoding="utf-8") as f:
            f.write(text)
    return count


def markdown_files(root):
    files = [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md"))) + \
        sorted(glob.glob(os.path.join(root, "examples", "*", "README.md")))
    return [f for f in files if os.path.isfile(f)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fix", action="store_true", help="move #L anchors to the line of their identifier")
    parser.add_argument("paths", nargs="*", help="a repository root or markdown files (default: this repository)")
    args = parser.parse_args()
    paths = args.paths or [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    jobs = []
    for p in paths:
        if os.path.isdir(p):
            jobs += [(f, p) for f in markdown_files(p)]
        elif os.path.isfile(p):
            jobs.append((p, None))
        else:
            parser.error("%s does not exist" % p)
    problems, moves, cache, links = [], [], {}, 0
    for md, root in jobs:
        links += check_file(md, root, args.fix, problems, moves, cache)
    for line in moves:
        print("check_readme_links: moved " + line)
    print("check_readme_links: %d relative links in %d markdown files, %d problem(s)%s" %
          (links, len(jobs), len(problems), (", %d anchor(s) moved" % len(moves)) if args.fix else ""))
    for p in problems:
        print("check_readme_links: " + p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
