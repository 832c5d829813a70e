"""tools/tessera-simulate against hand-computed values (docs/simulator.md's equations), its
invariants (no communication on one worker, overlap never beats compute, efficiency never rises
with P) and its refusals of bad input.

    python3 -m pytest -q tests/tools/test_simulate.py
"""
from __future__ import annotations

import json
import math
import pathlib
import random
import struct
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from conftest import ROOT
from tessera_tools.simulate import collectives, data_parallel, inputs, measure, model_parallel, schedules
from tessera_tools.simulate.data_parallel import DpOptions
from tessera_tools.simulate.inputs import ALGORITHMS, DEFAULT_WORKERS, InputError, Network, Profile

TOOL = ROOT / "tools" / "tessera-simulate"
SIMULATOR = ROOT / "tools" / "simulator"


def close(a: float, b: float, rel: float = 1e-12) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-300)


def network(g: int = 4, ai: float = 1e-5, bi: float = 1e10, ae: float = 5e-5, be: float = 1e9,
            **extra: Any) -> Network:
    d = {"name": "test", "workers_per_node": g, "intra": {"alpha_s": ai, "beta_Bps": bi},
         "inter": {"alpha_s": ae, "beta_Bps": be}, **extra}
    return inputs.load_network("net.json", data=d)


def profile(layers: list[dict[str, Any]], forward: float = 0.5, optimizer: float = 0.25, **extra: Any) -> Profile:
    return inputs.load_profile("prof.json", data={"batch_per_worker": 32, "forward_s": forward,
                                                  "optimizer_s": optimizer, "layers": layers, **extra})


def expect_error(fn: Callable[[], object], *needles: str) -> None:
    """fn raises InputError whose message holds every needle."""
    with pytest.raises(InputError) as caught:
        fn()
    message = str(caught.value)
    assert all(n in message for n in needles), f"message {message!r} lacks one of {needles}"


# --- all-reduce equations, hand-computed -------------------------------------------------------

N, A, B = 1e8, 1e-5, 1e10


def test_flat_algorithms_hand_computed() -> None:
    single = network(g=1024, ai=A, bi=B)
    allreduce_s = collectives.allreduce_s
    # ring: 2(p-1) alpha + 2(p-1)/p n/beta at p=8 (0.01764 s)
    assert close(allreduce_s(single, "ring", 8, N), 2 * 7 * 1e-5 + 2 * 7 / 8 * 1e8 / 1e10)
    # ring: p=8, n=1e8 B, alpha=10 us, beta=10 GB/s is 17.64 ms
    assert close(allreduce_s(single, "ring", 8, N), 0.01764)
    # tree: 2 ceil(log2 p)(alpha + n/beta) at p=8; ceil(log2 5) = 3 levels
    assert close(allreduce_s(single, "tree", 8, N), 6 * (1e-5 + 0.01))
    assert close(allreduce_s(single, "tree", 5, N), 6 * (1e-5 + 0.01))
    # double binary tree: 2 ceil(log2 p) alpha + 2 n/beta
    assert close(allreduce_s(single, "dbtree", 8, N), 6e-5 + 0.02)
    # halving-doubling: 2 log2(p) alpha + 2(p-1)/p n/beta at p=8
    assert close(allreduce_s(single, "halving_doubling", 8, N), 6e-5 + 2 * 7 / 8 * 0.01)
    # halving-doubling at p=6: the 4-rank core plus a fold-in and fold-out of the whole message
    assert close(allreduce_s(single, "halving_doubling", 6, N), 4e-5 + 2 * 3 / 4 * 0.01 + 2 * (1e-5 + 0.01))
    # direct: 2 alpha + 2(p-1)/p n/beta
    assert close(allreduce_s(single, "direct", 4, N), 2e-5 + 2 * 3 / 4 * 0.01)


