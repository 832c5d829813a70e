"""Reference data for Linear and whole models (tests/layers/test_linear_residual.cpp,
tests/models/test_models.cpp), from PyTorch 1.13 in float64.

Whole-model cases load a torch state_dict into the Tessera model by name, so they check the
architecture, the parameter names and every layer's forward and backward at once.

    /usr/bin/python3 tools/reference/gen_models.py   # writes tests/data/models.safetensors
"""
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import torch_models  # noqa: E402
from safetensors_io import save  # noqa: E402

out = {}


def put(name, t):
    out[name] = t.detach().numpy().copy() if isinstance(t, torch.Tensor) else np.asarray(t)


def f32_error(ref64, f32):
    ref = ref64.detach()
    return float((f32.detach().double() - ref).abs().max() / max(ref.abs().max().item(), 1e-30))


torch.manual_seed(0)

# Linear: y = x W^T + b; L = sum(y * g).
lin = torch.nn.Linear(5, 4).double()
x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
g = torch.randn(3, 4, dtype=torch.float64)
y = lin(x)
(y * g).sum().backward()
for k, v in {"x": x, "g": g, "weight": lin.weight, "bias": lin.bias, "y": y, "dx": x.grad,
             "dweight": lin.weight.grad, "dbias": lin.bias.grad}.items():
    put("linear." + k, v)
lin32 = torch.nn.Linear(5, 4)
lin32.load_state_dict({k: v.float() for k, v in lin.state_dict().items()})
put("linear.torch_f32_err", np.array(f32_error(y, lin32(x.float()))))


def model_case(prefix, model, x, labels):
    """Train-mode forward, mean cross-entropy, backward: logits, loss, every parameter gradient,
    the BN running statistics after the step, then eval-mode logits."""
    model = model.double()
    with torch.no_grad():  # non-trivial BN statistics and affine parameters
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    for name, t in model.state_dict().items():
        if not name.endswith("num_batches_tracked"):
            put(f"{prefix}.init.{name}", t)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits, labels)
    loss.backward()
    put(f"{prefix}.x", x)
    put(f"{prefix}.labels", labels)
    put(f"{prefix}.logits", logits)
    put(f"{prefix}.loss", loss.reshape(1))
    for name, p in model.named_parameters():
        put(f"{prefix}.grad.{name}", p.grad)
    for name, t in model.state_dict().items():
        if "running" in name:
            put(f"{prefix}.after.{name}", t)
    model.eval()
    put(f"{prefix}.eval_logits", model(x))
    return state, logits


torch.manual_seed(1)
resnet8 = torch_models.CifarResNet(depth=8, in_channels=1, classes=5)
x = torch.randn(2, 1, 12, 12, dtype=torch.float64)
labels = torch.tensor([3, 1])
state, logits64 = model_case("resnet8", resnet8, x, labels)
twin = torch_models.CifarResNet(depth=8, in_channels=1, classes=5)
twin.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
twin.train()
put("resnet8.torch_f32_err", np.array(f32_error(logits64, twin(x.float()))))

torch.manual_seed(2)
lenet = torch_models.lenet5(1, 28, 10)
x = torch.randn(2, 1, 28, 28, dtype=torch.float64)
labels = torch.tensor([7, 0])
model_case("lenet", lenet, x, labels)

# Parameter counts of the torchvision / torch twins, for the count test.
import torchvision  # noqa: E402
counts = {
    "resnet18": torchvision.models.resnet18(), "resnet34": torchvision.models.resnet34(),
    "resnet50": torchvision.models.resnet50(), "resnet101": torchvision.models.resnet101(),
    "resnet152": torchvision.models.resnet152(), "resnet20": torch_models.resnet20(3, 10),
    "resnet56": torch_models.CifarResNet(56, 3, 10), "lenet": torch_models.lenet5(1, 28, 10),
    "mlp": torch_models.mlp(784, (512, 256), 10),
}
for name, m in counts.items():
    put(f"count.{name}", np.array([sum(p.numel() for p in m.parameters())], dtype=np.int64))

save(os.path.join(ROOT, "tests", "data", "models.safetensors"), out)
print(f"wrote {len(out)} tensors")
