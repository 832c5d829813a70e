"""Tessera's float32 convolutions against PyTorch 1.13's (oneDNN) layer by layer: where a network's
training time goes, shape by shape, forward and backward.

    /usr/bin/python3 bench/compare_conv_layers.py --build build [--model resnet50] [--batch 0] \\
        [--threads 2] [--runs 7] [--rounds 3] [--out FILE]

build/bench/conv_layers times each distinct convolution of the model (its JSON names the shapes);
bench/torch_conv_layers.py times the same shapes with torch.nn.Conv2d. Both sides are set up at
their best as compare_pytorch.py sets them (bench/peer.py: the peer's malloc, OpenMP wait policy
and OpenBLAS core type probed, Tessera's core type and idle spin probed; each probe one run with --runs 3, scored
by the total time), then --rounds rounds alternate one process of each, so machine noise hits both
alike. Per layer and pass, the median over the rounds of each process's median; "speedup" is
PyTorch's time over Tessera's. Writes one JSON object naming the CPU (bench/out/ unless --out).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer  # noqa: E402
from bench_common import cpu_details, cpu_model, default_result, write_result  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPE_KEYS = ("in", "out", "size", "kernel", "stride", "pad", "count")


def run_tessera(binary, model, batch, threads, runs, env=None):
    out = subprocess.run([binary, f"--model={model}", f"--batch={batch}", f"--threads={threads}", f"--runs={runs}"],
                         check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out)


def run_torch(env, shapes, batch, threads, runs):
    out = peer.run_child(["/usr/bin/python3", os.path.join(HERE, "torch_conv_layers.py"), "--shapes",
                          json.dumps(shapes), "--batch", str(batch), "--threads", str(threads), "--runs", str(runs)], env)
    return json.loads(out)


def total_ms(report):
    return report["total_ms"]["forward"] + report["total_ms"]["backward"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--model", default="resnet50", choices=["resnet50", "resnet20", "lenet"])
    ap.add_argument("--batch", type=int, default=0, help="0: the model's (ResNet-50 8, the others 64)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=7, help="timed passes per layer in each process")
    ap.add_argument("--rounds", type=int, default=3, help="alternating processes of each side")
    ap.add_argument("--out", default=default_result("conv_layers"))
    peer.add_arguments(ap)
    args = ap.parse_args()
    if args.runs < 1 or args.rounds < 1 or args.threads < 1 or args.batch < 0:
        sys.exit("compare_conv_layers.py: --runs, --rounds and --threads must be at least 1, --batch at least 0")
    binary = os.path.join(args.build, "bench", "conv_layers")
    if not os.path.exists(binary):
        sys.exit(f"compare_conv_layers.py: {binary} not found (build it: ninja -C {args.build} bench/conv_layers)")
    setup = peer.peer_or_exit(args.coretypes)

    first = run_tessera(binary, args.model, args.batch, args.threads, 1)
    batch = first["batch"]
    shapes = [[layer[k] for k in SHAPE_KEYS] for layer in first["layers"]]

    def probe_torch(coretype, policy, malloc):
        r = run_torch(setup.env(coretype, policy, malloc), shapes, batch, args.threads, 3)
        return 1e3 / total_ms(r), r["peer"]["openblas"].get("corename")

    best, trials = peer.choose_config(probe_torch, setup.candidates)

    def probe_tessera(env):
        t = run_tessera(binary, args.model, batch, args.threads, 3, env=env)
        return 1e3 / total_ms(t), t["gemm"]

    tessera_best, tessera_trials, tessera_env = peer.choose_tessera_config(probe_tessera, setup.candidates)
    ours, theirs, child = [], [], None
    for _ in range(args.rounds):
        ours.append(run_tessera(binary, args.model, batch, args.threads, args.runs, env=tessera_env))
        r = run_torch(setup.env_of(best), shapes, batch, args.threads, args.runs)
        theirs.append(r)
        child = r["peer"]

    def med(reports, i, key):
        return statistics.median(rep["layers"][i][key] for rep in reports)

    layers, totals = [], {"tessera": {"forward": 0.0, "backward": 0.0}, "pytorch": {"forward": 0.0, "backward": 0.0}}
    print(f"{'C K size kxk/stride x count':28} {'Tessera fwd':>11} {'bwd':>8} {'PyTorch fwd':>11} {'bwd':>8} "
          f"{'speedup fwd':>11} {'bwd':>6}", file=sys.stderr)
    for i, shape in enumerate(shapes):
        entry = dict(zip(SHAPE_KEYS, shape))
        for side, reports in (("tessera", ours), ("pytorch", theirs)):
            for p in ("forward", "backward"):
                entry[f"{side}_{p}_ms"] = med(reports, i, f"{p}_ms")
                totals[side][p] += entry[f"{side}_{p}_ms"] * shape[6]
        for p in ("forward", "backward"):
            entry[f"speedup_{p}"] = entry[f"pytorch_{p}_ms"] / entry[f"tessera_{p}_ms"]
        layers.append(entry)
        print(f"{shape[0]:4} {shape[1]:4} {shape[2]:3} {shape[3]}x{shape[3]}/{shape[4]} x{shape[6]:<10} "
              f"{entry['tessera_forward_ms']:11.2f} {entry['tessera_backward_ms']:8.2f} {entry['pytorch_forward_ms']:11.2f} "
              f"{entry['pytorch_backward_ms']:8.2f} {entry['speedup_forward']:11.2f} {entry['speedup_backward']:6.2f}",
              file=sys.stderr)
    speedup = {p: totals["pytorch"][p] / totals["tessera"][p] for p in ("forward", "backward")}
    speedup["both"] = sum(totals["pytorch"].values()) / sum(totals["tessera"].values())
    print(f"{'total (ms, x count)':28} {totals['tessera']['forward']:11.1f} {totals['tessera']['backward']:8.1f} "
          f"{totals['pytorch']['forward']:11.1f} {totals['pytorch']['backward']:8.1f} {speedup['forward']:11.2f} "
          f"{speedup['backward']:6.2f}  (both {speedup['both']:.2f})", file=sys.stderr)
    write_result({"benchmark": "compare_conv_layers", "cpu": cpu_model(), "cpu_details": cpu_details(),
                  "model": args.model, "batch": batch, "threads": args.threads, "runs": args.runs,
                  "rounds": args.rounds, "total_ms": totals, "speedup": speedup, "layers": layers,
                  "tessera_totals_per_round": [total_ms(r) for r in ours],
                  "pytorch_totals_per_round": [total_ms(r) for r in theirs],
                  "tessera_config": peer.tessera_record(tessera_best, tessera_trials),
                  "pytorch_config": setup.record(best, trials, child)}, args.out)


if __name__ == "__main__":
    main()
