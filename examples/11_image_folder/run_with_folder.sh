#!/usr/bin/env bash
# Test driver of example 11: converts part of Fashion-MNIST into a fresh image folder with
# idx-to-image-folder, runs the given command with --image-folder=<it> appended, and removes it.
#   run_with_folder.sh CONVERTER FORMAT COMMAND... (FORMAT: png, jpeg or mixed)
# Exits 77 (skipped) when Fashion-MNIST is not installed.
set -euo pipefail
converter=$1 format=$2
shift 2
dir=$(mktemp -d /tmp/tessera-image-folder.XXXXXX)
trap 'rm -rf "$dir"' EXIT
if ! out=$("$converter" --out="$dir" --format="$format" --limit=3000 --test-limit=1000 2>&1); then
  echo "$out"
  case $out in *"cannot find"*) exit 77 ;; esac
  exit 1
fi
echo "$out"
"$@" --image-folder="$dir"