def test_hierarchical_and_across_nodes() -> None:
    two = network(g=4, ai=1e-6, bi=2e10, ae=2e-5, be=2.5e9)
    # 16 workers on 4 nodes of 4: intra reduce-scatter + all-gather over 4, an inter-node ring over 4 nodes.
    hier = 2 * 3 * 1e-6 + 2 * 3 / 4 * 1e8 / 2e10 + 2 * 3 * 2e-5 + 2 * 3 / 4 * 1e8 / 2.5e9
    assert close(collectives.allreduce_s(two, "hierarchical", 16, N), hier), f"hierarchical: {hier * 1e3:.4f} ms"
    # hierarchical within one node is the intra-node ring
    assert close(collectives.allreduce_s(two, "hierarchical", 4, N), 2 * 3 * 1e-6 + 2 * 3 / 4 * 1e8 / 2e10)
    two_hd = inputs.load_network("net.json", data={"workers_per_node": 4, "intra": {"alpha_s": 1e-6, "beta_Bps": 2e10},
                                                   "inter": {"alpha_s": 2e-5, "beta_Bps": 2.5e9},
                                                   "inter_algorithm": "halving_doubling"})
    # hierarchical with halving-doubling between 8 nodes
    assert close(collectives.allreduce_s(two_hd, "hierarchical", 32, N),
                 2 * 3 * 1e-6 + 2 * 3 / 4 * 1e8 / 2e10 + 2 * 3 * 2e-5 + 2 * 7 / 8 * 1e8 / 2.5e9)
    # a flat ring across nodes runs at the inter-node link's pace
    assert close(collectives.allreduce_s(two, "ring", 8, N), 2 * 7 * 2e-5 + 2 * 7 / 8 * 1e8 / 2.5e9)
    # P=1: every algorithm costs nothing
    assert all(collectives.allreduce_s(two, alg, 1, N) == 0 for alg in ALGORITHMS)


def test_expected_max_of_two_normals() -> None:
    # E[max of 2 standard normals] = 1/sqrt(pi)
    assert abs(collectives.expected_max_normal(2) - 1 / math.sqrt(math.pi)) < 1e-6


# --- DataParallel's buckets and timeline ---------------------------------------------------------

def test_bucket_plan_is_data_parallels() -> None:
    lenet = [40, 3360, 336, 40320, 480, 192000, 64, 9600, 24, 600]  # fc3.bias .. conv1.weight, visiting order
    plan = data_parallel.bucket_plan(lenet, 1024, 1024)
    # LeNet-5 at 1 KiB gives the 9 buckets of example 04's trace
    assert plan == [[0], [1], [2], [3], [4], [5], [6], [7], [8, 9]], str(plan)
    # LeNet-5 at the defaults: one bucket
    assert data_parallel.bucket_plan(lenet, 25 << 20, 1 << 20) == [list(range(10))]
    # the first bucket is capped by first_bucket_bytes, the others by bucket_bytes
    assert data_parallel.bucket_plan([600, 600, 600, 600], 1500, 1000) == [[0], [1, 2], [3]]


# Two layers of 1 s backward, 10 B each, one bucket each; ring on 2 ranks: 2(1)/2 n/beta.
PROF2 = [{"name": "b", "backward_s": 1.0, "grad_bytes": 10}, {"name": "a", "backward_s": 1.0, "grad_bytes": 10}]


def test_dp_timeline() -> None:
    prof2 = profile(PROF2)
    net10 = network(g=8, ai=0.0, bi=10.0)
    r = data_parallel.simulate_dp(prof2, net10, 2, "ring", bucket_bytes=10, first_bucket_bytes=10)
    # bucket 0 launches at 1 s, done at 2; backward ends at 2; the last (10 B + 4 B flag) runs 2 .. 3.4:
    # bucket 0 hidden behind layer 2, the last bucket (with its flag) exposed: step 4.15 s
    assert close(r.step_s, 0.5 + 3.4 + 0.25) and close(r.comm_exposed_s, 1.4) and close(r.comm_s, 2.4), str(r)
    r = data_parallel.simulate_dp(prof2, network(g=8, ai=0.0, bi=5.0), 2, "ring", bucket_bytes=10,
                                  first_bucket_bytes=10)
    # the last bucket waits for the one before it on the communication thread (6.55 s)
    assert close(r.step_s, 0.5 + 1 + 2 + 2.8 + 0.25), str(r)
    r = data_parallel.simulate_dp(prof2, network(g=8, ai=0.0, bi=10.0, copy_Bps=20.0), 2, "ring", bucket_bytes=10,
                                  first_bucket_bytes=10)
    # packing on the compute thread: 0.5 s after layer 1, 0.7 s in finish(); unpacking 24 B / 20 = 1.2 s after
    assert close(r.step_s, 0.5 + (1 + 0.5 + 1 + 0.7 + 1.4) + 1.2 + 0.25), str(r)
    r1 = data_parallel.simulate_dp(prof2, net10, 1, "ring")
    # P=1: no DataParallel, no communication
    assert r1.comm_s == 0 and r1.exposed_s == 0 and close(r1.step_s, 2.75)


