"""Inputs measured on a real run: a model profile from a Timeline trace and a checkpoint
(`tessera-simulate profile`), and a single-node network fitted to bench/collectives.py results
(`tessera-simulate fit`). Both return the JSON document they write."""
from __future__ import annotations

import json
import math
import statistics
import struct
import sys
from collections.abc import Sequence
from typing import Any

from tessera_tools.simulate.collectives import flat_allreduce_s
from tessera_tools.simulate.data_parallel import FIRST_BUCKET_BYTES, bucket_plan
from tessera_tools.simulate.inputs import InputError, read_json


def safetensors_header(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(size))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not a safetensors file ({e})") from None
    header.pop("__metadata__", None)
    return header


def parameters_of_checkpoint(path: str) -> list[tuple[str, int]]:
    """(name, bytes) of every trained parameter in model order: tensors that have optimizer state
    ("optim.<state>.<name>"); buffers such as BatchNorm's running statistics have none."""
    header = safetensors_header(path)
    tensors = sorted(((v["data_offsets"][0], k, v["data_offsets"][1] - v["data_offsets"][0])
                      for k, v in header.items() if not k.startswith("optim.")))
    state = {k.split(".", 2)[2] for k in header if k.startswith("optim.") and k.count(".") >= 2}
    params = [(k, n) for _, k, n in tensors if k in state]
    if not params:
        raise InputError(f"{path}: no tensor has optimizer state ('optim.<state>.<name>'); write the checkpoint "
                         f"after at least one step of an optimizer with state (SGD with momentum)")
    return params


def profile_from_trace(trace_path: str, checkpoint_path: str, bucket_kib: int, batch: int, skip: int,
                       name: str | None) -> dict[str, Any]:
    """Per-layer backward times from DataParallel's bucket launch times in a Timeline trace.

    A bucket goes out from the grad_ready hook that completes it, so its launch time is the moment
    the backward of its last parameter's layer ended. With small buckets (--bucket-kib=1 in the
    run) almost every layer closes a bucket of its own; layers that share a bucket share the
    interval between two launches in proportion to their parameter bytes. The last bucket goes out
    in finish(): its layer ends with backward."""
    params = parameters_of_checkpoint(checkpoint_path)[::-1]  # DataParallel's visiting order
    layer_names: list[str] = []
    for pname, _ in params:
        lname = pname.rsplit(".", 1)[0]
        if not layer_names or layer_names[-1] != lname:
            layer_names.append(lname)
    plan = bucket_plan([n for _, n in params], bucket_kib * 1024, min(FIRST_BUCKET_BYTES, bucket_kib * 1024))
    events = [e for e in read_json(trace_path).get("traceEvents", []) if e.get("ph") == "X" and e.get("pid") == 0]
    steps: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for e in events:
        if e["name"] == "forward":
            current = {"forward": e["dur"], "launch": []}
            steps.append(current)
        elif current is not None and e["name"] == "backward":
            current["backward"], current["t0"] = e["dur"], e["ts"]
        elif current is not None and e["name"].startswith("all_reduce bucket "):
            current["launch"].append(e["ts"])
        elif current is not None and e["name"] == "optimizer step":
            current["optimizer"] = e["dur"]
    steps = [s for s in steps[skip:] if "backward" in s and "optimizer" in s]
    if not steps:
        raise InputError(f"{trace_path}: no complete training step after the first {skip} (forward, backward, "
                         f"optimizer step spans of rank 0); was it written with --trace by a Trainer?")
    if any(len(s["launch"]) != len(plan) for s in steps):
        raise InputError(f"{trace_path}: {len(steps[0]['launch'])} buckets per step, but the checkpoint's "
                         f"parameters give {len(plan)} at --bucket-kib={bucket_kib}: pass the run's --bucket-kib")
    layer_index = {n: i for i, n in enumerate(layer_names)}
    closes = [layer_index[params[b[-1]][0].rsplit(".", 1)[0]] for b in plan]
    layer_bytes = [0] * len(layer_names)
    param_bytes: list[list[int]] = [[] for _ in layer_names]
    for pname, n in params:
        layer_bytes[layer_index[pname.rsplit(".", 1)[0]]] += n
        param_bytes[layer_index[pname.rsplit(".", 1)[0]]].append(n)
    per_layer: list[list[float]] = [[] for _ in layer_names]
    for s in steps:
        ends = {closes[k]: s["launch"][k] - s["t0"] for k in range(len(plan) - 1)}
        ends[len(layer_names) - 1] = s["backward"]
        prev_layer, prev_t = -1, 0.0
        for i in sorted(ends):
            span = range(prev_layer + 1, i + 1)
            total = sum(layer_bytes[j] for j in span) or len(span)
            for j in span:
                per_layer[j].append((ends[i] - prev_t) * (layer_bytes[j] or 1) / total)
            prev_layer, prev_t = i, ends[i]
    backward = statistics.median(s["backward"] for s in steps)
    # compute_cv from the median absolute deviation (x 1.4826: the standard deviation of a normal):
    # a rare preempted step on a shared machine would otherwise dominate it.
    busy = [s["forward"] + s["backward"] for s in steps]
    mid = statistics.median(busy)
    cv = 1.4826 * statistics.median(abs(x - mid) for x in busy) / mid if mid > 0 else 0.0
    median_parts = [statistics.median(v) for v in per_layer]
    scale = backward / sum(median_parts)  # medians of parts, rescaled to the median whole
    return {
        "name": name or f"profile of {trace_path}",
        "source": (f"tessera-simulate profile: {len(steps)} steps of {trace_path} (first {skip} skipped), "
                   f"parameters of {checkpoint_path}; per-layer backward from {len(plan)} bucket launch times "
                   f"for {len(layer_names)} layers (layers sharing a bucket split by parameter bytes); "
                   f"forward split like backward; medians over steps, microseconds -> seconds; compute_cv: "
                   f"1.4826 x median absolute deviation / median of forward + backward over the steps"),
        "batch_per_worker": batch, "scalar_bytes": 4, "threads_per_worker": 1, "compute_cv": cv,
        "forward_s": statistics.median(s["forward"] for s in steps) * 1e-6,
        "optimizer_s": statistics.median(s["optimizer"] for s in steps) * 1e-6,
        "layers": [{"name": layer_names[i], "backward_s": median_parts[i] * scale * 1e-6,
                    "grad_bytes": layer_bytes[i], "param_bytes": param_bytes[i]} for i in range(len(layer_names))],
    }


