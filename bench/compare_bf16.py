"""bfloat16 compute on the CPU: speed and accuracy of Tessera's CpuLocalBf16 (float weights,
bfloat16 products with float accumulation, core/env.hpp) against Tessera float32 and against
PyTorch's CPU autocast to bfloat16.

    /usr/bin/python3 bench/compare_bf16.py --build build --threads 2 --runs 5 \\
        [--models resnet20,resnet50_b8] [--accuracy lenet,resnet20] [--seeds 3]

Speed: per model, four configurations run in turn, --runs times (Tessera float32, Tessera
bfloat16, PyTorch float32, PyTorch autocast bfloat16), so machine noise hits all alike; each
figure is a median, each ratio a ratio of medians. PyTorch runs at its best (bench/peer.py, as
compare_pytorch.py): its OPENBLAS_CORETYPE and OMP_WAIT_POLICY are probed once per precision.

Accuracy: examples 01 (LeNet-5, 5 epochs) and 02 (ResNet-20, --resnet-epochs) on Fashion-MNIST,
--precision=float32 and bfloat16 with the same seeds; the goal is a mean final test accuracy
within 0.3 points of float32's. Prints one JSON object (--out writes it too).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer  # noqa: E402
from bench_common import cpu_details, cpu_model, default_result  # noqa: E402
from compare_pytorch import run_tessera, run_torch  # noqa: E402

PRECISIONS = ("float32", "bfloat16")
EXAMPLES = {"lenet": "01_fashion_mnist_lenet", "resnet20": "02_fashion_mnist_resnet"}


def speed(args, setup):
    out = []
    binary = os.path.join(args.build, "bench", "train_throughput")
    for model in args.models.split(","):
        best = {}
        for precision in PRECISIONS:
            def probe(coretype, policy, malloc, precision=precision):
                r = run_torch(setup.env(coretype, policy, malloc), model, args.threads, precision)
                return r["images_per_second"], r["peer"]["openblas"].get("corename")

            best[precision] = peer.choose_config(probe, setup.candidates)
        runs = {f"{fw}_{p}": [] for fw in ("tessera", "pytorch") for p in PRECISIONS}
        tessera_config, child = {}, {}
        for _ in range(args.runs):
            for p in PRECISIONS:
                t = run_tessera(binary, model, args.threads, p)
                runs[f"tessera_{p}"].append(t["images_per_second"])
                tessera_config[p] = {"gemm": t["gemm"], "bf16_kernel": t["bf16_kernel"],
                                     "bf16_conv": t.get("bf16_conv", "")}
            for p in PRECISIONS:
                b = best[p][0]
                r = run_torch(setup.env_of(b), model, args.threads, p)
                runs[f"pytorch_{p}"].append(r["images_per_second"])
                child[p] = {**r["peer"], "conv_kernels": r.get("conv_kernels", [])}
        med = {k: statistics.median(v) for k, v in runs.items()}
        entry = {"model": model, "images_per_second": med, "runs": runs,
                 "tessera_bf16_over_tessera_fp32": med["tessera_bfloat16"] / med["tessera_float32"],
                 "tessera_bf16_over_pytorch_bf16": med["tessera_bfloat16"] / med["pytorch_bfloat16"],
                 "tessera_bf16_over_pytorch_fp32": med["tessera_bfloat16"] / med["pytorch_float32"],
                 "pytorch_bf16_over_pytorch_fp32": med["pytorch_bfloat16"] / med["pytorch_float32"],
                 "tessera_config": tessera_config,
                 "pytorch_config": {p: setup.record(best[p][0], best[p][1], child.get(p)) for p in PRECISIONS}}
        print(f"{model:13} tessera fp32 {med['tessera_float32']:8.1f} bf16 {med['tessera_bfloat16']:8.1f} | pytorch "
              f"fp32 {med['pytorch_float32']:8.1f} bf16 {med['pytorch_bfloat16']:8.1f} img/s | tessera bf16 / fp32 "
              f"{entry['tessera_bf16_over_tessera_fp32']:.2f}, / pytorch bf16 {entry['tessera_bf16_over_pytorch_bf16']:.2f}",
              file=sys.stderr)
        out.append(entry)
    return out


def final_accuracy(binary, precision, seed, threads, epochs):
    argv = [binary, f"--precision={precision}", f"--seed={seed}", f"--threads={threads}", "--progress=0"]
    if epochs:
        argv.append(f"--epochs={epochs}")
    text = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    m = re.search(r"final test accuracy: ([0-9.]+)%", text)
    if not m:
        sys.exit(f"{' '.join(argv)}: no final accuracy in its output:\n{text[-2000:]}")
    return float(m.group(1))


def accuracy(args):
    out = []
    for model in args.accuracy.split(","):
        binary = os.path.join(args.build, "examples", EXAMPLES[model])
        epochs = args.resnet_epochs if model == "resnet20" else 0
        acc = {p: [] for p in PRECISIONS}
        for seed in range(1, args.seeds + 1):
            for p in PRECISIONS:
                acc[p].append(final_accuracy(binary, p, seed, args.threads, epochs))
            print(f"{model} seed {seed}: float32 {acc['float32'][-1]:.2f}%  bfloat16 {acc['bfloat16'][-1]:.2f}%",
                  file=sys.stderr)
        mean = {p: statistics.mean(v) for p, v in acc.items()}
        gap = mean["bfloat16"] - mean["float32"]
        out.append({"model": model, "example": EXAMPLES[model], "epochs": epochs or 5, "seeds": args.seeds,
                    "test_accuracy_percent": acc, "mean": mean, "bf16_minus_fp32_points": gap,
                    "goal_points": 0.3, "met": abs(gap) <= 0.3})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--models", default="resnet20,resnet50_b8", help="speed: train_throughput's models ('' for none)")
    ap.add_argument("--accuracy", default="lenet", help="accuracy: lenet,resnet20 ('' for none)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--resnet-epochs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default="")
    peer.add_arguments(ap)
    args = ap.parse_args()
    report = {"cpu": cpu_model(), "cpu_details": cpu_details(), "threads": args.threads, "runs": args.runs}
    if args.models:
        setup = peer.peer_or_exit(args.coretypes)
        report["pytorch_blas"] = setup.blas
        report["speed"] = speed(args, setup)
    if args.accuracy:
        report["accuracy"] = accuracy(args)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out if args.out != "default" else default_result("bf16"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
