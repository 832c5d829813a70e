"""Tests of tools/tessera-run with small /bin/sh programs as ranks.

    python3 -m pytest -q tests/tools/test_launch.py

Every launch has a timeout, so a broken launcher fails the test instead of hanging it.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence

import pytest

from conftest import ROOT
from tessera_tools.launch import guards

LAUNCHER = ROOT / "tools" / "tessera-run"
TIMEOUT = 30  # seconds any single launch may take


class CheckFailed(AssertionError):
    pass


def expect(condition: object, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def launch(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str, float]:
    """Runs the launcher; returns (exit status, stdout, stderr, seconds taken)."""
    full_env = dict(os.environ, **(env or {}))
    start = time.monotonic()
    try:
        done = subprocess.run([str(LAUNCHER), *args], capture_output=True, env=full_env,
                              timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"launcher still running after {TIMEOUT} s: {args}") from None
    out, err = (s.decode("utf-8", "replace") for s in (done.stdout, done.stderr))
    return done.returncode, out, err, time.monotonic() - start


def sh(script: str) -> list[str]:
    return ["/bin/sh", "-c", script]


def wait_for_pids(directory: str, count: int, timeout: float = 10) -> list[int]:
    """Pids that ranks wrote to <directory>/<rank>.pid (written via mv, so never partial)."""
    deadline = time.monotonic() + timeout
    while True:
        files = sorted(pathlib.Path(directory).glob("*.pid"))
        if len(files) >= count:
            return [int(f.read_text()) for f in files]
        expect(time.monotonic() < deadline, f"only {len(files)} of {count} ranks wrote a pid")
        time.sleep(0.05)


def expect_gone(pids: Sequence[int], seconds: float = 2) -> None:
    deadline = time.monotonic() + seconds
    for pid in pids:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            expect(time.monotonic() < deadline, f"process {pid} of a stopped rank still exists")
            time.sleep(0.05)


# A rank script fragment: record this shell's pid (the later `exec` keeps it) in $D.
WRITE_PID = 'echo $$ > "$D/$TESSERA_RANK.tmp" && mv "$D/$TESSERA_RANK.tmp" "$D/$TESSERA_RANK.pid"; '


def test_environment_and_prefixes() -> None:
    """ranks get their environment; output is prefixed; temp store removed"""
    script = ('d="${TESSERA_STORE#file://}"; [ -d "$d" ] && e=yes || e=no; '
              'echo "rank=$TESSERA_RANK size=$TESSERA_WORLD_SIZE '
              'local=$TESSERA_LOCAL_RANK/$TESSERA_LOCAL_WORLD_SIZE store=$TESSERA_STORE '
              'exists=$e ompi=${OMPI_COMM_WORLD_RANK-unset} slurm=${SLURM_PROCID-unset}"')
    rc, out, err, _ = launch("-n", "3", *sh(script),
                             env={"OMPI_COMM_WORLD_RANK": "7", "SLURM_PROCID": "7"})
    expect(rc == 0, f"exit status {rc}, stderr: {err!r}")
    lines = sorted(out.splitlines())
    expect(len(lines) == 3, f"expected 3 lines, got {out!r}")
    stores = set()
    for rank, line in enumerate(lines):
        prefix = f"[rank {rank}] rank={rank} size=3 local={rank}/3 store=file:///"
        expect(line.startswith(prefix), f"line {line!r} does not start with {prefix!r}")
        expect(line.endswith(" exists=yes ompi=unset slurm=unset"), f"line {line!r}")
        stores.add(line.split("store=")[1].split()[0])
    expect(len(stores) == 1, f"ranks got different stores: {stores}")
    path = stores.pop()[len("file://"):]
    expect(os.path.basename(path).startswith("tessera-run-"), f"store dir {path}")
    expect(not os.path.exists(path), f"store dir {path} still exists after the launcher exited")


def test_options() -> None:
    """--store/--iface/--timeout/--no-prefix reach the ranks"""
    script = 'echo "$TESSERA_STORE $TESSERA_GLOO_IFACE $TESSERA_COMM_TIMEOUT"'
    rc, out, err, _ = launch("--store", "redis://127.0.0.1:6379", "--iface", "lo",
                             "--timeout", "42", "--no-prefix", "-n", "2", "--", *sh(script))
    expect(rc == 0, f"exit status {rc}, stderr: {err!r}")
    expect(out.splitlines() == ["redis://127.0.0.1:6379 lo 42"] * 2, f"stdout {out!r}")


def test_openmp_threads_shared_out() -> None:
    """unset, OMP_NUM_THREADS is the CPUs shared out (at least 1) and said; set, it is kept"""
    cpus = len(os.sched_getaffinity(0))
    clean = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    script = 'echo "omp=${OMP_NUM_THREADS-unset}"'
    for n in (2, 3, 2 * cpus + 1):
        done = subprocess.run([str(LAUNCHER), "--no-prefix", "-n", str(n), *sh(script)], capture_output=True,
                              env=clean, timeout=TIMEOUT)
        out, err = done.stdout.decode(), done.stderr.decode()
        want = max(1, cpus // n)
        expect(done.returncode == 0, f"exit status {done.returncode}, stderr: {err!r}")
        expect(out.splitlines() == [f"omp={want}"] * n, f"-n {n} on {cpus} CPUs: stdout {out!r}")
        expect(f"OMP_NUM_THREADS is not set: {want} OpenMP thread" in err, f"-n {n}: stderr {err!r}")
    done = subprocess.run([str(LAUNCHER), "--no-prefix", "-n", "1", *sh(script)], capture_output=True, env=clean,
                          timeout=TIMEOUT)
    expect(done.stdout.decode().splitlines() == ["omp=unset"], f"one rank: {done.stdout!r}")
    expect(b"OMP_NUM_THREADS" not in done.stderr, f"one rank: {done.stderr!r}")
    rc, out, err, _ = launch("--no-prefix", "-n", "2", *sh(script), env={"OMP_NUM_THREADS": "3"})
    expect(rc == 0 and out.splitlines() == ["omp=3"] * 2, f"a user's value: {out!r}")
    expect("OMP_NUM_THREADS" not in err, f"a user's value is not commented on: {err!r}")


def test_usr1_forwarded_and_exit_75_not_a_failure() -> None:
    """SIGUSR1 reaches every rank; ranks exiting 75 (checkpoint saved) do not stop the others"""
    with tempfile.TemporaryDirectory() as d:
        # Rank 1 takes a second longer to "save": it must not be stopped when rank 0 exits 75.
        # The trap goes in before the pid is written: the test signals once every pid is there,
        # and a SIGUSR1 that came before the trap would kill the rank (CI saw exit 138).
        script = ('trap \'[ "$TESSERA_RANK" = 1 ] && sleep 1; echo "saved $TESSERA_RANK"; exit 75\' USR1; '
                  + WRITE_PID + 'i=0; while [ $i -lt 200 ]; do sleep 0.05; i=$((i + 1)); done; exit 9')
        proc = subprocess.Popen([str(LAUNCHER), "-n", "2", *sh(script)], env=dict(os.environ, D=d),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            wait_for_pids(d, 2)
            proc.send_signal(signal.SIGUSR1)
            out, err = (s.decode() for s in proc.communicate(timeout=TIMEOUT))
        finally:
            proc.kill()
        expect(proc.returncode == 75, f"exit status {proc.returncode}, stderr {err!r}")
        expect("[rank 0] saved 0" in out and "[rank 1] saved 1" in out, f"stdout {out!r}")
        expect("every rank stopped on a signal with its checkpoint saved (exit 75)" in err and "SIGKILL" not in err
               and "stopping" not in err, f"stderr {err!r}")


def test_failure_stops_others() -> None:
    """a failing rank stops the others; its status is returned"""
    with tempfile.TemporaryDirectory() as d:
        # Rank 1 fails once ranks 0 and 2 are up and sleeping.
        script = ('if [ "$TESSERA_RANK" = 1 ]; then '
                  'while [ "$(ls "$D" | grep -c pid)" -lt 2 ]; do sleep 0.05; done; exit 3; fi; '
                  + WRITE_PID + 'exec sleep 60')
        rc, _, err, took = launch("-n", "3", *sh(script), env={"D": d})
        expect(rc == 3, f"exit status {rc}, expected 3; stderr: {err!r}")
        expect(took < 10, f"took {took:.1f} s")
        message = "tessera-run: rank 1 failed with exit status 3; stopping ranks 0, 2"
        expect(message in err, f"stderr {err!r} lacks {message!r}")
        expect_gone(wait_for_pids(d, 2, timeout=0))


def test_killed_by_signal() -> None:
    """a rank killed by SIGKILL gives 137 and names the signal"""
    rc, _, err, took = launch("-n", "3", *sh('[ "$TESSERA_RANK" = 1 ] && kill -9 $$; exec sleep 60'))
    expect(rc == 137, f"exit status {rc}, expected 137; stderr: {err!r}")
    expect(took < 10, f"took {took:.1f} s")
    expect("rank 1 killed by signal 9 (SIGKILL)" in err, f"stderr {err!r}")


def test_skipped() -> None:
    """exit status 77 (skipped) propagates"""
    rc, _, err, _ = launch("-n", "3", *sh("exit 77"))
    expect(rc == 77, f"all ranks 77: exit status {rc}, expected 77; stderr: {err!r}")
    rc, _, err, _ = launch("-n", "3", *sh('[ "$TESSERA_RANK" = 1 ] && exit 77; exit 0'))
    expect(rc == 77, f"ranks 0/77: exit status {rc}, expected 77; stderr: {err!r}")
    rc, _, err, _ = launch("-n", "2", *sh('[ "$TESSERA_RANK" = 1 ] && exit 3; exit 77'))
    expect(rc == 3, f"ranks 77/3: exit status {rc}, expected 3; stderr: {err!r}")


def test_usage_errors() -> None:
    """usage errors exit 2 with a message"""
    for args, words in ((["-n", "2", "./no-such-program"], "program not found: ./no-such-program"),
                        (["-n", "2", "tessera-no-such-cmd"], "tessera-no-such-cmd"),
                        (["-n", "0", "true"], "-n must be at least 1"),
                        (["-n", "2"], "no program given")):
        rc, out, err, _ = launch(*args)
        expect(rc == 2, f"{args}: exit status {rc}, expected 2")
        expect(words in err, f"{args}: stderr {err!r} lacks {words!r}")
        expect(out == "", f"{args}: unexpected stdout {out!r}")


def test_sigkill_after_grace() -> None:
    """a rank ignoring SIGTERM is SIGKILLed after --grace"""
    with tempfile.TemporaryDirectory() as d:
        # Rank 0 ignores SIGTERM (the ignore survives exec); rank 1 fails once rank 0 is up.
        script = ('if [ "$TESSERA_RANK" = 1 ]; then '
                  'while [ ! -e "$D/0.pid" ]; do sleep 0.05; done; exit 5; fi; '
                  "trap '' TERM; " + WRITE_PID + 'exec sleep 60')
        rc, _, err, took = launch("--grace", "1", "-n", "2", *sh(script), env={"D": d})
        expect(rc == 5, f"exit status {rc}, expected 5; stderr: {err!r}")
        expect(1 <= took < 10, f"took {took:.1f} s, expected between 1 and 10")
        expect("sending SIGKILL to rank 0" in err, f"stderr {err!r}")
        expect_gone(wait_for_pids(d, 1, timeout=0))


def test_stderr_and_partial_lines() -> None:
    """stderr stays stderr; partial and non-UTF-8 lines forwarded"""
    script = r"echo to-out; echo to-err >&2; printf 'bad\377\n'; printf 'no-newline' >&2"
    rc, out, err, _ = launch("-n", "1", *sh(script))
    expect(rc == 0, f"exit status {rc}, stderr: {err!r}")
    expect(out == "[rank 0] to-out\n[rank 0] bad\ufffd\n", f"stdout {out!r}")
    expect(err == "[rank 0] to-err\n[rank 0] no-newline\n", f"stderr {err!r}")


def start_sleeping_ranks(d: str, stderr: int) -> "subprocess.Popen[bytes]":
    """The launcher with 2 ranks that write their PIDs and the launch's store dir into `d`, then sleep"""
    script = WRITE_PID + 'echo "${TESSERA_STORE#file://}" > "$D/store"; exec sleep 60'
    return subprocess.Popen([str(LAUNCHER), "-n", "2", *sh(script)], env=dict(os.environ, D=d),
                            stdout=subprocess.DEVNULL, stderr=stderr)


