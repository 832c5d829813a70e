#!/usr/bin/env bash
# A machine without nvcc, cuda option on auto: configuring must succeed and build no CUDA target.
# Simulated with a native file pointing the CUDA compiler at a path that does not exist.
set -euo pipefail
source_dir="$1"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf "[binaries]\ncuda = '%s/no-nvcc-here'\n" "$work" > "$work/native.ini"
meson setup "$work/build" "$source_dir" --native-file "$work/native.ini" -Dtests=enabled -Dexamples=enabled \
  -Dbench=enabled > "$work/log.txt" 2>&1 || { cat "$work/log.txt"; echo "configure failed without nvcc"; exit 1; }
grep -q "CUDA *: no" "$work/log.txt" || { cat "$work/log.txt"; echo "CUDA was not reported absent"; exit 1; }
if grep -q "test_cuda_device" "$work/build/build.ninja"; then echo "a CUDA target was configured without nvcc"; exit 1; fi
echo "configured without nvcc: CUDA off, everything else on"
