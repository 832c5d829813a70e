#!/usr/bin/env bash
# if_gpus.sh N PROBE COMMAND...: runs COMMAND when PROBE (which prints the number of visible GPUs,
# e.g. gpu_device_count) reports at least N,
# else exits 77 (Meson: skipped). Multi-rank NCCL tests need one GPU per rank.
set -euo pipefail
needed=$1 probe=$2
shift 2
have=$("$probe")
if [ "$have" -lt "$needed" ]; then
  echo "needs $needed GPUs, found $have: skipped"
  exit 77
fi
exec "$@"