def test_launcher_sigterm() -> None:
    """SIGTERM to the launcher stops the ranks and exits 143"""
    with tempfile.TemporaryDirectory() as d:
        proc = start_sleeping_ranks(d, subprocess.PIPE)
        try:
            pids = wait_for_pids(d, 2)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        err = err.decode("utf-8", "replace")
        expect(proc.returncode == 143, f"exit status {proc.returncode}, expected 143; {err!r}")
        expect("received SIGTERM; stopping ranks 0, 1" in err, f"stderr {err!r}")
        expect_gone(pids)
        store = pathlib.Path(d, "store").read_text().strip()
        expect(not os.path.exists(store), f"store dir {store} still exists")


def test_launcher_sigkill() -> None:
    """SIGKILL to the launcher (no handler runs) still stops the ranks and removes the store: they
    used to be left running, and the store on disk"""
    with tempfile.TemporaryDirectory() as d:
        proc = start_sleeping_ranks(d, subprocess.DEVNULL)
        try:
            pids = wait_for_pids(d, 2)
            deadline = time.monotonic() + 10
            while not pathlib.Path(d, "store").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            store = pathlib.Path(d, "store").read_text().strip()
            expect(os.path.isdir(store), f"store dir {store} missing while the ranks run")
            proc.kill()
            proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        expect_gone(pids, seconds=5)
        deadline = time.monotonic() + 5
        while os.path.exists(store) and time.monotonic() < deadline:
            time.sleep(0.05)
        expect(not os.path.exists(store), f"store dir {store} left behind by a launcher killed with SIGKILL")