def overlap_case(rng: random.Random) -> tuple[Profile, Network, int, list[list[float]]]:
    """A random profile, network, bucket size and jitter per (algorithm, worker count)."""
    layers = [{"name": f"l{i}", "backward_s": rng.uniform(0, 0.02), "grad_bytes": rng.choice([0, 1, 10 ** rng.randint(2, 8)])}
              for i in range(rng.randint(1, 30))]
    layers[0]["backward_s"] += 1e-3
    p_ = profile(layers, forward=rng.uniform(0, 0.01), optimizer=rng.uniform(0, 0.01))
    net = network(g=rng.choice([1, 2, 4, 8]), ai=10 ** rng.uniform(-7, -4), bi=10 ** rng.uniform(7, 11),
                  ae=10 ** rng.uniform(-6, -3), be=10 ** rng.uniform(7, 10), copy_Bps=10 ** rng.uniform(8, 11),
                  collective_overhead_s=rng.uniform(0, 1e-4))
    bb = rng.choice([1 << 10, 1 << 20, 25 << 20])
    jitters = [[rng.choice([0.0, 0.05]) for _ in DEFAULT_WORKERS] for _ in ALGORITHMS]
    return p_, net, bb, jitters


def test_overlap_never_beats_compute() -> None:
    """200 random profiles x networks, every algorithm and worker count."""
    rng = random.Random(18)
    worst = math.inf
    for _ in range(200):
        p_, net, bb, jitters = overlap_case(rng)
        for alg, alg_jitters in zip(ALGORITHMS, jitters):
            for p, jitter in zip(DEFAULT_WORKERS, alg_jitters):
                r = data_parallel.simulate_dp(p_, net, p, alg, bb, min(bb, 1 << 20), jitter=jitter)
                bare = p_.forward_s + sum(layer.backward_s for layer in p_.layers) + p_.optimizer_s
                worst = min(worst, r.step_s - max(r.compute_s, bare))
    assert worst >= -1e-15, f"step - compute = {worst}"


def test_efficiency_non_increasing() -> None:
    """100 random networks, every algorithm: efficiency never rises from P = 1 to 1024."""
    rng = random.Random(18)
    for _ in range(200):  # the cases of the test above come first in this random stream
        overlap_case(rng)
    failures = []
    for trial in range(100):
        layers = [{"name": f"l{i}", "backward_s": rng.uniform(1e-4, 0.02), "grad_bytes": 10 ** rng.randint(3, 8)}
                  for i in range(rng.randint(1, 20))]
        p_ = profile(layers, threads_per_worker=rng.choice([1, 2]))
        net = network(g=rng.choice([1, 2, 4, 8]), ai=10 ** rng.uniform(-7, -4), bi=10 ** rng.uniform(9, 11),
                      ae=10 ** rng.uniform(-6, -4), be=10 ** rng.uniform(7, 9),
                      **({"cpu_cores_per_node": 2, "comm_uses_cpu": True} if trial % 3 == 0 else {}))
        for alg in ALGORITHMS:
            eff = [r.efficiency or 0.0 for r in data_parallel.dp_rows(
                p_, net, DEFAULT_WORKERS, [alg], DpOptions(baseline=1, bucket_bytes=25 << 20,
                                                           first_bucket_bytes=1 << 20, jitter=0.03))]
            if any(e2 > e1 * (1 + 1e-12) for e1, e2 in zip(eff, eff[1:])):
                failures.append(f"{alg}: {eff}")
    assert not failures, failures[-1]


def test_compute_slowdown() -> None:
    # A measured co-run slowdown replaces the time-sharing estimate for that many workers on a node.
    p_ = profile([{"name": "a", "backward_s": 0.01, "grad_bytes": 4096}], threads_per_worker=1)
    net = network(g=4, cpu_cores_per_node=2, compute_slowdown={"2": 1.1, "4": 2.3})
    # compute_slowdown (measured) replaces p x threads / cores for its worker counts
    assert close(collectives.compute_scale(p_, net, 2), 1.1) and close(collectives.compute_scale(p_, net, 4), 2.3)
    assert close(collectives.compute_scale(p_, network(g=4, cpu_cores_per_node=2), 4), 2.0)
    # compute_slowdown scales a step's compute
    assert close(data_parallel.simulate_dp(p_, net, 4, "ring").compute_s, (0.5 + 0.01 + 0.25) * 2.3)
    # bad input: a compute_slowdown key that is not a worker count; a negative compute_slowdown
    expect_error(lambda: network(compute_slowdown={"two": 1.1}), "net.json", "compute_slowdown", "'two'")
    expect_error(lambda: network(compute_slowdown={"2": -1}), "net.json", "compute_slowdown.2")


