#!/usr/bin/env python3
"""tools/tessera-sbatch on a Slurm of two nodes, each a network namespace with its own address
and host name (tests/slurm/two_node_slurm.py): jobs that span the nodes, and a node that dies.

    test_slurm_two_nodes.py --mpi-program conformance_mpi --gloo-program conformance_gloo \\
                            --fault-program fault_gloo --elastic-program 19_elastic_gloo

  across nodes   the MPI (srun --mpi=pmix) and Gloo (--iface eth0) conformance suites, 2 tasks
                 on each node: every rank passes, ranks 0-1 ran on node1 and 2-3 on node2 (each
                 rank's SLURMD_NODENAME, which the batch script records), and their traffic
                 crossed the bridge (node2's switch port carried it)
  node down      a Gloo job of barriers in a loop (TESSERA_COMM_TIMEOUT=5), 2 tasks per node;
                 node2 dies: its link goes down, then every process on it is killed (slurmd, its
                 slurmstepd, ranks 2 and 3), as a host that loses power: it says goodbye to no
                 one and writes nothing more to the shared file system. The job must end within
                 NODE_DOWN_BOUND s, and its summary must name node2 with ranks 2 and 3 (no exit
                 status, the node not answering Slurm) and give ranks 0 and 1's errors, which
                 name ranks 2 and 3.
  elastic        node2 comes back (a new slurmd); an elastic job of example 19 (--elastic
                 --replace 2, 2 tasks per node) loses node2 the same way: ranks 0 and 1 go on
                 as 2, the batch script starts a replacement job step for ranks 2 and 3 on node1
                 once Slurm marks node2 down, they join with the others' parameters, and the job
                 ends with 4 ranks and exit 0.

Exits 77 (skipped) where namespaces or Slurm cannot be used (not root, not installed). Every wait
is bounded; the daemons and namespaces are removed at the end, on failure and on SIGTERM.
"""
from __future__ import annotations

import argparse
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from types import FrameType

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tools"))
from elastic_logs import check_not_too_late, check_regrouped, watch_changes  # noqa: E402
from local_slurm import Unavailable  # noqa: E402
from test_sbatch import JOB_TIMEOUT, CheckFailed, expect  # noqa: E402
from two_node_slurm import TwoNodeSlurm  # noqa: E402

TOOL = HERE.parent.parent / "tools" / "tessera-sbatch"
COMM_TIMEOUT = 5
# After node2 dies: the survivors' timeout (5 s), then Slurm marks node2 DOWN (SlurmdTimeout, 6 s,
# found by a ping every 2 s that fails after MessageTimeout, 3 s) and ends the job: 12.6 to
# 15.6 s on a loaded 2-core machine. The bound leaves room for a slower one.
NODE_DOWN_BOUND = 60
EXPECTED_NODES = ["node1", "node1", "node2", "node2"]  # rank r's node: 2 tasks per node, in blocks


def submit(slurm: TwoNodeSlurm, log_dir: pathlib.Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(TOOL), "--wait", f"--log-dir={log_dir}", "--nodes=2",
                             "--ntasks-per-node=2", *args], env=slurm.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(job: subprocess.Popen[str], seconds: float) -> tuple[int, str, str]:
    """tessera-sbatch's exit status, output and job id, waited for at most `seconds`."""
    try:
        out = job.communicate(timeout=seconds)[0]
    except subprocess.TimeoutExpired:
        job.kill()
        out = job.communicate()[0]
        raise CheckFailed(f"tessera-sbatch --wait still waiting after {seconds:.0f} s:\n{out}")
    except BaseException:  # SIGTERM (SystemExit): tessera-sbatch would wait on for a Slurm that is gone
        job.kill()
        job.communicate()
        raise
    match = re.search(r"submitted job (\d+)", out)
    expect(match, f"no job submitted: {out}")
    assert match is not None
    return job.returncode, out, match.group(1)


