"""Lists a Tessera checkpoint from Python with numpy only: tensor names, dtypes, shapes, a norm,
and the training position stored in the metadata. Shows the file is plain safetensors.

    python3 tools/read_checkpoint.py ckpt.safetensors
    # with Hugging Face's package installed, the same file loads with safetensors.numpy.load_file
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="read_checkpoint.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a .safetensors file written by Tessera (or anything else)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    import numpy as np  # here, so that --help works without numpy

    from tessera_tools.safetensors_io import load

    tensors, metadata = load(args.checkpoint)
    for key in sorted(metadata):
        print(f"{key} = {metadata[key]}")
    for name, array in tensors.items():
        print(f"{name:60} {str(array.dtype):8} {str(list(array.shape)):20} |x|={np.linalg.norm(array.astype(np.float64)):.6g}")
    print(f"{len(tensors)} tensors, {sum(a.size for a in tensors.values())} values")
    return 0