@pytest.mark.parametrize("name", ["goyal_bigbasin_50gbe", "horovod_pascal_25gbe", "loopback_gloo", "loopback_mpi",
                                  "loopback_threads", "netns_tbf_100mbit"])
def test_efficiency_non_increasing_on_shipped_networks(name: str) -> None:
    net = inputs.load_network(str(SIMULATOR / f"{name}.json"))
    prof = inputs.load_profile(str(SIMULATOR / "goyal_resnet50.json"))
    eff = [data_parallel.simulate_dp(prof, net, 1, "ring").step_s
           / data_parallel.simulate_dp(prof, net, p, net.algorithm).step_s
           for p in DEFAULT_WORKERS if p <= net.workers_per_node or net.inter]
    assert all(e2 <= e1 for e1, e2 in zip(eff, eff[1:])), eff


# --- pipeline and tensor parallelism -------------------------------------------------------------

def even_profile(activation_bytes: int, count: int) -> Profile:
    return profile([{"name": f"l{i}", "backward_s": 0.2, "forward_s": 0.1, "grad_bytes": 100,
                     "activation_bytes": activation_bytes} for i in range(count)], optimizer=0.0)


@pytest.mark.parametrize("p,m", [(1, 4), (2, 4), (4, 8), (8, 1)])
def test_pipeline_balanced_free_links(p: int, m: int) -> None:
    # balanced, free links: step (m+p-1)/m x compute/p, idle = (p-1)/(m+p-1)
    r = model_parallel.simulate_pipeline(even_profile(0, 8), network(g=8, ai=0.0, bi=1e30), p, m, "1f1b")
    assert close(r.step_s, (m + p - 1) / m * 2.4 / p) and close(r.bubble_ideal, (p - 1) / (m + p - 1))
    assert abs(r.idle - r.bubble_ideal) < 1e-12


def test_pipeline_and_tensor_parallel() -> None:
    even, free = even_profile(0, 8), network(g=8, ai=0.0, bi=1e30)
    # GPipe = 1F1B in time on balanced stages
    assert close(model_parallel.simulate_pipeline(even, free, 4, 8, "gpipe").step_s, 11 / 8 * 0.6)
    # stage split minimizes the largest stage
    assert model_parallel.partition([1, 1, 1, 1, 4], 2) == [0, 4]
    act = even_profile(800, 4)
    # 1F1B on 2 stages, F 50 ms and B 100 ms per micro-batch, each message alpha + (activation/m)/beta,
    # one at a time per link and direction. Worked by hand, action by action (rank 0 runs F0 F1 B0
    # F2 B1 F3 B2 B3, rank 1 F0 B0 F1 B1 ...): with 21 ms messages rank 0's B0 waits for rank 1's
    # B0 (ends 221 ms) plus its message, and every later B on rank 0 waits for the round trip of
    # its micro-batch: the last ends at 834 ms (the old steady-state formula said 792).
    r = model_parallel.simulate_pipeline(act, network(g=8, ai=1e-3, bi=1e4), 2, 4, "1f1b")
    send = 1e-3 + 800 / 4 / 1e4  # one boundary, a micro-batch's activation: 21 ms
    assert close(send, 0.021) and close(r.step_s, 0.834), str(r)
    assert close(r.p2p_s, 2 * 4 * send)  # every micro-batch crosses the boundary both ways
    # 201 ms messages, longer than a stage's 150 ms slot: the link sets the pace. By hand: rank 0's
    # B_i start at 602, 803, 1304 and 1505 ms (the forward link carries F3 only from 953 ms).
    r = model_parallel.simulate_pipeline(act, network(g=8, ai=1e-3, bi=1e3), 2, 4, "1f1b")
    assert close(r.step_s, 1.605), str(r)
    t = model_parallel.simulate_tp(act, network(g=8, ai=1e-3, bi=1e4), 2, 2)
    tp_comm = 4 * (2 + 2) * (2 * 1e-3 + 800 / 1e4)  # 4 layers x (2 fwd + 2 bwd) ring all-reduces on 2 ranks
    # tensor parallel: 2+2 all-reduces per layer
    assert close(t.comm_s, tp_comm) and close(t.step_s, 1.2 / 2 + tp_comm)
    # tensor parallel on 1 worker: no communication
    assert model_parallel.simulate_tp(act, free, 1, 2).comm_s == 0


