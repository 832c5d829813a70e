#!/usr/bin/env python3
"""Tessera as a program outside the tree sees it: installed, then found with CMake and pkg-config.

    test_consumer.py --build-dir build --in-tree build/tests/consumer_local

Installs the build into a staging folder (meson install --destdir), then builds
tests/consumer/main.cpp against it with -Wall -Wextra -Werror:
  - CMake, find_package(Tessera): the local backend (Tessera::tessera) and MPI (Tessera::mpi);
  - pkg-config: the local backend (tessera) and Gloo (tessera-gloo);
runs each (one rank: MPI as a singleton, Gloo through a file store), checks that the installed
launchers and tools (bin/tessera-run, ...) run from the prefix alone, and compares the speed of
the two local consumers with the in-tree build of the same source, in alternating runs (each one's best): the
installed flags must give the in-tree speed (a consumer without OpenBLAS ran at half of it). The
installed flags carry no -march (option package_march): the consumer is built for the compiler's
portable target, so it runs on an older CPU than the build machine's, and picks the AVX-512 or AVX2
kernels at run time. Run with TESSERA_CPU_CAPABILITY=default (what an older CPU gets) it must
report the portable kernels and compute the same losses, to float32 rounding; an unknown capability is
refused by name. One line per check; exit 0 when all pass.
"""
import argparse
import concurrent.futures
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
# Consumer / in-tree images/s, medians. Issue 18 reported 0.49 (13.6 s against 27.7 s) without the
# flags (OpenBLAS, -march=native). The installed flags now carry no -march: the portable consumer
# (the hand-written AVX-512 kernels chosen at run time; Eigen's small products and the compiler's
# own loops SSE2) ran at 0.86 of the -march=native in-tree build on a Zen 5 (2026-11-29).
MIN_SPEED_RATIO = 0.7
ROUNDS = 3


class CheckFailed(Exception):
    pass


def expect(condition, message):
    if not condition:
        raise CheckFailed(message)


def run(command, what, env=None, cwd=None, timeout=600):
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    output = done.stdout + done.stderr
    expect(done.returncode == 0, f"{what} failed (exit {done.returncode}): {' '.join(map(str, command))}\n{output[-4000:]}")
    return output


def warnings_in(output):
    return [line for line in output.splitlines() if "warning:" in line]


def build_cmake(stage, build, backend, env):
    run(["cmake", "-S", str(HERE), "-B", str(build), f"-DCMAKE_PREFIX_PATH={stage}", "-DCMAKE_BUILD_TYPE=Release",
         f"-DTESSERA_BACKEND={backend}"], f"cmake configure ({backend})", env=env)
    output = run(["cmake", "--build", str(build)], f"cmake build ({backend})", env=env)
    expect(not warnings_in(output), f"cmake build ({backend}) warned:\n" + "\n".join(warnings_in(output)[:20]))
    return build / "consumer"


def build_pkg_config(package, env_alias, header, out, env):
    flags = run(["pkg-config", "--cflags", "--libs", package], f"pkg-config {package}", env=env).split()
    compiler = os.environ.get("CXX", "c++")
    output = run([compiler, "-std=c++20", "-O3", "-DNDEBUG", "-Wall", "-Wextra", "-Werror", str(HERE / "main.cpp"),
                  f"-DTESSERA_ENV={env_alias}", f'-DTESSERA_ENV_HEADER="{header}"', *flags, "-o", str(out)],
                 f"{compiler} with pkg-config {package}", env=env)
    expect(not warnings_in(output), f"pkg-config build ({package}) warned:\n" + "\n".join(warnings_in(output)[:20]))
    return out


