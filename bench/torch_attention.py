"""PyTorch twin of bench/attention.cpp: attention written as matmul, mask, softmax, matmul (nanoGPT's
CausalSelfAttention without flash, the only way in PyTorch 1.13, which has no
F.scaled_dot_product_attention), timed forward and backward, or its extra memory, as JSON on stdout.

    /usr/bin/python3 bench/torch_attention.py --t 1024 --threads 2
    /usr/bin/python3 bench/torch_attention.py --t 1024 --threads 2 --memory

  s = (q @ k^T) * (1 / sqrt(d));  s = s.masked_fill(~mask, -inf);  p = softmax(s, -1);  out = p @ v
with q, k, v (B, H, T, d) float32 of N(0, 1) values requiring gradients, and the causal mask a (T, T)
bool tensor built once, before anything is measured (nanoGPT keeps it in a buffer). Backward is
out.backward(g). --memory: one forward + backward in this fresh process; VmHWM after q, k, v, g and
the mask exist (the baseline) and after the backward; "extra" is the growth minus the returned
out, dq, dk, dv, as bench/attention.cpp reports it. Its JSON carries the "peer" record
(bench/peer.py); started by hand it selects OpenBLAS itself; compare_attention.py also picks
OPENBLAS_CORETYPE, OMP_WAIT_POLICY and the malloc setting.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer  # noqa: E402

peer.exec_with_openblas()  # started by hand on a machine whose libblas.so.3 is not OpenBLAS

import torch  # noqa: E402

BLAS = peer.verify_torch_blas(torch)  # refuses anything but OpenBLAS


def proc_status_bytes(key):
    """A 'VmHWM:' line of /proc/self/status in bytes (the kernel writes kB)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    sys.exit(f"torch_attention.py: /proc/self/status has no {key} line (not Linux?)")


def attention(q, k, v, mask):
    s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--causal", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--memory", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    start = proc_status_bytes("VmHWM")
    torch.manual_seed(5)
    shape = (args.batch, args.heads, args.t, args.head_dim)
    q, k, v = (torch.randn(shape).requires_grad_() for _ in range(3))
    g = torch.randn(shape)
    mask = torch.ones(args.t, args.t, dtype=torch.bool).tril() if args.causal else None
    record = {"framework": "pytorch", "kernel": "matmul, mask, softmax, matmul", "batch": args.batch,
              "heads": args.heads, "t": args.t, "head_dim": args.head_dim, "causal": bool(args.causal),
              "threads": args.threads, "peer": peer.torch_record(torch, BLAS)}
    if args.memory:
        baseline = proc_status_bytes("VmHWM")
        out = attention(q, k, v, mask)
        out.backward(g)
        peak = proc_status_bytes("VmHWM")
        returned = 4 * q.numel() * 4
        record.update({"mode": "memory", "vmhwm_start_bytes": start, "vmhwm_baseline_bytes": baseline,
                       "vmhwm_after_backward_bytes": peak, "returned_bytes": returned,
                       "extra_bytes": max(0, peak - baseline - returned),
                       "finite": bool(torch.isfinite(out).all() and torch.isfinite(q.grad).all())})
    else:
        forward_s, backward_s = [], []
        for i in range(args.warmup + args.steps):
            q.grad = k.grad = v.grad = None
            t0 = time.perf_counter()
            out = attention(q, k, v, mask)
            t1 = time.perf_counter()
            out.backward(g)
            t2 = time.perf_counter()
            if i >= args.warmup:
                forward_s.append(t1 - t0)
                backward_s.append(t2 - t1)
        record.update({"mode": "time", "steps": args.steps, "median_forward_s": statistics.median(forward_s),
                       "median_backward_s": statistics.median(backward_s),
                       "median_forward_backward_s": statistics.median([f + b for f, b in zip(forward_s, backward_s)]),
                       "finite": bool(torch.isfinite(out).all())})
    print(json.dumps(record))


if __name__ == "__main__":
    main()
