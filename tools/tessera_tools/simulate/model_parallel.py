"""Pipeline parallelism (GPipe / 1F1B) and tensor parallelism (Megatron): one step of one
replica split over p workers."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tessera_tools.simulate.collectives import allreduce_s, compute_scale, link
from tessera_tools.simulate.inputs import InputError, Network, Profile


@dataclass
class PipelineRow:
    workers: int
    stages: int
    micro_batches: int
    step_s: float
    compute_s: float     # the busiest stage's
    bubble_ideal: float  # (p-1)/(m+p-1)
    idle: float
    p2p_s: float
    efficiency: float | None = None  # strong scaling against one worker, from the command

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


def simulate_pipeline(profile: Profile, network: Network, p: int, micro_batches: int, schedule: str) -> PipelineRow:
    """One pipeline step of p stages (one worker each) and m micro-batches; times in seconds."""
    layers = profile.layers[::-1]  # forward order
    s = compute_scale(profile, network, p)
    m = micro_batches
    starts = partition([layer.forward_s + layer.backward_s for layer in layers], p) + [len(layers)]
    g = network.workers_per_node
    fwd: list[float] = []
    bwd: list[float] = []
    send: list[float] = []
    for k in range(p):
        group = layers[starts[k]:starts[k + 1]]
        fwd.append(sum(layer.forward_s for layer in group) * s / m)
        bwd.append(sum(layer.backward_s for layer in group) * s / m)
        if k < p - 1:
            a = group[-1].activation_bytes
            if a is None:
                raise InputError(f"{profile.path}: layer '{group[-1].name}' has no activation_bytes "
                                 f"(the bytes it sends to the next pipeline stage, whole per-worker batch)")
            alpha, beta = link(network, "inter" if (k + 1) % g == 0 else "intra", p)
            send.append(alpha + a / m / beta)  # activations forward, gradients of the same size back
    # The first micro-batch crosses every stage and link forward and back (fill and drain); each
    # further one adds one slot of the busiest stage, or of the busiest link when a transfer takes
    # longer (sends are asynchronous: a link carries activations one way, gradients the other).
    link_slot = max(send, default=0.0)
    if schedule == "gpipe":  # all forwards, then all backwards: each phase fills and drains
        t = (sum(fwd) + sum(send) + (m - 1) * max(max(fwd), link_slot)
             + sum(bwd) + sum(send) + (m - 1) * max(max(bwd), link_slot))
    else:  # 1F1B: in the steady state the busiest stage alternates one forward, one backward
        t = sum(fwd) + sum(bwd) + 2 * sum(send) + (m - 1) * max(max(fwd[k] + bwd[k] for k in range(p)), link_slot)
    t += profile.optimizer_s * s / p  # each stage updates only its own parameters (balanced)
    busy = sum(fwd) + sum(bwd)
    return PipelineRow(workers=p, stages=p, micro_batches=m, step_s=t,
                       compute_s=max(fwd[k] + bwd[k] for k in range(p)) * m,
                       bubble_ideal=(p - 1) / (m + p - 1),
                       idle=1 - busy * m / (p * (t - profile.optimizer_s * s / p)),
                       p2p_s=2 * m * sum(send))


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
