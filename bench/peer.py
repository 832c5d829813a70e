"""The PyTorch peer's setup, shared by every script that times PyTorch: which BLAS it runs on,
which OpenBLAS core type, its threads, and the JSON record of all of it.

Debian's PyTorch takes its BLAS from libblas.so.3, which update-alternatives points at whichever
BLAS is installed; on a machine with only libblas3 that is the reference BLAS (~2 GFLOP/s), and a
PyTorch MLP measured on it ran at 2.5k img/s instead of ~70k: a fake 40x win for Tessera. So:

- before the peer starts (no torch needed): `blas_setup()` finds the libblas.so.3 the peer would
  load; if it is not OpenBLAS but libopenblas0-pthread is installed, OpenBLAS is selected for the
  peer process alone (LD_LIBRARY_PATH), the system is left as it is; if OpenBLAS is not installed
  it refuses, naming the package to install;
- inside the peer (`torch_record()`): the library that actually serves libtorch_cpu's sgemm_ is
  looked up with dlsym/dladdr and must be OpenBLAS, else the process refuses. Merely finding
  OpenBLAS in /proc/self/maps proves nothing: libtorch_cpu also links libopenblas.so.0 directly, so
  OpenBLAS is mapped even when sgemm_ comes from the reference BLAS;
- `coretype_candidates()` lists OPENBLAS_CORETYPE values this CPU can run (from /proc/cpuinfo flags)
  and this OpenBLAS accepts; `choose_config()` probes them together with OMP_WAIT_POLICY and the
  malloc setting (MALLOCS).

Standard library only: the decision functions are tested without PyTorch (tests/bench/test_peer_blas.py).
"""
import ctypes
import glob
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import cpu_model  # noqa: E402

LIBDIR = "/usr/lib/x86_64-linux-gnu"
SYSTEM_LIBBLAS = os.path.join(LIBDIR, "libblas.so.3")
ALTERNATIVE = "libblas.so.3-x86_64-linux-gnu"
# Debian's OpenBLAS flavours, best first for a PyTorch peer (the brief of issue 17 asks for pthread).
OPENBLAS_DIRS = [os.path.join(LIBDIR, d) for d in ("openblas-pthread", "openblas-openmp", "openblas-serial")]
INSTALL_HINT = "apt-get install libopenblas0-pthread"

