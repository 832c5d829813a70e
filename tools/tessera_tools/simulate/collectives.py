"""All-reduce in the alpha-beta (Hockney) model: a message of m bytes over a link costs
alpha + m/beta. Also the compute slowdown of workers sharing a node and the expected slowest of
p workers, which set the pace of a synchronous step."""
from __future__ import annotations

import math

from tessera_tools.simulate.inputs import ALGORITHMS, InputError, Network, Profile


def flat_allreduce_s(alg: str, p: int, n: float, alpha: float, beta: float) -> float:
    """One all-reduce of n bytes over p ranks whose every link has latency alpha and bandwidth beta."""
    if p <= 1 or n <= 0:
        return 0.0
    if alg == "ring":  # reduce-scatter + all-gather, p - 1 steps each, n/p bytes per step
        return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n / beta
    if alg == "tree":  # binary tree: reduce to the root, broadcast back, the whole message per level
        return 2 * math.ceil(math.log2(p)) * (alpha + n / beta)
    if alg == "dbtree":  # two complementary pipelined binary trees, n/2 each (NCCL >= 2.4)
        return 2 * math.ceil(math.log2(p)) * alpha + 2 * n / beta
    if alg == "halving_doubling":  # Rabenseifner; a non-power of two folds its extra ranks in first
        q = 2 ** int(math.floor(math.log2(p)))
        t = 2 * math.log2(q) * alpha + 2 * (q - 1) / q * n / beta
        return t + (2 * (alpha + n / beta) if q != p else 0.0)
    if alg == "direct":  # one shot: every rank reduces its 1/p from all others' buffers, then copies out
        return 2 * alpha + 2 * (p - 1) / p * n / beta
    raise InputError(f"unknown all-reduce algorithm '{alg}' (one of {', '.join(ALGORITHMS)})")


def link(network: Network, name: str, p: int) -> tuple[float, float]:
    """(alpha, beta) of the 'intra' or 'inter' link."""
    chosen = network.intra if name == "intra" else network.inter
    if chosen is None:
        raise InputError(f"{network.path}: missing field 'inter' (alpha_s and beta_Bps between nodes), "
                         f"needed for {p} workers > workers_per_node={network.workers_per_node}")
    return chosen.alpha_s, chosen.beta_Bps


def allreduce_s(network: Network, alg: str, p: int, n: float) -> float:
    """Time of one all-reduce of n bytes on p workers packed onto nodes of workers_per_node."""
    if p <= 1 or n <= 0:
        return 0.0
    g = network.workers_per_node
    if alg == "hierarchical":
        # Reduce-scatter within the node (ring over g'), an all-reduce between nodes of each rank's
        # n/g' shard, all g' of them sharing the node's link (so the link carries n), all-gather
        # within the node. One node: a ring within it.
        local, nodes = min(p, g), math.ceil(p / g)
        a_in, b_in = link(network, "intra", p)
        t = 2 * (local - 1) * a_in + 2 * (local - 1) / local * n / b_in
        if nodes > 1:
            a_out, b_out = link(network, "inter", p)
            t += flat_allreduce_s(network.inter_algorithm, nodes, n, a_out, b_out)
        return t
    # A flat algorithm runs in lock-step rounds: each round is as slow as its slowest link, which
    # is the inter-node one as soon as the ranks span nodes.
    alpha, beta = link(network, "inter" if p > g else "intra", p)
    return flat_allreduce_s(alg, p, n, alpha, beta)


def compute_scale(profile: Profile, network: Network, p: int) -> float:
    """Factor on every compute time with p workers: the network's measured compute_slowdown for
    that many workers on a node when given, else time-sharing when the workers on a node need more
    threads than the node has cores (CPU runs; absent cpu_cores_per_node: dedicated devices)."""
    on_node = min(p, network.workers_per_node)
    if on_node in network.compute_slowdown:
        return network.compute_slowdown[on_node]
    cores = network.cpu_cores_per_node
    if not cores:
        return 1.0
    return max(1.0, min(p, network.workers_per_node) * profile.threads_per_worker / cores)


_max_normal = {1: 0.0}


def expected_max_normal(p: int) -> float:
    """E[max of p independent standard normals] = integral of x p phi(x) Phi(x)^(p-1) dx (0.56 for
    2, 1.03 for 4, 3.2 for 1024): a synchronous step waits for the slowest worker's backward."""
    if p not in _max_normal:
        h, total = 0.005, 0.0
        for i in range(-2400, 2401):  # x in [-12, 12], trapezoid; the integrand is smooth and tiny at the ends
            x = i * h
            pdf, cdf = math.exp(-x * x / 2) / math.sqrt(2 * math.pi), 0.5 * math.erfc(-x / math.sqrt(2))
            total += x * p * pdf * cdf ** (p - 1)
        _max_normal[p] = total * h
    return _max_normal[p]
