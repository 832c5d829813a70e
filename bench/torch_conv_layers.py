"""PyTorch twin of conv_layers: a network's float32 convolutions one by one, forward then backward
(dW and dx; the first layer has no dx), as JSON on stdout.

    /usr/bin/python3 bench/torch_conv_layers.py --shapes '[[3, 64, 224, 7, 2, 3, 1], ...]' --batch 8 \\
        [--threads 2] [--runs 7]

--shapes is conv_layers' list, [in, out, size, kernel, stride, pad, count] per distinct layer:
compare_conv_layers.py passes the shapes the Tessera program reported, so both time the same
layers. Each layer is torch.nn.Conv2d without bias (as in torchvision's ResNets); one untimed
forward and backward, then --runs timed ones; medians in ms. The JSON carries the peer record
(bench/peer.py) and the convolution kernels PyTorch ran (aten::mkldnn_convolution: oneDNN).
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


def time_layer(shape, batch, first, runs):
    c_in, c_out, size, kernel, stride, pad, _ = shape
    torch.manual_seed(1)
    conv = torch.nn.Conv2d(c_in, c_out, kernel, stride, pad, bias=False)
    x = torch.rand(batch, c_in, size, size) * 2 - 1
    x.requires_grad_(not first)  # a network's first layer computes no dx
    y = conv(x)
    dy = torch.rand_like(y) * 2 - 1
    y.backward(dy)
    forward, backward = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        y = conv(x)
        forward.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        y.backward(dy)
        backward.append((time.perf_counter() - t0) * 1e3)
        # dW accumulates into the weight's gradient, as in a training step after zero_grad(set_to_none=False)
        # (bench/torch_throughput.py); dx is a fresh tensor each time, as the gradient a layer passes back.
        x.grad = None
    forward.sort()
    backward.sort()
    return forward[runs // 2], backward[runs // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", required=True, help="JSON list of [in, out, size, kernel, stride, pad, count]")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    shapes = json.loads(args.shapes)
    if not shapes or any(len(s) != 7 or any(not isinstance(v, int) or v < 0 for v in s) for s in shapes):
        sys.exit(f"torch_conv_layers.py: --shapes must be a non-empty JSON list of 7 non-negative integers "
                 f"[in, out, size, kernel, stride, pad, count] per layer, got {args.shapes[:200]}")
    torch.set_num_threads(args.threads)
    layers, total_forward, total_backward = [], 0.0, 0.0
    for i, s in enumerate(shapes):
        f, b = time_layer(s, args.batch, i == 0, args.runs)
        total_forward += f * s[6]
        total_backward += b * s[6]
        layers.append({"in": s[0], "out": s[1], "size": s[2], "kernel": s[3], "stride": s[4], "pad": s[5],
                       "count": s[6], "forward_ms": f, "backward_ms": b})
        print(f"{s[0]:4} {s[1]:4} {s[2]:3} {s[3]}x{s[3]}/{s[4]} x{s[6]}  forward {f:8.3f}  backward {b:8.3f}",
              file=sys.stderr)

    def one_layer():  # the kernels one forward and backward of the first shape with a dx runs
        s = shapes[1] if len(shapes) > 1 else shapes[0]
        conv = torch.nn.Conv2d(s[0], s[1], s[3], s[4], s[5], bias=False)
        x = torch.rand(1, s[0], s[2], s[2], requires_grad=True)
        conv(x).sum().backward()

    print(json.dumps({"framework": "pytorch", "version": torch.__version__, "benchmark": "conv_layers",
                      "batch": args.batch, "threads": args.threads, "runs": args.runs,
                      "total_ms": {"forward": total_forward, "backward": total_backward}, "layers": layers,
                      "peer": {**peer.torch_record(torch, torch_models.BLAS),
                               "conv_kernels": peer.conv_kernels(torch, one_layer)}}))


if __name__ == "__main__":
    main()
