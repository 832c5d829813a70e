"""Reference data for BatchNorm2d, GELU, LeakyReLU, CrossEntropyLoss and MseLoss
(tests/layers/test_norm_act.cpp, tests/losses/test_losses.cpp).

Run with /usr/bin/python3 (PyTorch 1.13, CPU) from the repository root:
    /usr/bin/python3 tools/reference/gen_norm_act_loss.py
Writes tests/data/norm_act_loss.safetensors, everything in float64:
  BatchNorm (bn_*): <case>.x, .weight, .bias, .g (upstream gradient dL/dy of L = sum(y * g)),
    PyTorch's .y, .dx, .dweight, .dbias; train cases also .x2 (a second batch) and the running
    statistics after one step (.running_mean1, .running_var1) and after two (.running_mean2,
    .running_var2); eval cases take .running_mean, .running_var as inputs.
  GELU: gelu.x, gelu.g, gelu.y, gelu.dx.
  LeakyReLU (negative_slope 0.2): leaky_relu.x, leaky_relu.g, leaky_relu.y, leaky_relu.dx.
  GELU, tanh form (approximate='tanh'): gelu_tanh.x, gelu_tanh.g, gelu_tanh.y, gelu_tanh.dx.
  CrossEntropyLoss (ce_*): <case>.logits, .labels (int64), .loss (scalar), .dlogits; the ce_ignore_*
    cases have labels equal to ignore_index, and also .log_probs (torch.log_softmax of the logits).
  Softmax / LogSoftmax (softmax_*, log_softmax_*): <case>.x, .g, .y, .dx.
  NLLLoss (nll_*): <case>.log_probs, .labels, .loss, .dlog_probs.
  Linear over any rank (linear_*): <case>.x, .weight, .bias, .g, .y, .dx, .dweight, .dbias.
  MseLoss (mse_*): <case>.y, .target, .loss (scalar), .dy.
  <case>.torch_f32_err.<t>: PyTorch's own float32 error on tensor t, ||t32 - t64|| / ||t64||, from
    which the C++ tests derive their float32 tolerances.
The metadata holds each case's configuration string; the C++ tests rebuild it from their own
tables and require equality, so the two cannot drift apart.
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/
from tessera_tools.safetensors_io import save  # noqa: E402

# name: (shape of x, mode, eps, momentum)
BATCH_NORMS = {
    "bn_train_4d": ((4, 3, 5, 4), "train", 1e-5, 0.1),
    "bn_train_2d": ((6, 5), "train", 1e-3, 0.3),
    "bn_eval_4d": ((3, 4, 3, 3), "eval", 1e-5, 0.1),
    "bn_eval_2d": ((5, 3), "eval", 1e-2, 0.1),
}
# name: (N, C, reduction, label_smoothing, logit offset)
CROSS_ENTROPIES = {
    "ce_mean": (7, 5, "mean", 0.0, 0.0),
    "ce_sum": (7, 5, "sum", 0.0, 0.0),
    "ce_mean_ls": (7, 5, "mean", 0.1, 0.0),
    "ce_sum_ls": (6, 11, "sum", 0.25, 0.0),
    "ce_mean_large_logits": (4, 6, "mean", 0.1, 800.0),
}
# name: (shape, reduction)
MSES = {
    "mse_mean": ((3, 4, 5), "mean"),
    "mse_sum": ((6, 7), "sum"),
}


# name: (N, C, reduction, label_smoothing, ignore_index, rows ignored)
CE_IGNORES = {
    "ce_ignore_mean": (7, 5, "mean", 0.0, -100, 2),
    "ce_ignore_sum_ls": (6, 4, "sum", 0.2, -100, 3),
    "ce_ignore_mean_ls_index2": (8, 5, "mean", 0.1, 2, 0),
    "ce_ignore_all": (3, 4, "mean", 0.0, -100, 3),
}
# name: (N, C, reduction, ignore_index, rows ignored)
NLLS = {
    "nll_mean": (7, 5, "mean", -100, 0),
    "nll_sum": (6, 4, "sum", -100, 0),
    "nll_mean_ignore": (9, 6, "mean", -100, 3),
    "nll_sum_ignore_index1": (8, 3, "sum", 1, 0),
}
# name: (shape, dim, logit offset)
SOFTMAXES = {
    "softmax_2d_last": ((5, 7), -1, 0.0),
    "softmax_3d_middle": ((3, 4, 5), 1, 0.0),
    "softmax_4d_first": ((3, 2, 3, 2), 0, 0.0),
    "softmax_1d": ((9,), 0, 0.0),
    "softmax_large": ((4, 6), 1, 700.0),
}
# name: (input shape, in, out, bias)
LINEARS = {
    "linear_rank3": ((2, 3, 5), 5, 4, True),
    "linear_rank1": ((6,), 6, 3, True),
    "linear_rank4_nobias": ((2, 2, 3, 4), 4, 5, False),
}


def bn_config(c):
    shape, mode, eps, momentum = c
    return f"shape={'x'.join(map(str, shape))} mode={mode} eps={eps:g} momentum={momentum:g}"


def ce_config(c):
    n, classes, reduction, smoothing, offset = c
    return f"N={n} C={classes} reduction={reduction} label_smoothing={smoothing:g} offset={offset:g}"


def mse_config(c):
    shape, reduction = c
    return f"shape={'x'.join(map(str, shape))} reduction={reduction}"


def ce_ignore_config(c):
    n, classes, reduction, smoothing, ignore_index, ignored = c
    return (f"N={n} C={classes} reduction={reduction} label_smoothing={smoothing:g} "
            f"ignore_index={ignore_index} ignored={ignored}")


def nll_config(c):
    n, classes, reduction, ignore_index, ignored = c
    return f"N={n} C={classes} reduction={reduction} ignore_index={ignore_index} ignored={ignored}"


def softmax_config(c):
    shape, dim, offset = c
    return f"shape={'x'.join(map(str, shape))} dim={dim} offset={offset:g}"


def linear_config(c):
    shape, fan_in, fan_out, bias = c
    return f"shape={'x'.join(map(str, shape))} in={fan_in} out={fan_out} bias={int(bias)}"


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


def run_bn(c, inputs, dtype):
    shape, mode, eps, momentum = c
    channels = shape[1]
    bn = torch.nn.BatchNorm2d(channels, eps=eps, momentum=momentum) if len(shape) == 4 else \
        torch.nn.BatchNorm1d(channels, eps=eps, momentum=momentum)
    bn = bn.to(dtype)
    with torch.no_grad():
        bn.weight.copy_(inputs["weight"])
        bn.bias.copy_(inputs["bias"])
        if mode == "eval":
            bn.running_mean.copy_(inputs["running_mean"])
            bn.running_var.copy_(inputs["running_var"])
    bn.train(mode == "train")
    x = inputs["x"].to(dtype).clone().requires_grad_()
    y = bn(x)
    y.backward(inputs["g"].to(dtype))
    out = {"y": y.detach(), "dx": x.grad, "dweight": bn.weight.grad, "dbias": bn.bias.grad}
    if mode == "train":
        out["running_mean1"] = bn.running_mean.clone()
        out["running_var1"] = bn.running_var.clone()
        with torch.no_grad():
            bn(inputs["x2"].to(dtype))
        out["running_mean2"] = bn.running_mean.clone()
        out["running_var2"] = bn.running_var.clone()
    return out


def run_gelu(inputs, dtype, approximate="none"):
    x = inputs["x"].to(dtype).clone().requires_grad_()
    y = torch.nn.functional.gelu(x, approximate=approximate)  # 'none': the exact erf form
    y.backward(inputs["g"].to(dtype))
    return {"y": y.detach(), "dx": x.grad}


def run_leaky_relu(inputs, dtype, slope):
    x = inputs["x"].to(dtype).clone().requires_grad_()
    y = torch.nn.functional.leaky_relu(x, negative_slope=slope)
    y.backward(inputs["g"].to(dtype))
    return {"y": y.detach(), "dx": x.grad}


def run_ce(c, inputs, dtype):
    n, classes, reduction, smoothing, offset = c
    logits = inputs["logits"].to(dtype).clone().requires_grad_()
    loss = torch.nn.CrossEntropyLoss(reduction=reduction, label_smoothing=smoothing)(logits, inputs["labels"])
    loss.backward()
    return {"loss": loss.detach(), "dlogits": logits.grad}


def run_ce_ignore(c, inputs, dtype):
    n, classes, reduction, smoothing, ignore_index, ignored = c
    logits = inputs["logits"].to(dtype).clone().requires_grad_()
    loss = torch.nn.CrossEntropyLoss(reduction=reduction, label_smoothing=smoothing,
                                     ignore_index=ignore_index)(logits, inputs["labels"])
    loss.backward()
    return {"loss": loss.detach(), "dlogits": logits.grad,
            "log_probs": torch.log_softmax(inputs["logits"].to(dtype), 1)}


def run_nll(c, inputs, dtype):
    n, classes, reduction, ignore_index, ignored = c
    logp = inputs["log_probs"].to(dtype).clone().requires_grad_()
    loss = torch.nn.NLLLoss(reduction=reduction, ignore_index=ignore_index)(logp, inputs["labels"])
    loss.backward()
    return {"loss": loss.detach(), "dlog_probs": logp.grad}


def run_softmax(c, inputs, dtype, log):
    shape, dim, offset = c
    x = inputs["x"].to(dtype).clone().requires_grad_()
    y = (torch.nn.LogSoftmax(dim) if log else torch.nn.Softmax(dim))(x)
    y.backward(inputs["g"].to(dtype))
    return {"y": y.detach(), "dx": x.grad}


def run_linear(c, inputs, dtype):
    shape, fan_in, fan_out, bias = c
    lin = torch.nn.Linear(fan_in, fan_out, bias=bias).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(inputs["weight"])
        if bias:
            lin.bias.copy_(inputs["bias"])
    x = inputs["x"].to(dtype).clone().requires_grad_()
    y = lin(x)
    y.backward(inputs["g"].to(dtype))
    out = {"y": y.detach(), "dx": x.grad, "dweight": lin.weight.grad}
    if bias:
        out["dbias"] = lin.bias.grad
    return out


def run_mse(c, inputs, dtype):
    shape, reduction = c
    y = inputs["y"].to(dtype).clone().requires_grad_()
    loss = torch.nn.MSELoss(reduction=reduction)(y, inputs["target"].to(dtype))
    loss.backward()
    return {"loss": loss.detach(), "dy": y.grad}


def add_case(tensors, name, inputs, run):
    ref = run(torch.float64)
    f32 = run(torch.float32)
    for k, v in inputs.items():
        tensors[f"{name}.{k}"] = v.numpy()
    for k, v in ref.items():
        tensors[f"{name}.{k}"] = v.detach().numpy()
        tensors[f"{name}.torch_f32_err.{k}"] = np.array(rel_err(f32[k], v), dtype=np.float64)


def main():
    torch.manual_seed(20240611)
    tensors, metadata = {}, {}
    d = torch.float64

    for name, c in BATCH_NORMS.items():
        shape, mode, eps, momentum = c
        channels = shape[1]
        bshape = (1, channels) + (1,) * (len(shape) - 2)
        # Channel means and scales away from 0 and 1, so that a kernel that forgets to centre or
        # to scale fails.
        shift = torch.randn(bshape, dtype=d) * 2.0
        scale = torch.rand(bshape, dtype=d) * 2.0 + 0.5
        inputs = {
            "x": torch.randn(shape, dtype=d) * scale + shift,
            "weight": torch.rand(channels, dtype=d) + 0.5,
            "bias": torch.randn(channels, dtype=d),
            "g": torch.randn(shape, dtype=d),
        }
        if mode == "train":
            inputs["x2"] = torch.randn(shape, dtype=d) * scale + shift * 0.5
        else:
            inputs["running_mean"] = torch.randn(channels, dtype=d)
            inputs["running_var"] = torch.rand(channels, dtype=d) * 2.0 + 0.2
        add_case(tensors, name, inputs, lambda dt, c=c, i=inputs: run_bn(c, i, dt))
        metadata[name] = bn_config(c)

    x = torch.cat([torch.linspace(-9.0, 9.0, 121, dtype=d), torch.randn(79, dtype=d) * 2.0]).reshape(4, 50)
    inputs = {"x": x, "g": torch.randn(4, 50, dtype=d)}
    add_case(tensors, "gelu", inputs, lambda dt, i=inputs: run_gelu(i, dt))
    metadata["gelu"] = "shape=4x50"

    for name, c in CROSS_ENTROPIES.items():
        n, classes, reduction, smoothing, offset = c
        inputs = {"logits": torch.randn(n, classes, dtype=d) * 3.0 + offset,
                  "labels": torch.randint(0, classes, (n,), dtype=torch.int64)}
        add_case(tensors, name, inputs, lambda dt, c=c, i=inputs: run_ce(c, i, dt))
        metadata[name] = ce_config(c)

    for name, c in MSES.items():
        shape, reduction = c
        inputs = {"y": torch.randn(shape, dtype=d), "target": torch.randn(shape, dtype=d)}
        add_case(tensors, name, inputs, lambda dt, c=c, i=inputs: run_mse(c, i, dt))
        metadata[name] = mse_config(c)

    # After every other case, so their random draws stay what they were. Exact zeros included:
    # PyTorch's gradient there is the slope (x > 0 is false).
    x = torch.cat([torch.linspace(-3.0, 3.0, 61, dtype=d), torch.zeros(3, dtype=d), torch.randn(56, dtype=d)]).reshape(3, 40)
    inputs = {"x": x, "g": torch.randn(3, 40, dtype=d)}
    add_case(tensors, "leaky_relu", inputs, lambda dt, i=inputs: run_leaky_relu(i, dt, 0.2))
    metadata["leaky_relu"] = "shape=3x40 negative_slope=0.2"

    # Appended last for the same reason.
    x = torch.cat([torch.linspace(-9.0, 9.0, 121, dtype=d), torch.randn(79, dtype=d) * 2.0]).reshape(4, 50)
    inputs = {"x": x, "g": torch.randn(4, 50, dtype=d)}
    add_case(tensors, "gelu_tanh", inputs, lambda dt, i=inputs: run_gelu(i, dt, "tanh"))
    metadata["gelu_tanh"] = "shape=4x50 approximate=tanh"

    # Softmax, NLL, cross-entropy with ignore_index and Linear over any rank: appended last too.
    for name, c in CE_IGNORES.items():
        n, classes, reduction, smoothing, ignore_index, ignored = c
        labels = torch.randint(0, classes, (n,), dtype=torch.int64)
        labels[torch.randperm(n)[:ignored]] = ignore_index
        inputs = {"logits": torch.randn(n, classes, dtype=d) * 3.0, "labels": labels}
        add_case(tensors, name, inputs, lambda dt, c=c, i=inputs: run_ce_ignore(c, i, dt))
        metadata[name] = ce_ignore_config(c)
    for name, c in NLLS.items():
        n, classes, reduction, ignore_index, ignored = c
        labels = torch.randint(0, classes, (n,), dtype=torch.int64)
        labels[torch.randperm(n)[:ignored]] = ignore_index
        inputs = {"log_probs": torch.log_softmax(torch.randn(n, classes, dtype=d) * 2.0, 1), "labels": labels}
        add_case(tensors, name, inputs, lambda dt, c=c, i=inputs: run_nll(c, i, dt))
        metadata[name] = nll_config(c)
    for log in (False, True):
        for name, c in SOFTMAXES.items():
            shape, dim, offset = c
            case = ("log_" if log else "") + name
            inputs = {"x": torch.randn(shape, dtype=d) * 3.0 + offset, "g": torch.randn(shape, dtype=d)}
            add_case(tensors, case, inputs, lambda dt, c=c, i=inputs, log=log: run_softmax(c, i, dt, log))
            metadata[case] = softmax_config(c)
    for name, c in LINEARS.items():
        shape, fan_in, fan_out, bias = c
        out_shape = shape[:-1] + (fan_out,)
        inputs = {"x": torch.randn(shape, dtype=d), "weight": torch.randn(fan_out, fan_in, dtype=d) * 0.5,
                  "g": torch.randn(out_shape, dtype=d)}
        if bias:
            inputs["bias"] = torch.randn(fan_out, dtype=d)
        add_case(tensors, name, inputs, lambda dt, c=c, i=inputs: run_linear(c, i, dt))
        metadata[name] = linear_config(c)

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "tests", "data", "norm_act_loss.safetensors")
    save(path, tensors, metadata)
    print(f"wrote {path}: {len(tensors)} tensors, {os.path.getsize(path)} bytes")
    for k in sorted(tensors):
        if ".torch_f32_err." in k:
            print(f"  {k} = {float(tensors[k]):.3e}")


if __name__ == "__main__":
    main()