def test_sigcont_before_kill() -> None:
    """a stopped rank is continued after SIGTERM and handles it"""
    with tempfile.TemporaryDirectory() as d:
        # Rank 0 handles SIGTERM (writes a file, exits 0) and then stops itself; rank 1 fails once
        # rank 0 is stopped. A stopped rank keeps SIGTERM pending until continued: without
        # SIGCONT its handler never runs and only the SIGKILL after --grace (10 s) ends it.
        script = ('if [ "$TESSERA_RANK" = 1 ]; then '
                  'while [ ! -e "$D/0.pid" ]; do sleep 0.05; done; '
                  'while [ "$(cut -d" " -f3 "/proc/$(cat "$D/0.pid")/stat")" != T ]; do sleep 0.05; done; '
                  'exit 4; fi; '
                  "trap 'echo handled > \"$D/term\"; exit 0' TERM; " + WRITE_PID +
                  'kill -STOP $$; while :; do sleep 0.05; done')
        rc, _, err, took = launch("--grace", "10", "-n", "2", *sh(script), env={"D": d})
        expect(rc == 4, f"exit status {rc}, expected 4; stderr: {err!r}")
        expect(took < 8, f"took {took:.1f} s: the stopped rank waited for SIGKILL")
        expect("SIGKILL" not in err, f"stderr {err!r}")
        expect(pathlib.Path(d, "term").exists(), "the stopped rank's SIGTERM handler never ran")
        expect_gone(wait_for_pids(d, 1, timeout=0))


