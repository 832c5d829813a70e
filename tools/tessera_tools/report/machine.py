"""The machine and software a campaign ran on: CPU, cores, flags, memory, OS, compiler, library
versions (dpkg), build options, the tree's git commit, inherited tuning variables, date."""
from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from tessera_tools.paths import SOURCE_ROOT
from tessera_tools.report.formatting import JsonDict, md_table

INTERESTING_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
                     "amx_int8")
PACKAGES = ("g++", "libeigen3-dev", "libopenblas0-pthread", "libopenblas-dev", "libopenmpi-dev", "openmpi-bin",
            "libgloo-dev", "python3-torch", "python3-matplotlib", "meson", "ninja-build")



@dataclass
class CpuInfo:
    """What /proc/cpuinfo says; a field is None where the text does not have it."""
    model: str | None = None
    logical_cpus: int = 0
    flags: list[str] = field(default_factory=list)  # those of INTERESTING_FLAGS it has, in that order
    physical_cores: int | None = None
    sockets: int | None = None
    mhz: float | None = None
    cache: str | None = None


def parse_cpuinfo(text: str) -> CpuInfo:
    """CPU model, logical CPUs, physical cores, sockets, MHz, cache and the flags of interest from a
    /proc/cpuinfo text (x86 layout; fields absent elsewhere are left out)."""
    info = CpuInfo()
    cores: set[tuple[str, str]] = set()
    sockets: set[str] = set()
    flags: set[str] | None = None
    physical: str | None = None
    core: str | None = None
    for line in text.splitlines() + [""]:
        if not line.strip():  # end of one processor's block
            if physical is not None and core is not None:
                cores.add((physical, core))
            physical = core = None
            continue
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "processor":
            info.logical_cpus += 1
        elif key == "model name" and info.model is None:
            info.model = value
        elif key == "physical id":
            physical = value
            sockets.add(value)
        elif key == "core id":
            core = value
        elif key == "cpu MHz" and info.mhz is None:
            info.mhz = float(value)
        elif key == "cache size" and info.cache is None:
            info.cache = value
        elif key == "flags" and flags is None:
            flags = set(value.split())
    if cores:
        info.physical_cores = len(cores)
    if sockets:
        info.sockets = len(sockets)
    info.flags = [f for f in INTERESTING_FLAGS if flags and f in flags]
    return info


def parse_meminfo(text: str) -> float | None:
    """MemTotal in GiB from a /proc/meminfo text, or None."""
    m = re.search(r"^MemTotal:\s+(\d+)\s*kB", text, re.M)
    return int(m.group(1)) / (1 << 20) if m else None


def parse_dpkg(text: str) -> dict[str, str]:
    """{package: version} from `dpkg-query -W -f '${Package}\\t${Version}\\n'` output."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        name, _, version = line.partition("\t")
        if name and version:
            out[name.split(":")[0]] = version
    return out


def _output(argv: Sequence[str], cwd: str | None = None) -> str | None:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=cwd)
        return p.stdout if p.returncode == 0 or p.stdout else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def describe_machine(build_dir: str | None = None, root: str = str(SOURCE_ROOT)) -> JsonDict:
    """The machine and software the campaign ran on: CPU, cores, flags, memory, OS, compiler,
    library versions (dpkg), build options, the tree's git commit, inherited tuning variables, date."""
    d: JsonDict = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "hostname": platform.node()}
    cpu = parse_cpuinfo(_read("/proc/cpuinfo"))
    d["cpu_model"] = cpu.model or platform.processor() or "unknown"
    d["logical_cpus"] = cpu.logical_cpus or os.cpu_count()
    for k in ("physical_cores", "sockets", "mhz", "cache"):
        if getattr(cpu, k) is not None:
            d[k] = getattr(cpu, k)
    try:
        d["usable_cpus"] = len(os.sched_getaffinity(0))
    except AttributeError:
        d["usable_cpus"] = os.cpu_count()
    d["cpu_flags"] = cpu.flags
    lscpu = _output(["lscpu"]) or ""
    for name in ("L1d", "L2", "L3"):
        m = re.search(rf"^{name} cache:\s*(.+)$", lscpu, re.M)
        if m:
            d[f"{name}_cache"] = m.group(1).strip()
    d["memory_gib"] = parse_meminfo(_read("/proc/meminfo"))
    os_release = dict(re.findall(r'^(\w+)="?([^"\n]*)"?$', _read("/etc/os-release"), re.M))
    d["os"] = os_release.get("PRETTY_NAME") or platform.platform()
    d["kernel"] = platform.release()
    d["python"] = f"{platform.python_version()} ({sys.executable})"
    if build_dir:
        log = _read(os.path.join(build_dir, "meson-logs", "meson-log.txt"))
        m = re.search(r"C\+\+ compiler for the host machine: (.+)", log)
        if m:
            d["compiler"] = m.group(1).strip()
        try:
            with open(os.path.join(build_dir, "meson-info", "intro-buildoptions.json")) as f:
                options = {o["name"]: o["value"] for o in json.load(f)}
            d["build_options"] = {k: options[k] for k in ("buildtype", "optimization", "debug", "b_ndebug", "cpp_args",
                                                          "openblas", "compiled_kernels", "mpi", "gloo")
                                  if k in options}
        except (OSError, ValueError, KeyError):
            pass
    if "compiler" not in d:
        out = _output(["c++", "--version"])
        d["compiler"] = out.splitlines()[0] if out else "unknown"
    dpkg = _output(["dpkg-query", "-W", "-f", "${Package}\t${Version}\n", *PACKAGES])
    d["packages"] = parse_dpkg(dpkg or "")
    mpirun = _output(["mpirun", "--version"])
    if mpirun:
        d["mpirun"] = mpirun.splitlines()[0]
    commit = _output(["git", "rev-parse", "HEAD"], cwd=root)
    if commit:
        changed = _output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root) or ""
        n = len([line for line in changed.splitlines() if line.strip()])
        d["git_commit"] = commit.strip()
        d["git_modified_files"] = n
    d["environment"] = {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS",
                                                   "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GLIBC_TUNABLES")
                        if k in os.environ}
    d["load_average"] = list(os.getloadavg())
    return d


