"""Tessera vs PyTorch: ResNet-50 inference images/s (eval mode, no grad) and the peak memory of one
ResNet-50 training step (issue 17, item 4).

    /usr/bin/python3 bench/compare_inference.py --tessera build/bench/inference_throughput --threads 2 --runs 3

Inference, per batch size (--batches, default 1,8): the PyTorch configuration is probed as
compare_pytorch.py does (bench/peer.py: OpenBLAS selected, one OpenBLAS thread, each malloc setting,
OMP_WAIT_POLICY and OPENBLAS_CORETYPE tried once, the fastest kept); PyTorch reports the faster of torch.no_grad()
and torch.inference_mode() and which one it was. Then Tessera and PyTorch runs alternate --runs
times; the ratio is of the medians (goal >= 1.5, issue 52; 1.3 before it). Tessera's OpenBLAS core
type is chosen per batch the same way (the shell's, 'unset', then each other candidate, once), then its idle spin
(KMP_BLOCKTIME=1 against the OpenMP runtime's default, two runs each; peer.choose_tessera_config).

Memory (--memory-batch, default 32): each run is one SGD training step in a fresh process of each
framework, alternating, --runs times, PyTorch with the configuration chosen for the largest
inference batch. Each process reads VmHWM (/proc/self/status) at start (after the framework is
loaded), after model + optimizer + batch creation, and after the step. Three ratios (Tessera /
PyTorch, goal <= 0.8), of the medians:
  - "training_footprint": peak minus start: everything the training step needs (parameters,
    gradients, optimizer state, the batch, activations, workspaces), without the framework's own
    code and runtime. The headline number: it does not depend on when a framework allocates
    gradients (Tessera at construction, PyTorch in the first backward).
  - "step_growth": peak minus the after-creation baseline. Favours Tessera by the gradients
    (~100 MB), which it allocates with the model: recorded as asked, not the headline.
  - "absolute": the process's VmHWM, runtime included (libtorch and Python are larger than
    Tessera's binary).
Prints one JSON object (stdout).
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
MIB = 2 ** 20


def run_tessera(binary, args, env=None):
    out = subprocess.run([binary] + args, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(f"{binary} {' '.join(args)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


def run_torch(env, args):
    out = peer.run_child(["/usr/bin/python3", os.path.join(HERE, "torch_inference.py")] + args, env)
    return json.loads(out)


def memory_metrics(r):
    return {"absolute": r["vmhwm_after_step_bytes"],
            "training_footprint": r["vmhwm_after_step_bytes"] - r["vmhwm_start_bytes"],
            "step_growth": r["vmhwm_step_growth_bytes"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tessera", default="build/bench/inference_throughput")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--memory-batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--output", default="", help="also write the JSON here")
    peer.add_arguments(ap)
    args = ap.parse_args()
    if args.runs < 1:
        sys.exit("compare_inference.py: --runs must be >= 1")
    setup = peer.peer_or_exit(args.coretypes)
    threads = str(args.threads)
    report = {"cpu": cpu_model(), "cpu_details": cpu_details(), "threads": args.threads, "runs": args.runs,
              "pytorch_blas": setup.blas,
              "inference": [], "memory": None}

    best = {"OPENBLAS_CORETYPE": peer.UNSET, "OMP_WAIT_POLICY": peer.UNSET}
    tessera_env = None  # the memory runs use the last batch's choice, as the peer does
    for batch in (int(b) for b in args.batches.split(",")):
        torch_args = ["--batches", str(batch), "--threads", threads]

        def probe(coretype, policy, malloc):
            r = run_torch(setup.env(coretype, policy, malloc), torch_args)
            return r["results"][0]["images_per_second"], r["peer"]["openblas"].get("corename")

        best, trials = peer.choose_config(probe, setup.candidates)
        tessera_args = [f"--batches={batch}", f"--threads={threads}"]

        def probe_tessera(env):
            t = run_tessera(args.tessera, tessera_args, env)
            return t["results"][0]["images_per_second"], t.get("gemm", "?")

        tessera_best, tessera_trials, tessera_env = peer.choose_tessera_config(probe_tessera, setup.candidates)
        ours, theirs, contexts, child, tessera_last, torch_last = [], [], [], None, None, None
        for _ in range(args.runs):
            tessera_last = run_tessera(args.tessera, tessera_args, tessera_env)["results"][0]
            ours.append(tessera_last["images_per_second"])
            r = run_torch(setup.env_of(best), torch_args)
            torch_last = r["results"][0]
            theirs.append(torch_last["images_per_second"])
            contexts.append(torch_last["context"])
            child = {**r["peer"], "conv_kernels": torch_last.get("conv_kernels", [])}
        entry = {"model": "resnet50", "mode": "inference (eval, forward only)", "batch": batch,
                 "tessera_images_per_second": statistics.median(ours),
                 "pytorch_images_per_second": statistics.median(theirs),
                 "ratio": statistics.median(ours) / statistics.median(theirs), "goal": ">= 1.5",
                 "tessera_runs": ours, "pytorch_runs": theirs, "pytorch_context_per_run": contexts,
                 "pytorch_contexts_last_run": torch_last["contexts"],
                 "tessera_allocations_in_timed_forwards_last_run": tessera_last["allocations_in_timed_forwards"],
                 "logits_finite": {"tessera": tessera_last["logits_finite"], "pytorch": torch_last["logits_finite"]},
                 "tessera_config": peer.tessera_record(tessera_best, tessera_trials),
                 "pytorch_config": setup.record(best, trials, child)}
        entry["meets_goal"] = entry["ratio"] >= 1.5
        print(f"resnet50 eval b{batch:<3} tessera {entry['tessera_images_per_second']:8.1f}  pytorch "
              f"{entry['pytorch_images_per_second']:8.1f} img/s  ratio {entry['ratio']:.2f}  (tessera "
              f"OPENBLAS_CORETYPE={tessera_best['OPENBLAS_CORETYPE']} KMP_BLOCKTIME={tessera_best['KMP_BLOCKTIME']}; torch "
              f"{'/'.join(sorted(set(contexts)))}, OMP_WAIT_POLICY={best['OMP_WAIT_POLICY']} "
              f"OPENBLAS_CORETYPE={best['OPENBLAS_CORETYPE']} malloc={best['malloc']})", file=sys.stderr)
        report["inference"].append(entry)

    if args.memory_batch > 0:
        ours, theirs, child, tessera_runs = [], [], None, []
        for _ in range(args.runs):
            t = run_tessera(args.tessera, ["--memory", f"--batch={args.memory_batch}", f"--threads={threads}"],
                            tessera_env)
            tessera_runs.append(t)
            ours.append(memory_metrics(t))
            # glibc's default malloc: retaining freed memory (a timing setting) could only raise the peak.
            r = run_torch(setup.env(best["OPENBLAS_CORETYPE"], best["OMP_WAIT_POLICY"]),
                          ["--memory", "--batch", str(args.memory_batch), "--threads", threads])
            child = r.pop("peer")
            theirs.append({**memory_metrics(r), "raw": r})
        metrics = {}
        for key in ("training_footprint", "absolute", "step_growth"):
            a = statistics.median(m[key] for m in ours)
            b = statistics.median(m[key] for m in theirs)
            metrics[key] = {"tessera_bytes": a, "pytorch_bytes": b, "tessera_mib": a / MIB, "pytorch_mib": b / MIB,
                            "ratio": a / b, "goal": "<= 0.8", "meets_goal": a / b <= 0.8}
            print(f"resnet50 b{args.memory_batch} train step peak memory [{key}]  tessera {a / MIB:8.1f} MiB  "
                  f"pytorch {b / MIB:8.1f} MiB  ratio {a / b:.2f}", file=sys.stderr)
        report["memory"] = {
            "model": "resnet50", "batch": args.memory_batch, "what": "one SGD(momentum) training step, fresh process",
            "headline": "training_footprint", "metrics": metrics,
            "tessera_allocator_peak_bytes_median": statistics.median(t["allocator_peak_bytes"] for t in tessera_runs),
            "tessera_runs": tessera_runs, "pytorch_runs": [t["raw"] for t in theirs],
            "pytorch_config": setup.record({**best, "malloc": peer.MALLOC_DEFAULT}, [], child)}

    text = json.dumps(report, indent=1)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
