#!/usr/bin/env bash
# Set up (install, configure), build what the tests run, run them, and end with
# "N passed, N failed, N skipped".
#
#   scripts/test.sh           the quick tier, before every commit: unit, gradient, golden,
#                             conformance, equivalence and example self-check tests on every CPU
#                             backend, the checks of docs and include order, mypy and pytest on the tools
#   scripts/test.sh --full    everything (what CI runs): the quick tier plus the tests of the
#                             `full` suite, each slow for the reason docs/testing.md gives
#                             (header check, sanitizer build, fuzzing, Slurm, network namespaces, consumer
#                             packages, fault campaigns, CUDA builds), after building every target;
#                             the `waits` suite runs beside the rest
#
# Other arguments go to `meson test` (a test name, --suite comm, --list, ...).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)  # the tier's time includes setup and build, as a fresh machine sees it

tier=quick
args=()
for a in "$@"; do
  if [ "$a" = "--full" ]; then tier=full; else args+=("$a"); fi
done

if [ "$tier" = full ]; then
  scripts/setup.sh || { echo "0 passed, 1 failed, 0 skipped"; exit 1; }
  select=()
else
  # The quick tier builds only the programs its tests run (meson test rebuilds a test's depends).
  scripts/setup.sh --configure-only || { echo "0 passed, 1 failed, 0 skipped"; exit 1; }
  select=(--no-suite full)
fi
rm -f build/meson-logs/testlog.json build/meson-logs/testlog-waits.json
if [ "$tier" = full ] && [ ${#args[@]} -eq 0 ]; then
  # The `waits` suite (Slurm, the fault campaigns, the network namespaces) spends its minutes
  # waiting on timeouts, polls and shaped links, with a core mostly idle: it runs beside the rest
  # (everything is built by now, so neither run builds), its report printed when both are done.
  # Its processes run at a higher priority (nice -5, as root) than the compiles and training
  # beside them, so that their short bursts of work, which its time limits measure, come first.
  nice -n -5 meson test -C build --no-rebuild --print-errorlogs --num-processes 1 --suite waits \
    --logbase testlog-waits >build/meson-logs/waits.out 2>&1 &
  waits=$!
  trap 'kill $waits 2>/dev/null' EXIT INT TERM
  meson test -C build --no-rebuild --print-errorlogs --num-processes 1 --no-suite waits
  status=$?
  wait $waits || status=1
  trap - EXIT INT TERM
  cat build/meson-logs/waits.out
else
  meson test -C build --print-errorlogs --num-processes 1 "${select[@]}" "${args[@]}"
  status=$?
fi
python3 - "$tier" "$(( $(date +%s) - start ))" "$status" <<'PY'
import json, sys
tier, seconds, status = sys.argv[1], int(sys.argv[2]), sys.argv[3]
counts = {"OK": 0, "FAIL": 0, "SKIP": 0, "TIMEOUT": 0, "ERROR": 0, "EXPECTEDFAIL": 0, "UNEXPECTEDPASS": 0}
lines = []
for log in ("build/meson-logs/testlog.json", "build/meson-logs/testlog-waits.json"):
    try:
        lines += open(log).read().splitlines()
    except OSError:
        pass
if not lines:
    print("meson test wrote no log (the build failed?)")
    print("0 passed, 1 failed, 0 skipped")
    sys.exit(0)
results = [json.loads(line) for line in lines]
for r in results:
    counts[r["result"]] = counts.get(r["result"], 0) + 1
slowest = sorted(results, key=lambda r: -r["duration"])[:10]
print(f"{tier} tier: build and tests {seconds // 60} min {seconds % 60} s; slowest tests:")
for r in slowest:
    print(f"  {r['duration']:7.1f} s  {r['name']}")
passed = counts["OK"] + counts["EXPECTEDFAIL"]
failed = counts["FAIL"] + counts["TIMEOUT"] + counts["ERROR"] + counts["UNEXPECTEDPASS"]
if status != "0" and failed == 0:
    print("meson test failed without a failed test in its logs (it stopped early?)")
    failed = 1
print(f"{passed} passed, {failed} failed, {counts['SKIP']} skipped")
PY
exit $status
