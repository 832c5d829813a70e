"""convert_gpt2: a Hugging Face GPT-2 checkpoint (model.safetensors) to the state dict of Tessera's
GPT (include/tessera/models/gpt.hpp), which has nanoGPT's names.

    convert_gpt2.py model.safetensors gpt2.safetensors

What changes (nanoGPT's GPT.from_pretrained does the same):
  - names: GPT2Model's "wte.weight", "h.0.ln_1.weight", ... (or GPT2LMHeadModel's "transformer.*")
    become "transformer.wte.weight", "transformer.h.0.ln_1.weight", ...;
  - the four Conv1D weights per block (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj) are stored
    (in, out) by Hugging Face and (out, in) by nn.Linear: they are transposed;
  - the attention's causal-mask buffers (".attn.bias", ".attn.masked_bias") are dropped;
  - lm_head.weight is written as a copy of transformer.wte.weight (the tie); a source lm_head.weight
    that differs from wte.weight is refused (not a tied GPT-2).
Anything else (a missing or unknown key, a shape that does not fit GPT-2, an unsupported dtype) is
an error naming the key. The output keeps the source's float dtype and carries {"format": "pt"}
plus the inferred config (n_layer, n_embd, vocab_size, block_size) in its metadata; n_head is not
in the weights: pass it to GPTConfig yourself (12 for GPT-2 small).
"""
from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
DROPPED = (".attn.bias", ".attn.masked_bias")
PER_BLOCK = ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
             "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight",
             "mlp.c_proj.bias")


class ConversionError(ValueError):
    """The source is not a GPT-2 checkpoint this converter understands; the message names the key."""


@dataclass
class Gpt2Layout:
    n_layer: int
    n_embd: int
    vocab_size: int
    block_size: int


def _strip(name: str) -> str:
    return name[len("transformer."):] if name.startswith("transformer.") else name


def convert(source: dict[str, Any]) -> tuple[dict[str, Any], Gpt2Layout]:
    """The nanoGPT-named state dict of a Hugging Face GPT-2 state dict, and its inferred sizes."""
    import numpy as np  # here, so that --help needs no numpy
    tensors = {_strip(k): v for k, v in source.items() if not k.endswith(DROPPED)}
    for name in ("wte.weight", "wpe.weight", "ln_f.weight"):
        if name not in tensors:
            raise ConversionError(f"missing key {name!r}: not a GPT-2 checkpoint")
    vocab, embd = tensors["wte.weight"].shape
    block = tensors["wpe.weight"].shape[0]
    layers = sorted({int(m.group(1)) for k in tensors if (m := re.match(r"h\.(\d+)\.", k))})
    if layers != list(range(len(layers))) or not layers:
        raise ConversionError(f"blocks {layers} are not 0..n_layer-1")
    expected: dict[str, tuple[int, ...]] = {"wte.weight": (vocab, embd), "wpe.weight": (block, embd),
                                             "ln_f.weight": (embd,), "ln_f.bias": (embd,)}
    hf_shapes = {"ln_1.weight": (embd,), "ln_1.bias": (embd,), "ln_2.weight": (embd,), "ln_2.bias": (embd,),
                 "attn.c_attn.weight": (embd, 3 * embd), "attn.c_attn.bias": (3 * embd,),
                 "attn.c_proj.weight": (embd, embd), "attn.c_proj.bias": (embd,),
                 "mlp.c_fc.weight": (embd, 4 * embd), "mlp.c_fc.bias": (4 * embd,),
                 "mlp.c_proj.weight": (4 * embd, embd), "mlp.c_proj.bias": (embd,)}
    for i in layers:
        for part in PER_BLOCK:
            expected[f"h.{i}.{part}"] = hf_shapes[part]
    lm_head = tensors.pop("lm_head.weight", None)
    if lm_head is not None and not np.array_equal(lm_head, tensors["wte.weight"]):
        raise ConversionError("lm_head.weight differs from wte.weight: not a tied GPT-2 checkpoint")
    missing = [k for k in expected if k not in tensors]
    unknown = [k for k in tensors if k not in expected]
    if missing or unknown:
        raise ConversionError(f"missing keys {missing}, unknown keys {unknown}")
    out: dict[str, Any] = {}
    for name, shape in expected.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise ConversionError(f"{name}: shape {tuple(t.shape)}, GPT-2 with n_embd={embd} needs {shape}")
        if t.dtype.kind != "f":
            raise ConversionError(f"{name}: dtype {t.dtype} is not floating point")
        if name.endswith(TRANSPOSED):
            t = np.ascontiguousarray(t.T)
        out["transformer." + name] = t
    ordered = {k: out[k] for k in _nanogpt_order(len(layers))}
    ordered["lm_head.weight"] = out["transformer.wte.weight"].copy()
    return ordered, Gpt2Layout(n_layer=len(layers), n_embd=int(embd), vocab_size=int(vocab), block_size=int(block))


def _nanogpt_order(n_layer: int) -> list[str]:
    keys = ["transformer.wte.weight", "transformer.wpe.weight"]
    for i in range(n_layer):
        keys += [f"transformer.h.{i}.{p}" for p in PER_BLOCK]
    return keys + ["transformer.ln_f.weight", "transformer.ln_f.bias"]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="convert_gpt2.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("source", help="Hugging Face GPT-2 weights (model.safetensors)")
    ap.add_argument("output", help="Tessera / nanoGPT state dict to write (safetensors)")
    args = ap.parse_args(argv)
    from tessera_tools import safetensors_io  # numpy: after --help

    try:
        source, _ = safetensors_io.load(args.source)
    except (OSError, KeyError, ValueError) as e:
        print(f"convert_gpt2.py: cannot read {args.source}: {e!r}", file=sys.stderr)
        return 1
    try:
        state, layout = convert(source)
    except ConversionError as e:
        print(f"convert_gpt2.py: {args.source}: {e}", file=sys.stderr)
        return 1
    safetensors_io.save(args.output, state, {"format": "pt", "n_layer": layout.n_layer, "n_embd": layout.n_embd,
                                             "vocab_size": layout.vocab_size, "block_size": layout.block_size})
    print(f"wrote {args.output}: {len(state)} tensors, n_layer={layout.n_layer} n_embd={layout.n_embd} "
          f"vocab_size={layout.vocab_size} block_size={layout.block_size}")
    return 0