def fit_network(path: str, comm: str, ranks: Sequence[int], alg: str, cores: int | None,
                max_bytes: int | None = None, workers_per_node: int | None = None) -> dict[str, Any]:
    """alpha and beta of `alg` fitted to Tessera's measured all_reduce times (bench/collectives.py
    output), least squares on relative error so that small and large messages count alike."""
    rows: list[dict[str, Any]] = []
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror}") from None
    for number_, line in enumerate(lines, 1):
        try:
            r = json.loads(line) if line.strip().startswith("{") else {}
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{number_}: not a JSON line: {e}") from None
        if (r.get("bench") == "collectives" and r.get("comm") == comm and r.get("impl") == "tessera"
                and r.get("op") == "all_reduce" and r.get("ranks") in ranks
                and (max_bytes is None or r.get("bytes", 0) <= max_bytes)):
            rows.append(r)
    if not rows:
        raise InputError(f"{path}: no Tessera all_reduce rows for comm '{comm}' on {ranks} ranks")
    # t = alpha * A + (1/beta) * B, A and B the algorithm's coefficients at this size.
    sxx = sxy = syy = sx = sy = 0.0
    for r in rows:
        p, n, t = r["ranks"], r["bytes"], r["time_us"] * 1e-6
        a = flat_allreduce_s(alg, p, n, 1.0, math.inf) / t
        b = flat_allreduce_s(alg, p, n, 0.0, 1.0) / t
        sxx, sxy, syy, sx, sy = sxx + a * a, sxy + a * b, syy + b * b, sx + a, sy + b
    det = sxx * syy - sxy * sxy
    if len(rows) < 2 or det <= 1e-12 * sxx * syy:
        raise InputError(f"{path}: {len(rows)} row(s) for comm '{comm}' cannot separate alpha from beta; "
                         f"fit over several message sizes")
    alpha, inv_beta = (syy * sx - sxy * sy) / det, (sxx * sy - sxy * sx) / det
    if alpha <= 0 or inv_beta <= 0:
        raise InputError(f"{path}: the fit of '{alg}' to {comm} gives alpha={alpha:.3g} s, 1/beta={inv_beta:.3g} s/B; "
                         f"the times do not follow alpha + n/beta (try other --ranks or --algorithm)")
    net: dict[str, Any] = {"name": f"this machine, {comm} (fitted)", "workers_per_node": workers_per_node or max(ranks),
           "source": f"tessera-simulate fit: {alg} alpha-beta least squares (relative error) on {len(rows)} "
                     f"Tessera all_reduce rows of {path}, ranks {sorted(set(ranks))}"
                     + (f", messages <= {max_bytes} B" if max_bytes else ""),
           "algorithm": alg, "intra": {"alpha_s": alpha, "beta_Bps": 1 / inv_beta}}
    if cores:
        net.update(cpu_cores_per_node=cores, comm_uses_cpu=True)
    print(f"{'ranks':>5} {'bytes':>10} {'measured us':>12} {'fitted us':>10} {'error':>7}", file=sys.stderr)
    for r in rows:
        fit = flat_allreduce_s(alg, r["ranks"], r["bytes"], alpha, 1 / inv_beta) * 1e6
        print(f"{r['ranks']:>5} {r['bytes']:>10} {r['time_us']:>12.1f} {fit:>10.1f} "
              f"{fit / r['time_us'] - 1:>+7.0%}", file=sys.stderr)
    return net