def machine_markdown(d: JsonDict) -> str:
    rows = [("CPU", d.get("cpu_model", "unknown"))]
    cores = f"{d.get('logical_cpus')} logical CPUs"
    if "physical_cores" in d:
        cores += f", {d['physical_cores']} physical cores"
    if "sockets" in d:
        cores += f" on {d['sockets']} socket(s)"
    if d.get("usable_cpus") and d["usable_cpus"] != d.get("logical_cpus"):
        cores += f"; {d['usable_cpus']} usable by this process"
    rows.append(("Cores", cores))
    if "mhz" in d:
        rows.append(("Clock (reported)", f"{d['mhz']:.0f} MHz"))
    caches = ", ".join(f"{k.split('_')[0]} {d[k]}" for k in ("L1d_cache", "L2_cache", "L3_cache") if k in d)
    if caches or "cache" in d:
        rows.append(("Caches", caches or f"{d['cache']} (/proc/cpuinfo 'cache size'; lscpu lists none)"))
    rows.append(("Flags of interest", " ".join(d.get("cpu_flags", [])) or "none of " + ", ".join(INTERESTING_FLAGS)))
    if d.get("memory_gib"):
        rows.append(("Memory", f"{d['memory_gib']:.1f} GiB"))
    rows.append(("OS", f"{d.get('os')}, Linux {d.get('kernel')}"))
    rows.append(("Compiler", d.get("compiler", "unknown")))
    if d.get("build_options"):
        rows.append(("Build options", ", ".join(f"{k}={v}" for k, v in d["build_options"].items())))
    pk = d.get("packages", {})
    names = [("Eigen", "libeigen3-dev"), ("OpenBLAS", "libopenblas0-pthread"), ("OpenBLAS (dev)", "libopenblas-dev"),
             ("Open MPI", "libopenmpi-dev"), ("Gloo", "libgloo-dev"), ("PyTorch", "python3-torch"),
             ("matplotlib", "python3-matplotlib"), ("g++ package", "g++")]
    for label, pkg in names:
        rows.append((label, f"{pk[pkg]} (`{pkg}`)" if pkg in pk else f"not installed (`{pkg}`)"))
    if "mpirun" in d:
        rows.append(("mpirun", d["mpirun"]))
    rows.append(("Python (report)", d.get("python", "")))
    if "git_commit" in d:
        dirty = f", plus uncommitted changes to {d['git_modified_files']} tracked files" if d["git_modified_files"] else ""
        rows.append(("Tessera commit", f"`{d['git_commit'][:12]}`{dirty}"))
    if d.get("environment"):
        rows.append(("Inherited tuning variables", ", ".join(f"`{k}={v}`" for k, v in d["environment"].items())))
    la = d.get("load_average")
    if la:
        rows.append(("Load average at start", f"{la[0]:.2f} / {la[1]:.2f} / {la[2]:.2f} (1 / 5 / 15 min)"))
    rows.append(("Date", d.get("date", "")))
    return md_table(["", ""], [list(r) for r in rows], ["l", "l"])
