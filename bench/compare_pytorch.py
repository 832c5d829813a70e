"""Tessera vs PyTorch 1.13 training throughput on the same models, batches and threads.

    /usr/bin/python3 bench/compare_pytorch.py --tessera build/bench/train_throughput --threads 2 --runs 5

PyTorch is run at its best: threads set explicitly (torch.set_num_threads), OpenBLAS limited to one
thread so it does not fight OpenMP, OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE unset for its process only,
and each OMP_WAIT_POLICY (unset, PASSIVE, ACTIVE) tried once per model; the fastest configuration is
then used for the measured runs. Tessera and PyTorch runs alternate, so machine noise hits both
alike; the ratio is of the medians over --runs runs. Prints one JSON object.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import cpu_model  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def run_tessera(binary, model, threads):
    out = subprocess.run([binary, f"--models={model}", f"--threads={threads}"], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out)["results"][0]


def torch_env(policy):
    env = dict(os.environ)
    env.pop("OPENBLAS_CORETYPE", None)
    env.pop("OPENBLAS_L2_SIZE", None)
    env["OPENBLAS_NUM_THREADS"] = "1"
    env.pop("OMP_WAIT_POLICY", None)
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    return env


def run_torch(model, threads, policy):
    out = subprocess.run(["/usr/bin/python3", os.path.join(HERE, "torch_throughput.py"), "--models", model,
                          "--threads", str(threads)], check=True, capture_output=True, text=True,
                         env=torch_env(policy)).stdout
    result = json.loads(out)
    return {**result["results"][0], "blas": result.get("blas")}




def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tessera", default="build/bench/train_throughput")
    ap.add_argument("--models", default="mlp,lenet,resnet20,resnet50_b8,resnet50_b32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    report = {"cpu": cpu_model(), "threads": args.threads, "runs": args.runs, "models": []}
    for model in args.models.split(","):
        probes = {p or "unset": run_torch(model, args.threads, p) for p in ("", "PASSIVE", "ACTIVE")}
        trials = {p: r["images_per_second"] for p, r in probes.items()}
        report["pytorch_blas"] = probes["unset"]["blas"]
        best = max(trials, key=trials.get)
        policy = "" if best == "unset" else best
        ours, theirs = [], []
        for _ in range(args.runs):
            ours.append(run_tessera(args.tessera, model, args.threads)["images_per_second"])
            theirs.append(run_torch(model, args.threads, policy)["images_per_second"])
        entry = {"model": model, "tessera_images_per_second": statistics.median(ours),
                 "pytorch_images_per_second": statistics.median(theirs),
                 "ratio": statistics.median(ours) / statistics.median(theirs),
                 "tessera_runs": ours, "pytorch_runs": theirs,
                 "pytorch_config": {"OPENBLAS_NUM_THREADS": "1", "OMP_WAIT_POLICY": best,
                                    "wait_policy_trials": trials}}
        print(f"{model:13} tessera {entry['tessera_images_per_second']:8.1f}  pytorch "
              f"{entry['pytorch_images_per_second']:8.1f} img/s  ratio {entry['ratio']:.2f}  "
              f"(torch OMP_WAIT_POLICY={best})", file=sys.stderr)
        report["models"].append(entry)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
