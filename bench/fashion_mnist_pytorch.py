"""The Fashion-MNIST recipes of examples 01 (LeNet-5) and 02 (ResNet-20) in PyTorch 1.13, for the
accuracy and speed comparison: same architecture and init scheme, batch, SGD (momentum 0.9, weight
decay on weights only), per-iteration linear warmup (from 0.1x) into cosine decay, epochs,
normalization. Prints per-epoch lines and a final JSON line.

    OPENBLAS_NUM_THREADS=1 /usr/bin/python3 bench/fashion_mnist_pytorch.py --model lenet --threads 2

compare_fashion_mnist.py runs it with the peer setup of bench/peer.py; started by hand it selects
OpenBLAS itself. The final JSON line has a "peer" record (BLAS, OpenBLAS core, threads, oneDNN).
"""
import argparse
import gzip
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer  # noqa: E402

peer.exec_with_openblas()  # started by hand on a machine whose libblas.so.3 is not OpenBLAS

import torch  # noqa: E402

import torch_models  # noqa: E402

RECIPES = {"lenet": dict(batch=64, lr=0.05, weight_decay=5e-4, warmup=0.0, builder=torch_models.lenet5),
           "resnet20": dict(batch=128, lr=0.1, weight_decay=5e-4, warmup=0.5, builder=torch_models.resnet20)}
MEAN, STD = 0.2860, 0.3530


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    rank = data[3]
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(rank)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * rank).reshape(dims)


def load(directory, split):
    prefix = "train" if split == "train" else "t10k"
    images = read_idx(os.path.join(directory, f"{prefix}-images-idx3-ubyte.gz")).astype(np.float32) / 255.0
    labels = read_idx(os.path.join(directory, f"{prefix}-labels-idx1-ubyte.gz")).astype(np.int64)
    images = (images - MEAN) / STD
    return torch.from_numpy(images).unsqueeze(1), torch.from_numpy(labels)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=RECIPES, default="lenet")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--data-dir", default=os.environ.get("TESSERA_DATA_DIR", "/usr/share/datasets/fashion-mnist"))
    args = ap.parse_args()
    r = RECIPES[args.model]
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    x_train, y_train = load(args.data_dir, "train")
    x_test, y_test = load(args.data_dir, "test")
    model = r["builder"]()
    opt = torch.optim.SGD(torch_models.param_groups(model, r["weight_decay"]), lr=r["lr"], momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    n, batch = len(y_train), r["batch"]
    batches = math.ceil(n / batch)

    def lr_at(epoch):  # LinearWarmup(CosineLr) of Tessera's schedule.hpp
        cosine = r["lr"] * (1 + math.cos(math.pi * epoch / args.epochs)) / 2
        if epoch < r["warmup"]:
            return cosine * (0.1 + 0.9 * epoch / r["warmup"])
        return cosine

    total_time, final = 0.0, None
    for epoch in range(args.epochs):
        model.train()
        perm = torch.randperm(n)
        t0 = time.perf_counter()
        loss_sum, correct = 0.0, 0
        for b in range(batches):
            idx = perm[b * batch:(b + 1) * batch]
            for g in opt.param_groups:
                g["lr"] = lr_at(epoch + b / batches)
            xb, yb = x_train[idx], y_train[idx]
            opt.zero_grad()
            out = model(xb)
            loss = loss_fn(out, yb)
            loss.backward()
            opt.step()
            loss_sum += loss.item() * len(idx)
            correct += (out.argmax(1) == yb).sum().item()
        seconds = time.perf_counter() - t0
        total_time += seconds
        model.eval()
        with torch.no_grad():
            test_correct = sum((model(x_test[i:i + 500]).argmax(1) == y_test[i:i + 500]).sum().item()
                               for i in range(0, len(y_test), 500))
        final = test_correct / len(y_test)
        print(f"epoch {epoch + 1}: train loss {loss_sum / n:.4f} acc {100 * correct / n:.2f}% | "
              f"test acc {100 * final:.2f}% | {seconds:.1f} s, {n / seconds:.0f} img/s", flush=True)
    print(json.dumps({"framework": "pytorch", "model": args.model, "epochs": args.epochs, "test_accuracy": final,
                      "train_seconds": total_time, "images_per_second": n * args.epochs / total_time,
                      "threads": args.threads, "peer": peer.torch_record(torch, torch_models.BLAS)}))


if __name__ == "__main__":
    main()
