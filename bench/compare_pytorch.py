"""Tessera vs PyTorch 1.13 training throughput on the same models, batches and threads.

    /usr/bin/python3 bench/compare_pytorch.py --tessera build/bench/train_throughput --threads 2 --runs 5

PyTorch is run at its best (bench/peer.py; bench/README.md, "The PyTorch configuration"): on
OpenBLAS (selected for its process alone when libblas.so.3 is another BLAS; the script refuses
where OpenBLAS is not installed), threads set explicitly (torch.set_num_threads), OpenBLAS limited to
one thread so it does not fight OpenMP, OPENBLAS_L2_SIZE unset, and per model glibc's default
malloc, one retaining freed memory and jemalloc where installed (peer.MALLOCS), then each OMP_WAIT_POLICY (unset, PASSIVE,
ACTIVE), then each OPENBLAS_CORETYPE this CPU supports (--coretypes narrows them) tried once
(peer.choose_config); the fastest configuration is used for the measured runs. Tessera is run at
its best the same way: its OpenBLAS core type (the shell's, 'unset', then each other candidate) tried once per
model, the fastest kept, then its idle spin (KMP_BLOCKTIME=1 against the OpenMP runtime's default, two runs
each; bench/peer.py, choose_tessera_config). Tessera and PyTorch runs
alternate, so machine noise hits both alike; the ratio is of the medians over --runs runs. Prints
one JSON object, whose "pytorch_config" and "tessera_config" per model record each side's setup and
every trial.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer  # noqa: E402
from bench_common import cpu_details, cpu_model  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def run_tessera(binary, model, threads, precision="float32", env=None):
    out = subprocess.run([binary, f"--models={model}", f"--threads={threads}", f"--precision={precision}"],
                         check=True, capture_output=True, text=True, env=env).stdout
    report = json.loads(out)
    # Which gemm kernel Tessera ran ("OpenBLAS <core>" or "Eigen gebp"); its OpenBLAS core type is
    # chosen by peer.choose_tessera_config, as the peer's is.
    return {**report["results"][0], "gemm": report.get("gemm", "?"), "bf16_kernel": report.get("bf16_kernel", ""),
            "bf16_conv": report.get("bf16_conv", "")}


def run_torch(env, model, threads, precision="float32"):
    out = peer.run_child(["/usr/bin/python3", os.path.join(HERE, "torch_throughput.py"), "--models", model,
                          "--threads", str(threads), "--precision", precision], env)
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
    report = {"cpu": cpu_model(), "cpu_details": cpu_details(),
              "threads": args.threads, "runs": args.runs, "pytorch_blas": setup.blas,
              "models": []}
    for model in args.models.split(","):
        def probe(coretype, policy, malloc):
            r = run_torch(setup.env(coretype, policy, malloc), model, args.threads)
            return r["images_per_second"], r["peer"]["openblas"].get("corename")

        best, trials = peer.choose_config(probe, setup.candidates)

        def probe_tessera(env):
            t = run_tessera(args.tessera, model, args.threads, env=env)
            return t["images_per_second"], t["gemm"]

        tessera_best, tessera_trials, tessera_env = peer.choose_tessera_config(probe_tessera, setup.candidates)
        tessera_config = peer.tessera_record(tessera_best, tessera_trials)
        ours, theirs, child = [], [], None
        for _ in range(args.runs):
            t = run_tessera(args.tessera, model, args.threads, env=tessera_env)
            ours.append(t["images_per_second"])
            r = run_torch(setup.env_of(best), model, args.threads)
            theirs.append(r["images_per_second"])
            child = {**r["peer"], "conv_kernels": r.get("conv_kernels", [])}
        entry = {"model": model, "tessera_images_per_second": statistics.median(ours),
                 "pytorch_images_per_second": statistics.median(theirs),
                 "ratio": statistics.median(ours) / statistics.median(theirs),
                 "tessera_runs": ours, "pytorch_runs": theirs, "tessera_config": tessera_config,
                 "pytorch_config": setup.record(best, trials, child)}
        print(f"{model:13} tessera {entry['tessera_images_per_second']:8.1f}  pytorch "
              f"{entry['pytorch_images_per_second']:8.1f} img/s  ratio {entry['ratio']:.2f}  "
              f"(tessera OPENBLAS_CORETYPE={tessera_best['OPENBLAS_CORETYPE']} KMP_BLOCKTIME={tessera_best['KMP_BLOCKTIME']}; "
              f"torch OMP_WAIT_POLICY={best['OMP_WAIT_POLICY']} OPENBLAS_CORETYPE={best['OPENBLAS_CORETYPE']} "
              f"malloc={best['malloc']}, "
              f"OpenBLAS core {child['openblas'].get('corename', '?')})", file=sys.stderr)
        report["models"].append(entry)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
