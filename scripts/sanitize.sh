#!/usr/bin/env bash
# Builds the unit tests (tests/tessera_tests, every Catch2 case) with AddressSanitizer and
# UndefinedBehaviorSanitizer (tests at -Og, the kernels library at -O1, -g1,
# -fno-sanitize-recover=undefined: any report fails the run)
# in a build directory of their own, and runs them. Exit 0 when every case passes with no
# sanitizer report, 1 otherwise.
#
#   scripts/sanitize.sh                      build-sanitize/, all cases
#   scripts/sanitize.sh --build DIR [CATCH2 ARGS...]   e.g. '[data]' for one area
# The compiler is the one of clang++ and g++ that the main build does not use (below); CXX chooses
# another. See tests/fuzz/README.md.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$root/build-sanitize"
main_build="$root/build"
if [ "${1:-}" = --build ]; then
  build="$2"
  main_build="$(dirname "$build")"  # meson's test passes <main build>/sanitize
  shift 2
fi

# A second compiler: this build takes the one of clang++ and g++ that the main build (build/, or
# the directory above --build's) does not use, so every unit test compiles under both. The main
# build is clang's where it is installed (scripts/setup.sh), so this one is g++'s; with a g++ main
# build it is clang's (which refused what g++ 12 let pass: a lambda capturing a structured
# binding, a constraint naming tuple_element_t<-1>), given clang's sanitizer runtime
# (libclang-rt-14-dev: without it -print-file-name answers the bare name). CXX chooses another; a
# directory configured before keeps its compiler (meson does not change it on --reconfigure).
if [ -z "${CXX:-}" ]; then
  if grep -q -m1 -E '^ command = (ccache )?clang\+\+ ' "$main_build/build.ninja" 2>/dev/null; then
    command -v g++ >/dev/null && export CXX=g++ CC=gcc
  elif command -v clang++ >/dev/null && command -v clang >/dev/null &&
    [ -f "$(clang++ -print-file-name=libclang_rt.asan-x86_64.a)" ]; then
    export CXX=clang++ CC=clang
  fi
fi
# Only what the unit tests need: no communicator libraries, examples or benchmarks. -g1: line
# tables only, which is what the reports' stack traces print (file:line), without the type and
# variable information of -g that a debugger wants and the build pays for. -Dunity_size=15: the
# unit tests' sources 15 to a unity file, two files today instead of five (the main build keeps 6
# to a file, so a contributor's edit recompiles fewer sources); the headers and templates they
# share are parsed and instantiated twice instead of five times: 325 instead of 369 compile-seconds for those files, 318
# instead of 327 s wall for the whole build (one run each, same hour, 2026-12-02; docs/testing.md).
options=(--buildtype=plain -Db_sanitize=address,undefined -Db_lundef=false -Dunity_size=15
  "-Dcpp_args=-g1 -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
  -Dtests=enabled -Dexamples=disabled -Dbench=disabled -Dmpi=disabled -Dgloo=disabled -Dcuda=disabled -Dnccl=disabled)
if [ -f "$build/build.ninja" ]; then
  meson setup --reconfigure "$build" "$root" "${options[@]}" >/dev/null || exit 1
else
  setup_log=$(mktemp)
  meson setup "$build" "$root" "${options[@]}" >"$setup_log" 2>&1 || { cat "$setup_log"; rm -f "$setup_log"; exit 1; }
  rm -f "$setup_log"
fi
jobs="${SANITIZE_JOBS:-$(nproc)}"
meson compile -C "$build" -j "$jobs" tests/tessera_tests >"$build/compile.log" 2>&1 ||
  { grep -E "error|Error" "$build/compile.log" | head -30; echo "sanitize.sh: tessera_tests does not compile"; exit 1; }

# halt_on_error/abort_on_error: the first report ends the run with an error, whatever the case
# was doing; detect_leaks: a leak at exit fails too. Catch2's own result decides the rest.
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:abort_on_error=1:strict_string_checks=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
cd "$build" || exit 1
start=$(date +%s)
if [ $# -gt 0 ] || [ "$jobs" -lt 2 ]; then
  "$build/tests/tessera_tests" --order decl "$@"
  rc=$?
  echo "sanitize.sh: tessera_tests under ASan+UBSan: exit $rc in $(($(date +%s) - start)) s"
  exit $((rc == 0 ? 0 : 1))
fi

# Every case, in shards at once (one per core, at most 4): most cases run on one thread, so one
# process at a time left the other core idle for a minute and a half. A case goes to shard (its
# index mod shards), in declaration order. Each shard keeps OMP_NUM_THREADS (the kernels' split
# loops stay checked with 2 threads) with a passive OpenMP wait, so shards that outnumber the
# cores yield instead of spinning. Catch2 reads --input-file lines as quoted test specs, where
# `\`, `,` and `"` are special (a third of the names hold a comma): they are escaped, and each
# shard's spec is listed back and compared with its names before anything runs, so no case can
# drop out unnoticed.
bin="$build/tests/tessera_tests"
"$bin" --list-test-names-only >"$build/cases.txt"  # exits with the count of cases (at most 255)
total=$(grep -c . "$build/cases.txt")
((total > 0)) || { echo "sanitize.sh: $bin lists no cases"; exit 1; }
shards=$((jobs < 4 ? jobs : 4))
shards=$((shards < total ? shards : total))
for ((s = 0; s < shards; s++)); do
  awk -v s="$s" -v n="$shards" 'NF && (NR - 1) % n == s' "$build/cases.txt" >"$build/shard-$s.names"
  sed -E 's/[\\,"]/\\&/g' "$build/shard-$s.names" >"$build/shard-$s.txt"
  "$bin" --list-test-names-only --input-file "$build/shard-$s.txt" >"$build/shard-$s.listed"
  if ! diff -q "$build/shard-$s.names" "$build/shard-$s.listed" >/dev/null; then
    echo "sanitize.sh: shard $s's spec ($build/shard-$s.txt) does not select exactly its cases:"
    diff "$build/shard-$s.names" "$build/shard-$s.listed" | head -10
    exit 1
  fi
done
pids=()
for ((s = 0; s < shards; s++)); do
  OMP_WAIT_POLICY=passive "$bin" --order decl -w NoTests --input-file "$build/shard-$s.txt" >"$build/shard-$s.log" 2>&1 &
  pids+=($!)
done
rc=0
for ((s = 0; s < shards; s++)); do
  if wait "${pids[$s]}"; then
    tail -n 2 "$build/shard-$s.log"
  else
    rc=1
    echo "sanitize.sh: shard $s of $shards failed; its output ($build/shard-$s.log):"
    cat "$build/shard-$s.log"
  fi
done
# A failing shard's whole output is long and CI shows only the end of the log: the failed cases and
# assertions (Catch2's FAILED blocks) and any sanitizer report go last, where they are read.
if ((rc != 0)); then
  for ((s = 0; s < shards; s++)); do
    grep -n -B 14 -A 6 -E "FAILED:|ERROR: AddressSanitizer|runtime error:|ERROR: LeakSanitizer" \
      "$build/shard-$s.log" | head -120 | sed "s|^|shard $s: |"
  done
fi
echo "sanitize.sh: tessera_tests under ASan+UBSan: $total cases in $shards shards: exit $rc in $(($(date +%s) - start)) s"
exit "$rc"
