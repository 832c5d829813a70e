"""Reference data for the GPT model (tests/models/test_gpt.cpp): nanoGPT's model.py, rebuilt here
module for module with its names (PyTorch 1.13 has no F.scaled_dot_product_attention, so attention
is nanoGPT's own slow path: matmul, causal mask, softmax, matmul; dropout 0).

Run with /usr/bin/python3 (PyTorch 1.13, CPU) from the repository root:
    /usr/bin/python3 tools/reference/gen_gpt.py
Writes tests/data/gpt.safetensors, everything in float64. Per case <c>:
  <c>.<key> for every key of model.state_dict() (transformer.wte.weight, ..., lm_head.weight: the
    tied pair holds the same values), drawn N(0, 0.3^2) (biases N(0, 0.1^2), LayerNorm weights
    1 + N(0, 0.1^2)) so that nothing is near a trivial value;
  <c>.idx (B, T) token ids and <c>.targets (B, T) with some -1 (ignored), both as float64;
  <c>.logits (B, T, V), <c>.loss (F.cross_entropy(logits.view(-1, V), targets.view(-1),
    ignore_index=-1), as nanoGPT's forward), and <c>.d<key> the gradient of the loss for every
    parameter (transformer.wte.weight's includes lm_head's: they are one tensor);
  <c>.torch_f32_err.<t>: PyTorch's own float32 error on tensor t (tests/support/reference.hpp).
The metadata holds each case's configuration string and "<c>.keys", the state dict's keys in order.
"""
import math
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/reference/
from gen_norm_act_loss import rel_err  # noqa: E402
from tessera_tools.safetensors_io import save  # noqa: E402

# name: (block_size, vocab_size, n_layer, n_head, n_embd, bias, B, T, targets ignored)
CASES = {
    "gpt_tiny": (8, 11, 2, 2, 8, True, 2, 6, 2),
    "gpt_nobias_full_block": (8, 13, 1, 4, 8, False, 2, 8, 0),
}


def config_str(c):
    block, vocab, layers, heads, embd, bias, b, t, ignored = c
    return (f"block_size={block} vocab_size={vocab} n_layer={layers} n_head={heads} n_embd={embd} bias={int(bias)} "
            f"B={b} T={t} ignored={ignored}")


class LayerNorm(nn.Module):
    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, embd, heads, bias):
        super().__init__()
        self.c_attn = nn.Linear(embd, 3 * embd, bias=bias)
        self.c_proj = nn.Linear(embd, embd, bias=bias)
        self.n_head, self.n_embd = heads, embd

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, embd, bias):
        super().__init__()
        self.c_fc = nn.Linear(embd, 4 * embd, bias=bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * embd, embd, bias=bias)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, embd, heads, bias):
        super().__init__()
        self.ln_1 = LayerNorm(embd, bias)
        self.attn = CausalSelfAttention(embd, heads, bias)
        self.ln_2 = LayerNorm(embd, bias)
        self.mlp = MLP(embd, bias)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, block, vocab, layers, heads, embd, bias):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, embd), wpe=nn.Embedding(block, embd), drop=nn.Dropout(0.0),
            h=nn.ModuleList([Block(embd, heads, bias) for _ in range(layers)]), ln_f=LayerNorm(embd, bias)))
        self.lm_head = nn.Linear(embd, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # nanoGPT's weight tying

    def forward(self, idx, targets):
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def write_hf_layout(state, path):
    """gpt_tiny's weights as Hugging Face's GPT2Model saves them (the hub's model.safetensors): no
    "transformer." prefix, the four Conv1D weights per block stored (in, out), each block's causal
    mask buffer ".attn.bias" (1, 1, block, block) and ".attn.masked_bias", no lm_head (tied). The
    converter (tools/convert_gpt2.py) must turn it back into gpt_tiny's state dict
    (tests/tools/test_convert_gpt2.py)."""
    hf = {}
    for k, v in state.items():
        if k == "lm_head.weight":
            continue
        name = k[len("transformer."):]
        if name.endswith(("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")):
            v = v.t().contiguous()
        hf[name] = v.float().numpy()
        if name.endswith("ln_1.weight"):
            block = state["transformer.wpe.weight"].shape[0]
            hf[name.replace("ln_1.weight", "attn.bias")] = np.tril(np.ones((block, block), np.float32))[None, None]
            hf[name.replace("ln_1.weight", "attn.masked_bias")] = np.array(-1e4, np.float32)
    save(path, hf, {"format": "pt"})


def run(c, state, idx, targets, dtype):
    block, vocab, layers, heads, embd, bias, b, t, ignored = c
    model = GPT(block, vocab, layers, heads, embd, bias).to(dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    logits, loss = model(idx, targets)
    loss.backward()
    out = {"logits": logits.detach(), "loss": loss.detach()}
    for name, p in model.named_parameters():  # the tied weight once, under its first name
        out["d" + name] = p.grad
    return out


def main():
    torch.manual_seed(20261201)
    tensors, metadata = {}, {}
    for name, c in CASES.items():
        block, vocab, layers, heads, embd, bias, b, t, ignored = c
        shapes = GPT(block, vocab, layers, heads, embd, bias).state_dict()
        state = {}
        for k, v in shapes.items():
            if k == "lm_head.weight":
                state[k] = state["transformer.wte.weight"]
            elif k.endswith(".bias"):
                state[k] = torch.randn(v.shape, dtype=torch.float64) * 0.1
            elif ".ln_" in k:
                state[k] = 1.0 + torch.randn(v.shape, dtype=torch.float64) * 0.1
            else:
                state[k] = torch.randn(v.shape, dtype=torch.float64) * 0.3
        idx = torch.randint(0, vocab, (b, t), dtype=torch.int64)
        targets = torch.randint(0, vocab, (b, t), dtype=torch.int64)
        targets.view(-1)[torch.randperm(b * t)[:ignored]] = -1
        ref = run(c, state, idx, targets, torch.float64)
        f32 = run(c, state, idx, targets, torch.float32)
        for k, v in state.items():
            tensors[f"{name}.{k}"] = v.numpy()
        tensors[f"{name}.idx"] = idx.double().numpy()
        tensors[f"{name}.targets"] = targets.double().numpy()
        for k, v in ref.items():
            tensors[f"{name}.{k}"] = v.detach().numpy()
            tensors[f"{name}.torch_f32_err.{k}"] = np.array(rel_err(f32[k], v), dtype=np.float64)
        metadata[name] = config_str(c)
        metadata[f"{name}.keys"] = ",".join(shapes.keys())
        if name == "gpt_tiny":
            tiny_state = state

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    write_hf_layout(tiny_state, os.path.join(root, "tests", "data", "gpt2_hf_tiny.safetensors"))
    path = os.path.join(root, "tests", "data", "gpt.safetensors")
    save(path, tensors, metadata)
    print(f"wrote {path}: {len(tensors)} tensors, {os.path.getsize(path)} bytes")
    for k in sorted(tensors):
        if ".torch_f32_err." in k:
            print(f"  {k} = {float(tensors[k]):.3e}")


if __name__ == "__main__":
    main()
