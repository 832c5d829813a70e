"""Reference data for Conv2d, MaxPool2d, AvgPool2d, AdaptiveAvgPool2d and GlobalAvgPool (tests/layers/test_conv_pool.cpp).

Run with /usr/bin/python3 (PyTorch 1.13, CPU) from the repository root:
    /usr/bin/python3 tools/reference/gen_conv_pool.py
Writes tests/data/conv_pool.safetensors. For each case, in float64:
    <case>.x, <case>.weight, <case>.bias (convolutions), <case>.g (the upstream gradient dL/dy of
    L = sum(y * g)), and PyTorch's <case>.y, <case>.dx, <case>.dweight, <case>.dbias;
    <case>.torch_f32_err.<t>: PyTorch's own float32 error on tensor t, ||t32 - t64|| / ||t64||,
    from which the C++ test derives its float32 tolerance.
The metadata holds each case's configuration string; the C++ test rebuilds it from its own table
and requires equality, so the two cannot drift apart.
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/
from tessera_tools.safetensors_io import save  # noqa: E402

# name: (N, C_in, H, W, C_out, (kh, kw), (sh, sw), (ph, pw), (dh, dw), groups, bias)
CONVS = {
    "conv_groups_dilation": (2, 4, 7, 7, 6, (3, 3), (1, 1), (2, 2), (2, 2), 2, True),
    "conv_stem": (2, 3, 16, 16, 8, (7, 7), (2, 2), (3, 3), (1, 1), 1, False),
    "conv_1x1": (3, 8, 5, 5, 6, (1, 1), (1, 1), (0, 0), (1, 1), 1, True),
    "conv_1x1_stride2": (2, 6, 7, 7, 4, (1, 1), (2, 2), (0, 0), (1, 1), 1, False),
    "conv_rect": (3, 3, 9, 8, 4, (3, 2), (2, 1), (1, 0), (1, 1), 1, True),
    # 3x3 stride 1: the shapes Winograd F(2x2, 3x3) takes (odd sizes: clipped edge tiles).
    "conv_3x3_same": (3, 8, 9, 7, 10, (3, 3), (1, 1), (1, 1), (1, 1), 1, True),
    "conv_3x3_pad0": (2, 5, 8, 6, 4, (3, 3), (1, 1), (0, 0), (1, 1), 1, False),
    "conv_3x3_pad2": (2, 4, 5, 6, 3, (3, 3), (1, 1), (2, 2), (1, 1), 1, True),
}
# name: (kind, N, C, H, W, kernel, stride, padding)
POOLS = {
    "maxpool_3_2_1": ("max", 2, 3, 9, 9, 3, 2, 1),
    "maxpool_2_2_0": ("max", 2, 2, 6, 7, 2, 2, 0),
    "avgpool_3_2_1": ("avg", 2, 3, 9, 8, 3, 2, 1),
    "avgpool_2_2_0": ("avg", 2, 2, 6, 6, 2, 2, 0),
    "global_avg_pool": ("gap", 2, 5, 4, 3, 0, 0, 0),
    # Options beyond the defaults, as a ninth element: (ceil_mode, count_include_pad, divisor_override).
    "maxpool_3_2_1_ceil": ("max", 2, 3, 8, 8, 3, 2, 1, (True, True, None)),
    "maxpool_2_2_0_ceil": ("max", 2, 2, 5, 7, 2, 2, 0, (True, True, None)),
    # H = 5: ceil gives 4 windows, the last starting in the right padding, so PyTorch drops it.
    "maxpool_2_2_1_ceil_drop": ("max", 2, 2, 5, 6, 2, 2, 1, (True, True, None)),
    "avgpool_3_2_1_ceil": ("avg", 2, 3, 8, 9, 3, 2, 1, (True, True, None)),
    "avgpool_3_2_1_exclude_pad": ("avg", 2, 3, 9, 8, 3, 2, 1, (False, False, None)),
    "avgpool_3_2_1_ceil_exclude_pad": ("avg", 2, 3, 8, 7, 3, 2, 1, (True, False, None)),
    "avgpool_2_2_1_ceil_drop": ("avg", 2, 2, 5, 6, 2, 2, 1, (True, True, None)),
    "avgpool_3_2_1_ceil_divisor": ("avg", 2, 2, 8, 7, 3, 2, 1, (True, True, 5)),
}
# name: (N, C, H, W, out_h, out_w), torch.nn.functional.adaptive_avg_pool2d
ADAPTIVE = {
    "adaptive_7_to_3": (2, 3, 7, 7, 3, 3),
    "adaptive_5x4_to_2x3": (2, 2, 5, 4, 2, 3),
    "adaptive_2x5_to_3x2": (2, 2, 2, 5, 3, 2),
    "adaptive_5x3_to_1": (2, 3, 5, 3, 1, 1),
}


def conv_config(c):
    n, cin, h, w, cout, k, s, p, d, groups, bias = c
    return (f"N={n} C_in={cin} H={h} W={w} C_out={cout} kernel={k[0]}x{k[1]} stride={s[0]}x{s[1]} "
            f"padding={p[0]}x{p[1]} dilation={d[0]}x{d[1]} groups={groups} bias={int(bias)}")


def pool_options(c):
    return c[8] if len(c) > 8 else (False, True, None)


def pool_config(c):
    kind, n, ch, h, w, k, s, p = c[:8]
    text = f"{kind} N={n} C={ch} H={h} W={w} kernel={k} stride={s} padding={p}"
    ceil_mode, count_include_pad, divisor_override = pool_options(c)
    if ceil_mode:
        text += " ceil_mode=1"
    if not count_include_pad:
        text += " count_include_pad=0"
    if divisor_override is not None:
        text += f" divisor_override={divisor_override}"
    return text


def adaptive_config(c):
    n, ch, h, w, oh, ow = c
    return f"adaptive N={n} C={ch} H={h} W={w} output={oh}x{ow}"


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


def run_conv(c, inputs, dtype):
    s, p, d, groups, bias = c[6:]
    x = inputs["x"].to(dtype).clone().requires_grad_()
    weight = inputs["weight"].to(dtype).clone().requires_grad_()
    b = inputs["bias"].to(dtype).clone().requires_grad_() if bias else None
    y = torch.nn.functional.conv2d(x, weight, b, stride=s, padding=p, dilation=d, groups=groups)
    y.backward(inputs["g"].to(dtype))
    out = {"y": y.detach(), "dx": x.grad, "dweight": weight.grad}
    if bias:
        out["dbias"] = b.grad
    return out


def pool_forward(c, x):
    kind = c[0]
    if kind == "adaptive":
        return torch.nn.functional.adaptive_avg_pool2d(x, c[1:3])
    k, s, p = c[5:8]
    ceil_mode, count_include_pad, divisor_override = pool_options(c)
    if kind == "max":
        return torch.nn.functional.max_pool2d(x, k, s, p, ceil_mode=ceil_mode)
    if kind == "avg":
        return torch.nn.functional.avg_pool2d(x, k, s, p, ceil_mode=ceil_mode, count_include_pad=count_include_pad,
                                              divisor_override=divisor_override)
    return torch.nn.functional.adaptive_avg_pool2d(x, 1).flatten(1)


def run_pool(c, inputs, dtype):
    x = inputs["x"].to(dtype).clone().requires_grad_()
    y = pool_forward(c, x)
    y.backward(inputs["g"].to(dtype))
    return {"y": y.detach(), "dx": x.grad}


def main():
    torch.manual_seed(20240611)
    tensors, metadata = {}, {}

    def record(name, inputs, run, config):
        ref = run(config, inputs, torch.float64)
        f32 = run(config, inputs, torch.float32)
        for key, value in inputs.items():
            tensors[f"{name}.{key}"] = value.numpy()
        for key, value in ref.items():
            tensors[f"{name}.{key}"] = value.numpy()
            tensors[f"{name}.torch_f32_err.{key}"] = np.array([rel_err(f32[key], value)])

    for name, c in CONVS.items():
        n, cin, h, w, cout, k, s, p, d, groups, bias = c
        conv = torch.nn.Conv2d(cin, cout, k, s, p, d, groups, bias).double()  # PyTorch's default init
        inputs = {"x": torch.randn(n, cin, h, w, dtype=torch.float64), "weight": conv.weight.detach().clone()}
        if bias:
            inputs["bias"] = conv.bias.detach().clone()
        y_shape = torch.nn.functional.conv2d(inputs["x"], inputs["weight"], None, s, p, d, groups).shape
        inputs["g"] = torch.randn(y_shape, dtype=torch.float64)
        record(name, inputs, run_conv, c)
        metadata[name] = conv_config(c)

    for name, c in POOLS.items():
        kind, n, ch, h, w, k, s, p = c[:8]
        inputs = {"x": torch.randn(n, ch, h, w, dtype=torch.float64)}
        inputs["g"] = torch.randn(pool_forward(c, inputs["x"]).shape, dtype=torch.float64)  # ceil_mode included
        record(name, inputs, run_pool, c)
        metadata[name] = pool_config(c)

    for name, c in ADAPTIVE.items():
        n, ch, h, w, oh, ow = c
        inputs = {"x": torch.randn(n, ch, h, w, dtype=torch.float64), "g": torch.randn(n, ch, oh, ow, dtype=torch.float64)}
        record(name, inputs, run_pool, ("adaptive", oh, ow))
        metadata[name] = adaptive_config(c)

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "tests", "data", "conv_pool.safetensors")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save(path, tensors, metadata)
    print(f"wrote {path}: {len(tensors)} tensors, {os.path.getsize(path)} bytes")
    for key in sorted(k for k in tensors if ".torch_f32_err." in k):
        print(f"  {key} = {tensors[key][0]:.3g}")


if __name__ == "__main__":
    main()
