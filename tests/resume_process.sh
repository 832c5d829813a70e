#!/usr/bin/env bash
# Resume across processes: train 3 epochs straight, versus 2 of the 3 epochs + checkpoint, then a new
# process that loads it and trains the third. The two final checkpoints (parameters, BN buffers,
# optimizer state, loader position, RNG) must be byte-identical.
set -euo pipefail
example=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
args=(--limit=1200 --batch=64 --progress=0 --threads=2)
"$example" "${args[@]}" --epochs=3 --checkpoint="$dir/straight.safetensors" >/dev/null
"$example" "${args[@]}" --epochs=3 --stop-after=2 --checkpoint="$dir/two.safetensors" >/dev/null
"$example" "${args[@]}" --epochs=3 --resume="$dir/two.safetensors" --checkpoint="$dir/resumed.safetensors"
cmp "$dir/straight.safetensors" "$dir/resumed.safetensors"
echo "resumed run is byte-identical to the straight run"
# A truncated checkpoint is refused with an error, not a crash.
head -c 3000 "$dir/two.safetensors" > "$dir/cut.safetensors"
if "$example" "${args[@]}" --epochs=3 --resume="$dir/cut.safetensors" 2>"$dir/err.txt"; then
  echo "loading a truncated checkpoint succeeded"; exit 1
fi
grep -q "safetensors" "$dir/err.txt"
cat "$dir/err.txt"