def check_portable(binary):
    """The consumer built from the installed flags: no AVX-512 in its -march, the same losses with
    the AVX-512 kernels (where this CPU has them) and with the portable loops, to float32 rounding:
    the packed AVX-512 kernel sums a product's steps in blocks of 256 where OpenBLAS (the portable
    path's) blocks them otherwise, so after 5 steps the losses may differ in the 7th digit (seen:
    2.27988744 against 2.27988768 on a Zen 5); a wrong kernel moves them by far more."""
    fast = run_consumer(binary, steps=5)
    portable = run_consumer(binary, env=dict(os.environ, TESSERA_CPU_CAPABILITY="default"), steps=5)
    expect(portable["cpu_capability"] == "default",
           f"TESSERA_CPU_CAPABILITY=default still ran the {portable['cpu_capability']} kernels")
    for key in ("first_loss", "last_loss"):
        expect(abs(fast[key] - portable[key]) <= 1e-5 * max(1.0, abs(portable[key])),
               f"{key} differs between the {fast['cpu_capability']} kernels ({fast[key]!r}) and the portable "
               f"loops ({portable[key]!r}) by more than float32 rounding (1e-5 relative)")
    bad = subprocess.run([str(binary), "--steps=2"], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, TESSERA_CPU_CAPABILITY="avx9"))
    expect(bad.returncode != 0 and "TESSERA_CPU_CAPABILITY='avx9'" in bad.stderr,
           f"TESSERA_CPU_CAPABILITY=avx9 was not refused by name (exit {bad.returncode}):\n{bad.stderr[-2000:]}")
    bad = subprocess.run([str(binary), "--steps=2"], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, TESSERA_CPU_BF16="maybe"))
    expect(bad.returncode != 0 and "TESSERA_CPU_BF16='maybe'" in bad.stderr,
           f"TESSERA_CPU_BF16=maybe was not refused by name (exit {bad.returncode}):\n{bad.stderr[-2000:]}")
    return fast["cpu_capability"]