# OPENBLAS_CORETYPE values worth probing on an x86-64 server, with the /proc/cpuinfo flags their
# kernels need. Older ones (Sandybridge, Nehalem, ...) are strictly slower where these run. Zen's
# kernels are Haswell's AVX2/FMA kernels with other blocking, so it runs on Intel too.
_AVX512 = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})
CORETYPES = [
    ("Haswell", frozenset({"avx2", "fma"})),
    ("Zen", frozenset({"avx2", "fma"})),
    ("SkylakeX", _AVX512),
    ("Cooperlake", _AVX512 | {"avx512_bf16"}),
    ("SapphireRapids", _AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"}),  # OpenBLAS >= 0.3.22
]
UNSET = "unset"
WAIT_POLICIES = (UNSET, "PASSIVE", "ACTIVE")
# glibc malloc for the peer: "default", or "retain": freed blocks stay in the heap instead of going
# back to the kernel (no mmap per large block, no trimming), so a tensor allocated every step
# reuses pages instead of faulting fresh zeroed ones in. PyTorch (its CPU allocator is malloc)
# allocates every activation anew each step; where page faults are dear (this VM: ResNet-50
# inference b8 ran 10 img/s with glibc's defaults, 26 retaining) that handicap is the machine's,
# not PyTorch's, and its guides give the same remedy (jemalloc or tcmalloc preloaded). Tessera's
# caching allocator makes no allocation in a steady step, so it is not affected.
MALLOC_DEFAULT = "default"
MALLOC_RETAIN = "retain"
RETAIN_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"
# glibc caps mmap_threshold at 32 MiB, so a tensor above it (attention's (12, 1024, 1024) scores are
# 48 MiB) is still fresh mmap'd pages on every allocation: on this VM a 48 MiB bmm output cost
# 160 ms of page faults around a 12 ms product. "jemalloc" preloads Debian's libjemalloc2 with its
# freed pages kept (MALLOC_CONF below), PyTorch's own performance guide's remedy; probed only where
# the library is installed (apt-get install libjemalloc2).
MALLOC_JEMALLOC = "jemalloc"
JEMALLOC_LIBRARY = os.path.join(LIBDIR, "libjemalloc.so.2")
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"


def available_mallocs(exists=os.path.exists):
    """The malloc settings the probe tries: glibc's default, glibc retaining, and jemalloc where installed."""
    return (MALLOC_DEFAULT, MALLOC_RETAIN) + ((MALLOC_JEMALLOC,) if exists(JEMALLOC_LIBRARY) else ())


MALLOCS = available_mallocs()


class PeerSetupError(RuntimeError):
    """The peer cannot be measured at its best here; the message says why and what to do."""


# ---------------------------------------------------------------- BLAS, before the peer starts

def blas_kind(path):
    """'openblas', 'reference' (Debian's libblas3, .../blas/libblas.so.3*), 'none' or 'other'."""
    if not path:
        return "none"
    if "openblas" in path.lower():
        return "openblas"
    if os.path.basename(os.path.dirname(path)) == "blas" and os.path.basename(path).startswith("libblas.so"):
        return "reference"
    return "other"


def parse_alternatives(text):
    """The 'Value:' of `update-alternatives --query libblas.so.3-x86_64-linux-gnu`, or None."""
    for line in (text or "").splitlines():
        if line.startswith("Value:"):
            value = line.split(":", 1)[1].strip()
            return value if value and value != "none" else None
    return None


def query_alternatives():
    """update-alternatives' output for libblas.so.3, or None where there is no such tool/group."""
    try:
        out = subprocess.run(["update-alternatives", "--query", ALTERNATIVE], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def resolve_libblas(env, alternatives_text, exists=os.path.exists, realpath=os.path.realpath):
    """(path, how) of the libblas.so.3 a process started with env loads: the first LD_LIBRARY_PATH
    directory holding one (the loader searches those first), else the system's choice as
    update-alternatives reports it, else whatever the /usr/lib link resolves to."""
    for d in env.get("LD_LIBRARY_PATH", "").split(":"):
        if d and exists(os.path.join(d, "libblas.so.3")):
            return realpath(os.path.join(d, "libblas.so.3")), f"LD_LIBRARY_PATH ({d})"
    value = parse_alternatives(alternatives_text)
    if value:
        return realpath(value), f"update-alternatives {ALTERNATIVE}"
    if exists(SYSTEM_LIBBLAS):
        return realpath(SYSTEM_LIBBLAS), SYSTEM_LIBBLAS
    return None, "no libblas.so.3 found"


def choose_blas(env, libblas, how, openblas_dir):
    """The decision. libblas/how: what resolve_libblas found for env; openblas_dir: an installed
    OpenBLAS directory holding libblas.so.3, or None. Returns (environment additions for the peer,
    record); raises PeerSetupError where the peer would run on anything but OpenBLAS."""
    kind = blas_kind(libblas)
    record = {"libblas_default": libblas, "libblas_default_kind": kind, "libblas_default_from": how}
    if kind == "openblas":
        return {}, {**record, "selected": libblas, "selected_by": how}
    if openblas_dir:
        old = env.get("LD_LIBRARY_PATH", "")
        path = openblas_dir + (":" + old if old else "")
        return {"LD_LIBRARY_PATH": path}, {**record, "selected": os.path.join(openblas_dir, "libblas.so.3"),
                                           "selected_by": f"LD_LIBRARY_PATH={openblas_dir} for the peer only"}
    raise PeerSetupError(
        f"refusing to time PyTorch: its libblas.so.3 would be {libblas or 'missing'} ({kind} BLAS, from {how}), "
        f"and no OpenBLAS is installed to select instead (looked in {', '.join(OPENBLAS_DIRS)}). "
        f"On the reference BLAS PyTorch runs ~30x slower and any comparison with it is fake. "
        f"Install OpenBLAS: `{INSTALL_HINT}`, then rerun.")


def installed_openblas_dir(exists=os.path.exists):
    for d in OPENBLAS_DIRS:
        if exists(os.path.join(d, "libblas.so.3")):
            return d
    return None


def blas_setup(env=None):
    """(environment additions, record) for the peer on this machine; raises PeerSetupError."""
    env = os.environ if env is None else env
    libblas, how = resolve_libblas(env, query_alternatives())
    return choose_blas(env, libblas, how, installed_openblas_dir())


# ---------------------------------------------------------------- OpenBLAS core types

def cpu_flags(cpuinfo_text):
    """The flags of the first processor in a /proc/cpuinfo text."""
    for line in cpuinfo_text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def openblas_corenames(library_bytes):
    """The CORETYPES names this OpenBLAS build knows: OPENBLAS_CORETYPE is matched
    case-insensitively against NUL-terminated names in its dynamic-arch table."""
    lowered = library_bytes.lower()
    return {name for name, _ in CORETYPES if b"\0" + name.lower().encode() + b"\0" in lowered}


def coretype_candidates(flags, accepted):
    """'unset' (OpenBLAS detects the core itself) and then every CORETYPES entry whose instructions
    this CPU has and that this OpenBLAS accepts. OpenBLAS does not check a forced core type against
    the CPU, so one it cannot run would crash with SIGILL: hence the flags."""
    return [UNSET] + [name for name, needs in CORETYPES if needs <= flags and name in accepted]


def openblas_library(openblas_dir):
    """The OpenBLAS core library (libopenblas*.so*) next to the selected libblas.so.3."""
    found = sorted(glob.glob(os.path.join(openblas_dir, "libopenblas*.so*")))
    return os.path.realpath(found[0]) if found else None


class Peer:
    """Everything a driver needs to start PyTorch processes: BLAS selection, core-type candidates,
    and the environment of one configuration."""

    def __init__(self, coretypes=None, env=None):
        self.base_env = dict(os.environ if env is None else env)
        self.blas_env, self.blas = blas_setup(self.base_env)
        selected_dir = os.path.dirname(self.blas["selected"])
        self.openblas = openblas_library(selected_dir)
        with open("/proc/cpuinfo") as f:
            flags = cpu_flags(f.read())
        accepted = set()
        if self.openblas:
            with open(self.openblas, "rb") as f:
                accepted = openblas_corenames(f.read())
        self.candidates = coretype_candidates(flags, accepted)
        if coretypes:  # --coretypes: a subset, to bound the probing time; unknown names refused
            wanted = coretypes.split(",")
            unknown = [c for c in wanted if c not in self.candidates]
            if unknown:
                raise PeerSetupError(f"--coretypes {','.join(unknown)}: not among this CPU's and OpenBLAS's "
                                     f"candidates {','.join(self.candidates)}")
            self.candidates = wanted
        self.inherited = {k: self.base_env[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OMP_WAIT_POLICY",
                                                         "OPENBLAS_NUM_THREADS") if k in self.base_env}

    def env(self, coretype=UNSET, wait_policy=UNSET, malloc=MALLOC_DEFAULT):
        """The peer's environment: OpenBLAS selected, one OpenBLAS thread (its own threads fight
        PyTorch's OpenMP threads on 2 cores), OPENBLAS_L2_SIZE never inherited (the machine sets it
        for Tessera's sake), and the given core type, OpenMP wait policy and malloc setting."""
        env = dict(self.base_env)
        for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OMP_WAIT_POLICY", "GLIBC_TUNABLES", "MALLOC_CONF"):
            env.pop(k, None)
        env.update(self.blas_env)
        env["OPENBLAS_NUM_THREADS"] = "1"
        if coretype != UNSET:
            env["OPENBLAS_CORETYPE"] = coretype
        if wait_policy != UNSET:
            env["OMP_WAIT_POLICY"] = wait_policy
        if malloc == MALLOC_RETAIN:
            env["GLIBC_TUNABLES"] = RETAIN_TUNABLES
        if malloc == MALLOC_JEMALLOC:
            env["LD_PRELOAD"] = " ".join(p for p in (JEMALLOC_LIBRARY, env.get("LD_PRELOAD", "")) if p)
            env["MALLOC_CONF"] = JEMALLOC_CONF
        return env

    def env_of(self, trial):
        """The environment of a trial that choose_config returned."""
        return self.env(trial["OPENBLAS_CORETYPE"], trial["OMP_WAIT_POLICY"], trial.get("malloc", MALLOC_DEFAULT))

    def record(self, best, trials, child=None):
        """The JSON record of the configuration measured: best is the chosen trial, trials all of
        them, child the 'peer' record the PyTorch process wrote about itself."""
        return {"cpu": cpu_model(), "candidates": self.candidates, "blas_selection": self.blas,
                "openblas_library": self.openblas, "OPENBLAS_CORETYPE": best["OPENBLAS_CORETYPE"],
                "OMP_WAIT_POLICY": best["OMP_WAIT_POLICY"], "malloc": best.get("malloc", MALLOC_DEFAULT),
                "GLIBC_TUNABLES": RETAIN_TUNABLES if best.get("malloc") == MALLOC_RETAIN else UNSET,
                "MALLOC_CONF": JEMALLOC_CONF if best.get("malloc") == MALLOC_JEMALLOC else UNSET,
                "OPENBLAS_NUM_THREADS": "1",
                "OPENBLAS_L2_SIZE": UNSET, "inherited_and_overridden": self.inherited, "trials": trials,
                "process": child}


def choose_config(run, coretypes, wait_policies=WAIT_POLICIES, mallocs=MALLOCS):
    """Probes configurations with run(coretype, wait_policy, malloc) -> (images/s, the core
    OpenBLAS reports it runs, or None) and returns (best trial, all trials).

    The malloc setting first (with the first core type, 'unset': the one OpenBLAS detects, and the
    first policy): where page faults are dear it outweighs the rest, and the other trials would
    otherwise be ranked by noise on top of it. Then each other wait policy with the fastest malloc,
    then each other core type with the fastest policy: len(mallocs) + 2 + len(coretypes) - 1 runs
    rather than a full grid. They are nearly independent: malloc decides what a fresh tensor costs,
    the policy how PyTorch's OpenMP threads wait between parallel regions, the core type which
    kernels OpenBLAS runs inside one thread (OPENBLAS_NUM_THREADS=1). A core type equal to the one
    OpenBLAS detected by itself is the same configuration and is not run again. Each trial is one
    run, so on a noisy machine the choice is only as good as the noise allows; every trial is
    recorded."""
    trials = []

    def trial(coretype, policy, malloc):
        ips, corename = run(coretype, policy, malloc)
        trials.append({"OPENBLAS_CORETYPE": coretype, "OMP_WAIT_POLICY": policy, "malloc": malloc,
                       "images_per_second": ips, "openblas_corename": corename})
        return trials[-1]

    def fastest():
        return max(trials, key=lambda t: t["images_per_second"])

    for m in mallocs:
        trial(coretypes[0], wait_policies[0], m)
    malloc = fastest()["malloc"]
    for p in wait_policies[1:]:
        trial(coretypes[0], p, malloc)
    policy = fastest()["OMP_WAIT_POLICY"]
    detected = {(t["openblas_corename"] or "").lower() for t in trials} if coretypes[0] == UNSET else set()
    for c in coretypes[1:]:
        if c.lower() not in detected:
            trial(c, policy, malloc)
    return fastest(), trials


# ---------------------------------------------------------------- Tessera's own core type

INHERITED = "inherited"


def tessera_env(base_env, coretype):
    """Tessera's environment for one OpenBLAS core type. 'inherited' keeps what the shell sets (a
    machine may force OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE for every process: here Haswell, whose
    AVX2 kernels ran Tessera's MLP and ResNet-50 about 1.4x slower than the AVX-512 ones OpenBLAS
    picks by itself on the EPYC); 'unset' lets OpenBLAS detect the core; a name forces that core.
    Overriding the core drops the inherited OPENBLAS_L2_SIZE too (it was set for the forced core)."""
    env = dict(base_env)
    if coretype != INHERITED:
        env.pop("OPENBLAS_CORETYPE", None)
        env.pop("OPENBLAS_L2_SIZE", None)
        if coretype != UNSET:
            env["OPENBLAS_CORETYPE"] = coretype
    return env


def gemm_core(gemm):
    """The OpenBLAS core named in a Tessera report's "gemm" ("OpenBLAS Cooperlake, one thread
    ...": "Cooperlake"), or None for another provider."""
    words = (gemm or "").replace(",", " ").split()
    return words[1] if len(words) > 1 and words[0] == "OpenBLAS" else None


# Tessera's idle spin (Cpu::set_idle_spin_ms; KMP_BLOCKTIME, read by LLVM's OpenMP runtime, which
# the clang build links) tried against the runtime's default of 200 ms, as the peer's OMP_WAIT_POLICY
# is: on a VM whose vCPUs the host rations, the default spin at every barrier spends the ration
# and the host stops the vCPUs for whole periods (ResNet-50 at two threads ran faster with 1 ms),
# while small models, many short parallel regions a step, ran faster with the default
# (bench/README.md, "Idle threads that spin"). Two runs each way, alternating, the means compared: one run each
# would often choose by which of the machine's minutes it fell in.
IDLE_SPIN_MS = "1"
IDLE_SPIN_RUNS = 2


def choose_tessera_config(run, coretypes, base_env=None):
    """Tessera at its best, as the peer is: run(env) -> (images/s, the "gemm" string Tessera
    reports) once with the inherited setting (when the shell sets a core type), once with 'unset',
    then with each other candidate whose core no earlier trial ran; then, with the fastest core
    type and unless the shell sets KMP_BLOCKTIME or OMP_WAIT_POLICY, KMP_BLOCKTIME=IDLE_SPIN_MS
    against the default (IDLE_SPIN_RUNS runs each, alternating, the first default run being the
    core type's trial). Returns (best trial, trials, its environment); every trial is recorded,
    and the best one says its KMP_BLOCKTIME ('inherited', 'unset' or IDLE_SPIN_MS)."""
    base_env = dict(os.environ if base_env is None else base_env)
    order = ([INHERITED] if "OPENBLAS_CORETYPE" in base_env else []) + [UNSET] + [c for c in coretypes if c != UNSET]
    trials, seen = [], set()
    for coretype in order:
        if coretype not in (INHERITED, UNSET) and coretype.lower() in seen:
            continue
        ips, gemm = run(tessera_env(base_env, coretype))
        core = gemm_core(gemm)
        seen.add((core or "").lower())
        trials.append({"OPENBLAS_CORETYPE": coretype, "images_per_second": ips, "openblas_corename": core,
                       "gemm": gemm})
    best = dict(max(trials, key=lambda t: t["images_per_second"]))
    env = tessera_env(base_env, best["OPENBLAS_CORETYPE"])
    if "KMP_BLOCKTIME" in base_env or "OMP_WAIT_POLICY" in base_env:
        best["KMP_BLOCKTIME"] = INHERITED
        return best, trials, env
    spin_env = dict(env, KMP_BLOCKTIME=IDLE_SPIN_MS)
    default_runs, spin_runs = [best["images_per_second"]], []
    for i in range(2 * IDLE_SPIN_RUNS - 1):  # short, default, short, ...: the default's first run is above
        short = i % 2 == 0
        ips, gemm = run(spin_env if short else env)
        (spin_runs if short else default_runs).append(ips)
        trials.append({"OPENBLAS_CORETYPE": best["OPENBLAS_CORETYPE"], "KMP_BLOCKTIME": IDLE_SPIN_MS if short else UNSET,
                       "images_per_second": ips, "openblas_corename": gemm_core(gemm), "gemm": gemm})
    if sum(spin_runs) / len(spin_runs) > sum(default_runs) / len(default_runs):
        best.update(KMP_BLOCKTIME=IDLE_SPIN_MS, images_per_second=max(spin_runs))
        return best, trials, spin_env
    best.update(KMP_BLOCKTIME=UNSET, images_per_second=max(default_runs))
    return best, trials, env


def tessera_record(best, trials, base_env=None):
    """The JSON record of Tessera's configuration: the chosen core type and idle spin, every trial."""
    base_env = os.environ if base_env is None else base_env
    return {"OPENBLAS_CORETYPE": best["OPENBLAS_CORETYPE"], "openblas_corename": best["openblas_corename"],
            "KMP_BLOCKTIME": best.get("KMP_BLOCKTIME", UNSET), "gemm": best["gemm"],
            "inherited": {k: base_env[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "KMP_BLOCKTIME",
                                                   "OMP_WAIT_POLICY") if k in base_env},
            "trials": trials}


def run_child(argv, env):
    """stdout of a PyTorch process; its stderr (a refusal, a traceback) shown when it fails."""
    out = subprocess.run(argv, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return out.stdout


def add_arguments(parser):
    parser.add_argument("--coretypes", default="",
                        help="OPENBLAS_CORETYPE values to probe for the PyTorch peer (comma-separated, 'unset' "
                             "first); default: every one this CPU and OpenBLAS support")


def peer_or_exit(coretypes=None, env=None):
    """Peer(coretypes, env), announced on stderr, or exit with PeerSetupError's message."""
    try:
        setup = Peer(coretypes, env)
    except PeerSetupError as e:
        sys.exit(f"{os.path.basename(sys.argv[0])}: {e}")
    print(f"PyTorch peer: BLAS {setup.blas['selected']} ({setup.blas['selected_by']}), OPENBLAS_CORETYPE "
          f"candidates {','.join(setup.candidates)}", file=sys.stderr)
    return setup


# ---------------------------------------------------------------- inside the PyTorch process

def exec_with_openblas():
    """For a PyTorch script started by hand: re-executes it with OpenBLAS selected when its
    libblas.so.3 is not OpenBLAS (LD_LIBRARY_PATH is read only at process start); exits with the
    install hint where there is none. Call before importing torch."""
    try:
        additions, _ = blas_setup()
    except PeerSetupError as e:
        sys.exit(f"{os.path.basename(sys.argv[0])}: {e}")
    if additions and not os.environ.get("TESSERA_PEER_REEXEC"):
        env = dict(os.environ, **additions, TESSERA_PEER_REEXEC="1")
        os.execve(sys.executable, [sys.executable] + sys.argv, env)


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _mapped(maps_text):
    return sorted({line.split()[-1] for line in maps_text.splitlines() if len(line.split()) >= 6 and "/" in line})


def sgemm_provider(maps_text=None):
    """(realpath of the library serving libtorch_cpu's sgemm_, libtorch_cpu path), found as the
    dynamic loader resolves it: dlsym on libtorch_cpu's handle searches it and its dependencies in
    load order; dladdr names the library the symbol lies in."""
    if maps_text is None:
        with open("/proc/self/maps") as f:
            maps_text = f.read()
    torch_cpu = [p for p in _mapped(maps_text) if "libtorch_cpu" in os.path.basename(p)]
    if not torch_cpu:
        return None, None
    handle = ctypes.CDLL(torch_cpu[0], mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    try:
        function = handle.sgemm_
    except AttributeError:
        return None, torch_cpu[0]
    info = _DlInfo()
    if not ctypes.CDLL(None).dladdr(ctypes.cast(function, ctypes.c_void_p), ctypes.byref(info)):
        return None, torch_cpu[0]
    return os.path.realpath(info.dli_fname.decode()), torch_cpu[0]


def verify_torch_blas(torch):
    """Inside the PyTorch process: the BLAS serving its matrix products, refusing anything but
    OpenBLAS. Returns {'sgemm_from', 'libtorch_cpu', 'mapped'}."""
    a = torch.ones(64, 64)
    torch.mm(a, a)  # make sure the BLAS is loaded
    with open("/proc/self/maps") as f:
        maps_text = f.read()
    provider, torch_cpu = sgemm_provider(maps_text)
    mapped = [p for p in _mapped(maps_text) if "blas" in p.lower() or "lapack" in p.lower()]
    if blas_kind(provider) != "openblas":
        sys.exit(f"{os.path.basename(sys.argv[0])}: refusing to time PyTorch: "
                 f"{torch_cpu or 'libtorch_cpu (not found)'} "
                 f"takes sgemm_ from {provider or 'an unknown library'} ({blas_kind(provider)} BLAS; mapped: "
                 f"{', '.join(mapped) or 'none'}). Start it through bench/peer.py's setup or install OpenBLAS: "
                 f"`{INSTALL_HINT}`.")
    return {"sgemm_from": provider, "libtorch_cpu": torch_cpu, "mapped": mapped}


def openblas_info(torch_cpu):
    """OpenBLAS's own account of the core it runs (openblas_get_corename) and its build config."""
    try:
        handle = ctypes.CDLL(torch_cpu, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        out = {}
        for name in ("openblas_get_corename", "openblas_get_config"):
            f = getattr(handle, name)
            f.restype = ctypes.c_char_p
            out[name.replace("openblas_get_", "")] = f().decode().strip()
        return out
    except (OSError, AttributeError):
        return {}


def torch_record(torch, blas):
    """What the PyTorch process reports about itself in its JSON; blas from verify_torch_blas."""
    return {"cpu": cpu_model(), "torch_version": torch.__version__, "torch_threads": torch.get_num_threads(),
            "blas": blas, "openblas": openblas_info(blas["libtorch_cpu"]) if blas.get("libtorch_cpu") else {},
            "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", UNSET),
            "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE", UNSET),
            "OPENBLAS_L2_SIZE": os.environ.get("OPENBLAS_L2_SIZE", UNSET),
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", UNSET),
            "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", UNSET),
            "MALLOC_CONF": os.environ.get("MALLOC_CONF", UNSET),
            "LD_PRELOAD": os.environ.get("LD_PRELOAD", ""),
            "LD_LIBRARY_PATH": os.environ.get("LD_LIBRARY_PATH", ""),
            "mkldnn_available": torch.backends.mkldnn.is_available(),
            "mkldnn_enabled": torch.backends.mkldnn.enabled}


def conv_kernels(torch, step):
    """The convolution kernels one call of step() runs (e.g. aten::mkldnn_convolution, or
    aten::thnn_conv2d where oneDNN is not used), seen by the autograd profiler."""
    with torch.autograd.profiler.profile() as prof:
        step()
    return sorted({e.name for e in prof.function_events if "conv" in e.name})
