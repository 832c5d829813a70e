#!/usr/bin/env python3
"""How fast can any fp32 implementation train the MLP here? The ceiling set by matrix products.

    python3 bench/gemm_ceiling.py [--threads 1] [--throughput bench/out/throughput_1thread_....json]

The MLP of bench/compare_pytorch.py (784-512-256-10, batch 128) is almost all matrix products. Per
step, with B = 128 and layers (in, out) = (784, 512), (512, 256), (256, 10):

    forward          Y = X W^T          2 B in out FLOPs per layer
    weight gradient  dW = dY^T X        2 B in out per layer
    input gradient   dX = dY W          2 B in out per layer but the first (its input is data)

    = 2 x 128 x (2 x 784 x 512 + 3 x 512 x 256 + 3 x 256 x 10) = 309 MFLOP per step, 2.41 MFLOP per image.

This script times OpenBLAS's own sgemm (the library both Tessera and PyTorch call here, loaded by
ctypes from the OpenBLAS that bench/peer.py selects, at each OPENBLAS_CORETYPE the CPU supports,
the fastest kept) on (a) large square products (best of 5), the machine's practical fp32 peak, and
(b) exactly the MLP step's products at their shapes with nothing else. Running the whole step at (a)
with nothing else to do is the ceiling no fp32 implementation passes: peak / 309 MFLOP x 128 images/s.
(b) is reported beside it. With --throughput (a compare_pytorch.py JSON at the same thread count) it
also gives both sides' GFLOP/s, the ratio to PyTorch that the ceiling allows, and the GFLOP/s a 1.5x
lead would need. Writes bench/out/gemm_ceiling_<date>.json.
"""
import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer  # noqa: E402
from bench_common import cpu_details, cpu_model, default_result  # noqa: E402

BATCH = 128
LAYERS = [(784, 512), (512, 256), (256, 10)]


def mlp_products(batch=BATCH, layers=LAYERS):
    """The MLP step's products as (label, trans_a, trans_b, M, N, K), row-major."""
    out = []
    for i, (fan_in, fan_out) in enumerate(layers):
        out.append((f"forward {i}", False, True, batch, fan_out, fan_in))     # X (B,in) W^T
        out.append((f"weight grad {i}", True, False, fan_out, fan_in, batch))  # dY^T (out,B) X (B,in)
        if i > 0:
            out.append((f"input grad {i}", False, False, batch, fan_in, fan_out))  # dY (B,out) W (out,in)
    return out


def step_flops(products):
    return sum(2 * m * n * k for _, _, _, m, n, k in products)


