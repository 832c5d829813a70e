"""Reference data for the transformer layers: LayerNorm, RMSNorm, Embedding, scaled dot-product
attention, nanoGPT's CausalSelfAttention block and cross-entropy over (B, T, V)
(tests/layers/test_transformer_layers.cpp).

Run with /usr/bin/python3 (PyTorch 1.13, CPU) from the repository root:
    /usr/bin/python3 tools/reference/gen_transformer.py
Writes tests/data/transformer.safetensors, everything in float64. Every case has inputs, an
upstream gradient .g (of L = sum(y * g)) where it has an output, and PyTorch's outputs and gradients:
  LayerNorm (ln_*): .x, .weight, .bias, .g -> .y, .dx, .dweight, .dbias. torch 1.13's nn.LayerNorm
    has no bias argument, so F.layer_norm(x, shape, weight, bias or None, eps) (nanoGPT's LayerNorm).
  RMSNorm (rms_*): .x, .weight, .g -> .y, .dx, .dweight. torch 1.13 has no nn.RMSNorm: written as
    torch >= 2.4 defines it, x * rsqrt(mean(x^2 over normalized_shape) + eps) * weight, with
    eps=None meaning torch.finfo(dtype).eps.
  Embedding (emb_*): .weight, .ids (as float64), .g -> .y, .dweight (F.embedding with padding_idx).
  Attention (sdpa_*): .q, .k, .v, .g -> .out, .dq, .dk, .dv, written as matmul, mask, softmax, matmul
    (torch 1.13 has no F.scaled_dot_product_attention); causal is torch's is_causal, the lower
    triangle of a (T, S) matrix of ones.
  Self-attention block (attn_*): nanoGPT's CausalSelfAttention (model.py) with dropout 0:
    .x, .c_attn.weight, .c_attn.bias, .c_proj.weight, .c_proj.bias, .g -> .y, .dx and the
    parameter gradients as .d<name>.
  Cross-entropy over (B, T, V) (ce_btv_*): .logits, .labels, -> .loss, .dlogits, as nanoGPT's
    F.cross_entropy(logits.view(-1, V), targets.view(-1), ignore_index).
  <case>.torch_f32_err.<t>: PyTorch's own float32 error on tensor t, from which the C++ tests
    derive their float32 tolerances (tests/support/reference.hpp).
The metadata holds each case's configuration string; the C++ tests rebuild it from their own tables
and require equality, so the two cannot drift apart.
"""
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/reference/
from gen_norm_act_loss import add_case  # noqa: E402  (float64 and float32 runs, PyTorch's own f32 error)
from tessera_tools.safetensors_io import save  # noqa: E402

# name: (x shape, normalized shape, eps, elementwise_affine, bias, offset added to x)
LAYER_NORMS = {
    "ln_3d": ((2, 3, 8), (8,), 1e-5, True, True, 0.0),
    "ln_two_dims": ((2, 3, 4, 5), (4, 5), 1e-3, True, True, 0.0),
    "ln_nobias": ((4, 6), (6,), 1e-5, True, False, 0.0),
    "ln_noaffine": ((3, 7), (7,), 1e-5, False, False, 0.0),
    "ln_offset": ((5, 16), (16,), 1e-5, True, True, 1000.0),
}
# name: (x shape, normalized shape, eps (None: finfo eps), elementwise_affine)
RMS_NORMS = {
    "rms_3d": ((2, 3, 8), (8,), None, True),
    "rms_eps": ((4, 6), (6,), 1e-5, True),
    "rms_noaffine": ((3, 5, 4), (5, 4), 1e-6, False),
}
# name: (num_embeddings, embedding_dim, ids shape, padding_idx (None: none))
EMBEDDINGS = {
    "emb_plain": (10, 4, (2, 5), None),
    "emb_padding": (7, 3, (3, 4), 2),
    "emb_padding_negative": (6, 5, (9,), -1),
}
# name: (q shape, keys S, value dim, causal, scale (None: 1/sqrt(d)))
ATTENTIONS = {
    "sdpa_small": ((2, 3, 5, 4), 5, 4, False, None),
    "sdpa_causal": ((2, 2, 9, 8), 9, 8, True, None),
    "sdpa_cross": ((2, 7, 4), 11, 3, False, None),
    "sdpa_causal_tiles": ((1, 2, 150, 16), 150, 16, True, None),
    "sdpa_scale": ((3, 6, 5), 6, 5, False, 0.3),
    "sdpa_causal_rect": ((2, 6, 4), 10, 4, True, None),
}
# name: (B, T, C, n_head, bias)
SELF_ATTENTIONS = {
    "attn_small": (2, 7, 12, 3, True),
    "attn_tiles_nobias": (1, 70, 16, 2, False),
}
# name: (B, T, V, ignore_index, positions ignored)
CE_BTV = {
    "ce_btv_ignore": (2, 5, 7, -1, 3),
    "ce_btv_default": (3, 4, 6, -100, 0),
}