# --- pipeline schedules as tables ---------------------------------------------------------------

GOLDEN_TABLES = ROOT / "tests" / "parallel" / "pipeline_tables"


def golden_case(path: pathlib.Path) -> tuple[str, int, int, int]:
    name, p, m, *v = path.stem.split("_")
    return name, int(p[1:]), int(m[1:]), int(v[0][1:]) if v else 2


@pytest.mark.parametrize("path", sorted(GOLDEN_TABLES.glob("*.csv")), ids=lambda p: p.stem)
def test_schedule_tables_equal_the_cpp_ones(path: pathlib.Path) -> None:
    # The same files pin the C++ tables (tests/parallel/test_pipeline_schedule.cpp)
    name, p, m, v = golden_case(path)
    built = schedules.table(name, p, m, v)
    assert built.to_csv() == path.read_text()
    read = schedules.parse_csv(path.read_text(), path.name)
    assert (read.ranks, read.stages_per_rank, read.micro_batches, read.placement) == \
        (built.ranks, built.stages_per_rank, built.micro_batches, built.placement)


def torch_pipelining_rules(t: schedules.Table) -> None:
    """What torch.distributed.pipelining (2.6 on) demands of a compute-only table it loads from CSV
    (PipelineScheduleMulti._load_csv): its _validate_schedule (a row per rank, each stage on one rank,
    per stage M forwards, every I or B after its F in the row, every W after its I, as many W as I,
    B + I = M), then _add_send_recv lowering the rows to sends and receives in order, rank by rank,
    which must never stall. Written here from those rules (Debian's torch 1.13 lacks the module)."""
    m, stages = t.micro_batches, t.stages
    owner: dict[int, int] = {}
    done: dict[tuple[int, str], set[int]] = {}
    for rank, row in enumerate(t.actions):
        for step, a in enumerate(row):
            where = f"rank {rank}, step {step} ({a})"
            assert owner.setdefault(a.stage, rank) == rank, f"{where}: stage {a.stage} on two ranks"
            seen = done.setdefault((a.stage, a.op), set())
            if a.op in ("B", "I"):
                assert a.micro in done.get((a.stage, "F"), set()), f"{where}: backward before its forward"
            if a.op == "W":
                assert a.micro in done.get((a.stage, "I"), set()), f"{where}: W before its I"
            seen.add(a.micro)
    for s in range(stages):
        count = {op: len(done.get((s, op), set())) for op in "FBIW"}
        assert count["F"] == m, f"stage {s}: {count['F']} forwards, expected {m}"
        assert count["I"] == count["W"], f"stage {s}: I={count['I']}, W={count['W']}"
        assert count["B"] + count["I"] == m, f"stage {s}: B={count['B']}, I={count['I']}, expected {m} backwards"
    # _add_send_recv: a rank's next action runs once what it needs is on the rank (its own earlier
    # action, or a receive its peer's send put there); a pass over the ranks that runs none stalls.
    rank_of = {s: r for s, r in owner.items()}
    have: list[set[tuple[int, str, int]]] = [set() for _ in t.actions]
    rows = [list(row) for row in t.actions]
    while any(rows):
        progress = False
        for r, row in enumerate(rows):
            if not row:
                continue
            a = row[0]
            if a.op == "F" and a.stage > 0:
                ready = (a.stage, "RECV_F", a.micro) in have[r] or (a.stage - 1, "F", a.micro) in have[r]
            elif a.op in ("B", "I") and a.stage < stages - 1:
                ready = any(k in have[r] for k in ((a.stage, "RECV_B", a.micro), (a.stage + 1, "I", a.micro),
                                                   (a.stage + 1, "B", a.micro)))
            else:
                ready = True
            if not ready:
                continue
            have[r].add((a.stage, a.op, a.micro))
            peer = a.stage + 1 if a.op == "F" else a.stage - 1 if a.op in ("B", "I") else -1
            if 0 <= peer < stages and rank_of[peer] != r:
                have[rank_of[peer]].add((peer, "RECV_F" if a.op == "F" else "RECV_B", a.micro))
            row.pop(0)
            progress = True
        assert progress, f"lowering to sends and receives stalls at {[str(row[0]) for row in rows if row]}"


