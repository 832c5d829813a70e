#!/usr/bin/env bash
# Set up (install, build), run every test, and end with "N passed, N failed, N skipped".
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh || { echo "0 passed, 1 failed"; exit 1; }
rm -f build/meson-logs/testlog.json
meson test -C build --print-errorlogs --num-processes 1 "$@"
status=$?
python3 - <<'PY'
import json, sys
counts = {"OK": 0, "FAIL": 0, "SKIP": 0, "TIMEOUT": 0, "ERROR": 0, "EXPECTEDFAIL": 0, "UNEXPECTEDPASS": 0}
try:
    lines = open("build/meson-logs/testlog.json").read().splitlines()
except OSError:
    print("meson test wrote no log")
    print("0 passed, 1 failed")
    sys.exit(0)
for line in lines:
    r = json.loads(line)["result"]
    counts[r] = counts.get(r, 0) + 1
passed = counts["OK"] + counts["EXPECTEDFAIL"]
failed = counts["FAIL"] + counts["TIMEOUT"] + counts["ERROR"] + counts["UNEXPECTEDPASS"]
print(f"{passed} passed, {failed} failed, {counts['SKIP']} skipped")
PY
exit $status
