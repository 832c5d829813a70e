#!/usr/bin/env python3
"""Lists a Tessera checkpoint from Python with numpy only: tensor names, dtypes, shapes, a norm,
and the training position stored in the metadata. Shows the file is plain safetensors.

    python3 tools/read_checkpoint.py ckpt.safetensors
    # with Hugging Face's package installed, the same file loads with safetensors.numpy.load_file
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference"))
from safetensors_io import load  # noqa: E402


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    tensors, metadata = load(sys.argv[1])
    for key in sorted(metadata):
        print(f"{key} = {metadata[key]}")
    for name, array in tensors.items():
        print(f"{name:60} {str(array.dtype):8} {str(list(array.shape)):20} |x|={np.linalg.norm(array.astype(np.float64)):.6g}")
    print(f"{len(tensors)} tensors, {sum(a.size for a in tensors.values())} values")


if __name__ == "__main__":
    main()
