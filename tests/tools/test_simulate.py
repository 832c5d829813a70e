#!/usr/bin/env python3
"""Checks tools/tessera-simulate against hand-computed values (docs/simulator.md's equations), its
invariants (no communication on one worker, overlap never beats compute, efficiency never rises
with P) and its refusals of bad input. Standard library only; one line per check; exit 1 on any
failure.

    python3 tests/tools/test_simulate.py
"""
import importlib.machinery
import importlib.util
import json
import math
import os
import random
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "tessera-simulate")
loader = importlib.machinery.SourceFileLoader("tessera_simulate", TOOL)
spec = importlib.util.spec_from_loader("tessera_simulate", loader)
sim = importlib.util.module_from_spec(spec)
loader.exec_module(sim)

failures = []


def check(ok, what, detail=""):
    print(("ok    " if ok else "FAIL  ") + what + ("" if ok else f"\n      {detail}"))
    if not ok:
        failures.append(what)


def close(a, b, rel=1e-12):
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-300)


def network(g=4, ai=1e-5, bi=1e10, ae=5e-5, be=1e9, **extra):
    d = {"name": "test", "workers_per_node": g, "intra": {"alpha_s": ai, "beta_Bps": bi},
         "inter": {"alpha_s": ae, "beta_Bps": be}, **extra}
    return sim.load_network("net.json", data=d)


def profile(layers, forward=0.5, optimizer=0.25, **extra):
    return sim.load_profile("prof.json", data={"batch_per_worker": 32, "forward_s": forward,
                                               "optimizer_s": optimizer, "layers": layers, **extra})


def expect_error(fn, *needles, what):
    try:
        fn()
    except sim.InputError as e:
        msg = str(e)
        check(all(n in msg for n in needles), what, f"message {msg!r} lacks one of {needles}")
        return
    check(False, what, "no InputError raised")


# --- all-reduce equations, hand-computed -------------------------------------------------------
n, a, b = 1e8, 1e-5, 1e10
single = network(g=1024, ai=a, bi=b)
check(close(sim.allreduce_s(single, "ring", 8, n), 2 * 7 * 1e-5 + 2 * 7 / 8 * 1e8 / 1e10),
      "ring: 2(p-1) alpha + 2(p-1)/p n/beta at p=8 (0.01764 s)")
check(close(sim.allreduce_s(single, "ring", 8, n), 0.01764), "ring: p=8, n=1e8 B, alpha=10 us, beta=10 GB/s is 17.64 ms")
check(close(sim.allreduce_s(single, "tree", 8, n), 6 * (1e-5 + 0.01)), "tree: 2 ceil(log2 p)(alpha + n/beta) at p=8")
check(close(sim.allreduce_s(single, "tree", 5, n), 6 * (1e-5 + 0.01)), "tree: ceil(log2 5) = 3 levels")
check(close(sim.allreduce_s(single, "dbtree", 8, n), 6e-5 + 0.02), "double binary tree: 2 ceil(log2 p) alpha + 2 n/beta")
check(close(sim.allreduce_s(single, "halving_doubling", 8, n), 6e-5 + 2 * 7 / 8 * 0.01),
      "halving-doubling: 2 log2(p) alpha + 2(p-1)/p n/beta at p=8")
check(close(sim.allreduce_s(single, "halving_doubling", 6, n), 4e-5 + 2 * 3 / 4 * 0.01 + 2 * (1e-5 + 0.01)),
      "halving-doubling at p=6: the 4-rank core plus a fold-in and fold-out of the whole message")
check(close(sim.allreduce_s(single, "direct", 4, n), 2e-5 + 2 * 3 / 4 * 0.01), "direct: 2 alpha + 2(p-1)/p n/beta")
two = network(g=4, ai=1e-6, bi=2e10, ae=2e-5, be=2.5e9)
# 16 workers on 4 nodes of 4: intra reduce-scatter + all-gather over 4, an inter-node ring over 4 nodes.
hier = 2 * 3 * 1e-6 + 2 * 3 / 4 * 1e8 / 2e10 + 2 * 3 * 2e-5 + 2 * 3 / 4 * 1e8 / 2.5e9
check(close(sim.allreduce_s(two, "hierarchical", 16, n), hier), f"hierarchical, 16 = 4 nodes x 4: {hier * 1e3:.4f} ms")
check(close(sim.allreduce_s(two, "hierarchical", 4, n), 2 * 3 * 1e-6 + 2 * 3 / 4 * 1e8 / 2e10),
      "hierarchical within one node is the intra-node ring")
