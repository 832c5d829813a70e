#!/usr/bin/env bash
# scripts/gpu_bundle.sh BUILD_DIR BUNDLE_DIR: copies the CUDA test and example binaries of a build
# (configured with -Dcuda=enabled -Dnccl=enabled -Dnative=false, so that they run on any x86-64)
# into BUNDLE_DIR, stripped, with this machine's libgomp and zlib in BUNDLE_DIR/lib as a fallback,
# for scripts/gpu_check.sh on a GPU machine that has CUDA but none of the Debian packages.
#
#   scripts/gpu_bundle.sh --check BUILD_DIR   only checks that BUILD_DIR has every target copied here
#                                            and every program gpu_check.sh runs (a test does, so a
#                                            renamed target fails here, not on a GPU machine)
set -euo pipefail
targets=(gpu_device_count tests/test_cuda_device tests/test_cuda_layers tests/conformance_nccl
         tests/dp_nccl examples/08_resnet50_cuda examples/08_resnet50_nccl)
if [ "${1:-}" = --check ]; then
  known=$(ninja -C "$2" -t targets all | cut -d: -f1)
  missing=0
  for t in "${targets[@]}"; do
    grep -qx "$t" <<<"$known" || { echo "gpu_bundle.sh: $2 has no target $t (renamed? update scripts/gpu_bundle.sh)"; missing=1; }
  done
  # The programs gpu_check.sh runs from the bundle ("$bin/NAME") must be ones copied here.
  names=" ${targets[*]##*/} "
  for p in $(grep -o '"$bin/[A-Za-z0-9_]*"' "$(dirname "$0")/gpu_check.sh" | sed 's/.*\///; s/"//' | sort -u); do
    [[ "$names" == *" $p "* ]] || { echo "gpu_bundle.sh: gpu_check.sh runs $p, which the bundle lacks"; missing=1; }
  done
  [ $missing -eq 0 ] && echo "gpu_bundle.sh: all ${#targets[@]} targets found; gpu_check.sh runs only bundled programs"
  exit $missing
fi
build=$1 bundle=$2
rm -rf "$bundle"
mkdir -p "$bundle/lib"
# Meson 1.0 records no header dependencies for nvcc's objects (ninja -t deps: "#deps 0"), so after
# a header change an incremental build would link stale CUDA objects against fresh host ones (two
# layouts of one class: a crash). Every CUDA object is compiled again.
find "$build" -name '*.cu.o' -delete
for t in "${targets[@]}"; do
  ninja -C "$build" "$t" >/dev/null
  cp "$build/$t" "$bundle/"
  strip "$bundle/$(basename "$t")"
done
for so in libgomp.so.1 libz.so.1; do
  cp -L "$(ldconfig -p | grep -m1 "$so (libc6,x86-64)" | sed 's/.*=> //')" "$bundle/lib/"
done
du -sh "$bundle"
