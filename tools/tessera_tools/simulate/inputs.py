"""The simulator's inputs: a model profile (per-layer times and gradient sizes in backward
order), a network (workers per node, alpha and beta within and between nodes) and measured
points to compare with, each checked field by field so that an error names the file and field."""
from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ALGORITHMS = ("ring", "tree", "dbtree", "halving_doubling", "direct", "hierarchical")
FLAT_ALGORITHMS = ALGORITHMS[:-1]
DEFAULT_WORKERS = [2 ** k for k in range(11)]  # 1 .. 1024


class InputError(Exception):
    """A bad input file or flag; the message names the file and the field."""


@dataclass
class Layer:
    name: str
    backward_s: float
    forward_s: float  # the profile's own, or its share of the whole forward (split like backward)
    grad_bytes: int
    activation_bytes: int | None  # what it sends to the next stage / all-reduces under tensor parallelism
    param_bytes: list[int]        # one entry per parameter tensor, summing to grad_bytes
    backward_weight_s: float = 0.0  # the weight-gradient half of backward_s (zero-bubble pipelines)


@dataclass
class Profile:
    name: str
    path: str
    batch_per_worker: float
    optimizer_s: float
    scalar_bytes: int
    threads_per_worker: float
    compute_cv: float
    forward_s: float
    layers: list[Layer]


@dataclass(frozen=True)
class Link:
    alpha_s: float   # latency of one message
    beta_Bps: float  # bandwidth, bytes per second


@dataclass
class Network:
    name: str
    path: str
    workers_per_node: int
    collective_overhead_s: float
    copy_Bps: float | None
    cpu_cores_per_node: float | None
    comm_uses_cpu: bool
    algorithm: str
    inter_algorithm: str
    intra: Link
    inter: Link | None  # only needed once workers span nodes
    compute_slowdown: dict[int, float] = field(default_factory=dict)


@dataclass
class MeasuredPoint:
    workers: int
    label: str
    step_s: float | None
    efficiency: float | None


def read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not JSON: {e}") from None


def number(obj: Mapping[str, Any], key: str, path: str, where: str = "", *, required: bool = True,
           default: float | None = None, positive: bool = False, integer: bool = False) -> float | None:
    """obj[key] as a finite number >= 0 (> 0 with positive), or default when absent and optional.
    With integer, a whole number (returned as int)."""
    name = f"{where}{key}"
    if key not in obj:
        if required:
            raise InputError(f"{path}: missing field '{name}'")
        return default
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise InputError(f"{path}: field '{name}' must be a number, got {v!r}")
    if integer and v != int(v):
        raise InputError(f"{path}: field '{name}' must be a whole number, got {v!r}")
    if v < 0 or (positive and v == 0):
        raise InputError(f"{path}: field '{name}' must be {'> 0' if positive else '>= 0'}, got {v!r}")
    return int(v) if integer else float(v)


def real(obj: Mapping[str, Any], key: str, path: str, where: str = "", *, positive: bool = False) -> float:
    """A required number."""
    v = number(obj, key, path, where, positive=positive)
    assert v is not None
    return v


def whole(obj: Mapping[str, Any], key: str, path: str, where: str = "", *, positive: bool = False) -> int:
    """A required whole number."""
    v = number(obj, key, path, where, positive=positive, integer=True)
    assert v is not None
    return int(v)


def optional_whole(obj: Mapping[str, Any], key: str, path: str, where: str = "") -> int | None:
    v = number(obj, key, path, where, required=False, integer=True)
    return None if v is None else int(v)