def shape_str(s):
    return "x".join(map(str, s))


def ln_config(c):
    shape, norm, eps, affine, bias, offset = c
    return (f"shape={shape_str(shape)} normalized={shape_str(norm)} eps={eps:g} affine={int(affine)} "
            f"bias={int(bias)} offset={offset:g}")


def rms_config(c):
    shape, norm, eps, affine = c
    return f"shape={shape_str(shape)} normalized={shape_str(norm)} eps={'none' if eps is None else f'{eps:g}'} affine={int(affine)}"


def emb_config(c):
    num, dim, ids, pad = c
    return f"num={num} dim={dim} ids={shape_str(ids)} padding_idx={'none' if pad is None else pad}"


def sdpa_config(c):
    q, s, dv, causal, scale = c
    return f"q={shape_str(q)} S={s} dv={dv} causal={int(causal)} scale={'default' if scale is None else f'{scale:g}'}"


def attn_config(c):
    b, t, ch, heads, bias = c
    return f"B={b} T={t} C={ch} n_head={heads} bias={int(bias)}"


def ce_btv_config(c):
    b, t, v, ignore_index, ignored = c
    return f"B={b} T={t} V={v} ignore_index={ignore_index} ignored={ignored}"


def leaf(t, dtype):
    return t.to(dtype).clone().requires_grad_()


def run_ln(c, i, dtype):
    shape, norm, eps, affine, bias, offset = c
    x = leaf(i["x"], dtype)
    w = leaf(i["weight"], dtype) if affine else None
    b = leaf(i["bias"], dtype) if bias else None
    y = F.layer_norm(x, norm, w, b, eps)
    y.backward(i["g"].to(dtype))
    out = {"y": y.detach(), "dx": x.grad}
    if affine:
        out["dweight"] = w.grad
    if bias:
        out["dbias"] = b.grad
    return out


def run_rms(c, i, dtype):
    shape, norm, eps, affine = c
    x = leaf(i["x"], dtype)
    dims = tuple(range(-len(norm), 0))
    e = torch.finfo(dtype).eps if eps is None else eps
    y = x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + e)
    if affine:
        w = leaf(i["weight"], dtype)
        y = y * w
    y.backward(i["g"].to(dtype))
    out = {"y": y.detach(), "dx": x.grad}
    if affine:
        out["dweight"] = w.grad
    return out


def run_emb(c, i, dtype):
    num, dim, ids_shape, pad = c
    w = leaf(i["weight"], dtype)
    y = F.embedding(i["ids"].long(), w, padding_idx=pad)
    y.backward(i["g"].to(dtype))
    return {"y": y.detach(), "dweight": w.grad}


def attention(q, k, v, causal, scale):
    s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v