def rank_nodes(logs: pathlib.Path) -> list[str]:
    return [(logs / f"rank-{r}.node").read_text().strip() if (logs / f"rank-{r}.node").exists() else "?"
            for r in range(len(EXPECTED_NODES))]


def failed_while_starting(out: str, logs: pathlib.Path) -> bool:
    """The job failed before any rank ran a check: a rank died inside Open MPI's start-up (MPI_Init's
    TCP wire-up) and the others were stopped before their first collective. Open MPI's part is seen
    in the summary or in a rank's full log (the summary keeps a few lines of each): one of its
    messages, or the crash report of the SIGSEGV handler MPI_Init installs ("*** Process received
    signal ***"; stop 89's CI had only that, its backtrace ending in the null address)."""
    texts = [p.read_text(errors="replace") for p in logs.glob("rank-*.log")]
    started = any(re.search(r"rank \d+: \d+ checks", text) for text in texts)
    open_mpi = any("Open MPI" in text or "*** Process received signal ***" in text for text in [out, *texts])
    return not started and "had not called a collective yet" in out and open_mpi


def check_across_nodes(slurm: TwoNodeSlurm, log_dir: pathlib.Path, backend: str, program: str) -> None:
    extra = ["--backend=mpi"] if backend == "mpi" else ["--backend=gloo", "--iface=eth0"]
    for attempt in (1, 2):
        before = slurm.net.port_bytes(slurm.port("node2"))
        start = time.monotonic()
        rc, out, job = finish(submit(slurm, log_dir, *extra, "--comm-timeout=60", "--", program, "--no-large"),
                              JOB_TIMEOUT)
        seconds = time.monotonic() - start
        crossed = slurm.net.port_bytes(slurm.port("node2")) - before
        logs = log_dir / f"job-{job}"
        # Twice in many CI runs (stops 80 and 89, a loaded 2-core machine), Open MPI 4.1's TCP
        # wire-up failed to connect between the namespaces and a rank crashed in that error path (a
        # call through a null pointer) before any rank ran a check. That is Open MPI's start-up, not the code under
        # test: one more job, with the first one's summary printed. A second failure fails the test.
        if rc != 0 and backend == "mpi" and attempt == 1 and failed_while_starting(out, logs):
            print(f"note: mpi job {job} failed inside Open MPI's start-up; submitting it once more. Its "
                  f"summary:\n{out}")
            continue
        break
    batch = (log_dir / f"job-{job}.out").read_text()
    expect(rc == 0, f"{backend} job across 2 nodes exited {rc}:\n{out}\n{batch}")
    nodes = rank_nodes(logs)
    expect(nodes == EXPECTED_NODES, f"{backend}: the ranks ran on {nodes}, not {EXPECTED_NODES}:\n{out}")
    for r, node in enumerate(EXPECTED_NODES):
        expect(f"rank {r} ({node}): exit 0" in out, f"{backend}: the summary lacks rank {r} on {node}:\n{out}")
        text = (logs / f"rank-{r}.log").read_text()
        expect(re.search(rf"rank {r}: \d+ checks, 0 failed", text), f"{backend}: rank {r}'s log has no passed "
                                                                     f"checks:\n{text}")
    # The suite's collectives over 4 ranks, 2 of them on node2: megabytes, where the only other
    # traffic through the port (srun's and slurmd's messages, the rendezvous) is kilobytes.
    expect(crossed > 1 << 20, f"{backend}: only {crossed} bytes crossed node2's link: the ranks did not talk "
                              f"across the bridge")
    print(f"ok: {backend} conformance on node1 and node2 (ranks {', '.join(nodes)}) in {seconds:.1f} s; "
          f"{crossed / 2**20:.1f} MiB through node2's switch port")


