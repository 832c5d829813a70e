"""Checks that docs/api.md documents every public type of the library.

A public type is a class, struct, enum or alias declared at the scope of namespace `tessera` or
`tessera::testing` in a header under <root>/tessera (one --root per include directory: include/
and communicators/<name>/include). Names in any `detail` namespace are private, and so are names
in PRIVATE below (implementation parts that users never name). A type counts as documented when
its name appears in the document between backticks as a whole word, e.g. `Conv2d` or
`Conv2d<E>(in, out, k)`.

  python3 tools/check_api_docs.py --doc docs/api.md --root include --root communicators/mpi/include
  python3 tools/check_api_docs.py --list --root include       # the public names, one per line
  python3 tools/check_api_docs.py --self-test

Exit 1 lists the missing names with the header that declares each, and names in the document's
index (lines `- `Name` ...` under a heading) that no header declares any more (a stale entry)."""
from __future__ import annotations

import argparse
import pathlib
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence

PUBLIC_NAMESPACES = {("tessera",), ("tessera", "testing")}
# Parts that are public only because templates in other headers need to name them; a user never
# writes them. Each is listed with why.
PRIVATE = {
    "Conv2dCache": "per-call saved tensors of Conv2d, owned by the layer",
    "BatchNormCache": "per-call saved tensors of BatchNorm2d",
    "PoolCache": "per-call saved indices of the pooling layers",
}
PRIVATE_SUFFIXES = ("Cache", "Impl", "Tag")

TOKEN = re.compile(
    r"""(?P<comment>//[^\n]*|/\*.*?\*/)
      | (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*')
      | (?P<pre>^[ \t]*\#(?:[^\n]*\\\n)*[^\n]*)
      | (?P<word>[A-Za-z_][A-Za-z0-9_]*(?:::[A-Za-z_][A-Za-z0-9_]*)*)
      | (?P<punct>[{};=<>(),:])""",
    re.S | re.M | re.X)


def tokens(text: str) -> Iterator[str]:
    for m in TOKEN.finditer(text):
        kind = m.lastgroup
        if kind in ("comment", "string", "pre"):
            continue
        yield m.group(kind or 0)


def public_names(text: str) -> set[str]:
    """Names declared at a public namespace scope of one header's text."""
    names = set()
    scope: list[tuple[str, ...] | None] = []  # per open brace: the namespace parts, or None for any other brace
    pending_namespace: tuple[str, ...] | None = None
    toks = list(tokens(text))
    i = 0
    while i < len(toks):
        t = toks[i]
        if t == "namespace":
            # `namespace a::b {` or `namespace fs = std::filesystem;`
            name = toks[i + 1] if i + 1 < len(toks) else ""
            if i + 2 < len(toks) and toks[i + 2] == "{":
                pending_namespace = tuple(name.split("::"))
                i += 2
                continue
            if name == "{":
                pending_namespace = ("",)
                i += 1
                continue
        if t == "template" and i + 1 < len(toks) and toks[i + 1] == "<":
            # Skip the parameter list: the `class T` of `template <class T>` declares nothing here.
            depth, i = 0, i + 1
            while i < len(toks):
                depth += {"<": 1, ">": -1}.get(toks[i], 0)
                if depth == 0:
                    break
                i += 1
            i += 1
            continue
        if t == "{":
            scope.append(pending_namespace)
            pending_namespace = None
        elif t == "}":
            if scope:
                scope.pop()
        elif all(s is not None for s in scope):
            current = tuple(part for s in scope if s is not None for part in s)
            if current in PUBLIC_NAMESPACES:
                declared = None
                if t in ("class", "struct", "enum", "union") and i + 1 < len(toks):
                    j = i + 1
                    if toks[j] in ("class", "struct"):   # enum class X
                        j += 1
                    # skip attributes / alignas are rare here; the next word is the name
                    if j < len(toks) and re.fullmatch(r"[A-Za-z_]\w*", toks[j]):
                        # `struct X` used as an elaborated type inside a declaration is followed by
                        # a word or `*`; a declaration is followed by `{`, `;`, `:`, `<` or `final`.
                        after = toks[j + 1] if j + 1 < len(toks) else ";"
                        if after in ("{", ";", ":", "<", "final"):
                            declared = toks[j]
                elif t == "using" and i + 2 < len(toks) and toks[i + 2] == "=":
                    declared = toks[i + 1]
                if declared:
                    names.add(declared)
        i += 1
    return names


def is_private(name: str) -> bool:
    return name in PRIVATE or name.startswith("_") or name.endswith(PRIVATE_SUFFIXES)