two_hd = sim.load_network("net.json", data={"workers_per_node": 4, "intra": {"alpha_s": 1e-6, "beta_Bps": 2e10},
                                            "inter": {"alpha_s": 2e-5, "beta_Bps": 2.5e9},
                                            "inter_algorithm": "halving_doubling"})
check(close(sim.allreduce_s(two_hd, "hierarchical", 32, n),
            2 * 3 * 1e-6 + 2 * 3 / 4 * 1e8 / 2e10 + 2 * 3 * 2e-5 + 2 * 7 / 8 * 1e8 / 2.5e9),
      "hierarchical with halving-doubling between 8 nodes")
check(close(sim.allreduce_s(two, "ring", 8, n), 2 * 7 * 2e-5 + 2 * 7 / 8 * 1e8 / 2.5e9),
      "a flat ring across nodes runs at the inter-node link's pace")
check(all(sim.allreduce_s(two, alg, 1, n) == 0 for alg in sim.ALGORITHMS), "P=1: every algorithm costs nothing")
check(abs(sim.expected_max_normal(2) - 1 / math.sqrt(math.pi)) < 1e-6, "E[max of 2 standard normals] = 1/sqrt(pi)")

# --- DataParallel's buckets and timeline ---------------------------------------------------------
lenet = [40, 3360, 336, 40320, 480, 192000, 64, 9600, 24, 600]  # fc3.bias .. conv1.weight, visiting order
plan = sim.bucket_plan(lenet, 1024, 1024)
check(plan == [[0], [1], [2], [3], [4], [5], [6], [7], [8, 9]],
      "bucket plan = data_parallel.hpp's: LeNet-5 at 1 KiB gives the 9 buckets of example 04's trace", str(plan))
check(sim.bucket_plan(lenet, 25 << 20, 1 << 20) == [list(range(10))], "LeNet-5 at the defaults: one bucket")
check(sim.bucket_plan([600, 600, 600, 600], 1500, 1000) == [[0], [1, 2], [3]],
      "the first bucket is capped by first_bucket_bytes, the others by bucket_bytes")

# Two layers of 1 s backward, 10 B each, one bucket each; ring on 2 ranks: 2(1)/2 n/beta.
prof2 = profile([{"name": "b", "backward_s": 1.0, "grad_bytes": 10}, {"name": "a", "backward_s": 1.0, "grad_bytes": 10}])
net10 = network(g=8, ai=0.0, bi=10.0)
r = sim.simulate_dp(prof2, net10, 2, "ring", bucket_bytes=10, first_bucket_bytes=10)
# bucket 0 launches at 1 s, done at 2; backward ends at 2; the last (10 B + 4 B flag) runs 2 .. 3.4.
check(close(r["step_s"], 0.5 + 3.4 + 0.25) and close(r["comm_exposed_s"], 1.4) and close(r["comm_s"], 2.4),
      "timeline: bucket 0 hidden behind layer 2, the last bucket (with its flag) exposed: step 4.15 s", str(r))
r = sim.simulate_dp(prof2, network(g=8, ai=0.0, bi=5.0), 2, "ring", bucket_bytes=10, first_bucket_bytes=10)
check(close(r["step_s"], 0.5 + 1 + 2 + 2.8 + 0.25),
      "timeline: the last bucket waits for the one before it on the communication thread (6.55 s)", str(r))
r = sim.simulate_dp(prof2, network(g=8, ai=0.0, bi=10.0, copy_Bps=20.0), 2, "ring", bucket_bytes=10,
                    first_bucket_bytes=10)
# packing on the compute thread: 0.5 s after layer 1, 0.7 s in finish(); unpacking 24 B / 20 = 1.2 s after.
check(close(r["step_s"], 0.5 + (1 + 0.5 + 1 + 0.7 + 1.4) + 1.2 + 0.25), "timeline: packing delays backward, unpacking the step",
      str(r))
r1 = sim.simulate_dp(prof2, net10, 1, "ring")
check(r1["comm_s"] == 0 and r1["exposed_s"] == 0 and close(r1["step_s"], 2.75), "P=1: no DataParallel, no communication")

