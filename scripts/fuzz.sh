#!/usr/bin/env bash
# Builds the libFuzzer harnesses of tests/fuzz (clang, with AddressSanitizer and
# UndefinedBehaviorSanitizer) and runs each from its seed corpus for a fixed number of executions
# with a fixed seed. One line per target ("fuzz_idx: 100000 executions in 9.1 s, 0 crashes, ...");
# exit 0 when no target crashed, leaked, timed out or ran out of memory, 1 otherwise, 77 (skipped,
# for meson test) when clang or its libFuzzer runtime is missing.
#
#   scripts/fuzz.sh --smoke                 the CI pass: 100,000 executions per target, at most 30 s each
#   scripts/fuzz.sh --runs 1000000          what bench/fuzz.py runs
#   options: --targets idx,json   --build DIR (default build-fuzz)   --report FILE (JSON lines)
#            --seconds S (a cap per target, default 600)   --build-only
# A failing input is kept as DIR/artifacts/<target>-crash-<sha1> (or leak-, timeout-, oom-);
# reproduce it with DIR/fuzz_<target> FILE. See tests/fuzz/README.md.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"

runs=100000
seconds=600
build="$root/build-fuzz"
report=""
build_only=0
all_targets=(idx safetensors json search flags launch_env monitor)
targets=("${all_targets[@]}")
while (($#)); do
  case "$1" in
    --smoke) runs=100000; seconds=30 ;;
    --runs) runs="$2"; shift ;;
    --seconds) seconds="$2"; shift ;;
    --build) build="$2"; shift ;;
    --report) report="$2"; shift ;;
    --targets) IFS=, read -r -a targets <<<"$2"; shift ;;
    --build-only) build_only=1 ;;
    *) echo "fuzz.sh: unknown argument '$1' (see the header of $0)" >&2; exit 2 ;;
  esac
  shift
done
for t in "${targets[@]}"; do
  [ -f "$root/tests/fuzz/fuzz_$t.cpp" ] || { echo "fuzz.sh: no target '$t' (tests/fuzz/fuzz_$t.cpp)" >&2; exit 2; }
done

