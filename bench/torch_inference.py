"""PyTorch twin of inference_throughput: ResNet-50 inference images/s, or the peak memory of one
ResNet-50 training step, as JSON on stdout.

    /usr/bin/python3 bench/torch_inference.py --threads 2 --batches 1,8
    /usr/bin/python3 bench/torch_inference.py --threads 2 --memory --batch 32

Inference: torchvision resnet50 (3x224x224, 1000 classes), model.eval(), forward only under a
grad-free context. Both torch.no_grad() and torch.inference_mode() are timed (same warm-up and
steps each); the faster one is reported as the result, both are recorded ("contexts").
--memory: one SGD (momentum) training step in this fresh process; VmHWM (/proc/self/status) at
start, after model + optimizer + batch creation (the baseline) and after the step, as
inference_throughput --memory reports it. Its JSON carries the "peer" record (bench/peer.py); started
by hand it selects OpenBLAS itself; compare_inference.py also picks OPENBLAS_CORETYPE and OMP_WAIT_POLICY.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer  # noqa: E402

peer.exec_with_openblas()  # started by hand on a machine whose libblas.so.3 is not OpenBLAS

import torch  # noqa: E402

import torch_models  # noqa: E402


def proc_status_bytes(key):
    """A 'VmHWM:' / 'VmRSS:' line of /proc/self/status in bytes (the kernel writes kB)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    sys.exit(f"torch_inference.py: /proc/self/status has no {key} line (not Linux?)")


def time_forwards(model, x, context, warmup, steps):
    with context():
        for _ in range(max(1, warmup)):
            out = model(x)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = model(x)
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2], bool(torch.isfinite(out).all())


def measure_inference(model, batch, steps_flag, warmup):
    steps = steps_flag or (20 if batch < 8 else 10)
    torch.manual_seed(11)
    x = torch.empty(batch, 3, 224, 224).uniform_(-1, 1)
    contexts = {}
    for name, context in (("no_grad", torch.no_grad), ("inference_mode", torch.inference_mode)):
        median, finite = time_forwards(model, x, context, warmup, steps)
        contexts[name] = {"median_forward_s": median, "images_per_second": batch / median, "logits_finite": finite}
    best = min(contexts, key=lambda k: contexts[k]["median_forward_s"])
    with torch.no_grad():
        kernels = peer.conv_kernels(torch, lambda: model(x))
    return {"model": "resnet50", "batch": batch, "image": 224, "steps": steps,
            "median_forward_s": contexts[best]["median_forward_s"],
            "images_per_second": contexts[best]["images_per_second"], "context": best, "contexts": contexts,
            "logits_finite": contexts[best]["logits_finite"], "conv_kernels": kernels}


def run_memory(batch, threads):
    hwm_start = proc_status_bytes("VmHWM")
    torch.manual_seed(1)
    model = torch_models.resnet50()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    x = torch.randn(batch, 3, 224, 224)
    y = torch.randint(0, 1000, (batch,))
    hwm_baseline = proc_status_bytes("VmHWM")
    rss_baseline = proc_status_bytes("VmRSS")
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=False)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    step_s = time.perf_counter() - t0
    hwm_after = proc_status_bytes("VmHWM")
    print(f"resnet50 b{batch} training step: VmHWM {hwm_after / 2**20:.1f} MiB (baseline after "
          f"model+optimizer+batch {hwm_baseline / 2**20:.1f} MiB, growth {(hwm_after - hwm_baseline) / 2**20:.1f} MiB)",
          file=sys.stderr)
    return {"framework": "pytorch", "mode": "memory", "version": torch.__version__, "threads": threads,
            "model": "resnet50", "batch": batch, "image": 224, "step_s": step_s, "loss": float(loss),
            "vmhwm_start_bytes": hwm_start, "vmhwm_baseline_bytes": hwm_baseline, "vmrss_baseline_bytes": rss_baseline,
            "vmhwm_after_step_bytes": hwm_after, "vmhwm_step_growth_bytes": hwm_after - hwm_baseline,
            "peer": peer.torch_record(torch, torch_models.BLAS)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory:
        print(json.dumps(run_memory(args.batch, args.threads)))
        return
    torch.manual_seed(1)
    model = torch_models.resnet50()
    model.eval()
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        r = measure_inference(model, batch, args.steps, args.warmup)
        print(f"resnet50 eval batch {batch:3}  {r['images_per_second']:8.1f} img/s  ({r['context']}; "
              + ", ".join(f"{k} {v['images_per_second']:.1f}" for k, v in r["contexts"].items()) + ")",
              file=sys.stderr)
        results.append(r)
    print(json.dumps({"framework": "pytorch", "mode": "inference", "version": torch.__version__,
                      "threads": args.threads, "peer": peer.torch_record(torch, torch_models.BLAS),
                      "results": results}))


if __name__ == "__main__":
    main()