def load_profile(path: str, data: Any = None) -> Profile:
    """The model profile: per-layer times and gradient sizes in backward order (see docs/simulator.md)."""
    d = read_json(path) if data is None else data
    if not isinstance(d, dict):
        raise InputError(f"{path}: a profile is a JSON object")
    layers = d.get("layers")
    if not isinstance(layers, list) or not layers:
        raise InputError(f"{path}: missing field 'layers' (a non-empty list, in backward order)")
    name = str(d.get("name", path))
    batch_per_worker = real(d, "batch_per_worker", path, positive=True)
    optimizer_s = real(d, "optimizer_s", path)
    scalar_bytes = int(number(d, "scalar_bytes", path, required=False, default=4, positive=True, integer=True) or 4)
    threads_per_worker = float(number(d, "threads_per_worker", path, required=False, default=1, positive=True) or 1)
    compute_cv = float(number(d, "compute_cv", path, required=False, default=0.0) or 0.0)
    has_forward = [isinstance(layer, dict) and "forward_s" in layer for layer in layers]
    if not all(has_forward) and "forward_s" not in d:
        raise InputError(f"{path}: missing field 'forward_s' (the whole forward pass; needed when "
                         f"not every layer has its own forward_s)")
    parsed: list[Layer] = []
    for i, raw in enumerate(layers):
        where = f"layers[{i}]."
        if not isinstance(raw, dict):
            raise InputError(f"{path}: field 'layers[{i}]' must be an object")
        layer_name = str(raw.get("name", f"layer{i}"))
        backward_s = real(raw, "backward_s", path, where)
        forward_s = number(raw, "forward_s", path, where, required=False)
        grad_bytes = whole(raw, "grad_bytes", path, where)
        activation_bytes = optional_whole(raw, "activation_bytes", path, where)
        params = raw.get("param_bytes", [grad_bytes])
        if not isinstance(params, list):
            raise InputError(f"{path}: field '{where}param_bytes' must be a list of byte counts")
        param_bytes = [whole({f"param_bytes[{j}]": b}, f"param_bytes[{j}]", path, where) for j, b in enumerate(params)]
        if sum(param_bytes) != grad_bytes:
            raise InputError(f"{path}: field '{where}param_bytes' sums to {sum(param_bytes)}, "
                             f"but '{where}grad_bytes' is {grad_bytes}")
        # The weight-gradient half of backward (a zero-bubble schedule runs it apart): measured, or
        # half, as the two products of a dense or convolutional layer's backward are the same size.
        weight_s = number(raw, "backward_weight_s", path, where, required=False,
                          default=backward_s / 2 if grad_bytes else 0.0)
        assert weight_s is not None
        if weight_s > backward_s:
            raise InputError(f"{path}: field '{where}backward_weight_s' is {weight_s}, more than "
                             f"'{where}backward_s' ({backward_s})")
        parsed.append(Layer(layer_name, backward_s, forward_s if forward_s is not None else 0.0, grad_bytes,
                            activation_bytes, param_bytes, weight_s))
    if not any(layer.param_bytes for layer in parsed):
        raise InputError(f"{path}: no layer has parameters (param_bytes, or grad_bytes alone, of some layer)")
    total_backward = sum(layer.backward_s for layer in parsed)
    if all(has_forward):
        forward = sum(layer.forward_s for layer in parsed)
    else:
        # Per-layer forward times only matter for pipeline stages and tensor parallelism; without
        # them forward is split like backward (backward ~ 2 x forward for conv and dense layers).
        forward = real(d, "forward_s", path)
        for layer in parsed:
            share = layer.backward_s / total_backward if total_backward else 1 / len(parsed)
            layer.forward_s = forward * share
    if forward + total_backward + optimizer_s <= 0:
        raise InputError(f"{path}: forward, backward and optimizer times are all zero")
    return Profile(name=name, path=path, batch_per_worker=batch_per_worker, optimizer_s=optimizer_s,
                   scalar_bytes=scalar_bytes, threads_per_worker=threads_per_worker, compute_cv=compute_cv,
                   forward_s=forward, layers=parsed)


def apply_overrides(d: dict[str, Any], settings: Sequence[str] | None, path: str) -> dict[str, Any]:
    """--set intra.beta_Bps=1.25e7: a number into a (nested) field before validation."""
    for s in settings or []:
        key, eq, value = s.partition("=")
        if not eq:
            raise InputError(f"--set {s}: expected FIELD=VALUE, e.g. inter.beta_Bps=1.25e7")
        *parents, leaf = key.split(".")
        obj = d
        for k in parents:
            obj = obj.setdefault(k, {})
            if not isinstance(obj, dict):
                raise InputError(f"--set {s}: field '{k}' of {path} is not an object")
        try:
            obj[leaf] = json.loads(value)
        except json.JSONDecodeError:
            obj[leaf] = value
    return d


def load_link(d: dict[str, Any], link: str, path: str) -> Link:
    if not isinstance(d[link], dict):
        raise InputError(f"{path}: field '{link}' must be an object with alpha_s and beta_Bps")
    return Link(alpha_s=real(d[link], "alpha_s", path, f"{link}."),
                beta_Bps=real(d[link], "beta_Bps", path, f"{link}.", positive=True))