def collect(roots: Sequence[pathlib.Path]) -> dict[str, str]:
    """{name: header} for every public type of every header under the roots."""
    found: dict[str, str] = {}
    for root in roots:
        base = root / "tessera"
        for path in sorted(base.rglob("*")):
            if path.suffix not in (".hpp", ".cuh"):
                continue
            rel = path.relative_to(root).as_posix()
            if "/detail/" in rel:
                continue
            for name in public_names(path.read_text()):
                if not is_private(name):
                    found.setdefault(name, rel)
    return found


def documented(doc_text: str) -> set[str]:
    """Every identifier that appears inside backticks in the document."""
    words: set[str] = set()
    for span in re.findall(r"`([^`\n]+)`", doc_text):
        words.update(re.findall(r"[A-Za-z_]\w*", span))
    return words


def index_entries(doc_text: str) -> set[str]:
    """Names the document gives an entry of their own: a heading `### `Name`` or a row of a type
    table, `| `Name` | `tessera/<header>` | ...` (argument tables, whose rows name template
    parameters, have no header column)."""
    entries = set()
    for m in re.finditer(r"^#{2,4}\s+`([A-Za-z_]\w*)", doc_text, re.M):
        entries.add(m.group(1))
    for m in re.finditer(r"^\|\s*`([A-Za-z_]\w*)[^`]*`\s*\|\s*`tessera/", doc_text, re.M):
        entries.add(m.group(1))
    return entries


def check(roots: Sequence[pathlib.Path], doc: pathlib.Path) -> tuple[dict[str, str], list[tuple[str, str]], list[str]]:
    found = collect(roots)
    text = doc.read_text()
    words = documented(text)
    missing = sorted((name, hdr) for name, hdr in found.items() if name not in words)
    stale = sorted(e for e in index_entries(text) if e not in found and not _known_elsewhere(e, text))
    return found, missing, stale


def _known_elsewhere(entry: str, text: str) -> bool:
    # Entries for functions and variables (lower-case first letter: `launch`, `named_tensors`) are
    # documented too but not checked against the type scan.
    return entry[:1].islower()


def self_test() -> int:
    header = """
    #pragma once
    #include <vector>
    namespace tessera {
    /* class Commented {}; */ // struct AlsoCommented {};
    template <class T, typename U = int> class Public { struct Nested {}; void f() { struct Local {}; } };
    struct Declared;
    enum class Mode { Train, Eval };
    using Alias = Public<float>;
    namespace detail { struct Hidden {}; using HiddenAlias = int; }
    inline void g(struct Declared* p) {}
    struct ConvCache {};
    namespace fs = std::filesystem;
    }
    namespace tessera::testing { struct Checker {}; }
    namespace other { struct Foreign {}; }
    """
    got = {n for n in public_names(header) if not is_private(n)}
    want = {"Public", "Declared", "Mode", "Alias", "Checker"}
    if got != want:
        print(f"check_api_docs self-test: found {sorted(got)}, expected {sorted(want)}")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp) / "include"
        (root / "tessera" / "layers").mkdir(parents=True)
        (root / "tessera" / "layers" / "x.hpp").write_text(header)
        doc = pathlib.Path(tmp) / "api.md"
        doc.write_text("### `Public<T>`\n`Mode::Train`, `Alias`, `Checker`\n| `Gone` | `tessera/layers/x.hpp` | removed |\n| `T` | — | a template parameter |\n")
        _, missing, stale = check([root], doc)
        if [m for m, _ in missing] != ["Declared"] or stale != ["Gone"]:
            print(f"check_api_docs self-test: missing {missing}, stale {stale}; expected Declared and Gone")
            return 1
    print("check_api_docs self-test: ok")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="check_api_docs.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", action="append", default=[], type=pathlib.Path,
                   help="include directory holding tessera/ (repeatable)")
    p.add_argument("--doc", type=pathlib.Path, help="the API reference to check")
    p.add_argument("--list", action="store_true", help="print the public names and their headers")
    p.add_argument("--self-test", action="store_true")
    a = p.parse_args(argv)
    if a.self_test:
        return self_test()
    for r in a.root:
        if not (r / "tessera").is_dir():
            sys.exit(f"check_api_docs: {r}/tessera is not a directory")
    if not a.root:
        sys.exit("check_api_docs: give at least one --root")
    if a.list:
        for name, hdr in sorted(collect(a.root).items(), key=lambda kv: (kv[1], kv[0])):
            print(f"{hdr}\t{name}")
        return 0
    if not a.doc or not a.doc.exists():
        sys.exit(f"check_api_docs: the document {a.doc} does not exist")
    found, missing, stale = check(a.root, a.doc)
    for name, hdr in missing:
        print(f"{a.doc}: public type `{name}` ({hdr}) is not documented")
    for name in stale:
        print(f"{a.doc}: entry `{name}` names no public type of the headers (renamed or removed?)")
    print(f"check_api_docs: {len(found)} public types, {len(missing)} undocumented, {len(stale)} stale entries")
    return 1 if missing or stale else 0