def build_fake_mpi_program(d: str) -> str | None:
    """A program whose ELF file needs libmpi.so.40: a stub library of that name is built here, so
    no MPI installation is needed. Returns its path, or None without a C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    pathlib.Path(d, "stub.c").write_text("int tessera_fake_mpi_init(void) { return 0; }\n")
    pathlib.Path(d, "main.c").write_text('#include <stdio.h>\nint tessera_fake_mpi_init(void);\n'
                                         'int main(void) { puts("ran"); return tessera_fake_mpi_init(); }\n')
    lib, prog = os.path.join(d, "libmpi.so.40"), os.path.join(d, "prog")
    for args in ([cc, "-shared", "-fPIC", "-Wl,-soname,libmpi.so.40", "-o", lib, os.path.join(d, "stub.c")],
                 [cc, "-o", prog, os.path.join(d, "main.c"), "-Wl,--no-as-needed", lib, f"-Wl,-rpath,{d}"]):
        done = subprocess.run(args, capture_output=True, timeout=120)
        expect(done.returncode == 0, f"{args}: {done.stderr!r}")
    return prog


def test_mpi_program_refused() -> None:
    """a program linking MPI is refused (mpirun -n N named); --allow-mpi starts it"""
    with tempfile.TemporaryDirectory() as d:
        prog = build_fake_mpi_program(d)
        if prog is None:
            pytest.skip("no C compiler: MPI program check skipped")
        rc, out, err, _ = launch("-n", "2", prog)
        expect(rc == 2, f"exit status {rc}, expected 2; stderr: {err!r}")
        expect(out == "", f"a rank ran: stdout {out!r}")
        for words in ("links the MPI library libmpi.so.40", f"`mpirun -n 2 {prog}`", "--allow-mpi"):
            expect(words in err, f"stderr {err!r} lacks {words!r}")
        # Found in the ELF dynamic section too (the path used where ldd is missing).
        needed = guards.elf_needed(prog)
        expect("libmpi.so.40" in needed, f"DT_NEEDED of {prog}: {needed}")
        expect(guards.elf_needed("/bin/sh") != [] and
               guards.linked_mpi_library("/bin/sh") is None, "/bin/sh taken for an MPI program")
        rc, out, err, _ = launch("--allow-mpi", "-n", "2", prog)
        expect(rc == 0 and sorted(out.splitlines()) == ["[rank 0] ran", "[rank 1] ran"], f"--allow-mpi: exit status {rc}, stdout {out!r}, stderr {err!r}")


def test_rank_bound() -> None:
    """more than 64 ranks per CPU is a usage error"""
    cpus = len(os.sched_getaffinity(0))
    limit = 64 * cpus
    rc, out, err, took = launch("-n", str(limit + 1), "true")
    expect(rc == 2, f"-n {limit + 1}: exit status {rc}, expected 2; stderr: {err!r}")
    words = f"-n {limit + 1}: at most {limit} ranks (64 per CPU, {cpus} CPU"
    expect(words in err, f"stderr {err!r} lacks {words!r}")
    expect(out == "" and took < 10, f"stdout {out!r}, took {took:.1f} s")


def test_bind_to_core() -> None:
    """--bind-to core: rank r on the r-th CPU; refused past the CPUs and with --hosts"""
    cpus = sorted(os.sched_getaffinity(0))
    n = min(len(cpus), 4)
    # Each rank reports the CPUs it may run on, read from /proc (no taskset needed).
    script = 'echo "$TESSERA_RANK $(grep Cpus_allowed_list /proc/self/status | cut -f2)"'
    rc, out, err, _ = launch("--bind-to", "core", "--no-prefix", "-n", str(n), "--", *sh(script))
    expect(rc == 0, f"exit status {rc}, stderr: {err!r}")
    got = sorted(line.split() for line in out.splitlines())
    expect(got == [[str(r), str(cpus[r])] for r in range(n)], f"--bind-to core: ranks ran on {got}, expected "
                                                               f"rank r on CPU {cpus[:n]}[r]")
    # Unbound (the default), a rank keeps the launcher's whole set.
    rc, out, err, _ = launch("--no-prefix", "-n", "1", "--", *sh(script))
    expect(rc == 0, f"exit status {rc}, stderr: {err!r}")
    expect(len(cpus) == 1 or any(sep in out.split()[1] for sep in "-,"), f"unbound rank pinned: {out!r}")
    # More ranks than CPUs, or --hosts: refused with the reason.
    rc, out, err, _ = launch("--bind-to", "core", "-n", str(len(cpus) + 1), "true")
    expect(rc == 2 and f"only {len(cpus)} CPU" in err, f"-n {len(cpus) + 1}: exit {rc}, stderr {err!r}")
    rc, out, err, _ = launch("--bind-to", "core", "--hosts", "a,b", "true")
    expect(rc == 2 and "this machine only" in err, f"--hosts: exit {rc}, stderr {err!r}")


# A stand-in for ssh that needs no remote machine: like ssh, it hands the rank a clean
# environment (env -i) and runs the one command line it is given with a shell; FAKE_HOST shows
# which host the launcher named.
FAKE_RSH = "env -i PATH=/usr/bin:/bin FAKE_HOST={host} sh -c"


def test_hosts() -> None:
    """--hosts places ranks by slot through --rsh, with TESSERA_* on the command line"""
    script = ('echo "host=$FAKE_HOST rank=$TESSERA_RANK size=$TESSERA_WORLD_SIZE '
              'local=$TESSERA_LOCAL_RANK/$TESSERA_LOCAL_WORLD_SIZE x=$TESSERA_X y=${NOT_TESSERA-unset} '
              'iface=$TESSERA_GLOO_IFACE pwd=$(pwd) arg=$0"')
    with tempfile.TemporaryDirectory() as d:
        done = subprocess.run([str(LAUNCHER), "--hosts", "a,b:2,c", "--rsh", FAKE_RSH, "--iface", "eth0",
                               "--no-prefix", "--", *sh(script), "it's a \"word\""], capture_output=True,
                              timeout=TIMEOUT, cwd=d, env=dict(os.environ, TESSERA_X="1 2", NOT_TESSERA="no"))
        out, err = (t.decode("utf-8", "replace") for t in (done.stdout, done.stderr))
        expect(done.returncode == 0, f"exit status {done.returncode}, stderr: {err!r}")
        places = (("a", 0, 0, 1), ("b", 1, 0, 2), ("b", 2, 1, 2), ("c", 3, 0, 1))
        want = [f"host={h} rank={r} size=4 local={l}/{n} x=1 2 y=unset iface=eth0 pwd={os.path.realpath(d)} "
                f"arg=it's a \"word\"" for h, r, l, n in places]
        expect(sorted(out.splitlines()) == want, f"stdout {out!r}, expected {want!r}")
    # -n below the slot count fills hosts in order; without {host} the host follows the command.
    rc, out, err, _ = launch("--hosts", "a:2,b", "-n", "2", "--rsh", "sh -c 'echo \"on $0\"; exec sh -c \"$1\"'",
                             "--", *sh('echo "rank $TESSERA_RANK"'))
    expect(rc == 0, f"exit status {rc}, stderr: {err!r}")
    expect(sorted(out.splitlines()) == ["[rank 0] on a", "[rank 0] rank 0", "[rank 1] on a", "[rank 1] rank 1"],
           f"stdout {out!r}")
    for args, words in ((["--hosts", "a,b", "-n", "3", "true"], "-n 3: --hosts has only 2 slots (a:1,b:1)"),
                        (["--hosts", "a;rm", "true"], "bad host 'a;rm'"),
                        (["--hosts", "a:0", "true"], "bad slot count '0' for host 'a'"),
                        (["--hosts", "a:x", "true"], "bad slot count 'x' for host 'a'"),
                        (["true"], "give -n N (the number of ranks) or --hosts")):
        rc, out, err, _ = launch(*args)
        expect(rc == 2 and words in err and out == "", f"{args}: exit status {rc}, stderr {err!r} lacks {words!r}")


def test_hosts_failure_stops_others() -> None:
    """--hosts: a failing rank stops the others through the remote-exec command"""
    with tempfile.TemporaryDirectory() as d:
        # Through the remote-exec command the rank's pid is still the program's (sh -c and env exec
        # it), so stopping the rank stops the program.
        script = ('D="$TESSERA_D"; if [ "$TESSERA_RANK" = 1 ]; then '
                  'while [ "$(ls "$D" | grep -c pid)" -lt 2 ]; do sleep 0.05; done; exit 3; fi; '
                  + WRITE_PID + 'exec sleep 60')
        rc, _, err, took = launch("--hosts", "a,b,c", "--rsh", FAKE_RSH, *sh(script), env={"TESSERA_D": d})
        # The clean environment keeps only TESSERA_* variables: the script reads D from TESSERA_D.
        expect(rc == 3, f"exit status {rc}, expected 3; stderr: {err!r}")
        expect(took < 10, f"took {took:.1f} s")
        expect("tessera-run: rank 1 failed with exit status 3; stopping ranks 0, 2" in err, f"stderr {err!r}")
        expect_gone(wait_for_pids(d, 2, timeout=0))
