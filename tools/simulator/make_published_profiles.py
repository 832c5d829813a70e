#!/usr/bin/env python3
"""Writes the model profiles of the published-results validation (docs/simulator.md) next to this
file: ResNet-50 as in Goyal et al. 2017, Inception V3 and ResNet-101 as in Sergeev & Del Balso 2018
(Horovod), and a transformer for the pipeline and tensor-parallel examples.

No profiling run of those setups exists here, so each profile is derived, and says so in its
"source": the layer list (parameters, multiply-adds, output size) comes from the architecture;
the per-GPU forward and backward time of a step is the published or stated figure below, split
over the layers in proportion to their multiply-adds (BatchNorm, ReLU and pooling, memory-bound
on a GPU, count as nothing). Gradients are fp32 (4 bytes per parameter), as in those runs.

    python3 tools/simulator/make_published_profiles.py
"""
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


class Net:
    """Records conv + BatchNorm units in forward order: name, parameters, multiply-adds, output."""

    def __init__(self, h, c):
        self.h, self.c, self.units = h, c, []

    def conv(self, name, cin, cout, k, stride=1, pad=None, h=None, bn_params=2):
        kh, kw = k if isinstance(k, tuple) else (k, k)
        h = self.h if h is None else h
        if pad is None:  # "same" padding unless given (the valid-padded stem convs pass 0)
            pad = (kh // 2, kw // 2)
        ph, pw = pad if isinstance(pad, tuple) else (pad, pad)
        ho, wo = (h + 2 * ph - kh) // stride + 1, (h + 2 * pw - kw) // stride + 1
        weights = kh * kw * cin * cout
        params = [weights] + [cout] * bn_params  # model order: conv weight, BN weight, BN bias
        self.units.append({"name": name, "params": params, "macs": ho * wo * weights, "out": ho * wo * cout})
        return ho

    def fc(self, name, cin, cout):
        self.units.append({"name": name, "params": [cin * cout, cout], "macs": cin * cout, "out": cout})


def resnet(blocks, image=224):
    net = Net(image, 3)
    h = net.conv("conv1", 3, 64, 7, stride=2, pad=3)  # 112
    h = (h + 2 - 3) // 2 + 1  # max pool 3x3 s2 -> 56
    cin = 64
    for stage, (mid, count) in enumerate(zip((64, 128, 256, 512), blocks)):
        for b in range(count):
            stride = 2 if stage > 0 and b == 0 else 1
            prefix = f"layer{stage + 1}.{b}"
            net.conv(f"{prefix}.conv1", cin, mid, 1, h=h)
            ho = net.conv(f"{prefix}.conv2", mid, mid, 3, stride=stride, h=h)  # stride in the 3x3 (v1.5)
            net.conv(f"{prefix}.conv3", mid, 4 * mid, 1, h=ho)
            if b == 0:
                net.conv(f"{prefix}.downsample", cin, 4 * mid, 1, stride=stride, h=h)
            cin, h = 4 * mid, ho
    net.fc("fc", 2048, 1000)
    return net.units


def inception_v3():
    """torchvision's Inception3 at 299 x 299, without the auxiliary classifier."""
    net = Net(299, 3)
    h = net.conv("Conv2d_1a_3x3", 3, 32, 3, stride=2, pad=0)  # 149
    h = net.conv("Conv2d_2a_3x3", 32, 32, 3, pad=0, h=h)  # 147
    h = net.conv("Conv2d_2b_3x3", 32, 64, 3, h=h)  # 147
    h = (h - 3) // 2 + 1  # 73
    h = net.conv("Conv2d_3b_1x1", 64, 80, 1, h=h)
    h = net.conv("Conv2d_4a_3x3", 80, 192, 3, pad=0, h=h)  # 71
    h = (h - 3) // 2 + 1  # 35
    c = net.conv

    def block_a(n, cin, pool):
        c(f"{n}.branch1x1", cin, 64, 1, h=h)
        c(f"{n}.branch5x5_1", cin, 48, 1, h=h), c(f"{n}.branch5x5_2", 48, 64, 5, h=h)
        c(f"{n}.branch3x3dbl_1", cin, 64, 1, h=h), c(f"{n}.branch3x3dbl_2", 64, 96, 3, h=h)
        c(f"{n}.branch3x3dbl_3", 96, 96, 3, h=h), c(f"{n}.branch_pool", cin, pool, 1, h=h)
        return 224 + pool

    def block_c(n, c7):
        c(f"{n}.branch1x1", 768, 192, 1, h=h)
        c(f"{n}.branch7x7_1", 768, c7, 1, h=h), c(f"{n}.branch7x7_2", c7, c7, (1, 7), h=h)
        c(f"{n}.branch7x7_3", c7, 192, (7, 1), h=h)
        c(f"{n}.branch7x7dbl_1", 768, c7, 1, h=h)
        for i, (a, b, k) in enumerate(((c7, c7, (7, 1)), (c7, c7, (1, 7)), (c7, c7, (7, 1)), (c7, 192, (1, 7)))):
            c(f"{n}.branch7x7dbl_{i + 2}", a, b, k, h=h)
        c(f"{n}.branch_pool", 768, 192, 1, h=h)

    def block_e(n, cin):
        c(f"{n}.branch1x1", cin, 320, 1, h=h)
        c(f"{n}.branch3x3_1", cin, 384, 1, h=h), c(f"{n}.branch3x3_2a", 384, 384, (1, 3), h=h)
        c(f"{n}.branch3x3_2b", 384, 384, (3, 1), h=h)
        c(f"{n}.branch3x3dbl_1", cin, 448, 1, h=h), c(f"{n}.branch3x3dbl_2", 448, 384, 3, h=h)
        c(f"{n}.branch3x3dbl_3a", 384, 384, (1, 3), h=h), c(f"{n}.branch3x3dbl_3b", 384, 384, (3, 1), h=h)
        c(f"{n}.branch_pool", cin, 192, 1, h=h)

    cin = block_a("Mixed_5b", 192, 32)
    cin = block_a("Mixed_5c", cin, 64)
    cin = block_a("Mixed_5d", cin, 64)
    c("Mixed_6a.branch3x3", cin, 384, 3, stride=2, pad=0, h=h)  # 35 -> 17
    c("Mixed_6a.branch3x3dbl_1", cin, 64, 1, h=h), c("Mixed_6a.branch3x3dbl_2", 64, 96, 3, h=h)
    h = c("Mixed_6a.branch3x3dbl_3", 96, 96, 3, stride=2, pad=0, h=h)
    for n, c7 in (("Mixed_6b", 128), ("Mixed_6c", 160), ("Mixed_6d", 160), ("Mixed_6e", 192)):
        block_c(n, c7)
    c("Mixed_7a.branch3x3_1", 768, 192, 1, h=h), c("Mixed_7a.branch3x3_2", 192, 320, 3, stride=2, pad=0, h=h)
    c("Mixed_7a.branch7x7x3_1", 768, 192, 1, h=h), c("Mixed_7a.branch7x7x3_2", 192, 192, (1, 7), h=h)
    c("Mixed_7a.branch7x7x3_3", 192, 192, (7, 1), h=h)
    h = c("Mixed_7a.branch7x7x3_4", 192, 192, 3, stride=2, pad=0, h=h)  # 17 -> 8
    block_e("Mixed_7b", 1280)
    block_e("Mixed_7c", 2048)
    net.fc("fc", 2048, 1000)
    return net.units


def transformer(layers, hidden, seq, batch, vocab):
    """GPT-style decoder layers: attention (4h^2) and MLP (8h^2) weights, their multiply-adds per
    sequence of `seq` tokens (+ the attention scores, 2 s^2 h), output (s, h) per sequence."""
    units = [{"name": "embedding", "params": [vocab * hidden], "macs": 0, "out": seq * hidden}]
    for i in range(layers):
        units.append({"name": f"layer{i}", "params": [2 * hidden, 4 * hidden * hidden + 4 * hidden, 2 * hidden,
                                                      8 * hidden * hidden + 5 * hidden],
                      "macs": seq * 12 * hidden * hidden + 2 * seq * seq * hidden, "out": seq * hidden})
    units.append({"name": "lm_head", "params": [2 * hidden], "macs": seq * hidden * vocab, "out": seq * vocab})
    return units


def profile(units, *, name, source, batch, forward_s, backward_s, optimizer_s, scalar=4, activation_scalar=4):
    macs = sum(u["macs"] for u in units)
    layers = []
    for u in reversed(units):  # backward order
        share = u["macs"] / macs
        params = [scalar * p for p in reversed(u["params"])]  # DataParallel visits them in reverse
        layers.append({"name": u["name"], "forward_s": forward_s * share, "backward_s": backward_s * share,
                       "grad_bytes": sum(params), "param_bytes": params,
                       "activation_bytes": activation_scalar * batch * u["out"]})
    n_params = sum(sum(u["params"]) for u in units)
    return {"name": name, "source": source + f" Architecture: {n_params / 1e6:.2f} M parameters, "
                                             f"{macs / 1e9:.2f} G multiply-adds per sample.",
            "batch_per_worker": batch, "scalar_bytes": scalar, "optimizer_s": optimizer_s, "layers": layers}


def transformer_profile(flops_per_s=100e12 / 3):
    units = transformer(24, 2048, 1024, 8, 50257)
    forward = 2 * sum(u["macs"] for u in units) * 8 / flops_per_s  # 8 sequences per worker
    return profile(units, name="GPT-style 1.3 B, 24 layers, h=2048, 8 x 1024 tokens", batch=8,
                   forward_s=forward, backward_s=2 * forward, optimizer_s=0.02, scalar=2, activation_scalar=2,
                   source=f"Illustrative input for the pipeline and tensor-parallel predictions, not a validation: "
                          f"2 x multiply-adds x 8 sequences at an assumed sustained {flops_per_s / 1e12:.0f} TFLOP/s "
                          f"in fp16 ({forward:.2f} s forward), backward twice forward, 20 ms update; fp16 "
                          f"gradients and activations.")


def main():
    out = {
        "goyal_resnet50.json": profile(
            resnet((3, 4, 6, 3)), name="ResNet-50, 32 images per P100 (Goyal et al. 2017)", batch=32,
            forward_s=0.060, backward_s=0.120, optimizer_s=0.050,
            source="Backward 120 ms per P100 at 32 images: Goyal et al. 2017, section 4 ('backwards pass time "
                   "for ResNet-50 on a single NVIDIA Tesla P100 GPU is 120 ms'). Forward assumed half of "
                   "backward (60 ms). optimizer_s = the rest of an iteration (update, data loading, framework), "
                   "50 ms: chosen so that the 8-GPU step is ~0.23 s, the 29 hours for 90 epochs of the paper's "
                   "8-GPU baseline (90 x 1.28 M images / 29 h = 1100 images/s per server = 32 images per "
                   "0.232 s per GPU). Split over layers by multiply-adds."),
        "horovod_inception_v3.json": profile(
            inception_v3(), name="Inception V3, 64 images per P100 (Horovod paper)", batch=64,
            forward_s=0.150, backward_s=0.300, optimizer_s=0.005,
            source="Assumed: 142 images/s per Pascal P100 in fp32 at batch 64 (tf_cnn_benchmarks, the "
                   "benchmark of the Horovod paper), i.e. 0.45 s per step, one third forward; 5 ms update. "
                   "Split over layers by multiply-adds; no auxiliary classifier."),
        "horovod_resnet101.json": profile(
            resnet((3, 4, 23, 3)), name="ResNet-101, 64 images per P100 (Horovod paper)", batch=64,
            forward_s=0.170, backward_s=0.340, optimizer_s=0.005,
            source="Assumed: 125 images/s per Pascal P100 in fp32 at batch 64 (tf_cnn_benchmarks' ResNet-50 "
                   "219 and ResNet-152 ~90 images/s on P100, scaled by multiply-adds), i.e. 0.51 s per step, "
                   "one third forward; 5 ms update. Split over layers by multiply-adds."),
        "transformer_1b3.json": transformer_profile(),
    }
    for name, p in out.items():
        with open(os.path.join(HERE, name), "w") as f:
            json.dump(p, f, indent=1)
            f.write("\n")
        print(f"wrote {name}: {len(p['layers'])} layers, {sum(l['grad_bytes'] for l in p['layers']) / 1e6:.1f} MB "
              f"of gradients")


if __name__ == "__main__":
    main()