def load_network(path: str, settings: Sequence[str] | None = None, data: Any = None) -> Network:
    """The network: workers per node, alpha (s) and beta (bytes/s) within and between nodes."""
    d = read_json(path) if data is None else data
    if not isinstance(d, dict):
        raise InputError(f"{path}: a network is a JSON object")
    d = apply_overrides(d, settings, path)
    name = str(d.get("name", path))
    workers_per_node = whole(d, "workers_per_node", path, positive=True)
    collective_overhead_s = float(number(d, "collective_overhead_s", path, required=False, default=0.0) or 0.0)
    copy_Bps = number(d, "copy_Bps", path, required=False, positive=True)
    cpu_cores_per_node = number(d, "cpu_cores_per_node", path, required=False, positive=True)
    comm_uses_cpu = d.get("comm_uses_cpu", False)
    algorithm = d.get("algorithm", "ring")
    inter_algorithm = d.get("inter_algorithm", "ring")
    # compute_slowdown: {"<workers on one node>": factor}, measured: one worker's compute time when
    # that many workers run at once on the node, over its time alone (bench/simulator_validation.py
    # co-runs independent 1-rank processes). Replaces the time-sharing estimate of compute_scale.
    slowdown = d.get("compute_slowdown", {})
    if not isinstance(slowdown, dict):
        raise InputError(f"{path}: field 'compute_slowdown' must be an object {{\"workers\": factor}}")
    compute_slowdown: dict[int, float] = {}
    for key in slowdown:
        if not str(key).isdigit() or int(key) < 1:
            raise InputError(f"{path}: field 'compute_slowdown' has key {key!r}, not a worker count")
        compute_slowdown[int(key)] = real(slowdown, key, path, "compute_slowdown.", positive=True)
    if not isinstance(comm_uses_cpu, bool):
        raise InputError(f"{path}: field 'comm_uses_cpu' must be true or false, got {comm_uses_cpu!r}")
    if algorithm not in ALGORITHMS:
        raise InputError(f"{path}: field 'algorithm' is '{algorithm}', not one of {', '.join(ALGORITHMS)}")
    if inter_algorithm not in FLAT_ALGORITHMS:
        raise InputError(f"{path}: field 'inter_algorithm' is '{inter_algorithm}', "
                         f"not one of {', '.join(FLAT_ALGORITHMS)}")
    if "intra" not in d:
        raise InputError(f"{path}: missing field 'intra' (alpha_s and beta_Bps within a node)")
    intra = load_link(d, "intra", path)
    inter = load_link(d, "inter", path) if "inter" in d else None  # link() says so when it is needed
    return Network(name=name, path=path, workers_per_node=workers_per_node,
                   collective_overhead_s=collective_overhead_s, copy_Bps=copy_Bps,
                   cpu_cores_per_node=cpu_cores_per_node, comm_uses_cpu=comm_uses_cpu, algorithm=algorithm,
                   inter_algorithm=inter_algorithm, intra=intra, inter=inter, compute_slowdown=compute_slowdown)


def parse_workers(text: str) -> list[int]:
    try:
        workers = [int(w) for w in text.split(",")]
    except ValueError:
        raise InputError(f"--workers {text}: expected a comma list of positive integers") from None
    if not workers or min(workers) < 1:
        raise InputError(f"--workers {text}: expected a comma list of positive integers")
    return sorted(set(workers))


def parse_algorithms(text: str | None, network: Network) -> list[str]:
    algs = (text or network.algorithm).split(",")
    for a in algs:
        if a not in ALGORITHMS:
            raise InputError(f"--algorithm {a}: unknown algorithm, expected one of {', '.join(ALGORITHMS)}")
    return algs


def load_measured(path: str) -> list[MeasuredPoint]:
    """{"points": [{"workers": 2, "label": "gloo", "step_s": 0.006}, ...]}, step_s or efficiency each."""
    d = read_json(path)
    points = d.get("points") if isinstance(d, dict) else None
    if not isinstance(points, list):
        raise InputError(f"{path}: missing field 'points' (a list of measured points)")
    out = []
    for i, pt in enumerate(points):
        where = f"points[{i}]."
        if not isinstance(pt, dict):
            raise InputError(f"{path}: field 'points[{i}]' must be an object")
        q = MeasuredPoint(workers=whole(pt, "workers", path, where, positive=True),
                          label=str(pt.get("label", "measured")),
                          step_s=number(pt, "step_s", path, where, required=False, positive=True),
                          efficiency=number(pt, "efficiency", path, where, required=False, positive=True))
        if q.step_s is None and q.efficiency is None:
            raise InputError(f"{path}: missing field '{where}step_s' (or '{where}efficiency')")
        out.append(q)
    for q in out:  # efficiency against the same label's point at the fewest workers
        if q.efficiency is None and q.step_s is not None:
            base = min((r for r in out if r.label == q.label and r.step_s), key=lambda r: r.workers)
            assert base.step_s is not None
            q.efficiency = base.step_s / q.step_s
    return out