def check_node_down(slurm: TwoNodeSlurm, log_dir: pathlib.Path, fault_program: str) -> None:
    # --no-requeue: Slurm would otherwise put the job back in the queue, where it waits for a
    # second node that this cluster no longer has.
    earlier = set(log_dir.glob("job-*/"))
    job = submit(slurm, log_dir, "--backend=gloo", "--iface=eth0", f"--comm-timeout={COMM_TIMEOUT}", "--no-requeue",
                 "--", fault_program, "barrier")
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        # Mid-job: every rank has made its first barrier (it prints "rank R ready pid P").
        def ready(logs: pathlib.Path) -> bool:
            return all((logs / f"rank-{r}.log").exists() and f"rank {r} ready" in (logs / f"rank-{r}.log").read_text()
                       for r in range(len(EXPECTED_NODES)))
        while not (logs := next(iter(set(log_dir.glob("job-*/")) - earlier), None)) or not ready(logs):
            if job.poll() is not None:
                raise CheckFailed(f"the node-down job ended before node2 was taken down:\n{job.communicate()[0]}")
            expect(time.monotonic() < deadline, f"the node-down job's ranks were not ready after {JOB_TIMEOUT} s")
            time.sleep(0.2)
        time.sleep(1)
        down_at, down_wall = time.monotonic(), time.time()
        slurm.take_down("node2")
        rc, out, job_id = finish(job, NODE_DOWN_BOUND)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    took = time.monotonic() - down_at
    batch = (log_dir / f"job-{job_id}.out").read_text()
    expect(rc != 0, f"the job exited 0 although node2 died:\n{out}")
    for r in (2, 3):
        expect(re.search(rf"rank {r} \(node2\): exit none: node2 stopped answering Slurm \(State=\S*"
                         rf"(DOWN|NOT_RESPONDING)", out),
               f"the summary does not say rank {r} was lost with node2:\n{out}\n{batch}")
    expect("ranks lost with their node: 2 3" in out, f"the summary does not list the lost ranks:\n{out}")
    for r in (0, 1):
        expect(f"rank {r} (node1): exit 3" in out, f"rank {r} on node1 did not end with its CommError (3):\n{out}")
        error = next((line for line in (logs / f"rank-{r}.log").read_text().splitlines() if "CommError" in line), "")
        expect(re.search(r"rank [23]\b", error) and error in out,
               f"rank {r}'s error in the summary does not name rank 2 or 3:\n{error}\n{out}")
    survivors = max((logs / f"rank-{r}.exit").stat().st_mtime for r in (0, 1)) - down_wall
    expect(survivors <= 3 * COMM_TIMEOUT, f"ranks 0 and 1 ended {survivors:.1f} s after node2 died "
                                          f"(TESSERA_COMM_TIMEOUT={COMM_TIMEOUT})")
    print(f"ok: node2 taken down mid-job: ranks 0 and 1 ended with their CommError {survivors:.1f} s after, the job "
          f"{took:.1f} s after (bound {NODE_DOWN_BOUND} s; tessera-sbatch exit {rc}); the summary names node2 and "
          f"ranks 2 and 3")
    print("     " + next(line for line in out.splitlines() if line.startswith("rank 2 (node2)")))


# Example 19's training in the elastic job: long enough to still be training when Slurm marks node2
# down (12 to 16 s after the fault, NODE_DOWN_BOUND's comment) and the replacements have joined.
ELASTIC_ARGS = ("--epochs=4", "--limit=24000", "--check-every=1")


