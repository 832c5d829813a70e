#!/usr/bin/env bash
# scripts/gpu_check.sh BIN_DIR OUT_DIR: the CUDA test suite and the GPU benchmark, run from prebuilt
# binaries on a machine with one GPU (a lent GPU machine has nvcc and PyTorch but no Debian
# packages, so the binaries are built elsewhere with scripts/gpu_bundle.sh and carried over).
#
# Runs what one GPU can run of meson's 'cuda' suite, with the same arguments as tests/meson.build
# and examples/meson.build (multi-rank NCCL tests need one GPU per rank and are listed as skipped),
# then bench/gpu_resnet50.py and bench/gpu_kernel_breakdown.py (ncu). Logs and JSON go to OUT_DIR;
# the last line is 'N passed, N failed'.
set -u
bin=$(cd "$1" && pwd) out=$2
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$out/gpu.txt"

# cuDNN and NCCL may come only with Python wheels there: find the folders that hold them.
libdirs=/usr/local/cuda/lib64:/usr/local/cuda/lib
for so in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcudnn.so.9 libnccl.so.2; do
  if ! ldconfig -p | grep -q "$so"; then
    found=$(find /usr /opt /root -name "$so" 2>/dev/null | head -1)
    [ -n "$found" ] && libdirs="$libdirs:$(dirname "$found")"
  fi
done
# The bundle's own lib/ (libgomp, zlib) comes last: used only where the machine lacks them.
export LD_LIBRARY_PATH="$libdirs:$bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export TESSERA_COMM_TIMEOUT=120
for b in "$bin"/*; do
  [ -f "$b" ] && [ -x "$b" ] && ldd "$b" | grep "not found" | sed "s|^|$(basename "$b"): |"
done

passed=0 failed=0 skipped=0
run_test() {  # run_test NAME TIMEOUT COMMAND...
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s.%N)
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  local took
  took=$(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$start" "$(date +%s.%N)")
  if [ $rc -eq 0 ]; then passed=$((passed + 1)); echo "PASS $name (${took} s)"
  elif [ $rc -eq 77 ]; then skipped=$((skipped + 1)); echo "SKIP $name"
  else failed=$((failed + 1)); echo "FAIL $name (exit $rc, ${took} s)"; tail -25 "$out/$name.log"; fi
}
run_test cuda-device 120 "$bin/test_cuda_device"
run_test cuda-layers 300 "$bin/test_cuda_layers"
run_test nccl-1 300 python3 "$root/tools/tessera-run" -n 1 "$bin/conformance_nccl"
run_test nccl-data-parallel-1 300 python3 "$root/tools/tessera-run" -n 1 "$bin/dp_nccl"
run_test example_08_cuda 300 "$bin/08_resnet50_cuda" --steps=2 --batch=4
run_test example_08_cuda_contiguous 300 "$bin/08_resnet50_cuda" --steps=2 --batch=4 --memory-format=contiguous
run_test example_08_data_nccl_1 300 python3 "$root/tools/tessera-run" -n 1 "$bin/08_resnet50_nccl" --threads=1 \
  --steps=2 --batch=2 --image=64 --classes=10
run_test example_08_cuda_bf16 300 env TESSERA_MATH_PRECISION=bfloat16 "$bin/08_resnet50_cuda" --steps=2 --batch=4
for s in pipeline:1 tensor; do
  run_test "example_08_${s%%:*}_nccl_1" 300 python3 "$root/tools/tessera-run" -n 1 "$bin/08_resnet50_nccl" --threads=1 \
    --steps=2 --batch=2 --image=64 --classes=10 --strategy=$s --verify
done
gpus=$(nvidia-smi -L | wc -l)
for t in nccl-2 nccl-4 nccl-host-buffers-2 nccl-faults nccl-data-parallel-2 example_04_nccl example_06_nccl \
         example_07_nccl example_08_data_nccl; do
  echo "SKIP $t (needs 2 or more GPUs, this machine has $gpus)"
  skipped=$((skipped + 1))
done

# Per batch and run: five Tessera runs (float32 NCHW with and without cuDNN benchmark, float32, TF32
# and bfloat16 in channels_last) and six of PyTorch's (fp32, TF32 and autocast bfloat16, each in both
# memory formats); two runs are meant to fit the device's 10-minute command with the tests and the
# profile (GPU_BENCH_RUNS=1 if they do not).
PYTHONUNBUFFERED=1 timeout 480 python3 "$root/bench/gpu_resnet50.py" --tessera "$bin/08_resnet50_cuda" \
  --batches "${GPU_BENCH_BATCHES:-32,128}" --runs "${GPU_BENCH_RUNS:-2}" --steps 10 --out "$out/gpu_resnet50.json" \
  >"$out/gpu_resnet50.stdout" 2>"$out/gpu_resnet50.log" || { echo "gpu_resnet50 failed:"; tail -20 "$out/gpu_resnet50.log"; }
tail -4 "$out/gpu_resnet50.log"

# Where the kernel time goes (bench/gpu_kernel_breakdown.py), where the machine has Nsight Compute.
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -n "$ncu" ]; then
  if TESSERA_CUDNN_BENCHMARK=0 TESSERA_MATH_PRECISION=tf32 timeout 300 "$ncu" --csv --metrics gpu__time_duration.sum \
       --clock-control none --print-units base "$bin/08_resnet50_cuda" --batch=64 --steps=2 >"$out/ncu.csv" 2>"$out/ncu.log"; then
    python3 "$root/bench/gpu_kernel_breakdown.py" --csv "$out/ncu.csv" --batch 64 --steps 2 --precision tf32 \
      --out "$out/gpu_kernel_breakdown.json" >/dev/null 2>"$out/gpu_kernel_breakdown.txt"
    cat "$out/gpu_kernel_breakdown.txt"
  else
    echo "ncu failed:"; tail -20 "$out/ncu.log"
  fi
fi

# compute-sanitizer's memcheck over the two unit tests (where the machine has it and lets it read
# the device: on some sandboxes it refuses, which shows in the log).
if command -v compute-sanitizer >/dev/null; then
  run_test cuda-device-memcheck 90 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 "$bin/test_cuda_device"
  run_test cuda-layers-memcheck 180 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 "$bin/test_cuda_layers"
fi
echo "$passed passed, $failed failed, $skipped skipped"
