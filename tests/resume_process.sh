#!/usr/bin/env bash
# Resume across processes: train 3 epochs straight, versus 2 of the 3 epochs + checkpoint, then a new
# process that loads it and trains the third. The two final checkpoints (parameters, BN buffers,
# optimizer state, loader position, RNG) must be byte-identical.
set -euo pipefail
example=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
args=(--limit=1200 --batch=64 --progress=0 --threads=2 --min-accuracy=0)
"$example" "${args[@]}" --epochs=3 --checkpoint="$dir/straight.safetensors" >/dev/null
"$example" "${args[@]}" --epochs=3 --stop-after=2 --checkpoint="$dir/two.safetensors" >/dev/null
"$example" "${args[@]}" --epochs=3 --resume="$dir/two.safetensors" --checkpoint="$dir/resumed.safetensors"
cmp "$dir/straight.safetensors" "$dir/resumed.safetensors"
echo "resumed run is byte-identical to the straight run"
# A truncated checkpoint is refused with an error (exit 1), not a crash or a partial load.
head -c 3000 "$dir/two.safetensors" > "$dir/cut.safetensors"
status=0
"$example" "${args[@]}" --epochs=3 --resume="$dir/cut.safetensors" 2>"$dir/err.txt" >/dev/null || status=$?
cat "$dir/err.txt"
[ "$status" -eq 1 ] || { echo "expected exit status 1 for a truncated checkpoint, got $status"; exit 1; }
grep -q "truncated" "$dir/err.txt"
# A checkpoint of a newer format is refused, saying so, before anything says "resumed".
LC_ALL=C sed 's/tessera-checkpoint-2/tessera-checkpoint-7/' "$dir/two.safetensors" > "$dir/newer.safetensors"
status=0
"$example" "${args[@]}" --epochs=3 --resume="$dir/newer.safetensors" >"$dir/out.txt" 2>"$dir/err.txt" || status=$?
cat "$dir/err.txt"
[ "$status" -eq 1 ] || { echo "expected exit status 1 for a newer format, got $status"; exit 1; }
grep -q "format 'tessera-checkpoint-7' is newer than this build reads" "$dir/err.txt"
if grep -q "resumed from" "$dir/out.txt"; then echo "said 'resumed' before refusing the file"; exit 1; fi
# The temporary of a save killed mid-write (kill -9) is removed by the next save to that path;
# other files are left alone.
cp "$dir/two.safetensors" "$dir/resumed.safetensors.tmp.Xy12Z9"
cp "$dir/two.safetensors" "$dir/resumed.safetensors.tmp.keep"
"$example" "${args[@]}" --epochs=3 --resume="$dir/two.safetensors" --checkpoint="$dir/resumed.safetensors" >/dev/null
[ ! -e "$dir/resumed.safetensors.tmp.Xy12Z9" ] || { echo "stale temporary not removed"; exit 1; }
[ -e "$dir/resumed.safetensors.tmp.keep" ]
echo "stale temporary removed by the next save"
# Resuming with another batch size is refused: the saved data position would mean other samples.
status=0
"$example" --limit=1200 --batch=32 --progress=0 --threads=2 --min-accuracy=0 --epochs=3 --resume="$dir/two.safetensors" \
  2>"$dir/err.txt" >/dev/null || status=$?
cat "$dir/err.txt"
[ "$status" -eq 1 ] && grep -q "batch size 64" "$dir/err.txt"
# Resumed from a finished run there is nothing to train, but --min-accuracy is still checked, on
# the model as loaded (it used to be skipped, and the run exited 0 whatever the model's accuracy).
status=0
"$example" --limit=1200 --batch=64 --progress=0 --threads=2 --epochs=3 --min-accuracy=0.99 \
  --resume="$dir/straight.safetensors" >"$dir/out.txt" 2>"$dir/err.txt" || status=$?
cat "$dir/out.txt" "$dir/err.txt"
[ "$status" -eq 1 ] || { echo "a finished checkpoint passed --min-accuracy=0.99 unmeasured (exit $status)"; exit 1; }
grep -q "nothing left to train" "$dir/out.txt" && grep -q "below --min-accuracy=0.99" "$dir/err.txt"
"$example" --limit=1200 --batch=64 --progress=0 --threads=2 --epochs=3 --min-accuracy=0.05 \
  --resume="$dir/straight.safetensors" >"$dir/out.txt"
grep -q "check: final test accuracy .* >= the floor of 5.00%" "$dir/out.txt"
echo "a finished checkpoint is measured against --min-accuracy on resume"
