"""PyTorch twin of train_throughput: images/s of the same training steps, as JSON on stdout.

    /usr/bin/python3 bench/torch_throughput.py --threads 2 --models mlp,lenet,resnet20,resnet50_b8,resnet50_b32
                                                [--precision float32|bfloat16]

--precision bfloat16 runs forward and loss under torch.autocast("cpu", dtype=torch.bfloat16), PyTorch's
CPU mixed precision (float parameters; convolutions and linears in bfloat16 through oneDNN), the
peer of Tessera's CpuLocalBf16.

Its JSON carries a "peer" record (bench/peer.py: the BLAS serving sgemm_, OpenBLAS's core, threads,
wait policy, oneDNN) and, per model, the convolution kernels one training step ran. Started by
hand, it selects OpenBLAS itself; compare_pytorch.py also picks OPENBLAS_CORETYPE and OMP_WAIT_POLICY.
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

CONFIGS = {  # name: (builder, batch, channels, image, classes, default steps)
    "mlp": (lambda: torch_models.mlp(), 128, 1, 28, 10, 50),
    "lenet": (lambda: torch_models.lenet5(), 64, 1, 28, 10, 50),
    "resnet20": (lambda: torch_models.resnet20(), 64, 1, 28, 10, 10),
    "resnet50_b8": (lambda: torch_models.resnet50(), 8, 3, 224, 1000, 3),
    "resnet50_b32": (lambda: torch_models.resnet50(), 32, 3, 224, 1000, 3),
}


MAX_WARMUP_STEPS = 100000


def measure(name, steps_flag, warmup, precision="float32", warmup_seconds=0.5):
    build, batch, channels, image, classes, default_steps = CONFIGS[name]
    steps = steps_flag or default_steps
    torch.manual_seed(1)
    model = build()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    x = torch.randn(batch, channels, image, image)
    y = torch.randint(0, classes, (batch,))

    def step():
        opt.zero_grad(set_to_none=False)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16"):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()

    # Warm-up as train_throughput's: at least `warmup` steps (2 at most for ResNet-50), and more
    # until warmup_seconds have passed since the first began (at most MAX_WARMUP_STEPS).
    start = time.perf_counter()
    done, least = 0, max(1, min(warmup, 2) if name.startswith("resnet50") else warmup)
    while done < least or (done < MAX_WARMUP_STEPS and time.perf_counter() - start < warmup_seconds):
        step()
        done += 1
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    times.sort()
    median = times[len(times) // 2]
    return {"model": name, "batch": batch, "image": image, "steps": steps, "median_step_s": median,
            "images_per_second": batch / median,
            "conv_kernels": peer.conv_kernels(torch, step) if name != "mlp" else []}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(CONFIGS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--warmup-seconds", type=float, default=0.5)
    ap.add_argument("--precision", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for name in args.models.split(","):
        r = measure(name, args.steps, args.warmup, args.precision, args.warmup_seconds)
        print(f"{name:13} batch {r['batch']:3}  {r['images_per_second']:8.1f} img/s", file=sys.stderr)
        results.append(r)
    print(json.dumps({"framework": "pytorch", "version": torch.__version__, "threads": args.threads,
                      "precision": args.precision,
                      "peer": peer.torch_record(torch, torch_models.BLAS), "results": results}))


if __name__ == "__main__":
    main()
