#!/usr/bin/env python3
"""Compiles every public header on its own (a translation unit that includes only that header), so
that no header leans on another being included first. Headers are those under <root>/tessera for
each --root (include/, and communicators/<name>/include for the backends that were found); every
root and --include is on the include path. CUDA headers (*.cuh) are compiled by --cuda-compiler
(nvcc, one architecture, host and device code) when one is given. Exit 1 lists the headers that
failed with the compiler's first lines of output."""
import argparse
import concurrent.futures
import pathlib
import subprocess
import sys
import tempfile


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compiler", default="c++")
    ap.add_argument("--root", action="append", default=[], help="a directory holding tessera/ headers to check")
    ap.add_argument("--include", action="append", default=[], help="an extra include directory")
    ap.add_argument("--cuda-compiler", default="", help="nvcc: also check the *.cuh headers")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    roots = [pathlib.Path(r) for r in args.root]
    patterns = ["*.hpp", "*.cuh"] if args.cuda_compiler else ["*.hpp"]
    headers = sorted({p.relative_to(root) for root in roots for pattern in patterns
                      for p in (root / "tessera").rglob(pattern)})
    flags = ["-std=c++20", "-fopenmp", "-fsyntax-only", "-Wall", "-Wextra", "-x", "c++", "-"]
    flags += [f"-I{d}" for d in [*args.root, *args.include]]

    includes = [f"-I{d}" for d in [*args.root, *args.include]]

    def check(header):
        source = f'#include "{header}"\n'
        if header.suffix == ".cuh":
            with tempfile.TemporaryDirectory() as tmp:
                unit = pathlib.Path(tmp) / "unit.cu"
                unit.write_text(source)
                r = subprocess.run([args.cuda_compiler, "-std=c++20", "--expt-relaxed-constexpr", "-arch=sm_80",
                                    "-Xcompiler=-fopenmp,-Wall,-Wextra", *includes, "-c", str(unit), "-o",
                                    str(pathlib.Path(tmp) / "unit.o")], capture_output=True, text=True)
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


if __name__ == "__main__":
    sys.exit(main())
