"""bfloat16 convolutions layer by layer: float32, Tessera's bfloat16 kernels, oneDNN's, and Auto's
choice between them (build/bench/bf16_conv, which alternates the four per layer), for each model
asked, in one JSON object naming the CPU. The figures behind onednn_conv_chosen
(include/tessera/kernels/cpu/onednn_conv.hpp; bench/README.md, "bfloat16").

    python3 bench/bf16_conv.py --build build [--threads 2] [--runs 7] \\
        [--models resnet50_b8,resnet50_b32,resnet20,lenet] [--out FILE]
"""
import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import cpu_details, cpu_model, default_result, write_result  # noqa: E402

# model name -> (bf16_conv's --model, --batch; 0 takes the model's own)
MODELS = {"resnet50_b8": ("resnet50", 8), "resnet50_b32": ("resnet50", 32), "resnet20": ("resnet20", 0),
          "lenet": ("lenet", 0)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--models", default="resnet50_b8,resnet50_b32,resnet20,lenet")
    ap.add_argument("--out", default=default_result("bf16_conv"))
    args = ap.parse_args()
    binary = os.path.join(args.build, "bench", "bf16_conv")
    if not os.path.exists(binary):
        sys.exit(f"{binary} not found: bf16_conv is built only with oneDNN (meson option onednn; Debian: libdnnl-dev)")
    results = []
    for name in args.models.split(","):
        if name not in MODELS:
            sys.exit(f"unknown model '{name}' (one of {', '.join(MODELS)})")
        model, batch = MODELS[name]
        cmd = [binary, f"--model={model}", f"--batch={batch}", f"--threads={args.threads}", f"--runs={args.runs}"]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
        sys.stderr.write(out.stderr)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        totals = result["total_ms"]
        result["name"] = name
        result["float32_over_bf16_auto"] = totals["float32"] / totals["bf16_auto"]
        result["bf16_tessera_over_bf16_auto"] = totals["bf16_tessera"] / totals["bf16_auto"]
        results.append(result)
    write_result({"benchmark": "bf16_conv", "cpu": cpu_model(), "cpu_details": cpu_details(), "threads": args.threads,
                  "runs": args.runs, "results": results}, args.out)


if __name__ == "__main__":
    main()