@pytest.mark.parametrize("name", schedules.BUILT_IN)
def test_built_in_tables_pass_torch_rules(name: str) -> None:
    # every golden file (the C++ tables, cell for cell) and more sizes of the same generators
    for path in sorted(GOLDEN_TABLES.glob(f"{name}_*.csv")):
        torch_pipelining_rules(schedules.parse_csv(path.read_text(), path.name))
    for p in (1, 2, 3, 4, 6):
        for m in (p, 2 * p, 3 * p + (0 if name == "interleaved1f1b" else 1)):
            torch_pipelining_rules(schedules.table(name, p, m))
    # and the rules are not vacuous: each refuses its kind of mistake
    t = schedules.table(name, 2, 4)
    bad = [list(row) for row in t.actions]
    first_backward = next(k for k, a in enumerate(bad[0]) if a.op in ("B", "I"))
    bad[0].insert(0, bad[0].pop(first_backward))  # a backward before its forward
    with pytest.raises(AssertionError, match="backward before its forward"):
        torch_pipelining_rules(schedules.Table(t.name, t.ranks, t.stages_per_rank, t.micro_batches, t.placement, bad))
    if name in ("1f1b", "zbh1"):  # rank 1 runs all its forwards, the last micro-batch first: rank 0 stalls
        crossed = [list(row) for row in t.actions]  # on its first backward, rank 1 on micro-batch 3's input
        crossed[1] = [a for a in crossed[1] if a.op == "F"][::-1] + [a for a in crossed[1] if a.op != "F"]
        with pytest.raises(AssertionError, match="stalls"):
            torch_pipelining_rules(schedules.Table(t.name, t.ranks, 1, t.micro_batches, t.placement, crossed))
    missing = [list(row) for row in t.actions]
    missing[0] = [a for a in missing[0] if not (a.op == "F" and a.micro == 0 and a.stage == 0)]
    with pytest.raises(AssertionError):
        torch_pipelining_rules(schedules.Table(t.name, t.ranks, t.stages_per_rank, t.micro_batches, t.placement,
                                               missing))


def test_schedule_bubbles_hand_computed() -> None:
    # F, I, W one unit each at P = 4, M = 8 (each rank busy 24 units, or 48 with two stages):
    # 1F1B and GPipe (p-1)/(m+p-1) = 3/11 (9 idle of 33), interleaved with v = 2 3/19 (Megatron:
    # the bubble over v), ZB-H1 1/9 (3 idle of 27), ZB-V 1/17 (3 idle of 51)
    assert close(schedules.unit_bubble(schedules.table("1f1b", 4, 8)), 3 / 11)
    assert close(schedules.unit_bubble(schedules.table("gpipe", 4, 8)), 3 / 11)
    assert close(schedules.unit_bubble(schedules.table("interleaved1f1b", 4, 8, 2)), 3 / 19)
    assert close(schedules.unit_bubble(schedules.table("zbh1", 4, 8)), 1 / 9)
    assert abs(schedules.unit_bubble(schedules.table("zbv", 4, 8)) - 1 / 17) < 1e-12


def test_schedule_csv_forms_and_refusals() -> None:
    # torch 2.5 wrote the input gradient as B beside W's; 2.6 writes I
    old = schedules.parse_csv("0F0,0B0,0W0\n", "old.csv")
    assert [str(a) for a in old.actions[0]] == ["0F0", "0I0", "0W0"]
    assert [str(a) for a in schedules.parse_csv("0F0,,0BW0\n").actions[0]] == ["0F0", "0B0"]
    expect_error(lambda: schedules.parse_csv("0F0,0X0\n", "bad.csv"), "bad.csv", "row 1", "cell 2", "'0X0'")
    expect_error(lambda: schedules.parse_csv("0F0,1F0\n1F1\n", "t.csv"), "t.csv", "another rank")
    expect_error(lambda: schedules.table("zb-h2", 2, 4), "zb-h2", "unknown")
    expect_error(lambda: schedules.table("interleaved1f1b", 2, 3), "not a multiple of the 2 ranks")
    deadlock = schedules.parse_csv("0F0,0B0\n1B0,1F0\n", "dead.csv")
    even = even_profile(0, 4)
    expect_error(lambda: model_parallel.simulate_pipeline(even, network(g=8), 2, 1, "", table=deadlock),
                 "dead.csv", "deadlocks", "rank 1 at 1B0")


