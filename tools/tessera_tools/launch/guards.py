"""Checks made before any rank starts: the rank count against the CPUs and the open-file limit,
and the refusal of programs that link an MPI library."""
from __future__ import annotations

import mmap
import os
import re
import shutil
import struct
import subprocess

try:
    import resource
    HAVE_RESOURCE = True
except ImportError:  # not on every platform; the descriptor check is skipped there
    HAVE_RESOURCE = False

# Ranks per usable CPU. A rank is a process holding its own model, optimizer state and data set
# (example 04 holds about 200 MB), and ranks beyond the cores take turns on them; 64 per CPU is far
# past any useful oversubscription (the tests run 4 ranks on 2 cores) and stops a typo such as
# -n 10000 from forking the machine to a halt.
MAX_RANKS_PER_CPU = 64


def usable_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def ensure_descriptors(nproc: int) -> str | None:
    """The launcher keeps 2 pipe ends per rank open (stdout, stderr) plus a few of its own. Raises
    the soft open-file limit up to the hard one if that is needed; returns an error text if even
    the hard limit is too low, else None."""
    if not HAVE_RESOURCE:
        return None
    needed = 2 * nproc + 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return None
    if hard == resource.RLIM_INFINITY or hard >= needed:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
            return None
        except (ValueError, OSError):
            pass
    return (f"-n {nproc}: needs about {needed} open files (2 pipes per rank), above the limit of "
            f"{hard if hard != resource.RLIM_INFINITY else soft} (ulimit -n)")


# Shared-library names of MPI implementations: Open MPI (libmpi.so.40, libmpi_cxx, libmpi_mpifh),
# MPICH (libmpich.so.12, libmpi.so.12), Intel MPI and MVAPICH (libmpi.so.12).
MPI_LIBRARY = re.compile(r"^lib(mpi|mpich)(_\w+)?\.so(\.[0-9.]+)?$")


def linked_mpi_library(path: str) -> str | None:
    """The first MPI library `path` links, directly or through its own libraries, or None.
    ldd gives the whole closure (a library missing on this machine still appears, as "not
    found"); without ldd, the program's own DT_NEEDED entries are read from its ELF file."""
    names: list[str] | None = None
    ldd = shutil.which("ldd")
    if ldd:
        try:
            done = subprocess.run([ldd, path], capture_output=True, timeout=30,
                                  env=dict(os.environ, LC_ALL="C"))
            names = [line.split()[0] for line in done.stdout.decode("utf-8", "replace").splitlines()
                     if line.split()]
        except (OSError, subprocess.SubprocessError):
            names = None
    if names is None:
        names = elf_needed(path)
    for name in names:
        base = os.path.basename(name)
        if MPI_LIBRARY.match(base):
            return base
    return None


def elf_needed(path: str) -> list[str]:
    """DT_NEEDED names of a 32- or 64-bit ELF file, [] for anything else (a script, a bad file)."""
    try:
        with open(path, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # binaries can be large
    except (OSError, ValueError):
        return []  # unreadable, or empty (mmap refuses length 0)
    with data:
        return elf_needed_in(data)


def elf_needed_in(data: bytes | mmap.mmap) -> list[str]:
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] not in (1, 2) or data[5] not in (1, 2):
        return []
    wide, end = data[4] == 2, "<" if data[5] == 1 else ">"
    try:
        if wide:
            phoff, = struct.unpack_from(end + "Q", data, 32)
            phentsize, phnum = struct.unpack_from(end + "HH", data, 54)
        else:
            phoff, = struct.unpack_from(end + "I", data, 28)
            phentsize, phnum = struct.unpack_from(end + "HH", data, 42)
        loads: list[tuple[int, int, int]] = []
        dynamic: tuple[int, int] | None = None
        for i in range(phnum):
            at = phoff + i * phentsize
            if wide:
                p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from(end + "IIQQQQ", data, at)
            else:
                p_type, p_offset, p_vaddr, _, p_filesz = struct.unpack_from(end + "IIIII", data, at)
            if p_type == 1:    # PT_LOAD
                loads.append((p_vaddr, p_offset, p_filesz))
            elif p_type == 2:  # PT_DYNAMIC
                dynamic = (p_offset, p_filesz)
        if dynamic is None:
            return []  # statically linked
        entry = "qQ" if wide else "iI"
        size = struct.calcsize(end + entry)
        needed: list[int] = []
        strtab: int | None = None
        for at in range(dynamic[0], dynamic[0] + dynamic[1] - size + 1, size):
            tag, value = struct.unpack_from(end + entry, data, at)
            if tag == 0:     # DT_NULL
                break
            if tag == 1:     # DT_NEEDED: an offset into the string table
                needed.append(value)
            elif tag == 5:   # DT_STRTAB: a virtual address
                strtab = value
        if strtab is None:
            return []
        base = next((off + strtab - vaddr for vaddr, off, size_ in loads if vaddr <= strtab < vaddr + size_), None)
        if base is None:
            return []
        names = []
        for n in needed:
            stop = data.find(b"\0", base + n)
            if stop < 0:
                return []
            names.append(bytes(data[base + n:stop]).decode("utf-8", "replace"))
        return names
    except (struct.error, ValueError):
        return []
