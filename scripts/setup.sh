#!/usr/bin/env bash
# Installs what Tessera needs on Debian 12 (only the packages that are missing), then configures
# and builds into ./build: everything, only the targets given (scripts/setup.sh 01_fashion_mnist_lenet),
# or nothing (scripts/setup.sh --configure-only).
# Safe to run again: it skips what is already done.
set -euo pipefail
cd "$(dirname "$0")/.."

# Communicators: Open MPI (MpiComm, mpirun), Gloo with hiredis (GlooComm and its Redis store) and
# redis-server, which the Gloo Redis tests start on a private port themselves.
# clang with its runtime (libFuzzer) and libomp: the fuzz-smoke test (scripts/fuzz.sh,
# tests/fuzz/README.md) and the headers test, which compiles every header on its own with clang++.
# slurm-wlm and munge: a private local Slurm for the tessera-sbatch test (tests/slurm/); matplotlib:
# tools/tessera-report's plots; cmake: the CMake consumer test (tests/consumer/).
# libturbojpeg0-dev and libpng-dev: ImageFolder's JPEG and PNG decoders (optional to the build).
# mypy and python3-pytest: the tools package's type check and tests (quick tier); ccache: meson
# picks it up by itself, so a rebuild after switching branches recompiles only what changed.
# fortunes: English text (about 1.4 MB) that example 15_gpt trains its language model on.
# libdnnl-dev: oneDNN, the bfloat16 Envs' convolutions (AMX where the CPU has it; optional to the build).
packages=(g++ meson ninja-build pkg-config python3 libeigen3-dev libopenblas-dev libdnnl-dev catch2 zlib1g-dev dataset-fashion-mnist
  libopenmpi-dev openmpi-bin libgloo-dev libhiredis-dev redis-server clang libclang-rt-14-dev libomp-dev
  slurm-wlm munge python3-matplotlib cmake libturbojpeg0-dev libpng-dev mypy python3-pytest ccache fortunes)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "error: missing packages (${missing[*]}) and no sudo: install them as root" >&2; exit 1; }
    sudo=(sudo)
  fi
  "${sudo[@]}" apt-get update -qq
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# CUDA (optional, on auto): the toolkit's usual place is not on PATH by default; with nvcc found,
# the Cuda device and its GPU tests are built too (they exit 77, skipped, without a GPU).
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="$PATH:/usr/local/cuda/bin"
fi

# Tests, examples and benchmarks are required here, so a missing dependency fails loudly instead
# of silently building less; --reconfigure picks up packages installed since the last run.
# -O2: the programs; tessera_kernels, where the hot loops are, builds at -O3 (meson.build says why).
options=(-Doptimization=2 -Ddebug=false -Db_ndebug=true -Dtests=enabled -Dexamples=enabled -Dbench=enabled -Dmpi=enabled -Dgloo=enabled)
if [ -f build/build.ninja ]; then
  setup_log=$(mktemp)
  meson setup --reconfigure build "${options[@]}" >"$setup_log" 2>&1 || { cat "$setup_log"; rm -f "$setup_log"; exit 1; }
  rm -f "$setup_log"
else
  # nvcc through scripts/nvcc-with-deps, so that a CUDA object is rebuilt when a header it includes
  # changes (Meson 1.0 asks nvcc for no dependency file; that script says more).
  if command -v nvcc >/dev/null; then
    mkdir -p build
    printf "[binaries]\ncuda = ['%s', '%s']\n" "$PWD/scripts/nvcc-with-deps" "$(command -v nvcc)" > build/cuda-native.ini
    options+=(--native-file build/cuda-native.ini)
  fi
  # The compiler: clang++ where it is installed with its OpenMP runtime (the packages above), else
  # the system's c++ (g++). clang builds every target in about half of g++'s compile-seconds and
  # trains as fast (docs/testing.md, "clang++ is the build's compiler"); the sanitizer build keeps
  # g++ compiling every unit test. CXX=g++ (or any compiler) chooses another; a build directory keeps the compiler it was
  # configured with (remove it to switch).
  if [ -z "${CXX:-}" ] && command -v clang++ >/dev/null && command -v clang >/dev/null &&
    printf '#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n' |
    clang++ -fopenmp -x c++ - -o /dev/null 2>/dev/null; then
    export CXX=clang++ CC=clang
  fi
  meson setup build "${options[@]}"
fi
# --configure-only stops here: scripts/test.sh's quick tier lets `meson test` build just the
# programs its tests run. Targets given as arguments (scripts/train.sh passes its example) build
# alone; none builds all.
if [ "${1:-}" = "--configure-only" ]; then
  exit 0
fi
jobs=$(nproc)
meson compile -C build -j "$jobs" "$@"
