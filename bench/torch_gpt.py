"""PyTorch twin of example 15_gpt: the same GPT (nanoGPT's model.py, as tools/reference/gen_gpt.py
rebuilds it), the same data, windows, recipe and starting weights, trained in PyTorch 1.13 on one
process; one JSON line on stdout with the same keys as the example's --json.

    /usr/bin/python3 bench/torch_gpt.py --data-dir build/data/fortunes --init init.safetensors --threads 2

Same data: the example's token files (train.bin, val.bin: uint16, nanoGPT's layout) and the same
windows, drawn as TokenLoader draws them (data/token_loader.hpp: window j of global batch i of
epoch e starts at splitmix64(epoch_seed(seed, e) ^ k * golden) * (n - T) >> 64 with k = i G + j;
an "epoch" is one evaluation interval). Same weights: --init is the example's --init-out (nanoGPT's
keys; the tied lm_head.weight is wte's). Same recipe: AdamW with nanoGPT's two parameter groups
(weight decay on tensors of 2 or more dimensions only), betas (0.9, beta2), eps 1e-8, no gradient
clipping (Tessera has none yet: the example runs without it and so does the twin), nanoGPT's get_lr
(linear warmup to lr, cosine to min_lr) set before every step, and the validation loss over the
same consecutive windows of val.bin, batches of 32, the mean over every token. Timing: the training
steps only (the batch's assembly included, evaluation excluded), as the example's Trainer counts.
Dropout 0 (nanoGPT's pretraining setting, and Tessera's GPT has none).
"""
import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tools", "reference"))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
import peer  # noqa: E402

peer.exec_with_openblas()  # started by hand on a machine whose libblas.so.3 is not OpenBLAS

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gen_gpt import GPT  # noqa: E402
from tessera_tools.safetensors_io import load  # noqa: E402

BLAS = peer.verify_torch_blas(torch)  # refuses anything but OpenBLAS
MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def splitmix(z):
    z = (z + GOLDEN) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def epoch_seed(seed, epoch):
    """data/loader.hpp's epoch_seed."""
    return splitmix(splitmix(seed) ^ epoch)


def window_starts(seed, epoch, batch_index, global_batch, n, block):
    """TokenLoader's random window starts of one global batch."""
    s = epoch_seed(seed, epoch)
    starts = []
    for j in range(global_batch):
        k = batch_index * global_batch + j
        z = splitmix(s ^ ((k * GOLDEN) & MASK))
        starts.append((z * (n - block)) >> 64)
    return starts


def batch_of(tokens, starts, block):
    x = np.stack([tokens[s:s + block] for s in starts]).astype(np.int64)
    y = np.stack([tokens[s + 1:s + 1 + block] for s in starts]).astype(np.int64)
    return torch.from_numpy(x), torch.from_numpy(y)


def get_lr(it, a):
    """nanoGPT's get_lr, as the example writes it."""
    if it < a.warmup:
        return a.lr * (it + 1) / (a.warmup + 1)
    r = min(1.0, (it - a.warmup) / max(1.0, a.steps - a.warmup))
    return a.min_lr + 0.5 * (1 + math.cos(math.pi * r)) * (a.lr - a.min_lr)


@torch.no_grad()
def validation_loss(model, val, block, val_batches):
    """Mean loss over every token of consecutive windows of 32 (TokenLoader without shuffle)."""
    model.eval()
    windows = (len(val) - 1) // block
    batches = -(-windows // 32)
    if val_batches > 0:
        batches = min(batches, val_batches)
    total, count = 0.0, 0
    for b in range(batches):
        starts = [k * block for k in range(b * 32, min((b + 1) * 32, windows))]
        x, y = batch_of(val, starts, block)
        _, loss = model(x, y)
        total += loss.item() * y.numel()
        count += y.numel()
    model.train()
    return total / count


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--init", default="", help="the example's --init-out (empty: nanoGPT's own initialization)")
    for name, default in (("steps", 1000), ("eval-every", 250), ("batch", 16), ("block", 64), ("layers", 4),
                          ("heads", 4), ("embd", 128), ("val-batches", 0), ("seed", 1), ("threads", 1)):
        ap.add_argument(f"--{name}", type=int, default=default)
    for name, default in (("lr", 1e-3), ("min-lr", 1e-4), ("warmup", 100.0), ("weight-decay", 0.1), ("beta2", 0.99)):
        ap.add_argument(f"--{name}", type=float, default=default)
    ap.add_argument("--foreach", type=int, default=1, help="AdamW's multi-tensor update (the faster one here)")
    a = ap.parse_args()
    if a.steps % a.eval_every:
        sys.exit(f"torch_gpt.py: --eval-every={a.eval_every} must divide --steps={a.steps}")
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    train = np.memmap(os.path.join(a.data_dir, "train.bin"), dtype=np.uint16, mode="r")
    val = np.memmap(os.path.join(a.data_dir, "val.bin"), dtype=np.uint16, mode="r")
    model = GPT(a.block, 256, a.layers, a.heads, a.embd, True)
    if a.init:
        tensors, _ = load(a.init)
        state = {k: torch.from_numpy(np.array(v)) for k, v in tensors.items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            sys.exit(f"torch_gpt.py: {a.init}: missing keys {missing}, unexpected keys {unexpected}")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, a.beta2), eps=1e-8, foreach=bool(a.foreach))
    seconds, it, train_loss = 0.0, 0, float("nan")
    evals = []
    for epoch in range(a.steps // a.eval_every):
        start = time.perf_counter()
        loss_sum = 0.0
        for i in range(a.eval_every):
            x, y = batch_of(train, window_starts(a.seed, epoch, i, a.batch, len(train), a.block), a.block)
            for group in opt.param_groups:
                group["lr"] = get_lr(it, a)
            _, loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += loss.item()
            it += 1
        seconds += time.perf_counter() - start
        train_loss = loss_sum / a.eval_every
        evals.append(validation_loss(model, val, a.block, a.val_batches))
        print(f"epoch {epoch + 1}: train loss {train_loss:.4f} | val loss {evals[-1]:.4f} | "
              f"{a.eval_every * a.batch * a.block / (time.perf_counter() - start):.0f} tok/s", file=sys.stderr)
    print(json.dumps({"val_loss": evals[-1], "val_losses": evals, "train_loss": train_loss,
                      "tokens_per_second": it * a.batch * a.block / seconds, "train_seconds": seconds, "steps": it,
                      "threads": a.threads, "parameters": sum(p.numel() for p in model.parameters()),
                      "foreach": bool(a.foreach), "peer": peer.torch_record(torch, BLAS)}))


if __name__ == "__main__":
    main()