def check_elastic_node_down(slurm: TwoNodeSlurm, log_dir: pathlib.Path, program: str,
                            delay: float = 0.0) -> dict[str, object]:
    """--elastic --replace 2 (issue 51): node2 dies mid-training with ranks 2 and 3; ranks 0 and 1
    go on as a group of 2, and once Slurm marks node2 down the batch script starts a replacement
    job step for each lost rank on node1, the node left, which join: the job ends with 4 ranks."""
    earlier = set(log_dir.glob("job-*/"))
    job = submit(slurm, log_dir, "--backend=gloo", "--iface=eth0", f"--comm-timeout={COMM_TIMEOUT}", "--no-requeue",
                 "--elastic", "--replace=2", "--", program, *ELASTIC_ARGS)
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        while not ((logs := next(iter(set(log_dir.glob("job-*/")) - earlier), None))
                   and (logs / "rank-0.log").exists() and re.search(r"epoch 1/\d+ \d+/", (logs / "rank-0.log").read_text())):
            if job.poll() is not None:
                raise CheckFailed(f"the elastic job ended before node2 was taken down:\n{job.communicate()[0]}")
            expect(time.monotonic() < deadline, f"the elastic job did not begin training in {JOB_TIMEOUT} s")
            time.sleep(0.1)
        time.sleep(delay)
        down_at = time.monotonic()
        slurm.take_down("node2")
        times = watch_changes(job, logs, down_at, JOB_TIMEOUT, 4)
        rc, out, job_id = finish(job, JOB_TIMEOUT)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    batch = (log_dir / f"job-{job_id}.out").read_text()
    check_not_too_late(logs, [2, 3])
    expect(rc == 0, f"the elastic job exited {rc} after node2 died:\n{out}\n{batch}")
    for r in (2, 3):
        expect(re.search(rf"rank {r} \(node2\): lost with node2 \(Slurm marks it down\); replacement [12] of 2 "
                         rf"started on node1", out), f"the summary does not show rank {r} lost and replaced:\n{out}")
    for r in range(4):
        expect(f"rank {r} (node1): exit 0" in out, f"rank {r}'s slot did not end on node1 with exit 0:\n{out}")
    record = check_regrouped(logs, 4, [2, 3])
    record.update(times, job=job_id, job_end_s=round(time.monotonic() - down_at, 2))
    print(f"ok: elastic job {job_id}: node2 taken down; ranks 0 and 1 went on {times.get('recovery_s')} s after; "
          f"{record['line']}; 4 ranks again {times.get('rejoined_s')} s after, the job ended {record['job_end_s']} s "
          f"after, exit 0")
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mpi-program", required=True, help="the MPI conformance suite (tests/conformance_mpi)")
    parser.add_argument("--gloo-program", required=True, help="the Gloo conformance suite (tests/conformance_gloo)")
    parser.add_argument("--fault-program", required=True, help="the Gloo fault program (tests/fault_gloo)")
    parser.add_argument("--elastic-program", required=True, help="examples/19_elastic_gloo, for the elastic job")
    args = parser.parse_args()
    programs = {name: str(pathlib.Path(path).resolve()) for name, path in
                (("mpi", args.mpi_program), ("gloo", args.gloo_program), ("fault", args.fault_program),
                 ("elastic", args.elastic_program))}

    def stop(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally blocks that remove Slurm and the network
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, stop)

    work = pathlib.Path(tempfile.mkdtemp(prefix="tessera-slurm2-test-"))
    started = time.monotonic()
    try:
        slurm = TwoNodeSlurm(work / "slurm")
        try:
            slurm.__enter__()
        except Unavailable as e:
            print(f"skipped: cannot start a two-node Slurm in network namespaces: {e}")
            shutil.rmtree(work, ignore_errors=True)
            return 77
        try:
            log_dir = work / "jobs"
            check_across_nodes(slurm, log_dir, "mpi", programs["mpi"])
            check_across_nodes(slurm, log_dir, "gloo", programs["gloo"])
            check_node_down(slurm, log_dir, programs["fault"])
            slurm.bring_back("node2")
            check_elastic_node_down(slurm, log_dir, programs["elastic"])
        finally:
            slurm.stop()
    except CheckFailed as e:
        print(f"FAILED: {e}")
        print(f"(files kept in {work})")
        return 1
    except subprocess.TimeoutExpired as e:
        print(f"FAILED: timed out: {e}")
        print(f"(files kept in {work})")
        return 1
    except SystemExit:
        print(f"stopped by a signal; Slurm and the namespaces removed, files kept in {work}")
        raise
    shutil.rmtree(work, ignore_errors=True)
    print(f"all two-node Slurm checks passed ({time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
