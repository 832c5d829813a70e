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
Tessera runs five times: with its default cuDNN algorithms (heuristics, deterministic first), with
TESSERA_CUDNN_BENCHMARK=1 (algorithms timed once per shape, the fastest kept: the peer's setting),
tessera_* and tessera_cudnn_benchmark_* in the JSON, both in float32 math and NCHW; that again in
channels_last (--memory-format=channels_last: NHWC activations, cuDNN's NHWC tensor-core kernels),
tessera_cudnn_benchmark_channels_last_*; and with that and TESSERA_MATH_PRECISION=tf32 (TF32
tensor cores in convolutions and GEMMs), tessera_tf32_*, in channels_last, which is compared with
the peer's default TF32 run (pytorch_tf32_tessera_tf32_ratio).
bfloat16: Tessera in channels_last with TESSERA_MATH_PRECISION=bfloat16 (and cuDNN benchmark: bf16 copies of each
convolution's operands, bf16 tensor-core products with fp32 sums, float weights and activations,
kernels/cuda/conv2d.cuh) against PyTorch under torch.autocast(dtype=torch.bfloat16), both memory
formats tried (tessera_bf16_*, pytorch_bf16_*). Peak memory: Tessera's from example 08's memory
lines (the model, the momentum and the first step's peak above them, requested bytes), PyTorch's
torch.cuda.max_memory_allocated over its timed loop (*_peak_mib).
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


MIB_MEASURED = re.compile(r"\| ([0-9.]+) MiB measured")


def tessera_images_per_second(binary, batch, steps, cudnn_benchmark=False, precision="float32",
                              memory_format="contiguous"):
    """Runs example 08 and reads its 'steady state: X img/s' line (the first step is warm-up, and
    with cudnn_benchmark it is also where cuDNN's algorithms are timed, as in PyTorch); returns
    (images/s, peak MiB): the peak is the sum of its three 'memory per rank' figures (parameters,
    gradients and buffers; momentum; the first step's peak above them), None if it printed none."""
    env = dict(os.environ, TESSERA_CUDNN_BENCHMARK="1" if cudnn_benchmark else "0", TESSERA_MATH_PRECISION=precision)
    out = subprocess.run([binary, f"--batch={batch}", f"--steps={steps}", f"--memory-format={memory_format}"],
                         capture_output=True, text=True, timeout=600, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{binary} --batch={batch} exited {out.returncode}: {out.stderr.strip()[-2000:]}")
    m = re.search(r"steady state: ([0-9.]+) img/s", out.stdout)
    if not m:
        raise RuntimeError(f"{binary} printed no 'steady state' line:\n{out.stdout[-2000:]}")
    memory = [float(x) for line in out.stdout.splitlines() if line.startswith("memory per rank:")
              for x in MIB_MEASURED.findall(line)]
    return float(m.group(1)), (round(sum(memory), 1) if len(memory) == 3 else None)


def torch_images_per_second(torch, torchvision, batch, steps, channels_last, tf32, bf16=False):
    """The same training step in PyTorch, under autocast to bfloat16 when bf16; returns (steady-state
    images/s, peak MiB allocated over the run). The first 2 steps warm up."""
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
    torch.cuda.reset_peak_memory_stats(device)
    warmup = 2
    for step in range(warmup + steps):
        if step == warmup:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        loss.item()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) / 2**20
    del model, opt, x, y
    torch.cuda.empty_cache()
    return batch * steps / seconds, round(peak, 1)


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
        # Tessera's runs: (cudnn_benchmark, precision, memory format) -> [(images/s, peak MiB)]. NCHW
        # in float32 (against earlier results), channels_last (example 08's default on the GPU) in
        # every precision.
        mine = {"tessera": (False, "float32", "contiguous"),
                "tessera_cudnn_benchmark": (True, "float32", "contiguous"),
                "tessera_cudnn_benchmark_channels_last": (True, "float32", "channels_last"),
                "tessera_tf32": (True, "tf32", "channels_last"), "tessera_bf16": (True, "bfloat16", "channels_last")}
        tessera = {k: [] for k in mine}
        # The peer's: (precision, channels_last) -> [(images/s, peak MiB)]
        configs = [(p, cl) for p in ("tf32", "fp32", "bf16") for cl in (False, True)]
        peer = {c: [] for c in configs}
        for run in range(args.runs):  # alternate Tessera and PyTorch so drift hits both alike
            for k, (bench, precision, memory_format) in mine.items():
                tessera[k].append(tessera_images_per_second(args.tessera, batch, args.steps + 1, cudnn_benchmark=bench,
                                                            precision=precision, memory_format=memory_format))
            for c in configs:
                peer[c].append(torch_images_per_second(torch, torchvision, batch, args.steps, c[1], c[0] == "tf32",
                                                       bf16=c[0] == "bf16"))
            print(f"batch {batch} run {run + 1}: " + ", ".join(f"{k} {v[-1][0]:.1f}" for k, v in tessera.items()) +
                  "; pytorch " + ", ".join(f"{c[0]} {'channels_last' if c[1] else 'NCHW'} {peer[c][-1][0]:.1f}"
                                           for c in configs) + " img/s", file=sys.stderr, flush=True)
        speed = {k: statistics.median(r[0] for r in v) for k, v in tessera.items()}
        # tessera_*: cuDNN's heuristics (the default); tessera_cudnn_benchmark_*: algorithms timed
        # once per shape (TESSERA_CUDNN_BENCHMARK=1), the setting the peer runs with.
        row = {"model": "resnet50", "batch": batch}
        for k, v in tessera.items():
            row.update({k + "_img_s": round(speed[k], 1), k + "_runs": [r[0] for r in v], k + "_peak_mib": v[-1][1]})
        t, tb = speed["tessera"], speed["tessera_cudnn_benchmark"]
        for precision in ("tf32", "fp32", "bf16"):
            key = "pytorch_" + precision
            best_cl = statistics.median(r[0] for r in peer[(precision, True)]) > \
                statistics.median(r[0] for r in peer[(precision, False)])
            runs = peer[(precision, best_cl)]
            p = statistics.median(r[0] for r in runs)
            other = statistics.median(r[0] for r in peer[(precision, not best_cl)])
            row.update({key + "_img_s": round(p, 1), key + "_runs": [r[0] for r in runs],
                        key + "_peak_mib": runs[-1][1], key + "_memory_format": "channels_last" if best_cl else "NCHW",
                        key + "_other_format_img_s": round(other, 1)})
            if precision != "bf16":
                row.update({key + "_ratio": round(t / p, 3), key + "_cudnn_benchmark_ratio": round(tb / p, 3),
                            key + "_cudnn_benchmark_channels_last_ratio":
                                round(speed["tessera_cudnn_benchmark_channels_last"] / p, 3)})
        row["pytorch_tf32_tessera_tf32_ratio"] = round(speed["tessera_tf32"] / row["pytorch_tf32_img_s"], 3)
        row["pytorch_bf16_tessera_bf16_ratio"] = round(speed["tessera_bf16"] / row["pytorch_bf16_img_s"], 3)
        rows.append(row)
    result = {
        "benchmark": "gpu_resnet50", "gpu": gpu, "cpu": cpu_model(),
        "dtype": "float32 storage (tf32 and bf16 products in the *_tf32_* and *_bf16_* runs)",
        "runs": args.runs, "steps_per_run": args.steps, "statistic": "median images/s",
        "peer": {"framework": "PyTorch " + torch.__version__, "cuda": torch.version.cuda,
                 "cudnn": torch.backends.cudnn.version(), "cudnn_benchmark": True,
                 "cudnn_allow_tf32": "pytorch_tf32_*: True (PyTorch's default); pytorch_fp32_*: False",
                 "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                 "autocast": "pytorch_bf16_*: torch.autocast('cuda', dtype=torch.bfloat16) over forward and loss",
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
                    f"({r['pytorch_fp32_cudnn_benchmark_ratio']}); tessera bf16 {r['tessera_bf16_img_s']}, pytorch "
                    f"bf16 {r['pytorch_bf16_img_s']} ({r['pytorch_bf16_memory_format']}), ratio "
                    f"{r['pytorch_bf16_tessera_bf16_ratio']}; peak MiB tessera "
                    f"{r['tessera_cudnn_benchmark_peak_mib']}, pytorch fp32 {r['pytorch_fp32_peak_mib']}"
                    for r in rows), file=sys.stderr)


if __name__ == "__main__":
    main()
