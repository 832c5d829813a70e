"""bfloat16 convolutions or Linear layers, layer by layer: float32, Tessera's bfloat16 kernels,
oneDNN's, and Auto's choice between them (build/bench/bf16_conv and bf16_linear, which alternate the
four per layer), for each model asked, in one JSON object naming the CPU. The figures behind
onednn_conv_chosen and onednn_gemm_chosen (include/tessera/kernels/cpu/onednn_conv.hpp and
onednn_gemm.hpp; bench/README.md, "bfloat16").

    python3 bench/bf16_conv.py --build build [--threads 2] [--runs 7] \\
        [--models resnet50_b8,resnet50_b32,resnet20,lenet] [--out FILE]
    python3 bench/bf16_conv.py --build build --models mlp_linear,lenet_linear,gpt_linear,gpt2_linear
"""
import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import cpu_details, cpu_model, default_result, write_result  # noqa: E402

# model name -> (the program, its --model, --batch; 0 takes the model's own, None has no flag)
MODELS = {"resnet50_b8": ("bf16_conv", "resnet50", 8), "resnet50_b32": ("bf16_conv", "resnet50", 32),
          "resnet20": ("bf16_conv", "resnet20", 0), "lenet": ("bf16_conv", "lenet", 0),
          "mlp_linear": ("bf16_linear", "mlp", None), "lenet_linear": ("bf16_linear", "lenet", None),
          "gpt_linear": ("bf16_linear", "gpt", None), "gpt2_linear": ("bf16_linear", "gpt2", None)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--models", default="resnet50_b8,resnet50_b32,resnet20,lenet")
    ap.add_argument("--out", default=default_result("bf16_conv"))
    args = ap.parse_args()
    results = []
    for name in args.models.split(","):
        if name not in MODELS:
            sys.exit(f"unknown model '{name}' (one of {', '.join(MODELS)})")
        program, model, batch = MODELS[name]
        binary = os.path.join(args.build, "bench", program)
        if not os.path.exists(binary):
            sys.exit(f"{binary} not found: {program} is built only with oneDNN (meson option onednn; Debian: libdnnl-dev)")
        cmd = [binary, f"--model={model}", f"--threads={args.threads}", f"--runs={args.runs}"]
        if batch is not None:
            cmd.append(f"--batch={batch}")
        # TESSERA_CPU_BF16=on: these programs time the bfloat16 kernels themselves, also on a CPU
        # where a bfloat16 Env computes in float by default (kernels/cpu/gemm_bf16.hpp).
        out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                             env=dict(os.environ, TESSERA_CPU_BF16="on"))
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
