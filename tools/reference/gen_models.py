"""Reference data for Linear and whole models (tests/layers/test_linear_residual.cpp,
tests/models/test_models.cpp), from PyTorch 1.13 in float64.

Whole-model cases load a torch state_dict into the Tessera model by name, so they check the
architecture, the parameter names and every layer's forward and backward at once.

models_resnet8_state.safetensors is the CIFAR ResNet-8 twin's state_dict after its training step
(running statistics updated, num_batches_tracked = 1), written by tools/convert_torchvision.py in
float64: test_models.cpp loads it with tessera::load_state_dict and compares eval logits.

ResNet-50 ("resnet50.*"): torchvision.models.resnet50 has 23.5M parameters (94 MB in float32), too
big to commit. Its weights therefore come from a generator both sides implement bit for bit
(splitmix64, below): value = float32(lo + span * u), u = (splitmix64 output >> 40) / 2^24, span a
power of two, so the double arithmetic is exact up to the final rounding and FMA contraction cannot
change it. What is committed: torchvision's state_dict keys, dtypes and shapes in torch's order
(metadata "resnet50.keys", one "name|dtype|d0,d1,.." per line), each tensor's lo and span, three
sampled values per tensor (so the C++ generator is checked against this one), the input, and
torchvision's eval-mode logits in float64 and float32. The C++ test writes the state as a
safetensors file under torch's names, loads it by name into tessera::resnet50 and compares logits.

    /usr/bin/python3 tools/reference/gen_models.py   # writes tests/data/models.safetensors and
                                                     # tests/data/models_resnet8_state.safetensors
"""
import collections
import math
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # tools/
sys.path.insert(0, os.path.join(ROOT, "bench"))
import torch_models  # noqa: E402
from tessera_tools.safetensors_io import save  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "tools"))
import convert_torchvision  # noqa: E402

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
convert_torchvision.save_safetensors(
    os.path.join(ROOT, "tests", "data", "models_resnet8_state.safetensors"),
    convert_torchvision.convert(resnet8.state_dict(), "keep"), {"format": "pt"})


def lenet5_classic(in_channels, image, classes):
    """The bench twin with the classic LeNet-5 names (conv1, conv2, fc1, fc2, fc3) that Tessera uses."""
    names = ["conv1", "relu1", "pool1", "conv2", "relu2", "pool2", "flatten", "fc1", "relu3", "fc2", "relu4", "fc3"]
    return torch.nn.Sequential(collections.OrderedDict(
        zip(names, torch_models.lenet5(in_channels, image, classes).children())))

torch.manual_seed(2)
lenet = lenet5_classic(1, 28, 10)
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



def splitmix_uniform(seed, n):
    """u[i] = (splitmix64(seed + (i + 1) * golden) >> 40) * 2^-24 in [0, 1): 24 exact bits."""
    i = np.arange(1, n + 1, dtype=np.uint64)
    z = np.uint64(seed) + i * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(40)).astype(np.float64) * 2.0 ** -24


def pow2(v):
    return 2.0 ** round(math.log2(v))


def generated_range(name, shape):
    """(lo, span) for one tensor: He-like uniform convolutions, BN statistics and affine away from trivial."""
    if name.endswith("running_var") or (name.endswith("weight") and len(shape) == 1):
        return 0.5, 1.0  # running_var, BN gamma in [0.5, 1.5)
    if len(shape) == 1 and not name.startswith("fc"):
        return -0.25, 0.5  # BN beta, running_mean
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 2048
    a = pow2(math.sqrt((6.0 if len(shape) == 4 else 1.0) / fan_in))
    return -a, 2 * a


torch.manual_seed(3)
rn50 = torchvision.models.resnet50(num_classes=10)
keys, los, spans, samples, state = [], [], [], [], {}
for k, (name, t) in enumerate(rn50.state_dict().items()):
    shape = tuple(t.shape)
    if name.endswith("num_batches_tracked"):
        state[name] = torch.tensor(k, dtype=torch.int64)  # value = the key's index
        lo, span = 0.0, 0.0
    else:
        lo, span = generated_range(name, shape)
        n = int(np.prod(shape))
        values = (lo + span * splitmix_uniform((k + 1) << 32, n)).astype(np.float32)
        samples.append(values[[0, n // 2, n - 1]])
        state[name] = torch.from_numpy(values.reshape(shape))
    keys.append(f"{name}|{'I64' if t.dtype == torch.int64 else 'F32'}|{','.join(str(d) for d in shape)}")
    los.append(lo)
    spans.append(span)
rn50.load_state_dict(state)
rn50.eval()
x = torch.randn(2, 3, 64, 64)
with torch.no_grad():
    logits32 = rn50(x)
    rn50_64 = torchvision.models.resnet50(num_classes=10).double()
    rn50_64.load_state_dict(state)
    rn50_64.eval()
    logits64 = rn50_64(x.double())
put("resnet50.gen.lo", np.array(los))
put("resnet50.gen.span", np.array(spans))
put("resnet50.gen.samples", np.stack(samples))
put("resnet50.x", x)
put("resnet50.eval_logits", logits64)
put("resnet50.torch_f32_eval_logits", logits32)
put("resnet50.torch_f32_err", np.array(f32_error(logits64, logits32)))
print("resnet50 logits", logits64.abs().max().item(), "torch f32 error", f32_error(logits64, logits32))

save(os.path.join(ROOT, "tests", "data", "models.safetensors"), out, {"resnet50.keys": "\n".join(keys)})
print(f"wrote {len(out)} tensors")