def test_zero_bubble_simulation_and_stage_halves() -> None:
    # Balanced stages, free links: the simulated idle is the schedule's own bubble; a layer's
    # backward_weight_s moves work from I to W (here none: I and W as in the unit table's ratio)
    layers = [{"name": f"l{i}", "forward_s": 0.1, "backward_s": 0.2, "backward_weight_s": 0.1, "grad_bytes": 4,
               "activation_bytes": 0} for i in range(8)]
    prof = profile(layers, optimizer=0.0)
    free = network(g=8, ai=0.0, bi=1e30)
    for name, v in (("1f1b", 1), ("interleaved1f1b", 2), ("zbh1", 1), ("zbv", 2)):
        r = model_parallel.simulate_pipeline(prof, free, 4, 8, name, v)
        assert r.stages == 4 * v and abs(r.idle - r.bubble_ideal) < 1e-12, (name, r)
        # the step: the busiest rank's compute over (1 - its idle share); compute is 2.4 s / 4
        assert close(r.compute_s, 0.6) and close(r.step_s * (1 - r.idle), 0.6), (name, r)
    expect_error(lambda: profile([{"name": "x", "backward_s": 1.0, "backward_weight_s": 2.0, "grad_bytes": 4}]),
                 "layers[0].backward_weight_s", "more than")


def test_pipeline_command_with_a_table(tmp_path: pathlib.Path) -> None:
    table = tmp_path / "zbh1.csv"
    table.write_text(schedules.table("zbh1", 2, 4).to_csv())
    out = subprocess.run([sys.executable, str(TOOL), "pipeline", "--profile", str(SIMULATOR / "transformer_1b3.json"),
                          "--network", str(SIMULATOR / "loopback_mpi.json"), "--micro-batches", "4", "--table",
                          str(table), "--json"], capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)["rows"]
    assert [r["workers"] for r in rows] == [2] and rows[0]["schedule"] == str(table)
    direct = subprocess.run([sys.executable, str(TOOL), "pipeline", "--profile", str(SIMULATOR / "transformer_1b3.json"),
                             "--network", str(SIMULATOR / "loopback_mpi.json"), "--micro-batches", "4", "--schedule",
                             "zbh1", "--stages", "2", "--json"], capture_output=True, text=True, check=True)
    assert json.loads(direct.stdout)["rows"][0]["step_s"] == rows[0]["step_s"]
    bad = subprocess.run([sys.executable, str(TOOL), "pipeline", "--profile", str(SIMULATOR / "transformer_1b3.json"),
                          "--network", str(SIMULATOR / "loopback_mpi.json"), "--micro-batches", "8", "--table",
                          str(table)], capture_output=True, text=True)
    assert bad.returncode != 0 and "runs 4 micro-batches, --micro-batches is 8" in bad.stderr


# --- bad input -----------------------------------------------------------------------------------

def test_bad_input_named() -> None:
    good_layer = {"name": "x", "backward_s": 1.0, "grad_bytes": 4}
    # profile without batch_per_worker: names the file and field
    expect_error(lambda: inputs.load_profile("p.json", data={"forward_s": 1, "optimizer_s": 0, "layers": [good_layer]}),
                 "p.json", "batch_per_worker")
    # layer without grad_bytes: names layers[0].grad_bytes
    expect_error(lambda: profile([{"name": "x", "backward_s": 1.0}]), "prof.json", "layers[0].grad_bytes")
    # negative backward time refused
    expect_error(lambda: profile([{"name": "x", "backward_s": -1.0, "grad_bytes": 4}]), "layers[0].backward_s", ">= 0")
    # param_bytes that do not sum to grad_bytes refused
    expect_error(lambda: profile([{"name": "x", "backward_s": 1.0, "grad_bytes": 4, "param_bytes": [1, 2]}]),
                 "layers[0].param_bytes", "grad_bytes")
    # negative bandwidth: names inter.beta_Bps; zero bandwidth refused
    expect_error(lambda: network(be=-1e9), "net.json", "inter.beta_Bps")
    expect_error(lambda: network(bi=0), "intra.beta_Bps", "> 0")
    # network without intra: names the field
    expect_error(lambda: inputs.load_network("n.json", data={"workers_per_node": 2}), "n.json", "intra")
    # unknown algorithm in the network file: named
    expect_error(lambda: inputs.load_network("n.json", data={"workers_per_node": 2, "algorithm": "butterfly",
                                                             "intra": {"alpha_s": 0, "beta_Bps": 1}}),
                 "n.json", "algorithm", "butterfly")
    # workers beyond one node without 'inter': names the field and the node size
    one_node = inputs.load_network("n.json", data={"workers_per_node": 2, "intra": {"alpha_s": 0, "beta_Bps": 1}})
    expect_error(lambda: collectives.allreduce_s(one_node, "ring", 4, 100), "n.json", "inter", "workers_per_node=2")
    # tensor parallel without activation sizes
    expect_error(lambda: model_parallel.simulate_tp(profile(PROF2), network(g=8, ai=0.0, bi=10.0), 2, 2),
                 "activation_bytes")


