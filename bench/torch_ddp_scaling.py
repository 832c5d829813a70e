"""PyTorch twin of dp_scaling: images/s of LeNet-5 / ResNet-20 training steps on synthetic data,
one process without DDP or N processes with DistributedDataParallel over Gloo (TCP rendezvous),
per-rank batch fixed. Prints one JSON line.

    /usr/bin/python3 bench/torch_ddp_scaling.py --ranks 2 --model lenet --batch 64 --steps 40

dp_scaling.py runs it with the peer setup of bench/peer.py (OpenBLAS, OPENBLAS_NUM_THREADS=1,
OPENBLAS_L2_SIZE unset, the best OPENBLAS_CORETYPE and OMP_WAIT_POLICY it probed): PyTorch at its
best on this machine. Started by hand it selects OpenBLAS itself; its JSON has a "peer" record.
"""
import argparse
import json
import os
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer  # noqa: E402

peer.exec_with_openblas()  # started by hand on a machine whose libblas.so.3 is not OpenBLAS

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import torch_models  # noqa: E402


def build(name):
    return torch_models.resnet20() if name == "resnet20" else torch_models.lenet5()


def worker(rank, world, args, init_file, out_file):
    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    model = build(args.model)
    model.train()
    if world > 1:
        # TCP store on a free local port, as torchrun --standalone does (the file store hung
        # intermittently here with mp.spawn).
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + init_file, rank=rank, world_size=world)
        model = torch.nn.parallel.DistributedDataParallel(model)  # default 25 MiB buckets, gloo all-reduce
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    x = torch.randn(args.batch, 1, 28, 28)
    y = torch.randint(0, 10, (args.batch,))

    def step():
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump({"bench": "dp_scaling", "framework": "pytorch", "comm": "gloo" if world > 1 else "none",
                       "model": args.model, "ranks": world, "threads_per_rank": args.threads,
                       "batch_per_rank": args.batch, "steps": args.steps, "seconds": seconds.item(),
                       "images_per_second": world * args.batch * args.steps / seconds.item(),
                       "torch": torch.__version__, "peer": peer.torch_record(torch, torch_models.BLAS)}, f)
    if world > 1:
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--model", default="lenet", choices=["lenet", "resnet20"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        init_file, out_file = port, os.path.join(tmp, "result.json")
        if args.ranks == 1:
            worker(0, 1, args, init_file, out_file)
        else:
            mp.spawn(worker, args=(args.ranks, args, init_file, out_file), nprocs=args.ranks, join=True)
        with open(out_file) as f:
            print(f.read())


if __name__ == "__main__":
    main()