def run_sdpa(c, i, dtype):
    q_shape, s_len, dv, causal, scale = c
    q, k, v = leaf(i["q"], dtype), leaf(i["k"], dtype), leaf(i["v"], dtype)
    out = attention(q, k, v, causal, scale)
    out.backward(i["g"].to(dtype))
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def run_attn(c, i, dtype):
    b, t, ch, heads, bias = c
    x = leaf(i["x"], dtype)
    p = {n: leaf(i[n], dtype) for n in ("c_attn.weight", "c_attn.bias", "c_proj.weight", "c_proj.bias")
         if n in i}
    # nanoGPT's CausalSelfAttention.forward, with its flash path's semantics (is_causal=True).
    qkv = F.linear(x, p["c_attn.weight"], p.get("c_attn.bias"))
    q, k, v = qkv.split(ch, dim=2)
    q = q.view(b, t, heads, ch // heads).transpose(1, 2)
    k = k.view(b, t, heads, ch // heads).transpose(1, 2)
    v = v.view(b, t, heads, ch // heads).transpose(1, 2)
    y = attention(q, k, v, True, None).transpose(1, 2).contiguous().view(b, t, ch)
    y = F.linear(y, p["c_proj.weight"], p.get("c_proj.bias"))
    y.backward(i["g"].to(dtype))
    out = {"y": y.detach(), "dx": x.grad}
    for n, t_ in p.items():
        out["d" + n] = t_.grad
    return out


def run_ce_btv(c, i, dtype):
    b, t, v, ignore_index, ignored = c
    logits = leaf(i["logits"], dtype)
    loss = F.cross_entropy(logits.view(-1, v), i["labels"].long().view(-1), ignore_index=ignore_index)
    loss.backward()
    return {"loss": loss.detach(), "dlogits": logits.grad}


def main():
    torch.manual_seed(20261130)
    tensors, metadata = {}, {}
    d = torch.float64

    for name, c in LAYER_NORMS.items():
        shape, norm, eps, affine, bias, offset = c
        inputs = {"x": torch.randn(shape, dtype=d) * 2.0 + offset, "g": torch.randn(shape, dtype=d)}
        if affine:
            inputs["weight"] = torch.rand(norm, dtype=d) + 0.5
        if bias:
            inputs["bias"] = torch.randn(norm, dtype=d)
        add_case(tensors, name, inputs, lambda dt, c=c, i=inputs: run_ln(c, i, dt))
        metadata[name] = ln_config(c)

    for name, c in RMS_NORMS.items():
        shape, norm, eps, affine = c
        inputs = {"x": torch.randn(shape, dtype=d) * 2.0 + 0.5, "g": torch.randn(shape, dtype=d)}
        if affine:
            inputs["weight"] = torch.rand(norm, dtype=d) + 0.5
        add_case(tensors, name, inputs, lambda dt, c=c, i=inputs: run_rms(c, i, dt))
        metadata[name] = rms_config(c)

    for name, c in EMBEDDINGS.items():
        num, dim, ids_shape, pad = c
        ids = torch.randint(0, num, ids_shape, dtype=torch.int64)
        ids.view(-1)[1] = ids.view(-1)[0]  # a repeated id: its gradient rows add up
        if pad is not None:
            ids.view(-1)[2] = pad % num
        weight = torch.randn(num, dim, dtype=d)
        if pad is not None:
            weight[pad] = 0.0  # as the layer starts it
        inputs = {"weight": weight, "ids": ids.to(d), "g": torch.randn(ids_shape + (dim,), dtype=d)}
        add_case(tensors, name, inputs, lambda dt, c=c, i=inputs: run_emb(c, i, dt))
        metadata[name] = emb_config(c)

    for name, c in ATTENTIONS.items():
        q_shape, s_len, dv, causal, scale = c
        lead = q_shape[:-2]
        inputs = {"q": torch.randn(q_shape, dtype=d), "k": torch.randn(lead + (s_len, q_shape[-1]), dtype=d),
                  "v": torch.randn(lead + (s_len, dv), dtype=d), "g": torch.randn(q_shape[:-1] + (dv,), dtype=d)}
        add_case(tensors, name, inputs, lambda dt, c=c, i=inputs: run_sdpa(c, i, dt))
        metadata[name] = sdpa_config(c)

    for name, c in SELF_ATTENTIONS.items():
        b, t, ch, heads, bias = c
        inputs = {"x": torch.randn(b, t, ch, dtype=d), "c_attn.weight": torch.randn(3 * ch, ch, dtype=d) * 0.3,
                  "c_proj.weight": torch.randn(ch, ch, dtype=d) * 0.3, "g": torch.randn(b, t, ch, dtype=d)}
        if bias:
            inputs["c_attn.bias"] = torch.randn(3 * ch, dtype=d) * 0.1
            inputs["c_proj.bias"] = torch.randn(ch, dtype=d) * 0.1
        add_case(tensors, name, inputs, lambda dt, c=c, i=inputs: run_attn(c, i, dt))
        metadata[name] = attn_config(c)

    for name, c in CE_BTV.items():
        b, t, v, ignore_index, ignored = c
        labels = torch.randint(0, v, (b, t), dtype=torch.int64)
        labels.view(-1)[torch.randperm(b * t)[:ignored]] = ignore_index
        inputs = {"logits": torch.randn(b, t, v, dtype=d) * 2.0, "labels": labels.to(d)}
        add_case(tensors, name, inputs, lambda dt, c=c, i=inputs: run_ce_btv(c, i, dt))
        metadata[name] = ce_btv_config(c)

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "tests", "data", "transformer.safetensors")
    save(path, tensors, metadata)
    print(f"wrote {path}: {len(tensors)} tensors, {os.path.getsize(path)} bytes")
    for k in sorted(tensors):
        if ".torch_f32_err." in k:
            print(f"  {k} = {float(tensors[k]):.3e}")


if __name__ == "__main__":
    main()
