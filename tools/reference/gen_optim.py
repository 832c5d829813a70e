"""Reference data for tests/optim/test_optim.cpp: torch.optim SGD / Adam / AdamW trajectories, LARS
and LAMB written in torch ops (torch 1.13 has neither; see Lars / Lamb below), and
torch.optim.lr_scheduler values, from PyTorch in float64 and float32.

Run: /usr/bin/python3 tools/reference/gen_optim.py   -> tests/data/optim.safetensors

Layout (every case uses the same four parameters, initial values and gradient sequence):
  init.<param>              initial value                         shape P
  grad.<param>              gradient fed at steps 1..5            (5, *P)
  <case>.lr                 learning rate used at steps 1..5      (5,)  (set before each step)
  <case>.<param>            parameter after steps 1..5            (5, *P)
  <case>.torch_f32_err      torch's own float32 error against float64, in the measure below
  sched.<name>              scheduler lr at epochs (or iterations) 0..N

Long float32 runs (every case of CASES, LONG_STEPS steps, a realistic gradient sequence and a
warmup-then-cosine learning rate; the initial values are init.<param> rounded to float32):
  long.grad.<param>         float32 gradient fed at steps 1..LONG_STEPS          (LONG_STEPS, *P)
  long.<case>.lr            learning rate set before steps 1..LONG_STEPS (float64) (LONG_STEPS,)
  long.<case>.<param>       float32 parameter computed by torch in float32 after steps
                            RECORD_EVERY, 2 RECORD_EVERY, ..., LONG_STEPS      (LONG_STEPS / RECORD_EVERY, *P)
  long.<case>.torch_f32_err how far torch's float32 run drifts from its float64 run (same measure)

Error measure (used here and in the C++ test): max |a - r| / max(max |r|, 1e-12) per tensor and
step, maximised over tensors and steps.

The option sets of each case are repeated in the C++ test (kCases); keep the two lists in step.
Parameters whose name starts with "fc.bias" are ParamKind::Bias and "bn." are ParamKind::Norm:
decay_norm_and_bias=False maps to two torch param groups, the second with weight_decay=0.
"""
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/
from tessera_tools.safetensors_io import save  # noqa: E402

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
    # LARS / LAMB: the last flag is adapt_norm_and_bias (False: biases and norms get neither decay
    # nor the trust ratio, as the decay mask of the others).
    "lars": ("lars", dict(lr=0.5, momentum=0.9, weight_decay=1e-3, eta=0.02), VARYING_LR, False),
    "lars_adapt_all": ("lars", dict(lr=0.5, momentum=0.9, weight_decay=5e-3, eta=0.01, eps=1e-6), [0.5] * STEPS,
                       True),
    "lamb": ("lamb", dict(lr=0.01, weight_decay=0.01), [0.01] * STEPS, False),
    "lamb_adapt_all": ("lamb", dict(lr=0.02, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.1), [0.02] * STEPS, True),
}

LONG_STEPS = 128
RECORD_EVERY = 4


def rel_err(a, r):
    return float(np.max(np.abs(a - r)) / max(float(np.max(np.abs(r))), 1e-12))


# LARS and LAMB as Tessera defines them (optim/lars.hpp, optim/lamb.hpp), written the way
# torch.optim writes Adam: hyper-parameters are Python floats (double), every derived scalar
# (1 - beta, bias corrections, trust ratio, lr * trust) is computed in double and handed to one
# tensor op, which rounds it to the tensor's dtype; norms are taken in float64, as Tessera sums them
# in double. Group option "adapt": the trust ratio and weight decay apply (weights, or everything
# with adapt_norm_and_bias); the other group gets trust 1 and no decay.
class Lars(torch.optim.Optimizer):
    def __init__(self, params, lr, momentum=0.9, weight_decay=0.0, eta=0.001, eps=1e-9, adapt=True):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta, eps=eps,
                                      adapt=adapt))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            wd = group["weight_decay"] if group["adapt"] else 0.0
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                trust = 1.0
                if group["adapt"]:
                    w_norm, g_norm = p.double().norm().item(), p.grad.double().norm().item()
                    if w_norm > 0 and g_norm > 0:
                        trust = group["eta"] * w_norm / (g_norm + wd * w_norm + group["eps"])
                d = p.grad.add(p, alpha=wd)
                buf = state["momentum_buffer"]
                buf.mul_(group["momentum"]).add_(d, alpha=group["lr"] * trust)
                p.sub_(buf)


