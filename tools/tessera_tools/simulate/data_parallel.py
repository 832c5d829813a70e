"""Data parallelism: DataParallel's buckets and its timeline
(include/tessera/parallel/data_parallel.hpp)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tessera_tools.simulate.collectives import allreduce_s, compute_scale, expected_max_normal
from tessera_tools.simulate.inputs import Network, Profile

BUCKET_BYTES = 25 << 20  # DataParallelOptions::bucket_bytes (data_parallel.hpp)
FIRST_BUCKET_BYTES = 1 << 20  # DataParallelOptions::first_bucket_bytes


@dataclass
class DpOptions:
    bucket_bytes: int = BUCKET_BYTES
    first_bucket_bytes: int = FIRST_BUCKET_BYTES
    jitter: float | None = None  # None: the profile's compute_cv
    baseline: int = 1            # efficiency relative to this worker count


@dataclass
class DpRow:
    """One synchronous step on `workers` workers; times in seconds. compute_s is a typical worker's
    busy time, exposed_s the rest of the step: communication backward did not hide, waiting,
    packing."""
    workers: int
    nodes: int
    algorithm: str
    compute_s: float
    step_s: float
    comm_s: float = 0.0
    exposed_s: float = 0.0
    comm_exposed_s: float = 0.0
    buckets: int = 0
    pack_s: float | None = None       # absent on one worker (no DataParallel)
    images_per_s: float | None = None  # these three from dp_rows
    efficiency: float | None = None
    hidden: float | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if self.pack_s is None:
            del d["pack_s"]
        return d


def bucket_plan(sizes: Sequence[int], bucket_bytes: int, first_bucket_bytes: int) -> list[list[int]]:
    """DataParallel::bucket_plan: sizes in visiting order (reverse parameter order); a new bucket
    when the next parameter would overflow the cap, the first bucket's cap being first_bucket_bytes."""
    plan: list[list[int]] = []
    cap, in_last = first_bucket_bytes, 0
    for i, size in enumerate(sizes):
        if not plan or (plan[-1] and in_last + size > cap):
            if plan:
                cap = bucket_bytes
            plan.append([])
            in_last = 0
        plan[-1].append(i)
        in_last += size
    return plan


def simulate_dp(profile: Profile, network: Network, p: int, alg: str, bucket_bytes: int = BUCKET_BYTES,
                first_bucket_bytes: int = FIRST_BUCKET_BYTES, jitter: float | None = None) -> DpRow:
    """One synchronous data-parallel step on p workers; times in seconds."""
    s = compute_scale(profile, network, p)
    cv = profile.compute_cv if jitter is None else jitter
    slowest = s * (1 + cv * expected_max_normal(p))  # forward and backward of the slowest worker
    forward, optimizer = profile.forward_s * slowest, profile.optimizer_s * s
    backward = [layer.backward_s * slowest for layer in profile.layers]
    # compute_s: a typical worker's busy time; the step is paced by the slowest worker, and
    # exposed_s is the rest: communication backward did not hide, waiting, packing.
    compute = (profile.forward_s + sum(layer.backward_s for layer in profile.layers) + profile.optimizer_s) * s
    row = DpRow(workers=p, nodes=math.ceil(p / network.workers_per_node), algorithm=alg, compute_s=compute,
                step_s=compute)
    if p == 1:  # one worker trains without DataParallel (the baseline of bench/dp_scaling)
        return row
    sizes: list[int] = []
    layer_of: list[int] = []
    for i, layer in enumerate(profile.layers):
        sizes += layer.param_bytes
        layer_of += [i] * len(layer.param_bytes)
    plan = bucket_plan(sizes, bucket_bytes, first_bucket_bytes)
    nbytes = [sum(sizes[j] for j in b) for b in plan]
    nbytes[-1] += profile.scalar_bytes  # the last bucket carries the step's error flag
    ready_after = [max(layer_of[j] for j in b) for b in plan]  # the layer whose backward completes it
    copy = network.copy_Bps
    pack = [n / copy if copy else 0.0 for n in nbytes]

    def collective(n: float) -> float:
        shared = s if network.comm_uses_cpu else 1.0
        return network.collective_overhead_s + allreduce_s(network, alg, p, n) * shared

    # The compute thread runs backward layer by layer; a grad_ready hook that completes a bucket
    # packs it and launches it, in bucket order (a later bucket waits for the earlier ones). The
    # asynchronous all-reduces run one at a time, in launch order, on the communicator's worker.
    t, comm_free, comm, k, last = 0.0, 0.0, 0.0, 0, len(plan) - 1
    for i, b in enumerate(backward):
        t += b
        while k < last and ready_after[k] <= i:
            t += pack[k]
            start = max(t, comm_free)
            comm_free = start + collective(nbytes[k])
            comm += comm_free - start
            k += 1
    backward_end = t
    # finish(): the last bucket (complete only with backward) is reduced on the calling thread,
    # after the queue has drained; then every bucket is copied back into the gradients.
    t += pack[last]
    start = max(t, comm_free)
    end = start + collective(nbytes[last])
    comm += end - start
    unpack = sum(nbytes) / copy if copy else 0.0
    step = forward + end + unpack + optimizer
    row.step_s, row.comm_s, row.exposed_s, row.comm_exposed_s = step, comm, step - compute, end - backward_end
    row.buckets, row.pack_s = len(plan), sum(pack) + unpack
    return row


def dp_rows(profile: Profile, network: Network, workers: Sequence[int], algs: Sequence[str],
            options: DpOptions) -> list[DpRow]:
    rows = []
    for alg in algs:
        settings = (options.bucket_bytes, options.first_bucket_bytes, options.jitter)
        base = simulate_dp(profile, network, options.baseline, alg, *settings)
        for p in workers:
            r = simulate_dp(profile, network, p, alg, *settings)
            r.images_per_s = p * profile.batch_per_worker / r.step_s
            r.efficiency = base.step_s / r.step_s  # weak scaling: per-worker throughput ratio
            r.hidden = 1 - r.comm_exposed_s / r.comm_s if r.comm_s > 0 else None
            rows.append(r)
    return rows
