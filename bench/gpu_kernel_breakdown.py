#!/usr/bin/env python3
"""Where a GPU training step's time goes, by kernel: Nsight Compute (ncu) times every kernel that
example 08 (`08_resnet50_cuda`) launches, and this script sums the times by kind, so that the work
on GPU speed (fusion, channels-last, CUDA graphs) starts from the largest share, not a guess.

  bench/gpu_kernel_breakdown.py --tessera BIN_DIR/08_resnet50_cuda [--batch 64] [--steps 2]
                                [--precision tf32] [--out FILE]
  bench/gpu_kernel_breakdown.py --csv ncu.csv ...     # parse an ncu CSV written earlier

ncu runs each kernel alone (serialised, caches flushed, `--clock-control none` so the clocks are the
ones a normal run gets), so the sum is kernel time without launch gaps or overlap: it tells the
shares, not the step time (gpu_resnet50.py measures that). Everything the program launches is
counted: parameter set-up, the warm-up step and the timed steps, all with cuDNN's heuristic
algorithm choice (with TESSERA_CUDNN_BENCHMARK=1 the trial kernels of cudnnFind would be counted).
Kinds: 'cuDNN/cuBLAS' is every library kernel (convolutions and the classifier's GEMM), except the
layout transforms cuDNN runs around tensor-core kernels on NCHW data ('layout transform'); the
rest are Tessera's own kernels, by their names in include/tessera/kernels/cuda/. Prints JSON.
"""
import argparse
import csv
import io
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import default_result, write_result  # noqa: E402

# Tessera's kernels by kind: the first pattern that matches a kernel's name decides.
KINDS = [
    ("layout transform", r"nchwToNhwc|nhwcToNchw|transpose|convertTensor|Tensor_?Transform|reformat"),
    ("batch norm", r"\bbn_\w+_kernel"),
    ("residual add + relu", r"add_relu_forward_kernel"),
    ("relu, gelu, dropout", r"relu_\w+_kernel|gelu_\w+_kernel|dropout_mask_kernel|map_\w+_kernel"),
    ("pooling", r"pool_\w+_kernel"),
    ("loss (softmax, nll)", r"softmax_\w+_kernel|nll_\w+_kernel|squared_error_\w+_kernel"),
    ("optimizer", r"sgd_update_kernel|adam_update_kernel|lars_update_kernel|lamb_\w+_kernel|sum_of_squares_kernel|"
                  r"unscale_and_flag_kernel"),
    ("bias, fill, copies, other Tessera", r"tessera::|_kernel\b"),
    ("cuDNN/cuBLAS", r"."),
]


def kind_of(name):
    for kind, pattern in KINDS:
        if re.search(pattern, name):
            return kind
    return "cuDNN/cuBLAS"


def kernel_times(csv_text):
    """(kernel name, nanoseconds) for every profiled launch in ncu's --csv output; ncu's own lines
    (==PROF==, the program's output) are skipped."""
    lines = [line for line in csv_text.splitlines() if line.startswith('"')]
    if not lines:
        raise RuntimeError("ncu's output holds no CSV rows: did it profile any kernel?")
    times = []
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(row["Metric Value"].replace(",", ""))
        unit = row.get("Metric Unit", "nsecond")
        scale = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6}.get(unit)
        if scale is None:
            raise RuntimeError(f"unknown time unit {unit!r} in ncu's CSV")
        times.append((row["Kernel Name"], value * scale))
    if not times:
        raise RuntimeError("ncu's CSV has no gpu__time_duration.sum rows")
    return times


def summarise(times, top=15):
    total = sum(t for _, t in times)
    by_kind, by_name = {}, {}
    for name, t in times:
        k = kind_of(name)
        by_kind.setdefault(k, [0.0, 0])
        by_kind[k][0] += t
        by_kind[k][1] += 1
        short = re.sub(r"\(.*", "", name)[:120]
        by_name.setdefault(short, [0.0, 0, k])
        by_name[short][0] += t
        by_name[short][1] += 1
    kinds = [{"kind": k, "ms": round(v[0] / 1e6, 4), "share": round(v[0] / total, 4), "launches": v[1]}
             for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1][0])]
    names = [{"kernel": n, "kind": v[2], "ms": round(v[0] / 1e6, 4), "share": round(v[0] / total, 4),
              "launches": v[1]} for n, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]]
    return {"kernel_ms": round(total / 1e6, 4), "launches": len(times), "by_kind": kinds, "top_kernels": names}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tessera", help="path of the 08_resnet50_cuda binary")
    ap.add_argument("--csv", help="parse this ncu CSV instead of running ncu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--precision", default="tf32", help="TESSERA_MATH_PRECISION: float32, tf32, bfloat16, float16")
    ap.add_argument("--ncu", default=shutil.which("ncu") or "/usr/local/cuda/bin/ncu")
    ap.add_argument("--out", default=default_result("gpu_kernel_breakdown"))
    args = ap.parse_args()
    if args.csv:
        with open(args.csv) as f:
            text = f.read()
    else:
        if not args.tessera:
            ap.error("give --tessera BINARY or --csv FILE")
        if not os.path.exists(args.ncu):
            print(f"no ncu at {args.ncu}: nothing measured", file=sys.stderr)
            sys.exit(77)
        env = dict(os.environ, TESSERA_CUDNN_BENCHMARK="0", TESSERA_MATH_PRECISION=args.precision)
        cmd = [args.ncu, "--csv", "--metrics", "gpu__time_duration.sum", "--clock-control", "none",
               "--print-units", "base", args.tessera, f"--batch={args.batch}", f"--steps={args.steps}"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
        if out.returncode != 0:
            raise RuntimeError(f"ncu exited {out.returncode}: {out.stderr.strip()[-2000:]}")
        text = out.stdout
    result = {"benchmark": "gpu_kernel_breakdown", "model": "resnet50", "batch": args.batch, "steps": args.steps,
              "precision": args.precision, "cudnn_algorithms": "heuristics",
              "counted": "every kernel of the run: set-up, the warm-up step and the timed steps",
              **summarise(kernel_times(text))}
    write_result(result, args.out)
    for k in result["by_kind"]:
        print(f"{k['kind']:36s} {k['ms']:9.2f} ms {100 * k['share']:5.1f}% {k['launches']:6d} launches", file=sys.stderr)


if __name__ == "__main__":
    main()