rng = random.Random(18)
worst = math.inf
for trial in range(200):
    layers = [{"name": f"l{i}", "backward_s": rng.uniform(0, 0.02), "grad_bytes": rng.choice([0, 1, 10 ** rng.randint(2, 8)])}
              for i in range(rng.randint(1, 30))]
    layers[0]["backward_s"] += 1e-3
    p_ = profile(layers, forward=rng.uniform(0, 0.01), optimizer=rng.uniform(0, 0.01))
    net = network(g=rng.choice([1, 2, 4, 8]), ai=10 ** rng.uniform(-7, -4), bi=10 ** rng.uniform(7, 11),
                  ae=10 ** rng.uniform(-6, -3), be=10 ** rng.uniform(7, 10), copy_Bps=10 ** rng.uniform(8, 11),
                  collective_overhead_s=rng.uniform(0, 1e-4))
    bb = rng.choice([1 << 10, 1 << 20, 25 << 20])
    for alg in sim.ALGORITHMS:
        for p in sim.DEFAULT_WORKERS:
            r = sim.simulate_dp(p_, net, p, alg, bb, min(bb, 1 << 20), jitter=rng.choice([0.0, 0.05]))
            bare = p_["forward_s"] + sum(l["backward_s"] for l in p_["layers"]) + p_["optimizer_s"]
            worst = min(worst, r["step_s"] - max(r["compute_s"], bare))
check(worst >= -1e-15, "overlap never makes a step shorter than its compute (200 random profiles x networks)",
      f"step - compute = {worst}")

ok, detail = True, ""
for trial in range(100):
    layers = [{"name": f"l{i}", "backward_s": rng.uniform(1e-4, 0.02), "grad_bytes": 10 ** rng.randint(3, 8)}
              for i in range(rng.randint(1, 20))]
    p_ = profile(layers, threads_per_worker=rng.choice([1, 2]))
    net = network(g=rng.choice([1, 2, 4, 8]), ai=10 ** rng.uniform(-7, -4), bi=10 ** rng.uniform(9, 11),
                  ae=10 ** rng.uniform(-6, -4), be=10 ** rng.uniform(7, 9),
                  **({"cpu_cores_per_node": 2, "comm_uses_cpu": True} if trial % 3 == 0 else {}))
    for alg in sim.ALGORITHMS:
        eff = [r["efficiency"] for r in sim.dp_rows(p_, net, sim.DEFAULT_WORKERS, [alg], type("A", (), {
            "baseline": 1, "bucket_bytes": 25 << 20, "first_bucket_bytes": 1 << 20, "jitter": 0.03})())]
        if any(e2 > e1 * (1 + 1e-12) for e1, e2 in zip(eff, eff[1:])):
            ok, detail = False, f"{alg}: {eff}"
check(ok, "efficiency is non-increasing in P = 1, 2, 4, ..., 1024 (100 random networks, every algorithm)", detail)
# A measured co-run slowdown replaces the time-sharing estimate for that many workers on a node.
p_ = profile([{"name": "a", "backward_s": 0.01, "grad_bytes": 4096}], threads_per_worker=1)
net = network(g=4, cpu_cores_per_node=2, compute_slowdown={"2": 1.1, "4": 2.3})
check(close(sim.compute_scale(p_, net, 2), 1.1) and close(sim.compute_scale(p_, net, 4), 2.3)
      and close(sim.compute_scale(p_, network(g=4, cpu_cores_per_node=2), 4), 2.0),
      "compute_slowdown (measured) replaces p x threads / cores for its worker counts",
      f"{sim.compute_scale(p_, net, 2)}, {sim.compute_scale(p_, net, 4)}")
check(close(sim.simulate_dp(p_, net, 4, "ring")["compute_s"], (0.5 + 0.01 + 0.25) * 2.3),
      "compute_slowdown scales a step's compute")
expect_error(lambda: network(compute_slowdown={"two": 1.1}), "net.json", "compute_slowdown", "'two'",
             what="bad input: a compute_slowdown key that is not a worker count")
expect_error(lambda: network(compute_slowdown={"2": -1}), "net.json", "compute_slowdown.2",
             what="bad input: a negative compute_slowdown")
for f in ("goyal_bigbasin_50gbe", "horovod_pascal_25gbe", "loopback_gloo", "loopback_mpi", "loopback_threads",
          "netns_tbf_100mbit"):
    path = os.path.join(ROOT, "tools", "simulator", f + ".json")
    net = sim.load_network(path)
    prof = sim.load_profile(os.path.join(ROOT, "tools", "simulator", "goyal_resnet50.json"))
    eff = [sim.simulate_dp(prof, net, 1, "ring")["step_s"] / sim.simulate_dp(prof, net, p, net["algorithm"])["step_s"]
           for p in sim.DEFAULT_WORKERS if p <= net["workers_per_node"] or net["inter"]]
    check(all(e2 <= e1 for e1, e2 in zip(eff, eff[1:])), f"efficiency non-increasing on tools/simulator/{f}.json")

# --- pipeline and tensor parallelism -------------------------------------------------------------
even = profile([{"name": f"l{i}", "backward_s": 0.2, "forward_s": 0.1, "grad_bytes": 100, "activation_bytes": 0}
                for i in range(8)], optimizer=0.0)