def simulate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=120)


def test_cli_refusals(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "bad_net.json"
    bad.write_text(json.dumps({"workers_per_node": 4, "intra": {"alpha_s": 1e-6, "beta_Bps": -5}}))
    prof_path = str(SIMULATOR / "goyal_resnet50.json")
    done = simulate("dp", "--profile", prof_path, "--network", str(bad))
    # negative bandwidth exits 2 naming the file and field
    assert done.returncode == 2 and "bad_net.json" in done.stderr and "intra.beta_Bps" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    done = simulate("dp", "--profile", prof_path, "--network", str(SIMULATOR / "goyal_bigbasin_50gbe.json"),
                    "--algorithm", "magic")
    # unknown --algorithm exits 2 listing the known ones
    assert done.returncode == 2 and "magic" in done.stderr and "ring" in done.stderr, done.stderr
    done = simulate("dp", "--profile", str(tmp_path / "absent.json"), "--network",
                    str(SIMULATOR / "goyal_bigbasin_50gbe.json"))
    # a missing file exits 2 naming it
    assert done.returncode == 2 and "absent.json" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_profile_from_trace(tmp_path: pathlib.Path) -> None:
    # a made-up trace of 3 layers (c, b, a in backward order), 1 KiB buckets
    params = [("a.weight", 2048), ("a.bias", 8), ("b.weight", 4096), ("c.weight", 1600)]
    header: dict[str, Any] = {}
    off = 0
    for name, size in params:
        header[name] = {"dtype": "F32", "shape": [size // 4], "data_offsets": [off, off + size]}
        off += size
    for name, size in params:
        header["optim.momentum_buffer." + name] = {"dtype": "F32", "shape": [size // 4], "data_offsets": [off, off + size]}
        off += size
    blob = json.dumps(header).encode()
    ckpt = tmp_path / "c.safetensors"
    ckpt.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(off))
    events: list[dict[str, Any]] = []
    t = 0.0
    for _ in range(5):  # 4 KiB buckets: [c.weight], [b.weight], [a.bias, a.weight]
        events += [{"name": "forward", "ph": "X", "ts": t, "dur": 100.0, "pid": 0, "tid": 0},
                   {"name": "backward", "ph": "X", "ts": t + 100, "dur": 600.0, "pid": 0, "tid": 0},
                   {"name": "all_reduce bucket 0 (1 KiB)", "ph": "X", "ts": t + 100 + 100, "dur": 1, "pid": 0, "tid": 1},
                   {"name": "all_reduce bucket 1 (4 KiB)", "ph": "X", "ts": t + 100 + 300, "dur": 1, "pid": 0, "tid": 1},
                   {"name": "all_reduce bucket 2 (2 KiB)", "ph": "X", "ts": t + 700, "dur": 1, "pid": 0, "tid": 1},
                   {"name": "optimizer step", "ph": "X", "ts": t + 710, "dur": 10.0, "pid": 0, "tid": 0}]
        t += 1000
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    prof = measure.profile_from_trace(str(trace), str(ckpt), 4, 16, 1, "made up")
    got = [(layer["name"], round(layer["backward_s"] * 1e6, 6), layer["grad_bytes"]) for layer in prof["layers"]]
    # per-layer backward from bucket launch times, gradient bytes from the checkpoint
    assert got == [("c", 100.0, 1600), ("b", 200.0, 4096), ("a", 300.0, 2056)], str(got)
    assert close(prof["forward_s"], 1e-4) and close(prof["optimizer_s"], 1e-5)
    # a trace whose bucket count disagrees asks for the run's --bucket-kib
    expect_error(lambda: measure.profile_from_trace(str(trace), str(ckpt), 1, 16, 1, "x"), "--bucket-kib")
