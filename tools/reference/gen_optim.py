"""Reference data for tests/optim/test_optim.cpp: torch.optim SGD / Adam / AdamW trajectories and
torch.optim.lr_scheduler values, from PyTorch in float64.

Run: /usr/bin/python3 tools/reference/gen_optim.py   -> tests/data/optim.safetensors

Layout (every case uses the same four parameters, initial values and gradient sequence):
  init.<param>              initial value                         shape P
  grad.<param>              gradient fed at steps 1..5            (5, *P)
  <case>.lr                 learning rate used at steps 1..5      (5,)  (set before each step)
  <case>.<param>            parameter after steps 1..5            (5, *P)
  <case>.torch_f32_err      torch's own float32 error against float64, in the measure below
  sched.<name>              scheduler lr at epochs (or iterations) 0..N

Error measure (used here and in the C++ test): max |a - r| / max(max |r|, 1e-12) per tensor and
step, maximised over tensors and steps.

The option sets of each case are repeated in the C++ test (kCases); keep the two lists in step.
Parameters whose name starts with "fc.bias" are ParamKind::Bias and "bn." are ParamKind::Norm:
decay_norm_and_bias=False maps to two torch param groups, the second with weight_decay=0.
"""
import math
import os

import numpy as np
import torch

from safetensors_io import save

STEPS = 5
PARAMS = {"fc.weight": (3, 4), "fc.bias": (3,), "bn.weight": (4,), "bn.bias": (4,)}
NO_DECAY = {"fc.bias", "bn.weight", "bn.bias"}
# Gradient magnitudes change between steps so that AMSGrad's running maximum matters and the
# moment estimates do not settle into a fixed ratio.
GRAD_SCALE = [1.0, 0.5, 2.0, 0.25, 1.0]
VARYING_LR = [0.1, 0.05, 0.2, 0.02, 0.1]

CASES = {
    "sgd_plain": ("sgd", dict(lr=0.1), [0.1] * STEPS, True),
    "sgd_momentum": ("sgd", dict(lr=0.1, momentum=0.9), [0.1] * STEPS, True),
    "sgd_dampening": ("sgd", dict(lr=0.1, momentum=0.9, dampening=0.3), [0.1] * STEPS, True),
    "sgd_nesterov": ("sgd", dict(lr=0.1, momentum=0.9, nesterov=True), VARYING_LR, True),
    "sgd_weight_decay": ("sgd", dict(lr=0.1, momentum=0.9, weight_decay=0.05), [0.1] * STEPS, True),
    "sgd_decay_excluded": ("sgd", dict(lr=0.1, momentum=0.9, weight_decay=0.05), VARYING_LR, False),
    "adam": ("adam", dict(lr=0.01), [0.01] * STEPS, True),
    "adam_weight_decay": ("adam", dict(lr=0.01, weight_decay=0.05), [0.01] * STEPS, True),
    "adam_decay_excluded": ("adam", dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05),
                            [0.01] * STEPS, False),
    # beta2 = 0.9 lets the second moment fall after the large step-3 gradient, so the maximum matters.
    "adam_amsgrad": ("adam", dict(lr=0.01, betas=(0.9, 0.9), amsgrad=True), [0.01] * STEPS, True),
    "adamw": ("adamw", dict(lr=0.01), [0.01, 0.005, 0.02, 0.002, 0.01], True),  # default weight_decay 0.01
    "adamw_decay_excluded": ("adamw", dict(lr=0.01, weight_decay=0.1), [0.01] * STEPS, False),
}


def rel_err(a, r):
    return float(np.max(np.abs(a - r)) / max(float(np.max(np.abs(r))), 1e-12))


def run(kind, options, lrs, decay_all, init, grads, dtype):
    params = {n: torch.tensor(v, dtype=dtype, requires_grad=True) for n, v in init.items()}
    if decay_all:
        groups = [{"params": list(params.values())}]
    else:
        groups = [{"params": [p for n, p in params.items() if n not in NO_DECAY]},
                  {"params": [p for n, p in params.items() if n in NO_DECAY], "weight_decay": 0.0}]
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind]
    opt = cls(groups, foreach=False, **options)
    out = {n: [] for n in params}
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = lrs[step]
        for n, p in params.items():
            p.grad = torch.tensor(grads[n][step], dtype=dtype)
        opt.step()
        for n, p in params.items():
            out[n].append(p.detach().double().numpy().copy())
    return {n: np.stack(v) for n, v in out.items()}


