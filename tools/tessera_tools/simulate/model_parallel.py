"""Pipeline parallelism (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V, or a table from a CSV) and
tensor parallelism (Megatron): one step of one replica split over p workers."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tessera_tools.simulate import schedules
from tessera_tools.simulate.collectives import allreduce_s, compute_scale, link
from tessera_tools.simulate.inputs import InputError, Network, Profile


@dataclass
class PipelineRow:
    workers: int
    stages: int
    micro_batches: int
    step_s: float
    compute_s: float     # the busiest stage's
    bubble_ideal: float  # the schedule's own: F, I, W of one unit each ((p-1)/(m+p-1) for GPipe, 1F1B)
    idle: float
    p2p_s: float
    efficiency: float | None = None  # strong scaling against one worker, from the command
    schedule: str = "1F1B"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TpRow:
    workers: int
    step_s: float
    compute_s: float
    comm_s: float
    exposed_s: float
    efficiency: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def partition(costs: Sequence[float], stages: int) -> list[int]:
    """Contiguous split of costs into `stages` groups minimizing the largest group (what Pipeline's
    balancing does with measured unit costs). Returns the start index of each stage."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]  # best[s][i]: first i units in s stages
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - stages + s + 1):
            for j in range(s - 1, i):
                v = max(best[s - 1][j], prefix[i] - prefix[j])
                if v < best[s][i]:
                    best[s][i], cut[s][i] = v, j
    starts, i = [], n
    for s in range(stages, 0, -1):
        i = cut[s][i]
        starts.append(i)
    return starts[::-1]


def simulate_pipeline(profile: Profile, network: Network, p: int, micro_batches: int, schedule: str,
                      stages_per_rank: int = 2, table: schedules.Table | None = None) -> PipelineRow:
    """One pipeline step on p workers and m micro-batches under a schedule (schedules.BUILT_IN, or
    `table` read from a CSV), simulated action by action (schedules.simulate); times in seconds.
    The layers are split into the table's stages (P, or P v with several stages per worker) by
    the same balancing as Pipeline's; a layer's backward splits into its input and weight halves by
    its backward_weight_s (default half: the two products of a dense or convolutional layer)."""
    m = micro_batches
    t = table if table is not None else schedules.table(schedule, p, m, stages_per_rank)
    if t.ranks != p or t.micro_batches != m:
        raise InputError(f"pipeline schedule '{t.name}': a table of {t.ranks} ranks and {t.micro_batches} "
                         f"micro-batches, asked for {p} workers and {m} micro-batches")
    layers = profile.layers[::-1]  # forward order
    if t.stages > len(layers):
        raise InputError(f"{profile.path}: {len(layers)} layers, fewer than the {t.stages} stages of "
                         f"'{t.name}' on {p} workers")
    s = compute_scale(profile, network, p)
    starts = partition([layer.forward_s + layer.backward_s for layer in layers], t.stages) + [len(layers)]
    g = network.workers_per_node
    fwd: list[float] = []
    bwd_in: list[float] = []
    bwd_w: list[float] = []
    send: list[float] = []
    for k in range(t.stages):
        group = layers[starts[k]:starts[k + 1]]
        fwd.append(sum(layer.forward_s for layer in group) * s / m)
        bwd_w.append(sum(layer.backward_weight_s for layer in group) * s / m)
        bwd_in.append(sum(layer.backward_s - layer.backward_weight_s for layer in group) * s / m)
        if k < t.stages - 1:
            a = group[-1].activation_bytes
            here, there = t.rank_of(k), t.rank_of(k + 1)
            if here == there:
                send.append(0.0)  # the next stage on the same worker: handed over in memory
                continue
            if a is None:
                raise InputError(f"{profile.path}: layer '{group[-1].name}' has no activation_bytes "
                                 f"(the bytes it sends to the next pipeline stage, whole per-worker batch)")
            alpha, beta = link(network, "inter" if here // g != there // g else "intra", p)
            send.append(alpha + a / m / beta)  # activations forward, gradients of the same size back
    sim = schedules.simulate(t, schedules.StageCosts(fwd, bwd_in, bwd_w, send))
    optimizer = profile.optimizer_s * s / p  # each worker updates only its own parameters (balanced)
    crossing = sum(send)
    return PipelineRow(workers=p, stages=t.stages, micro_batches=m, step_s=sim.makespan + optimizer,
                       compute_s=max(sim.busy), bubble_ideal=schedules.unit_bubble(t),
                       idle=sim.bubble_fraction(), p2p_s=2 * m * crossing, schedule=t.name)


def simulate_tp(profile: Profile, network: Network, t: int, allreduces_per_layer: int) -> TpRow:
    """One tensor-parallel step over t workers (Megatron): each layer's compute split t ways and,
    per layer, allreduces_per_layer all-reduces of its activation in forward and as many in backward."""
    s = compute_scale(profile, network, t)
    compute = (profile.forward_s + sum(layer.backward_s for layer in profile.layers) + profile.optimizer_s) * s / t
    comm = 0.0
    for layer in profile.layers:
        if layer.activation_bytes is None:
            raise InputError(f"{profile.path}: layer '{layer.name}' has no activation_bytes "
                             f"(its output for the whole batch: the size of the tensor-parallel all-reduce)")
        comm += 2 * allreduces_per_layer * (network.collective_overhead_s +
                                            allreduce_s(network, network.algorithm, t, layer.activation_bytes))
    return TpRow(workers=t, step_s=compute + comm, compute_s=compute, comm_s=comm, exposed_s=comm)