def child(library, repeats):
    """Inside a process with OPENBLAS_CORETYPE and OPENBLAS_NUM_THREADS set: times cblas_sgemm."""
    import numpy as np
    blas = ctypes.CDLL(library)
    blas.openblas_get_corename.restype = ctypes.c_char_p
    sgemm = blas.cblas_sgemm
    f32p = ctypes.POINTER(ctypes.c_float)
    row_major, no_trans, trans = 101, 111, 112

    def make(ta, tb, m, n, k):
        rng = np.random.default_rng(0)
        a = rng.standard_normal((k, m) if ta else (m, k), dtype=np.float32)
        b = rng.standard_normal((n, k) if tb else (k, n), dtype=np.float32)
        c = np.zeros((m, n), dtype=np.float32)
        args = (row_major, trans if ta else no_trans, trans if tb else no_trans, m, n, k, ctypes.c_float(1.0),
                a.ctypes.data_as(f32p), a.shape[1], b.ctypes.data_as(f32p), b.shape[1], ctypes.c_float(0.0),
                c.ctypes.data_as(f32p), n)
        return (a, b, c), args

    def seconds(calls, reps, pick=statistics.median):
        for fn, args in calls:  # warm up: pages, caches, OpenBLAS's buffers
            fn(*args)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            for fn, args in calls:
                fn(*args)
            times.append(time.perf_counter() - t)
        return pick(times)

    # The peak: the best of 5 large square products, the most generous figure for the ceiling.
    square = {}
    for n in (2048, 4096):
        arrays, args = make(False, False, n, n, n)  # arrays keeps the buffers args points into alive
        square[str(n)] = 2 * n ** 3 / seconds([(sgemm, args)], 5, min) / 1e9
    products = mlp_products()
    made = [make(ta, tb, m, n, k) for _, ta, tb, m, n, k in products]
    # A 1x1x1 product's time (ctypes' call plus OpenBLAS's entry) is taken off each call, so the
    # ceiling errs on the generous side: a C++ caller pays less than ctypes does.
    tiny_arrays, tiny = make(False, False, 1, 1, 1)
    call_s = seconds([(sgemm, tiny)] * 10, repeats) / 10
    step = seconds([(sgemm, args) for _, args in made], repeats) - len(made) * call_s
    per_product = {}
    for (label, ta, tb, *_), ((a, b, c), args) in zip(products, made):
        per_product[label] = seconds([(sgemm, args)], repeats) * 1e6
        # The shapes and transposes are the ones meant: OpenBLAS's product against numpy's.
        expected = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b).astype(np.float64)
        error = float(np.max(np.abs(c - expected)) / max(1.0, float(np.max(np.abs(expected)))))
        if error > 1e-4:
            raise SystemExit(f"gemm_ceiling.py: {label}: OpenBLAS's product is off by {error:.2e} (relative)")
    return {"corename": blas.openblas_get_corename().decode(), "square_gflops": square,
            "mlp_step_products_s": step, "mlp_product_us": per_product, "call_overhead_us": call_s * 1e6}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1, help="OpenBLAS threads (default 1: per core)")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--throughput", default="", help="a compare_pytorch.py JSON measured at the same thread count")
    p.add_argument("--out", default=default_result("gemm_ceiling"))
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.repeats)))
        return
    setup = peer.peer_or_exit()
    if not setup.openblas:
        sys.exit("gemm_ceiling.py: no OpenBLAS library found to time")
    trials = []
    for coretype in setup.candidates:
        env = setup.env(coretype)
        env["OPENBLAS_NUM_THREADS"] = str(args.threads)
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", setup.openblas,
                              "--repeats", str(args.repeats)], env=env, check=True, capture_output=True, text=True)
        trial = {"OPENBLAS_CORETYPE": coretype, **json.loads(out.stdout)}
        trials.append(trial)
        print(f"{coretype:>10} ({trial['corename']}): square {max(trial['square_gflops'].values()):.1f} GFLOP/s, "
              f"MLP step's products {trial['mlp_step_products_s'] * 1e3:.3f} ms", file=sys.stderr)
    best = min(trials, key=lambda t: t["mlp_step_products_s"])
    flops = step_flops(mlp_products())
    peak = max(max(t["square_gflops"].values()) for t in trials)
    # The bound: the whole step at the peak rate, nothing else done. OpenBLAS alone on the step's
    # own products (best) is slower still, but Tessera does the smallest one with Eigen, so that
    # figure is reported, not used as the bound.
    ceiling = BATCH * peak * 1e9 / flops
    report = {"bench": "gemm_ceiling", "cpu": cpu_model(), "cpu_details": cpu_details(), "threads": args.threads,
              "openblas_library": setup.openblas, "peak_gflops": peak, "mlp_step_mflop": flops / 1e6,
              "mlp_images_per_second_at_peak": ceiling, "best_coretype_for_mlp_products": best["OPENBLAS_CORETYPE"],
              "mlp_products_only_ms": best["mlp_step_products_s"] * 1e3,
              "mlp_products_only_gflops": flops / best["mlp_step_products_s"] / 1e9, "trials": trials}
    if args.throughput:
        with open(args.throughput) as f:
            measured = json.load(f)
        mlp = next(m for m in measured["models"] if m["model"] == "mlp")
        report["from"] = args.throughput
        report["tessera_images_per_second"] = mlp["tessera_images_per_second"]
        report["pytorch_images_per_second"] = mlp["pytorch_images_per_second"]
        report["ratio"] = mlp["ratio"]
        for side in ("tessera", "pytorch"):
            report[f"{side}_gflops"] = mlp[f"{side}_images_per_second"] * flops / BATCH / 1e9
            report[f"{side}_fraction_of_peak"] = report[f"{side}_gflops"] / peak
        report["largest_possible_ratio"] = ceiling / mlp["pytorch_images_per_second"]
        report["gflops_needed_for_1.5x"] = 1.5 * report["pytorch_gflops"]
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "trials"}))


if __name__ == "__main__":
    main()