def optimizer_cases(tensors):
    rng = np.random.default_rng(20240607)
    init = {n: rng.normal(size=s) for n, s in PARAMS.items()}
    grads = {n: np.stack([GRAD_SCALE[k] * rng.normal(size=s) for k in range(STEPS)]) for n, s in PARAMS.items()}
    for n in PARAMS:
        tensors[f"init.{n}"] = init[n]
        tensors[f"grad.{n}"] = grads[n]
    for case, (kind, options, lrs, decay_all) in CASES.items():
        ref = run(kind, options, lrs, decay_all, init, grads, torch.float64)
        f32 = run(kind, options, lrs, decay_all, init, grads, torch.float32)
        tensors[f"{case}.lr"] = np.array(lrs, dtype=np.float64)
        for n in PARAMS:
            tensors[f"{case}.{n}"] = ref[n]
        err = max(rel_err(f32[n][k], ref[n][k]) for n in PARAMS for k in range(STEPS))
        tensors[f"{case}.torch_f32_err"] = np.array([err])


def scheduler_values(make, steps, base_lr):
    """lr before each of `steps` scheduler steps: values at epochs (or iterations) 0..steps-1."""
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=base_lr)
    sched = make(opt)
    values = []
    for _ in range(steps):
        values.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return np.array(values, dtype=np.float64)


def schedule_cases(tensors):
    S = torch.optim.lr_scheduler
    # Each entry mirrors one schedule in test_optim.cpp's "schedules match torch" test.
    tensors["sched.step"] = scheduler_values(lambda o: S.StepLR(o, step_size=3, gamma=0.5), 13, 0.1)
    tensors["sched.multistep"] = scheduler_values(lambda o: S.MultiStepLR(o, milestones=[2, 5, 9], gamma=0.1),
                                                  13, 0.4)
    # Past t_max the torch recursion keeps following the closed-form cosine (it rises again).
    tensors["sched.cosine"] = scheduler_values(lambda o: S.CosineAnnealingLR(o, T_max=10, eta_min=0.001), 26, 0.1)
    tensors["sched.warmup_constant"] = scheduler_values(
        lambda o: S.LinearLR(o, start_factor=0.1, total_iters=5), 11, 0.4)
    # Goyal et al.: warmup, then steps; chained schedulers multiply their factors.
    tensors["sched.warmup_step"] = scheduler_values(
        lambda o: S.ChainedScheduler([S.LinearLR(o, start_factor=0.25, total_iters=4),
                                      S.StepLR(o, step_size=3, gamma=0.1)]), 11, 0.8)
    # The cosine recursion is a pure ratio only with eta_min = 0 (and up to t_max), which is when
    # chaining it with LinearLR gives the product our LinearWarmup computes.
    tensors["sched.warmup_cosine"] = scheduler_values(
        lambda o: S.ChainedScheduler([S.LinearLR(o, start_factor=0.1, total_iters=3),
                                      S.CosineAnnealingLR(o, T_max=10)]), 11, 0.2)
    # Per-iteration stepping (4 iterations per epoch): iteration i is epoch i / 4.
    tensors["sched.warmup_per_iter"] = scheduler_values(
        lambda o: S.LinearLR(o, start_factor=0.1, total_iters=2 * 4), 13, 0.4)
    tensors["sched.cosine_per_iter"] = scheduler_values(
        lambda o: S.CosineAnnealingLR(o, T_max=10 * 4, eta_min=0.001), 41, 0.1)
    # Sanity: torch's recursion agrees with the closed forms we implement.
    closed = [0.001 + (0.1 - 0.001) * (1 + math.cos(math.pi * e / 10)) / 2 for e in range(26)]
    assert np.max(np.abs(tensors["sched.cosine"] - closed)) < 1e-14, "cosine recursion drifted"


def main():
    torch.manual_seed(0)
    tensors = {}
    optimizer_cases(tensors)
    schedule_cases(tensors)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "tests", "data", "optim.safetensors")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save(path, tensors, {"generator": "tools/reference/gen_optim.py", "torch": torch.__version__})
    print(f"wrote {path}: {len(tensors)} tensors")
    for case in CASES:
        print(f"  {case:22s} torch f32 err {tensors[case + '.torch_f32_err'][0]:.3e}")


if __name__ == "__main__":
    main()
