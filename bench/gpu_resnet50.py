#!/usr/bin/env python3
"""ResNet-50 training throughput on one GPU: Tessera's example 08 (CudaLocal: cuDNN convolutions,
cuBLAS GEMMs, float32) next to PyTorch on the same GPU, in alternating runs, median images/s.

  bench/gpu_resnet50.py --tessera build/examples/08_resnet50_cuda [--batches 32,64] [--runs 3]
                        [--steps 12] [--out FILE]

Both train ResNet-50 v1.5 (torchvision's architecture, 1000 classes, 224x224) with SGD (momentum 0.9,
weight decay 1e-4) and cross-entropy on synthetic images; a step is forward, backward and update,
and both read the loss back to the host every step (Tessera's train_step returns it; the PyTorch
loop calls loss.item()), so a step's time is the GPU's time, not a launch queue's.

The peer at its best: cudnn.benchmark on, its data already on the GPU (Tessera copies each batch
from the host), both memory formats (NCHW and channels_last) tried, the faster kept. It runs twice:
with PyTorch's default TF32 convolutions (cudnn.allow_tf32 = True: tensor cores, 10-bit mantissa
products), and with TF32 off, the math Tessera uses in float32 (CUDNN_FMA_MATH, full fp32 products,
kernels/cuda/conv2d.cuh), so the JSON separates the cost of the precision choice from the rest.
Tessera runs three times: with its default cuDNN algorithms (heuristics, deterministic first), with
TESSERA_CUDNN_BENCHMARK=1 (algorithms timed once per shape, the fastest kept: the peer's setting),
tessera_* and tessera_cudnn_benchmark_* in the JSON, both in float32 math; and with that and
TESSERA_MATH_PRECISION=tf32 (TF32 tensor cores in convolutions and GEMMs), tessera_tf32_*, which
is compared with the peer's default TF32 run (pytorch_tf32_tessera_tf32_ratio).
The JSON records the peer's configuration. No GPU bench is a timed test: this prints JSON.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import cpu_model, default_result, write_result  # noqa: E402


def tessera_images_per_second(binary, batch, steps, cudnn_benchmark=False, precision="float32"):
    """Runs example 08 and reads its 'steady state: X img/s' line (the first step is warm-up, and
    with cudnn_benchmark it is also where cuDNN's algorithms are timed, as in PyTorch)."""
    env = dict(os.environ, TESSERA_CUDNN_BENCHMARK="1" if cudnn_benchmark else "0", TESSERA_MATH_PRECISION=precision)
    out = subprocess.run([binary, f"--batch={batch}", f"--steps={steps}"], capture_output=True, text=True,
                         timeout=600, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{binary} --batch={batch} exited {out.returncode}: {out.stderr.strip()[-2000:]}")
    m = re.search(r"steady state: ([0-9.]+) img/s", out.stdout)
    if not m:
        raise RuntimeError(f"{binary} printed no 'steady state' line:\n{out.stdout[-2000:]}")
    return float(m.group(1))


def torch_images_per_second(torch, torchvision, batch, steps, channels_last, tf32):
    """The same training step in PyTorch; returns steady-state images/s (first 2 steps warm up)."""
    torch.backends.cudnn.allow_tf32 = tf32
    device = torch.device("cuda")
    model = torchvision.models.resnet50(num_classes=1000, zero_init_residual=True).to(device)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=memory_format)
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    lr = 0.1 * batch / 256
    opt = torch.optim.SGD([{"params": decay, "weight_decay": 1e-4}, {"params": no_decay, "weight_decay": 0.0}],
                          lr=lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    gen = torch.Generator(device=device).manual_seed(7)
    x = torch.randn(batch, 3, 224, 224, device=device, generator=gen).contiguous(memory_format=memory_format)
    y = torch.randint(0, 1000, (batch,), device=device, generator=gen)
    model.train()
    warmup = 2
    for step in range(warmup + steps):
        if step == warmup:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        loss.item()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    del model, opt, x, y
    torch.cuda.empty_cache()
    return batch * steps / seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tessera", required=True, help="path of the 08_resnet50_cuda binary")
    ap.add_argument("--batches", default="32,64")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default=default_result("gpu_resnet50"))
    args = ap.parse_args()

    import torch
    import torchvision
    if not torch.cuda.is_available():
        print("no CUDA device visible: nothing measured", file=sys.stderr)
        sys.exit(77)
    torch.backends.cudnn.benchmark = True
    gpu = torch.cuda.get_device_name(0)

    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        tessera, tessera_bench, tessera_tf32 = [], [], []
        configs = [(tf32, cl) for tf32 in (True, False) for cl in (False, True)]
        peer = {c: [] for c in configs}
        for run in range(args.runs):  # alternate Tessera and PyTorch so drift hits both alike
            tessera.append(tessera_images_per_second(args.tessera, batch, args.steps + 1))
            tessera_bench.append(tessera_images_per_second(args.tessera, batch, args.steps + 1, cudnn_benchmark=True))
            tessera_tf32.append(tessera_images_per_second(args.tessera, batch, args.steps + 1, cudnn_benchmark=True,
                                                          precision="tf32"))
            for c in configs:
                peer[c].append(torch_images_per_second(torch, torchvision, batch, args.steps, c[1], c[0]))
            print(f"batch {batch} run {run + 1}: tessera {tessera[-1]:.1f}, cudnn benchmark {tessera_bench[-1]:.1f}, "
                  f"tf32 {tessera_tf32[-1]:.1f}; "
                  "pytorch " +
                  ", ".join(f"{'tf32' if c[0] else 'fp32'} {'channels_last' if c[1] else 'NCHW'} {peer[c][-1]:.1f}"
                            for c in configs) + " img/s", file=sys.stderr, flush=True)
        t, tb, tt = statistics.median(tessera), statistics.median(tessera_bench), statistics.median(tessera_tf32)
        # tessera_*: cuDNN's heuristics (the default); tessera_cudnn_benchmark_*: algorithms timed
        # once per shape (TESSERA_CUDNN_BENCHMARK=1), the setting the peer runs with.
        row = {"model": "resnet50", "batch": batch, "tessera_img_s": round(t, 1), "tessera_runs": tessera,
               "tessera_cudnn_benchmark_img_s": round(tb, 1), "tessera_cudnn_benchmark_runs": tessera_bench,
               "tessera_tf32_img_s": round(tt, 1), "tessera_tf32_runs": tessera_tf32}
        for tf32, key in ((True, "pytorch_tf32"), (False, "pytorch_fp32")):
            best_cl = statistics.median(peer[(tf32, True)]) > statistics.median(peer[(tf32, False)])
            p = statistics.median(peer[(tf32, best_cl)])
            row.update({key + "_img_s": round(p, 1), key + "_ratio": round(t / p, 3),
                        key + "_cudnn_benchmark_ratio": round(tb / p, 3), key + "_runs": peer[(tf32, best_cl)],
                        key + "_memory_format": "channels_last" if best_cl else "NCHW",
                        key + "_other_format_img_s": round(statistics.median(peer[(tf32, not best_cl)]), 1)})
        row["pytorch_tf32_tessera_tf32_ratio"] = round(tt / row["pytorch_tf32_img_s"], 3)
        rows.append(row)
    result = {
        "benchmark": "gpu_resnet50", "gpu": gpu, "cpu": cpu_model(), "dtype": "float32",
        "runs": args.runs, "steps_per_run": args.steps, "statistic": "median images/s",
        "peer": {"framework": "PyTorch " + torch.__version__, "cuda": torch.version.cuda,
                 "cudnn": torch.backends.cudnn.version(), "cudnn_benchmark": True,
                 "cudnn_allow_tf32": "pytorch_tf32_*: True (PyTorch's default); pytorch_fp32_*: False",
                 "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                 "data": "on the GPU before timing"},
        "rows": rows,
    }
    write_result(result, args.out)
    print("\n".join(f"resnet50 b{r['batch']}: tessera {r['tessera_img_s']} img/s (cudnn benchmark "
                    f"{r['tessera_cudnn_benchmark_img_s']}); pytorch tf32 {r['pytorch_tf32_img_s']} "
                    f"({r['pytorch_tf32_memory_format']}), ratio {r['pytorch_tf32_ratio']} "
                    f"({r['pytorch_tf32_cudnn_benchmark_ratio']}; tessera tf32 {r['tessera_tf32_img_s']}, "
                    f"{r['pytorch_tf32_tessera_tf32_ratio']}); pytorch fp32 {r['pytorch_fp32_img_s']} "
                    f"({r['pytorch_fp32_memory_format']}), ratio {r['pytorch_fp32_ratio']} "
                    f"({r['pytorch_fp32_cudnn_benchmark_ratio']})"
                    for r in rows), file=sys.stderr)


if __name__ == "__main__":
    main()