class Lamb(torch.optim.Optimizer):
    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, adapt=True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adapt=adapt))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            wd = group["weight_decay"] if group["adapt"] else 0.0
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                bias_correction1 = 1 - beta1 ** state["step"]
                bias_correction2 = 1 - beta2 ** state["step"]
                r = (exp_avg / bias_correction1) / (exp_avg_sq / bias_correction2).sqrt().add_(group["eps"])
                r.add_(p, alpha=wd)
                trust = 1.0
                if group["adapt"]:
                    w_norm, r_norm = p.double().norm().item(), r.double().norm().item()
                    if w_norm > 0 and r_norm > 0:
                        trust = w_norm / r_norm
                p.add_(r, alpha=-group["lr"] * trust)


def make_optimizer(kind, options, decay_all, params):
    if kind in ("lars", "lamb"):
        cls = Lars if kind == "lars" else Lamb
        groups = [{"params": [p for n, p in params.items() if decay_all or n not in NO_DECAY]}]
        if not decay_all:
            groups.append({"params": [p for n, p in params.items() if n in NO_DECAY], "adapt": False})
        return cls(groups, **options)
    if decay_all:
        groups = [{"params": list(params.values())}]
    else:
        groups = [{"params": [p for n, p in params.items() if n not in NO_DECAY]},
                  {"params": [p for n, p in params.items() if n in NO_DECAY], "weight_decay": 0.0}]
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind]
    return cls(groups, foreach=False, **options)


def run(kind, options, lrs, decay_all, init, grads, dtype, steps=STEPS, record_every=1):
    """Parameters (float64 numpy) after steps record_every, 2 record_every, ..., steps."""
    params = {n: torch.tensor(v, dtype=dtype, requires_grad=True) for n, v in init.items()}
    opt = make_optimizer(kind, options, decay_all, params)
    out = {n: [] for n in params}
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lrs[step]
        for n, p in params.items():
            p.grad = torch.tensor(grads[n][step], dtype=dtype)
        opt.step()
        if (step + 1) % record_every == 0:
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


def long_gradients(rng):
    """A training-like float32 gradient sequence per parameter: a mean direction that turns slowly
    and shrinks as training converges, minibatch noise that shrinks less, parameters whose gradients
    differ by orders of magnitude (so that Adam's eps and LARS/LAMB's norms matter), three spikes
    (x8, as after a bad batch) and one step where the BatchNorm shift gets no gradient."""
    t = np.arange(LONG_STEPS)[:, None]
    scale = {"fc.weight": 1.0, "fc.bias": 0.3, "bn.weight": 2e-3, "bn.bias": 5.0}
    out = {}
    for n, shape in PARAMS.items():
        size = int(np.prod(shape))
        d0, d1 = rng.normal(size=(2, size))
        mean = (d0 * np.cos(t / 40) + d1 * np.sin(t / 40)) * np.exp(-t / 60)
        noise = rng.normal(size=(LONG_STEPS, size)) * (0.3 + 0.7 * np.exp(-t / 90))
        g = scale[n] * (mean + noise)
        g[[17, 63, 101]] *= 8
        if n == "bn.bias":
            g[40] = 0
        out[n] = g.reshape((LONG_STEPS,) + shape).astype(np.float32)
    return out


def long_lrs(base):
    """Linear warmup from base / 10 over 8 steps, then cosine to base / 100 (computed in double)."""
    warm = 8
    lrs = []
    for k in range(LONG_STEPS):
        if k < warm:
            lrs.append(base * (0.1 + 0.9 * k / warm))
        else:
            lrs.append(base / 100 + (base - base / 100) * (1 + math.cos(math.pi * (k - warm) / (LONG_STEPS - warm))) / 2)
    return lrs


