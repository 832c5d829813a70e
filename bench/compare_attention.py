"""Tessera's fused attention vs PyTorch 1.13's attention written as matmul, mask, softmax, matmul
(issue 48): time at one sequence length and the extra memory at several.

    /usr/bin/python3 bench/compare_attention.py --tessera build/bench/attention --threads 2 --runs 5

Time (--t, default 1024; B 1, 12 heads of 64, causal): the PyTorch configuration is probed as
compare_inference.py does (bench/peer.py: OpenBLAS selected and checked, one OpenBLAS thread, each
malloc setting, OMP_WAIT_POLICY and OPENBLAS_CORETYPE tried once, the fastest kept), Tessera's
OpenBLAS core type and idle spin likewise (peer.choose_tessera_config). Then Tessera and PyTorch runs alternate
--runs times, each a fresh process timing --steps forward + backward pairs; the ratios (PyTorch time
/ Tessera time) are of the medians, for forward, backward and both (goal: both >= 1.5).

Memory (--memory-ts, default 256,1024,4096): one forward + backward per fresh process, the two
frameworks alternating --memory-runs times per length; "extra" is the VmHWM growth over the inputs
minus the returned out, dq, dk, dv (bench/attention.cpp). Linear in T means extra(4T) / extra(T)
near 4, a (T, T) matrix near 16. The goal recorded: Tessera's extra-memory ratio between the two
longest lengths at most 1.12 times their length ratio (linear, with room for page rounding). The
bytes per query row are printed too. Prints one JSON object (stdout).
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
TIME_GOAL = 1.5


def run_tessera(binary, args, env=None):
    out = subprocess.run([binary] + args, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(f"{binary} {' '.join(args)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


def run_torch(env, args):
    return json.loads(peer.run_child(["/usr/bin/python3", os.path.join(HERE, "torch_attention.py")] + args, env))


def shape_args(t, threads, dash):
    """The shared problem flags, as --t=1024 (Tessera's Flags) or --t 1024 (argparse)."""
    pairs = [("t", t), ("batch", 1), ("heads", 12), ("head-dim", 64), ("threads", threads)]
    return [f"--{k}={v}" for k, v in pairs] if dash else [x for k, v in pairs for x in (f"--{k}", str(v))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tessera", default="build/bench/attention")
    ap.add_argument("--t", type=int, default=1024)
    ap.add_argument("--memory-ts", default="256,1024,4096")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--memory-runs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--output", default="", help="also write the JSON here")
    peer.add_arguments(ap)
    args = ap.parse_args()
    if args.runs < 1 or args.memory_runs < 1:
        sys.exit("compare_attention.py: --runs and --memory-runs must be >= 1")
    setup = peer.peer_or_exit(args.coretypes)
    steps = str(args.steps)
    torch_args = shape_args(args.t, args.threads, False) + ["--steps", steps]
    tessera_args = shape_args(args.t, args.threads, True) + [f"--steps={steps}"]

    def probe(coretype, policy, malloc):
        r = run_torch(setup.env(coretype, policy, malloc), torch_args)
        return 1.0 / r["median_forward_backward_s"], r["peer"]["openblas"].get("corename")

    best, trials = peer.choose_config(probe, setup.candidates)

    def probe_tessera(env):
        r = run_tessera(args.tessera, tessera_args, env)
        return 1.0 / r["median_forward_backward_s"], r.get("gemm", "?")

    tessera_best, tessera_trials, tessera_env = peer.choose_tessera_config(probe_tessera, setup.candidates)
    ours, theirs, child = [], [], None
    for _ in range(args.runs):
        ours.append(run_tessera(args.tessera, tessera_args, tessera_env))
        r = run_torch(setup.env_of(best), torch_args)
        theirs.append(r)
        child = r["peer"]

    def med(runs, key):
        return statistics.median(x[key] for x in runs)

    timing = {"t": args.t, "batch": 1, "heads": 12, "head_dim": 64, "causal": True, "steps": args.steps}
    for part in ("forward", "backward", "forward_backward"):
        key = f"median_{part}_s"
        timing[f"tessera_{part}_s"] = med(ours, key)
        timing[f"pytorch_{part}_s"] = med(theirs, key)
        timing[f"speedup_{part}"] = med(theirs, key) / med(ours, key)
        timing[f"tessera_{part}_runs_s"] = [x[key] for x in ours]
        timing[f"pytorch_{part}_runs_s"] = [x[key] for x in theirs]
    timing["goal"] = f">= {TIME_GOAL} (forward and forward_backward)"
    timing["meets_goal"] = timing["speedup_forward"] >= TIME_GOAL and timing["speedup_forward_backward"] >= TIME_GOAL
    print(f"attention T={args.t}: tessera fwd {timing['tessera_forward_s'] * 1e3:.2f} ms bwd "
          f"{timing['tessera_backward_s'] * 1e3:.2f} ms; pytorch fwd {timing['pytorch_forward_s'] * 1e3:.2f} ms bwd "
          f"{timing['pytorch_backward_s'] * 1e3:.2f} ms; speedup fwd {timing['speedup_forward']:.2f}x "
          f"fwd+bwd {timing['speedup_forward_backward']:.2f}x", file=sys.stderr)

    memory = []
    for t in (int(x) for x in args.memory_ts.split(",")):
        mine, peers = [], []
        for _ in range(args.memory_runs):
            mine.append(run_tessera(args.tessera, shape_args(t, args.threads, True) + ["--memory"], tessera_env))
            peers.append(run_torch(setup.env_of(best), shape_args(t, args.threads, False) + ["--memory"]))
        rows = 12 * t
        entry = {"t": t, "tessera_extra_bytes": med(mine, "extra_bytes"), "pytorch_extra_bytes": med(peers, "extra_bytes"),
                 "tessera_extra_runs": [x["extra_bytes"] for x in mine],
                 "pytorch_extra_runs": [x["extra_bytes"] for x in peers],
                 "finite": all(x["finite"] for x in mine + peers)}
        entry["tessera_bytes_per_query_row"] = entry["tessera_extra_bytes"] / rows
        entry["pytorch_bytes_per_query_row"] = entry["pytorch_extra_bytes"] / rows
        memory.append(entry)
        print(f"attention T={t}: extra memory tessera {entry['tessera_extra_bytes'] / 2**20:.2f} MiB "
              f"({entry['tessera_bytes_per_query_row']:.0f} B/row), pytorch {entry['pytorch_extra_bytes'] / 2**20:.1f} "
              f"MiB ({entry['pytorch_bytes_per_query_row']:.0f} B/row)", file=sys.stderr)
    growth = None
    if len(memory) >= 2:
        a, b = memory[-2], memory[-1]
        length_ratio = b["t"] / a["t"]
        growth = {"from_t": a["t"], "to_t": b["t"], "length_ratio": length_ratio,
                  "tessera_extra_ratio": b["tessera_extra_bytes"] / max(a["tessera_extra_bytes"], 1),
                  "pytorch_extra_ratio": b["pytorch_extra_bytes"] / max(a["pytorch_extra_bytes"], 1),
                  "goal": "tessera_extra_ratio <= 1.12 x length_ratio (linear in T)"}
        growth["meets_goal"] = growth["tessera_extra_ratio"] <= 1.12 * length_ratio

    report = {"bench": "attention", "cpu": cpu_model(), "cpu_details": cpu_details(), "threads": args.threads,
              "runs": args.runs, "time": timing, "memory": memory, "memory_growth": growth,
              "tessera_config": peer.tessera_record(tessera_best, tessera_trials),
              "pytorch_config": setup.record(best, trials, child)}
    text = json.dumps(report, indent=1)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