def run_consumer(binary, env=None, steps=30):
    output = run([str(binary), f"--steps={steps}"], f"running {binary}", env=env, timeout=120)
    line = next((l for l in output.splitlines() if l.startswith("{")), None)
    expect(line is not None, f"{binary} printed no JSON line:\n{output}")
    return json.loads(line)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build-dir", required=True, help="the meson build to install")
    parser.add_argument("--in-tree", required=True, help="the in-tree build of tests/consumer/main.cpp (local)")
    args = parser.parse_args()
    missing = [tool for tool in ("cmake", "pkg-config") if shutil.which(tool) is None]
    if missing:
        print(f"skipped: {', '.join(missing)} not installed")
        return 77
    work = pathlib.Path(tempfile.mkdtemp(prefix="tessera-consumer-"))
    try:
        staging = work / "stage"
        run(["meson", "install", "-C", args.build_dir, "--no-rebuild", "--destdir", str(staging), "--quiet"],
            "meson install --destdir")
        pc_files = sorted(staging.rglob("pkgconfig/tessera.pc"))
        configs = sorted(staging.rglob("cmake/Tessera/TesseraConfig.cmake"))
        expect(len(pc_files) == 1 and len(configs) == 1, f"install lacks tessera.pc or TesseraConfig.cmake: {pc_files} {configs}")
        pc_dir = pc_files[0].parent
        # <prefix>/<libdir>/cmake/Tessera -> <prefix>: the staged prefix, whatever libdir is.
        prefix = configs[0].parent
        while not (prefix / "include" / "tessera").is_dir():
            expect(prefix != prefix.parent, f"no include/tessera above {configs[0]}")
            prefix = prefix.parent
        env = dict(os.environ, PKG_CONFIG_PATH=str(pc_dir))
        backends = sorted(p.stem for p in pc_dir.glob("tessera*.pc"))
        print(f"ok: installed to {prefix}: pkg-config {', '.join(backends)}; CMake package {configs[0].name}")
        cflags = run(["pkg-config", "--cflags", "tessera"], "pkg-config --cflags tessera", env=env)
        expect("-isystem" in cflags, f"tessera.pc does not put Tessera on the system include path: {cflags}")

        # The launchers and tools a cluster user runs, from the installed prefix alone: each finds
        # its package under <prefix>/share/tessera/python, not in this source tree.
        for tool in ("tessera-run", "tessera-sbatch", "tessera-simulate", "tessera-report"):
            installed = prefix / "bin" / tool
            expect(installed.is_file() and os.access(installed, os.X_OK), f"install lacks an executable bin/{tool}")
            usage = run([str(installed), "--help"], f"installed {tool} --help", cwd=str(work))
            expect(f"usage: {tool}" in usage, f"installed {tool} --help printed no usage line:\n{usage[:500]}")
        allreduce = run([str(prefix / "bin" / "tessera-simulate"), "allreduce", "--network",
                         str(prefix / "share" / "tessera" / "simulator" / "loopback_gloo.json"), "--workers", "2",
                         "--bytes", "1048576"], "installed tessera-simulate allreduce", cwd=str(work))
        print(f"ok: installed tessera-run, tessera-sbatch, tessera-simulate, tessera-report run from {prefix / 'bin'}"
              f" ({allreduce.strip().splitlines()[-1] if allreduce.strip() else 'no output'})")

        # The four consumers compile two at a time (one compiler each, on the two cores CI has).
        builds = {"cmake-local": lambda: build_cmake(prefix, work / "cmake-local", "local", env),
                  "pc-local": lambda: build_pkg_config("tessera", "tessera::CpuLocal", "tessera/comm/local.hpp",
                                                       work / "pc-local", env)}
        if "tessera-mpi" in backends:
            builds["cmake-mpi"] = lambda: build_cmake(prefix, work / "cmake-mpi", "mpi", env)
        if "tessera-gloo" in backends:
            builds["pc-gloo"] = lambda: build_pkg_config("tessera-gloo", "tessera::CpuGloo", "tessera/comm/gloo.hpp",
                                                         work / "pc-gloo", env)
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            futures = {name: pool.submit(build) for name, build in builds.items()}
            built = {name: future.result() for name, future in futures.items()}
        cmake_local, pc_local = built["cmake-local"], built["pc-local"]
        print("ok: local backend built with CMake (Tessera::tessera) and pkg-config (tessera), 0 warnings under "
              "-Wall -Wextra -Werror")
        expect("-march" not in cflags, f"tessera.pc gives consumers a -march (built with package_march?): {cflags}")
        capability = check_portable(pc_local)
        print(f"ok: the portable consumer (no -march) ran the {capability} kernels, and with "
              "TESSERA_CPU_CAPABILITY=default the portable loops, to the same losses (1e-5 relative); "
              "TESSERA_CPU_CAPABILITY=avx9 "
              "refused by name")
        if "tessera-mpi" in backends:
            result = run_consumer(built["cmake-mpi"], steps=3)
            expect(result["backend"] == "mpi", f"CMake MPI consumer ran backend {result['backend']}")
            print("ok: MPI backend built with CMake (Tessera::mpi) and run as one MPI rank")
        if "tessera-gloo" in backends:
            store = work / "store"
            store.mkdir()
            result = run_consumer(built["pc-gloo"], env=dict(os.environ, TESSERA_STORE=f"file://{store}"), steps=3)
            expect(result["backend"] == "gloo", f"pkg-config Gloo consumer ran backend {result['backend']}")
            print("ok: Gloo backend built with pkg-config (tessera-gloo) and run as one rank over a file store")

        # Speed: alternating runs, so that a noisy minute hits all three alike.
        speeds = {"in-tree": [], "cmake": [], "pkg-config": []}
        binaries = {"in-tree": args.in_tree, "cmake": cmake_local, "pkg-config": pc_local}
        for _ in range(ROUNDS):
            for name, binary in binaries.items():
                speeds[name].append(run_consumer(binary)["images_per_second"])
        # Each binary's best run: noise (the `waits` suite beside this test, another tenant on the
        # host) only ever slows a run down, and one slow minute took two of the CMake consumer's
        # three runs to 0.64 of the in-tree median while its third ran at 0.91 (2026-12-07, Zen 3).
        best = {name: max(v) for name, v in speeds.items()}
        report = {name: {"images_per_second": best[name], "median_images_per_second": statistics.median(v),
                         "runs": v, "ratio_to_in_tree": best[name] / best["in-tree"]} for name, v in speeds.items()}
        print("speed (LeNet-5 training steps, batch 64, 2 threads, best of the runs): " + json.dumps(report))
        for name in ("cmake", "pkg-config"):
            ratio = report[name]["ratio_to_in_tree"]
            expect(ratio >= MIN_SPEED_RATIO, f"the {name} consumer runs at {ratio:.2f} of the in-tree speed "
                                             f"(at least {MIN_SPEED_RATIO}): the installed flags lose speed")
        print(f"ok: consumers at {report['cmake']['ratio_to_in_tree']:.2f} (CMake) and "
              f"{report['pkg-config']['ratio_to_in_tree']:.2f} (pkg-config) of the in-tree speed")
    except CheckFailed as e:
        print(f"FAILED: {e}")
        print(f"(files kept in {work})")
        return 1
    shutil.rmtree(work, ignore_errors=True)
    print("all consumer checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