# CI (CI=true, as root, Debian): install clang and its libFuzzer runtime when missing.
install_clang() {
  [ "${CI:-}" = true ] && [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null || return 1
  echo "fuzz.sh: CI: installing clang libclang-rt-14-dev"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends clang libclang-rt-14-dev
}
find_clang() {
  cxx=""
  for c in "${CXX_FUZZ:-}" clang++ clang++-14 clang++-15 clang++-16; do
    if [ -n "$c" ] && command -v "$c" >/dev/null; then cxx="$c"; return 0; fi
  done
  return 1
}
if ! find_clang && ! { install_clang && find_clang; }; then
  echo "fuzz.sh: skipped: no clang++ (Debian: apt-get install clang libclang-rt-14-dev)"
  exit 77
fi
mkdir -p "$build/artifacts" || exit 1
flags=(-std=c++20 -O1 -g -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
  $(pkg-config --cflags eigen3 2>/dev/null || echo -I/usr/include/eigen3) -I"$root/include" -pthread)
# libFuzzer ships apart from clang on Debian (libclang-rt-N-dev): try it on an empty target first.
probe="$build/probe"
printf 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n' >"$probe.cpp"
if ! "$cxx" "${flags[@]}" "$probe.cpp" -o "$probe" >"$probe.log" 2>&1 &&
  ! { install_clang && "$cxx" "${flags[@]}" "$probe.cpp" -o "$probe" >"$probe.log" 2>&1; }; then
  echo "fuzz.sh: skipped: $cxx cannot link -fsanitize=fuzzer (Debian: apt-get install libclang-rt-14-dev):"
  tail -3 "$probe.log"
  exit 77
fi

# Rebuilt when a harness or any header is newer than the binary.
newest_source() { find "$root/include" "$root/tests/fuzz" \( -name '*.hpp' -o -name '*.cpp' \) -newer "$1" | head -1; }
compile() {  # compile OUT SOURCE EXTRA_FLAGS...
  local out="$1" src="$2"
  shift 2
  if [ -x "$out" ] && [ -z "$(newest_source "$out")" ]; then return 0; fi
  echo "fuzz.sh: compiling $(basename "$out")"
  rm -f "$out"
  "$cxx" "${flags[@]}" "$@" "$src" -o "$out.tmp" -lz && mv "$out.tmp" "$out"
}
# Up to FUZZ_JOBS (default: the number of cores) compiles at once.
jobs_max="${FUZZ_JOBS:-$(nproc)}"
[[ $jobs_max =~ ^[1-9][0-9]*$ ]] || { echo "fuzz.sh: FUZZ_JOBS=$jobs_max is not a positive count"; exit 1; }
for t in "${targets[@]}"; do
  compile "$build/fuzz_$t" "$root/tests/fuzz/fuzz_$t.cpp" &
  while (($(jobs -rp | wc -l) >= jobs_max)); do wait -n; done
done
if [[ " ${targets[*]} " == *" safetensors "* ]]; then
  # The checkpoint seed is written by the current code, so it always has the current format:
  # fuzz_safetensors.cpp as a plain program (no libFuzzer main).
  compile "$build/make_seed_ckpt" "$root/tests/fuzz/fuzz_safetensors.cpp" -DTESSERA_FUZZ_MAKE_SEED -fno-sanitize=fuzzer &
fi
wait
for t in "${targets[@]}"; do
  [ -x "$build/fuzz_$t" ] || { echo "fuzz.sh: fuzz_$t does not compile"; exit 1; }
done
if [[ " ${targets[*]} " == *" safetensors "* ]] && [ ! -x "$build/make_seed_ckpt" ]; then
  echo "fuzz.sh: make_seed_ckpt does not compile"
  exit 1
fi
((build_only)) && exit 0

# One target: its run, then its line (and its report's JSON line) into files that are printed
# in target order once all are done.
fuzz_one() {
  local t=$1
  # A fresh working corpus from the committed seeds each time: runs are repeatable (fixed -seed).
  local corpus="$build/corpus/$t"
  rm -rf "$corpus" && mkdir -p "$corpus" && cp "$root/tests/fuzz/corpus/$t/"* "$corpus/" 2>/dev/null
  if [ "$t" = safetensors ]; then
    "$build/make_seed_ckpt" "$corpus/checkpoint.safetensors" >"$build/fuzz_$t.line" 2>&1 ||
      { echo "fuzz.sh: make_seed_ckpt failed" >>"$build/fuzz_$t.line"; echo 1 >"$build/fuzz_$t.failed"; return; }
  fi
  rm -f "$build/artifacts/$t-"*
  local log="$build/fuzz_$t.log" start end rc execs crashes leaks timeouts ooms corpus_files secs bad
  start=$(date +%s.%N)
  # -error_exitcode/-timeout_exitcode: libFuzzer's default 77 would read as "skipped" to meson.
  ASAN_OPTIONS="detect_leaks=1:abort_on_error=0" UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
    "$build/fuzz_$t" -seed=1 -runs="$runs" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2560 \
    -max_len=4096 -print_final_stats=1 -error_exitcode=1 -timeout_exitcode=1 \
    -artifact_prefix="$build/artifacts/$t-" "$corpus" >"$log" 2>&1
  rc=$?
  end=$(date +%s.%N)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  execs=${execs:-0}
  crashes=$(find "$build/artifacts" -name "$t-crash-*" | wc -l)
  leaks=$(find "$build/artifacts" -name "$t-leak-*" | wc -l)
  timeouts=$(find "$build/artifacts" -name "$t-timeout-*" | wc -l)
  ooms=$(find "$build/artifacts" -name "$t-oom-*" | wc -l)
  corpus_files=$(find "$corpus" -type f | wc -l)
  secs=$(python3 -c "print(f'{$end - $start:.1f}')")
  bad=$((crashes + leaks + timeouts + ooms))
  # A failure that left no artifact (a sanitizer abort in another thread, say) counts as a crash.
  ((rc != 0 && bad == 0)) && crashes=1
  {
    printf 'fuzz_%s: %s executions in %s s, %s crashes, %s leaks, %s timeouts, %s out-of-memory, corpus %s inputs (exit %s)\n' \
      "$t" "$execs" "$secs" "$crashes" "$leaks" "$timeouts" "$ooms" "$corpus_files" "$rc"
    if ((rc != 0 || bad != 0)); then
      echo "--- fuzz_$t: the report in $log"
      grep -E "ERROR|runtime error|SUMMARY|Test unit written|==[0-9]+==" "$log" | head -20
      tail -5 "$log"
    fi
  } >"$build/fuzz_$t.line"
  echo "$execs" >"$build/fuzz_$t.execs"
  ((rc != 0 || bad != 0)) && echo 1 >"$build/fuzz_$t.failed"
  printf '{"target": "fuzz_%s", "executions": %s, "seconds": %s, "crashes": %s, "leaks": %s, "timeouts": %s, "ooms": %s, "corpus_inputs": %s, "seed_inputs": %s, "exit_code": %s, "artifacts": [%s]}\n' \
    "$t" "$execs" "$secs" "$crashes" "$leaks" "$timeouts" "$ooms" "$corpus_files" \
    "$(find "$root/tests/fuzz/corpus/$t" -type f | wc -l)" "$rc" \
    "$(find "$build/artifacts" -name "$t-*" -printf '"%f",' | sed 's/,$//')" >"$build/fuzz_$t.json"
  echo "fuzz.sh: fuzz_$t done in $secs s" >&2  # progress, should a timeout end the script before the report
}

# The targets run $jobs_max at a time (each libFuzzer process is one thread): 7 targets of
# 5 to 18 s took 80 s one after another. A target's -max_total_time is its own.
for t in "${targets[@]}"; do
  rm -f "$build/fuzz_$t.line" "$build/fuzz_$t.execs" "$build/fuzz_$t.failed" "$build/fuzz_$t.json"
  fuzz_one "$t" &
  while (($(jobs -rp | wc -l) >= jobs_max)); do wait -n; done
done
wait
[ -n "$report" ] && : >"$report"
failed=0
total_runs=0
for t in "${targets[@]}"; do
  if [ -f "$build/fuzz_$t.line" ]; then cat "$build/fuzz_$t.line"; else echo "fuzz_$t: no result (the run did not finish)"; failed=1; fi
  [ -f "$build/fuzz_$t.failed" ] && failed=1
  total_runs=$((total_runs + $(cat "$build/fuzz_$t.execs" 2>/dev/null || echo 0)))
  [ -n "$report" ] && [ -f "$build/fuzz_$t.json" ] && cat "$build/fuzz_$t.json" >>"$report"
done
echo "fuzz.sh: ${#targets[@]} targets, $total_runs executions, $([ $failed = 0 ] && echo "no failures" || echo "FAILURES above")"
exit $failed
