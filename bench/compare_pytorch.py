"""Tessera vs PyTorch 1.13 training throughput on the same models, batches and threads.

    /usr/bin/python3 bench/compare_pytorch.py --tessera build/bench/train_throughput --threads 2 --runs 5

PyTorch is run at its best (bench/peer.py; bench/README.md, "The PyTorch configuration"): on
OpenBLAS (selected for its process alone when libblas.so.3 is another BLAS; the script refuses
where OpenBLAS is not installed), threads set explicitly (torch.set_num_threads), OpenBLAS limited to
one thread so it does not fight OpenMP, OPENBLAS_L2_SIZE unset, and per model each OMP_WAIT_POLICY
(unset, PASSIVE, ACTIVE) and then each OPENBLAS_CORETYPE this CPU supports (--coretypes narrows
them) tried once; the fastest configuration is used for the measured runs. Tessera and PyTorch runs
alternate, so machine noise hits both alike; the ratio is of the medians over --runs runs. Prints
one JSON object, whose "pytorch_config" per model records the whole peer setup and every trial.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer  # noqa: E402
from bench_common import cpu_model  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def run_tessera(binary, model, threads, precision="float32"):
    out = subprocess.run([binary, f"--models={model}", f"--threads={threads}", f"--precision={precision}"],
                         check=True, capture_output=True, text=True).stdout
    report = json.loads(out)
    # Which gemm kernel Tessera ran ("OpenBLAS <core>" or "Eigen gebp") and the OpenBLAS core
    # setting it inherited (the machine may set OPENBLAS_CORETYPE; the peer's is chosen below).
    return {**report["results"][0], "gemm": report.get("gemm", "?"), "bf16_kernel": report.get("bf16_kernel", ""),
            "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE", "unset")}


def run_torch(setup, model, threads, coretype, policy, precision="float32"):
    out = peer.run_child(["/usr/bin/python3", os.path.join(HERE, "torch_throughput.py"), "--models", model,
                          "--threads", str(threads), "--precision", precision], setup.env(coretype, policy))
    result = json.loads(out)
    return {**result["results"][0], "peer": result["peer"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tessera", default="build/bench/train_throughput")
    ap.add_argument("--models", default="mlp,lenet,resnet20,resnet50_b8,resnet50_b32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    peer.add_arguments(ap)
    args = ap.parse_args()
    setup = peer.peer_or_exit(args.coretypes)
    report = {"cpu": cpu_model(), "threads": args.threads, "runs": args.runs, "pytorch_blas": setup.blas,
              "models": []}
    for model in args.models.split(","):
        def probe(coretype, policy):
            r = run_torch(setup, model, args.threads, coretype, policy)
            return r["images_per_second"], r["peer"]["openblas"].get("corename")

        best, trials = peer.choose_config(probe, setup.candidates)
        ours, theirs, child, tessera_config = [], [], None, None
        for _ in range(args.runs):
            t = run_tessera(args.tessera, model, args.threads)
            ours.append(t["images_per_second"])
            tessera_config = {"gemm": t["gemm"], "OPENBLAS_CORETYPE": t["OPENBLAS_CORETYPE"]}
            r = run_torch(setup, model, args.threads, best["OPENBLAS_CORETYPE"], best["OMP_WAIT_POLICY"])
            theirs.append(r["images_per_second"])
            child = {**r["peer"], "conv_kernels": r.get("conv_kernels", [])}
        entry = {"model": model, "tessera_images_per_second": statistics.median(ours),
                 "pytorch_images_per_second": statistics.median(theirs),
                 "ratio": statistics.median(ours) / statistics.median(theirs),
                 "tessera_runs": ours, "pytorch_runs": theirs, "tessera_config": tessera_config,
                 "pytorch_config": setup.record(best, trials, child)}
        print(f"{model:13} tessera {entry['tessera_images_per_second']:8.1f}  pytorch "
              f"{entry['pytorch_images_per_second']:8.1f} img/s  ratio {entry['ratio']:.2f}  "
              f"(torch OMP_WAIT_POLICY={best['OMP_WAIT_POLICY']} OPENBLAS_CORETYPE={best['OPENBLAS_CORETYPE']}, "
              f"OpenBLAS core {child['openblas'].get('corename', '?')})", file=sys.stderr)
        report["models"].append(entry)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
