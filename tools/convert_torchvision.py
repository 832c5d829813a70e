#!/usr/bin/env python3
"""Converts a torchvision (or any PyTorch) state_dict into a safetensors file that Tessera loads by
name with tessera::load_state_dict (include/tessera/io/state_dict.hpp).

Sources (no network access is needed):
    convert_torchvision.py resnet50.pth out.safetensors            # a local .pth / .pt file
    convert_torchvision.py --arch resnet50 --seed 0 out.safetensors  # torchvision.models.resnet50(weights=None)
                                                                     # initialized from torch.manual_seed(seed)
Options: --num-classes N (with --arch), --dtype keep|f32|f64|f16|bf16 (default f32; Tessera converts F64,
F32, F16 and BF16 to the model's scalar on load; num_batches_tracked stays I64).

A .pth file may hold a state_dict, a whole nn.Module, or a training checkpoint dict with the
state_dict under "state_dict", "model" or "model_state_dict"; a DistributedDataParallel "module."
prefix is removed. Names are kept exactly as torch writes them ("layer1.0.bn1.running_mean"),
which are Tessera's names for resnet18/34/50/101/152. The file carries {"format": "pt"} metadata,
as safetensors.torch.save_file writes, so Hugging Face's loader reads it too.

Then, in C++:
    auto net = tessera::resnet50<tessera::CpuLocal>({.num_classes = 1000});
    tessera::load_state_dict("out.safetensors", net);   // strict: every key, every shape
    net.set_mode(tessera::Mode::Eval);
"""
import argparse
import json
import struct
import sys

import torch

_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
_CASTS = {"f64": torch.float64, "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _raw_bytes(t):
    """Little-endian bytes of a contiguous CPU tensor (bfloat16 through its 16-bit pattern: numpy has no bf16)."""
    t = t.detach().cpu().contiguous().reshape(-1)
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    array = t.numpy()
    return array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()


def save_safetensors(path, tensors, metadata=None):
    """Writes {name: torch.Tensor} in the safetensors format (8-byte header length, JSON header, data)."""
    header, blobs, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, t in tensors.items():
        if t.dtype not in _NAMES:
            raise SystemExit(f"convert_torchvision: tensor '{name}' has dtype {t.dtype}, which safetensors cannot hold")
        data = _raw_bytes(t)
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # keeps the data 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def state_dict_of(obj):
    """The state_dict inside what torch.load returned."""
    if isinstance(obj, torch.nn.Module):
        obj = obj.state_dict()
    if isinstance(obj, dict):
        for key in ("state_dict", "model_state_dict", "model"):
            if key in obj and isinstance(obj[key], (dict, torch.nn.Module)):
                return state_dict_of(obj[key])
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise SystemExit("convert_torchvision: the file holds neither a state_dict, an nn.Module nor a checkpoint "
                         "dict with 'state_dict' / 'model' / 'model_state_dict'")
    if obj and all(k.startswith("module.") for k in obj):
        obj = {k[len("module."):]: v for k, v in obj.items()}  # saved from DistributedDataParallel
    return obj


def convert(state_dict, dtype="f32"):
    """{name: tensor} with floating-point tensors cast to dtype ("keep" leaves them); integer buffers
    (num_batches_tracked) stay as they are."""
    out = {}
    for name, t in state_dict.items():
        t = t.detach().cpu()
        if t.is_floating_point() and dtype != "keep":
            t = t.to(_CASTS[dtype])
        out[name] = t
    return out


def torchvision_state(arch, seed, num_classes):
    import torchvision
    torch.manual_seed(seed)
    model = getattr(torchvision.models, arch)(weights=None, num_classes=num_classes)
    return model.state_dict()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", nargs="?", help="a .pth/.pt file (omit with --arch)")
    p.add_argument("output", help="the safetensors file to write")
    p.add_argument("--arch", help="build torchvision.models.<arch>(weights=None) instead of reading a file")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed before building --arch (default 0)")
    p.add_argument("--num-classes", type=int, default=1000, help="classes of the --arch model (default 1000)")
    p.add_argument("--dtype", choices=["keep", "f32", "f64", "f16", "bf16"], default="f32")
    args = p.parse_args(argv)
    if (args.source is None) == (args.arch is None):
        p.error("give either a source .pth file or --arch")
    if args.arch:
        state = torchvision_state(args.arch, args.seed, args.num_classes)
        origin = f"torchvision.models.{args.arch}(weights=None, num_classes={args.num_classes}), seed {args.seed}"
    else:
        state = state_dict_of(torch.load(args.source, map_location="cpu"))
        origin = args.source
    tensors = convert(state, args.dtype)
    save_safetensors(args.output, tensors, {"format": "pt", "source": origin})
    count = sum(t.numel() for n, t in tensors.items() if not n.endswith("num_batches_tracked"))
    print(f"wrote {args.output}: {len(tensors)} tensors, {count} values, from {origin}")


if __name__ == "__main__":
    sys.exit(main())
