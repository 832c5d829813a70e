"""Minimal safetensors reader/writer on numpy (Debian has no python3-safetensors package).

Same format as Hugging Face's library: 8-byte little-endian header length, JSON header, raw
little-endian data. Used by the reference-data generators and to check that Tessera's checkpoints
are readable from Python.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

_DTYPES = {np.dtype("float64"): "F64", np.dtype("float32"): "F32", np.dtype("float16"): "F16",
           np.dtype("int64"): "I64", np.dtype("int32"): "I32", np.dtype("int16"): "I16",
           np.dtype("int8"): "I8", np.dtype("uint8"): "U8", np.dtype("bool"): "BOOL"}
_NUMPY = {v: k for k, v in _DTYPES.items()}


def save(path: str, tensors: Mapping[str, Any], metadata: Mapping[str, object] | None = None) -> None:
    header: dict[str, Any] = {}
    blobs: list[bytes] = []
    offset = 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        data = array.astype(array.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": _DTYPES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def load(path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Returns ({name: numpy array}, metadata)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    metadata: dict[str, str] = header.pop("__metadata__", {})
    out: dict[str, Any] = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        out[name] = np.frombuffer(data[begin:end], dtype=_NUMPY[info["dtype"]]).reshape(info["shape"])
    return out, metadata