free = network(g=8, ai=0.0, bi=1e30)
for p, m in ((1, 4), (2, 4), (4, 8), (8, 1)):
    r = sim.simulate_pipeline(even, free, p, m, "1f1b")
    check(close(r["step_s"], (m + p - 1) / m * 2.4 / p) and close(r["bubble_ideal"], (p - 1) / (m + p - 1))
          and abs(r["idle"] - r["bubble_ideal"]) < 1e-12,
          f"pipeline p={p}, m={m}, balanced, free links: step (m+p-1)/m x compute/p, idle = (p-1)/(m+p-1)")
check(close(sim.simulate_pipeline(even, free, 4, 8, "gpipe")["step_s"], 11 / 8 * 0.6), "GPipe = 1F1B in time on balanced stages")
check(sim.partition([1, 1, 1, 1, 4], 2) == [0, 4], "stage split minimizes the largest stage")
act = profile([{"name": f"l{i}", "backward_s": 0.2, "forward_s": 0.1, "grad_bytes": 100, "activation_bytes": 800}
               for i in range(4)], optimizer=0.0)
r = sim.simulate_pipeline(act, network(g=8, ai=1e-3, bi=1e4), 2, 4, "1f1b")
send = 1e-3 + 800 / 4 / 1e4  # one boundary, a micro-batch's activation: 21 ms
check(close(r["step_s"], 2 * 0.15 + 2 * send + 3 * 0.15), "pipeline p2p: alpha + (activation/m)/beta on fill and drain", str(r))
r = sim.simulate_pipeline(act, network(g=8, ai=1e-3, bi=1e3), 2, 4, "1f1b")
send = 1e-3 + 800 / 4 / 1e3  # 201 ms: longer than a stage's slot, so the link sets the pace
check(close(r["step_s"], 2 * 0.15 + 2 * send + 3 * send), "pipeline: a link slower than the stages sets the slot", str(r))
r = sim.simulate_tp(act, network(g=8, ai=1e-3, bi=1e4), 2, 2)
tp_comm = 4 * (2 + 2) * (2 * 1e-3 + 800 / 1e4)  # 4 layers x (2 fwd + 2 bwd) ring all-reduces on 2 ranks
check(close(r["comm_s"], tp_comm) and close(r["step_s"], 1.2 / 2 + tp_comm), "tensor parallel: 2+2 all-reduces per layer")
check(sim.simulate_tp(act, free, 1, 2)["comm_s"] == 0, "tensor parallel on 1 worker: no communication")

# --- bad input -----------------------------------------------------------------------------------
good_layer = {"name": "x", "backward_s": 1.0, "grad_bytes": 4}
expect_error(lambda: sim.load_profile("p.json", data={"forward_s": 1, "optimizer_s": 0, "layers": [good_layer]}),
             "p.json", "batch_per_worker", what="profile without batch_per_worker: names the file and field")
expect_error(lambda: profile([{"name": "x", "backward_s": 1.0}]), "prof.json", "layers[0].grad_bytes",
             what="layer without grad_bytes: names layers[0].grad_bytes")
expect_error(lambda: profile([{"name": "x", "backward_s": -1.0, "grad_bytes": 4}]), "layers[0].backward_s", ">= 0",
             what="negative backward time refused")
expect_error(lambda: profile([{"name": "x", "backward_s": 1.0, "grad_bytes": 4, "param_bytes": [1, 2]}]),
             "layers[0].param_bytes", "grad_bytes", what="param_bytes that do not sum to grad_bytes refused")
expect_error(lambda: network(be=-1e9), "net.json", "inter.beta_Bps", what="negative bandwidth: names inter.beta_Bps")
expect_error(lambda: network(bi=0), "intra.beta_Bps", "> 0", what="zero bandwidth refused")
expect_error(lambda: sim.load_network("n.json", data={"workers_per_node": 2}), "n.json", "intra",
             what="network without intra: names the field")
expect_error(lambda: sim.load_network("n.json", data={"workers_per_node": 2, "algorithm": "butterfly",
                                                      "intra": {"alpha_s": 0, "beta_Bps": 1}}),
             "n.json", "algorithm", "butterfly", what="unknown algorithm in the network file: named")
expect_error(lambda: sim.allreduce_s(sim.load_network("n.json", data={"workers_per_node": 2,
                                                                      "intra": {"alpha_s": 0, "beta_Bps": 1}}),
                                     "ring", 4, 100), "n.json", "inter", "workers_per_node=2",
             what="workers beyond one node without 'inter': names the field and the node size")