def long_cases(tensors):
    """Float32 trajectories over LONG_STEPS steps: the C++ test compares Tessera's float32 run to
    these (torch float32), not to float64, so rounding differences in the scalars show up."""
    rng = np.random.default_rng(20240919)
    init = {n: tensors[f"init.{n}"] for n in PARAMS}
    init32 = {n: v.astype(np.float32) for n, v in init.items()}
    grads = long_gradients(rng)
    for n in PARAMS:
        tensors[f"long.grad.{n}"] = grads[n]
    for case, (kind, options, _, decay_all) in CASES.items():
        lrs = long_lrs(options["lr"])
        f32 = run(kind, options, lrs, decay_all, init32, grads, torch.float32, LONG_STEPS, RECORD_EVERY)
        f64 = run(kind, options, lrs, decay_all, init, grads, torch.float64, LONG_STEPS, RECORD_EVERY)
        tensors[f"long.{case}.lr"] = np.array(lrs, dtype=np.float64)
        for n in PARAMS:
            tensors[f"long.{case}.{n}"] = f32[n].astype(np.float32)
        err = max(rel_err(f32[n][k], f64[n][k]) for n in PARAMS for k in range(LONG_STEPS // RECORD_EVERY))
        tensors[f"long.{case}.torch_f32_err"] = np.array([err])


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


def sequential_cases(tensors):
    """torch.optim.lr_scheduler.SequentialLR (1.13): at milestone M the next scheduler is stepped
    with step(0), i.e. set to its closed form at its own epoch 0 (base lr times its factor at 0),
    and its later step()s continue from there; so stage k runs on epoch e - M_k. Each entry mirrors
    one SequentialLr in test_optim.cpp's "SequentialLr matches torch" test."""
    S = torch.optim.lr_scheduler
    # Warmup then cosine over the rest (run past the cosine's end, where it rises again).
    tensors["sched.seq_warmup_cosine"] = scheduler_values(
        lambda o: S.SequentialLR(o, [S.LinearLR(o, start_factor=0.1, total_iters=5),
                                     S.CosineAnnealingLR(o, T_max=20, eta_min=0.004)], milestones=[5]), 31, 0.4)
    # ConstantLR holds factor * lr for its total_iters, then StepLR restarts its count at the milestone.
    tensors["sched.seq_constant_step"] = scheduler_values(
        lambda o: S.SequentialLR(o, [S.ConstantLR(o, factor=0.25, total_iters=3),
                                     S.StepLR(o, step_size=4, gamma=0.5)], milestones=[3]), 16, 0.8)
    tensors["sched.seq_constant_multistep"] = scheduler_values(
        lambda o: S.SequentialLR(o, [S.ConstantLR(o, factor=0.1, total_iters=2),
                                     S.MultiStepLR(o, milestones=[3, 7], gamma=0.1)], milestones=[2]), 14, 0.5)
    # ConstantLR ends (back to the full lr) before the milestone: a nested SequentialLr in Tessera.
    tensors["sched.seq_constant_ends_early"] = scheduler_values(
        lambda o: S.SequentialLR(o, [S.ConstantLR(o, factor=0.1, total_iters=2),
                                     S.StepLR(o, step_size=3, gamma=0.1)], milestones=[4]), 12, 0.5)
    # A warmup cut short by its milestone: the next stage starts from the full lr anyway.
    tensors["sched.seq_warmup_cut_short"] = scheduler_values(
        lambda o: S.SequentialLR(o, [S.LinearLR(o, start_factor=0.2, total_iters=6),
                                     S.MultiStepLR(o, milestones=[2, 4], gamma=0.5)], milestones=[3]), 10, 0.3)
    # Three stages: warmup, steps, then a cosine tail.
    tensors["sched.seq_three"] = scheduler_values(
        lambda o: S.SequentialLR(o, [S.LinearLR(o, start_factor=0.2, total_iters=4),
                                     S.StepLR(o, step_size=3, gamma=0.5),
                                     S.CosineAnnealingLR(o, T_max=8, eta_min=0.01)], milestones=[4, 10]), 22, 0.6)
    # Per-iteration stepping (4 iterations per epoch): warmup 2 epochs, cosine over 8.
    tensors["sched.seq_warmup_cosine_per_iter"] = scheduler_values(
        lambda o: S.SequentialLR(o, [S.LinearLR(o, start_factor=0.1, total_iters=2 * 4),
                                     S.CosineAnnealingLR(o, T_max=8 * 4)], milestones=[2 * 4]), 41, 0.2)


def main():
    torch.manual_seed(0)
    tensors = {}
    optimizer_cases(tensors)
    long_cases(tensors)
    schedule_cases(tensors)
    sequential_cases(tensors)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "tests", "data", "optim.safetensors")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save(path, tensors, {"generator": "tools/reference/gen_optim.py", "torch": torch.__version__})
    print(f"wrote {path}: {len(tensors)} tensors")
    for case in CASES:
        print(f"  {case:22s} torch f32 err {tensors[case + '.torch_f32_err'][0]:.3e}, "
              f"{LONG_STEPS} steps {tensors['long.' + case + '.torch_f32_err'][0]:.3e}")


if __name__ == "__main__":
    main()
