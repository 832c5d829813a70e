"""Compiles every public header on its own (a translation unit that includes only that header), so
that no header leans on another being included first. Headers are those under <root>/tessera for
each --root (include/, and communicators/<name>/include for the backends that were found); every
root and --include is on the include path. CUDA headers (*.cuh) go through --cuda-compiler's
front end when one is given (nvcc --cuda, one architecture: host and device code parsed and
checked, the host half not compiled). Exit 1 lists the headers that
failed with the compiler's first lines of output.

Before compiling, it checks that the include graph flows one way: a header may include headers of
its own directory and of lower layers only (LAYERS below: core, then device, then kernels / io /
comm, then layers / losses / optim, then models / data, then parallel, then train / testing, then
the umbrella headers). --order-only runs just that check; --self-test checks the checker on a
made-up tree with one upward edge."""
from __future__ import annotations

import argparse
import concurrent.futures
import pathlib
import re
import subprocess
import tempfile
from collections.abc import Sequence

# Layer of each directory under tessera/ (files directly under tessera/ are the umbrella headers).
# Equal layers of different directories may not include each other either: kernels never see a
# communicator, and a layer never includes an optimizer.
LAYERS = {
    "core": 0,
    "device": 1,
    "kernels": 2, "io": 2, "comm": 2,
    "layers": 3, "losses": 3, "optim": 3,
    "models": 4, "data": 4,
    "parallel": 5,
    "train": 6, "testing": 6,
}
UMBRELLA = 7
INCLUDE = re.compile(r'^\s*#\s*include\s+"tessera/([^"]+)"', re.M)


def area(relative: str) -> str:
    """'core' for tessera/core/tensor.hpp; '' for tessera/tessera.hpp."""
    parts = pathlib.PurePosixPath(relative).parts
    return parts[0] if len(parts) > 1 else ""


def layer_of(a: str) -> int | None:
    return LAYERS.get(a, UMBRELLA if a == "" else None)


def order_violations(roots: Sequence[pathlib.Path]) -> list[str]:
    """Every include of a higher (or a sibling) layer, as readable lines."""
    problems = []
    for root in roots:
        for path in sorted((root / "tessera").rglob("*")):
            if path.suffix not in (".hpp", ".cuh"):
                continue
            rel = path.relative_to(root / "tessera").as_posix()
            src = area(rel)
            if layer_of(src) is None:
                problems.append(f"tessera/{rel}: directory '{src}' has no layer in "
                                f"tools/tessera_tools/checks/headers.py LAYERS")
                continue
            for target in INCLUDE.findall(path.read_text()):
                dst = area(target)
                if dst == src:
                    continue
                dst_layer, src_layer = layer_of(dst), layer_of(src)
                if dst_layer is None or src_layer is None or dst_layer >= src_layer:
                    problems.append(f"tessera/{rel} (layer {src or 'umbrella'}) includes tessera/{target} "
                                    f"(layer {dst or 'umbrella'}): includes must go to lower layers only")
    return problems


def self_test() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        for rel, text in {"tessera/core/a.hpp": '#include "tessera/core/b.hpp"\n',
                          "tessera/core/b.hpp": '#include "tessera/train/c.hpp"\n',
                          "tessera/train/c.hpp": '#include "tessera/core/a.hpp"\n',
                          "tessera/kernels/k.hpp": '#include "tessera/comm/x.hpp"\n'}.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
        found = order_violations([root])
    want = ["tessera/core/b.hpp (layer core) includes tessera/train/c.hpp",
            "tessera/kernels/k.hpp (layer kernels) includes tessera/comm/x.hpp"]
    ok = len(found) == 2 and all(any(line.startswith(w) for line in found) for w in want)
    print("self-test:", "ok" if ok else "FAILED", *found, sep="\n  ")
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="check_headers.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compiler", default="c++")
    ap.add_argument("--root", action="append", default=[], help="a directory holding tessera/ headers to check")
    ap.add_argument("--include", action="append", default=[], help="an extra include directory")
    ap.add_argument("--cuda-compiler", default="", help="nvcc: also check the *.cuh headers")
    ap.add_argument("--cuda-only", action="store_true", help="with --cuda-compiler: check the *.cuh headers only")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--order-only", action="store_true", help="only check the include graph's direction")
    ap.add_argument("--self-test", action="store_true", help="check the order check on a made-up tree")
    args = ap.parse_args(argv)
    if args.self_test:
        return self_test()
    roots = [pathlib.Path(r) for r in args.root]
    problems = order_violations(roots)
    for line in problems:
        print("UPWARD", line)
    print(f"include graph: {len(problems)} upward or sideways includes")
    if args.order_only or problems:
        return 1 if problems else 0
    if args.cuda_only and not args.cuda_compiler:
        ap.error("--cuda-only needs --cuda-compiler")
    patterns = (["*.cuh"] if args.cuda_only else ["*.hpp", "*.cuh"]) if args.cuda_compiler else ["*.hpp"]
    headers = sorted({p.relative_to(root) for root in roots for pattern in patterns
                      for p in (root / "tessera").rglob(pattern)})
    flags = ["-std=c++20", "-fopenmp", "-fsyntax-only", "-Wall", "-Wextra", "-x", "c++", "-"]
    flags += [f"-I{d}" for d in [*args.root, *args.include]]

    includes = [f"-I{d}" for d in [*args.root, *args.include]]

    def check(header: pathlib.Path) -> tuple[pathlib.Path, int, str]:
        source = f'#include "{header}"\n'
        if header.suffix == ".cuh":
            with tempfile.TemporaryDirectory() as tmp:
                unit = pathlib.Path(tmp) / "unit.cu"
                unit.write_text(source)
                # --cuda stops after nvcc's front end (cudafe++ over the host and device code, cicc
                # over the device code) and writes the host half as C++ instead of compiling it: a
                # header that leans on an include it lacks fails there already, and the host
                # compiler sees every .cuh anyway in the build's CUDA sources. Each header costs
                # about half of a whole compile (-c) this way (bench/README.md, "Figures behind
                # design choices in the headers").
                r = subprocess.run([args.cuda_compiler, "-std=c++20", "--expt-relaxed-constexpr", "-arch=sm_80",
                                    *includes, "--cuda", str(unit), "-o", str(pathlib.Path(tmp) / "unit.cpp.ii")],
                                   capture_output=True, text=True)
            return header, r.returncode, r.stderr
        r = subprocess.run([args.compiler, *flags], input=source, capture_output=True, text=True)
        return header, r.returncode, r.stderr

    failed = 0
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for header, rc, err in pool.map(check, headers):
            status = "ok" if rc == 0 else "FAILED"
            print(f"{status:6} {header}")
            if rc != 0:
                failed += 1
                print("\n".join(err.splitlines()[:15]))
    print(f"{len(headers) - failed} of {len(headers)} headers compile on their own")
    return 1 if failed else 0