expect_error(lambda: sim.simulate_tp(prof2, net10, 2, 2), "activation_bytes", what="tensor parallel without activation sizes")

with tempfile.TemporaryDirectory() as tmp:
    bad = os.path.join(tmp, "bad_net.json")
    with open(bad, "w") as f:
        json.dump({"workers_per_node": 4, "intra": {"alpha_s": 1e-6, "beta_Bps": -5}}, f)
    prof_path = os.path.join(ROOT, "tools", "simulator", "goyal_resnet50.json")
    done = subprocess.run([sys.executable, TOOL, "dp", "--profile", prof_path, "--network", bad],
                          capture_output=True, text=True)
    check(done.returncode == 2 and "bad_net.json" in done.stderr and "intra.beta_Bps" in done.stderr
          and "Traceback" not in done.stderr, "CLI: negative bandwidth exits 2 naming the file and field", done.stderr)
    done = subprocess.run([sys.executable, TOOL, "dp", "--profile", prof_path, "--network",
                           os.path.join(ROOT, "tools", "simulator", "goyal_bigbasin_50gbe.json"), "--algorithm", "magic"],
                          capture_output=True, text=True)
    check(done.returncode == 2 and "magic" in done.stderr and "ring" in done.stderr,
          "CLI: unknown --algorithm exits 2 listing the known ones", done.stderr)
    done = subprocess.run([sys.executable, TOOL, "dp", "--profile", os.path.join(tmp, "absent.json"), "--network",
                           os.path.join(ROOT, "tools", "simulator", "goyal_bigbasin_50gbe.json")],
                          capture_output=True, text=True)
    check(done.returncode == 2 and "absent.json" in done.stderr and "Traceback" not in done.stderr,
          "CLI: a missing file exits 2 naming it", done.stderr)

    # profile: a made-up trace of 3 layers (c, b, a in backward order), 1 KiB buckets.
    params = [("a.weight", 2048), ("a.bias", 8), ("b.weight", 4096), ("c.weight", 1600)]
    header, off = {}, 0
    for name, size in params:
        header[name] = {"dtype": "F32", "shape": [size // 4], "data_offsets": [off, off + size]}
        off += size
    for name, size in params:
        header["optim.momentum_buffer." + name] = {"dtype": "F32", "shape": [size // 4], "data_offsets": [off, off + size]}
        off += size
    blob = json.dumps(header).encode()
    ckpt = os.path.join(tmp, "c.safetensors")
    with open(ckpt, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + bytes(off))
    events, t = [], 0.0
    for step in range(5):  # 4 KiB buckets: [c.weight], [b.weight], [a.bias, a.weight]
        events += [{"name": "forward", "ph": "X", "ts": t, "dur": 100.0, "pid": 0, "tid": 0},
                   {"name": "backward", "ph": "X", "ts": t + 100, "dur": 600.0, "pid": 0, "tid": 0},
                   {"name": "all_reduce bucket 0 (1 KiB)", "ph": "X", "ts": t + 100 + 100, "dur": 1, "pid": 0, "tid": 1},
                   {"name": "all_reduce bucket 1 (4 KiB)", "ph": "X", "ts": t + 100 + 300, "dur": 1, "pid": 0, "tid": 1},
                   {"name": "all_reduce bucket 2 (2 KiB)", "ph": "X", "ts": t + 700, "dur": 1, "pid": 0, "tid": 1},
                   {"name": "optimizer step", "ph": "X", "ts": t + 710, "dur": 10.0, "pid": 0, "tid": 0}]
        t += 1000
    trace = os.path.join(tmp, "t.json")
    with open(trace, "w") as f:
        json.dump({"traceEvents": events}, f)
    prof = sim.profile_from_trace(trace, ckpt, 4, 16, 1, "made up")
    got = [(l["name"], round(l["backward_s"] * 1e6, 6), l["grad_bytes"]) for l in prof["layers"]]
    check(got == [("c", 100.0, 1600), ("b", 200.0, 4096), ("a", 300.0, 2056)]
          and close(prof["forward_s"], 1e-4) and close(prof["optimizer_s"], 1e-5),
          "profile: per-layer backward from bucket launch times, gradient bytes from the checkpoint", str(got))
    expect_error(lambda: sim.profile_from_trace(trace, ckpt, 1, 16, 1, "x"), "--bucket-kib",
                 what="profile: a trace whose bucket count disagrees asks for the run's --bucket-kib")

print(f"\n{len(failures)} failed" if failures else "\nall checks passed")
sys.exit(1 if failures else 0)
