#!/usr/bin/env python3
"""tools/tessera-sbatch against a real Slurm started for the test (tests/slurm/local_slurm.py).

    test_slurm.py --mpi-program conformance_mpi --gloo-program conformance_gloo \\
                  --example 04_data_parallel_gloo

First the generated scripts without Slurm (flags, per-backend launch lines, bad input), then jobs
of 2 and 4 tasks over MPI (srun --mpi=pmix) and Gloo (file and Redis stores), a job whose rank 1
fails (its error in the summary, the others stopped), a job requeued mid-training that
resumes from its checkpoint, a job sent SIGUSR1 (what --signal=USR1@T sends before the time
limit) that checkpoints at a step, requeues itself and resumes at that step, and an elastic job
(--elastic --replace 1) whose rank 2 is killed: the others go on and a replacement job step joins. Exits 77 (skipped) when Slurm cannot be started here; every wait is
bounded.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tools"))  # the script checks, shared with the quick pytest tier
from elastic_logs import check_not_too_late, check_regrouped, slot_pid, watch_changes  # noqa: E402
from local_slurm import LocalSlurm, Unavailable  # noqa: E402
from test_sbatch import JOB_TIMEOUT, TOOL, CheckFailed, check_scripts, expect, tool  # noqa: E402

# --- with Slurm: jobs -------------------------------------------------------------------------

def submit_and_wait(slurm: LocalSlurm, log_dir: pathlib.Path, *args: str) -> tuple[int, str, str, str, float]:
    start = time.monotonic()
    rc, out, err = tool("--wait", f"--log-dir={log_dir}", *args, env=slurm.env())
    match = re.search(r"submitted job (\d+)", out)
    expect(match, f"no job submitted: {out}{err}")
    assert match is not None
    return rc, out, err, match.group(1), time.monotonic() - start


def check_job(slurm: LocalSlurm, log_dir: pathlib.Path, backend: str, program: str, tasks: int,
              extra: tuple[str, ...] = ()) -> None:
    rc, out, err, job, seconds = submit_and_wait(slurm, log_dir, f"--ntasks-per-node={tasks}", "--comm-timeout=60",
                                                 *extra, "--", program, "--no-large")
    logs = pathlib.Path(log_dir) / f"job-{job}"
    expect(rc == 0, f"{backend} job of {tasks} tasks exited {rc}:\n{out}{err}\n"
                    f"{(pathlib.Path(log_dir) / f'job-{job}.out').read_text() if rc else ''}")
    for r in range(tasks):
        expect(re.search(rf"rank {r} \({slurm.node}\): exit 0", out), f"summary lacks rank {r} on {slurm.node}: {out}")
        text = (logs / f"rank-{r}.log").read_text()
        expect(re.search(rf"rank {r}: \d+ checks, 0 failed", text), f"rank {r}'s log has no passed checks:\n{text}")
    batch = (pathlib.Path(log_dir) / f"job-{job}.out").read_text()
    launch = next(line for line in batch.splitlines() if line.startswith("launch: "))
    print(f"ok: {backend} {' '.join(extra)} {tasks} tasks in {seconds:.1f} s; {launch}")


def check_failure(slurm: LocalSlurm, log_dir: pathlib.Path, work: pathlib.Path) -> None:
    failing = work / "fail_on_rank_1.sh"
    failing.write_text("#!/bin/sh\n"
                       'if [ "$SLURM_PROCID" = 1 ]; then sleep 1; echo "error: rank 1 cannot read its shard" >&2; exit 3; fi\n'
                       'echo "rank $SLURM_PROCID: OMP_NUM_THREADS=$OMP_NUM_THREADS"\n'
                       "sleep 60\n")
    failing.chmod(0o755)
    rc, out, err, job, seconds = submit_and_wait(slurm, log_dir, "--backend=gloo", "--ntasks-per-node=2",
                                                 "--cpus-per-task=2", "--", str(failing))
    expect(rc != 0, f"a job whose rank 1 failed exited 0:\n{out}")
    expect(f"rank 1 ({slurm.node}): exit 3" in out and "error: rank 1 cannot read its shard" in out,
           f"the summary does not show rank 1's failure and error:\n{out}")
    # Rank 0 either never recorded an exit (none) or recorded 143 (SIGTERM) as srun stopped it.
    expect(re.search(rf"rank 0 \({slurm.node}\): exit (none|143 \(signal 15:) \(?stopped by Slurm", out) is not None,
           f"the summary does not say rank 0 was stopped:\n{out}")
    expect(seconds < 45, f"the other ranks were not stopped: the job took {seconds:.0f} s (they sleep 60 s)")
    rank0 = (pathlib.Path(log_dir) / f"job-{job}" / "rank-0.log").read_text()
    expect("rank 0: OMP_NUM_THREADS=2" in rank0, f"--cpus-per-task=2 did not give OMP_NUM_THREADS=2:\n{rank0}")
    print(f"ok: rank 1 failed: job exit {rc} after {seconds:.1f} s, its error in the summary")


def job_state(slurm: LocalSlurm, job: str) -> tuple[str, str, str]:
    done = subprocess.run(["scontrol", "show", "job", job], env=slurm.env(), capture_output=True, text=True,
                          timeout=10)
    fields = dict(re.findall(r"(\w+)=(\S*)", done.stdout))
    return fields.get("JobState", "?"), fields.get("ExitCode", "?"), fields.get("Restarts", "?")


def wait_until_ended(slurm: LocalSlurm, job: str, deadline: float) -> tuple[str, str, str]:
    """The job's final (state, exit code, restarts), polled until it ends or the deadline passes."""
    while True:
        state, exit_code, restarts = job_state(slurm, job)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            return state, exit_code, restarts
        expect(time.monotonic() < deadline, f"job {job} still {state} {JOB_TIMEOUT} s after it started")
        time.sleep(0.5)


def check_requeue(slurm: LocalSlurm, log_dir: pathlib.Path, example: str, work: pathlib.Path) -> None:
    checkpoint = work / "requeue.safetensors"
    rc, out, err = tool(f"--log-dir={log_dir}", "--ntasks-per-node=2", f"--checkpoint={checkpoint}",
                        "--comm-timeout=60", "--", example, "--epochs=4", "--limit=2048", env=slurm.env(), timeout=30)
    match = re.search(r"submitted job (\d+)", out)
    expect(rc == 0 and match, f"requeue job not submitted: {out}{err}")
    assert match is not None
    job = match.group(1)
    deadline = time.monotonic() + JOB_TIMEOUT
    while not checkpoint.exists():
        state = job_state(slurm, job)[0]
        expect(state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {job} is {state} before its first checkpoint")
        expect(time.monotonic() < deadline, f"no checkpoint from job {job} after {JOB_TIMEOUT} s")
        time.sleep(0.2)
    requeue = subprocess.run(["scontrol", "requeue", job], env=slurm.env(), capture_output=True, text=True, timeout=10)
    expect(requeue.returncode == 0, f"scontrol requeue {job}: {requeue.stderr}")
    state, exit_code, restarts = wait_until_ended(slurm, job, deadline)
    batch = (pathlib.Path(log_dir) / f"job-{job}.out").read_text()
    expect(state == "COMPLETED" and exit_code == "0:0", f"requeued job ended {state} {exit_code}:\n{batch}")
    expect(restarts == "1" and "=== start 2 of job" in batch, f"the job did not start twice (Restarts={restarts}):\n{batch}")
    rank0 = (pathlib.Path(log_dir) / f"job-{job}" / "rank-0.log").read_text()
    second = rank0.split("=== start 2 ===", 1)
    expect(len(second) == 2, f"rank 0's log has no second start:\n{rank0}")
    resumed = re.search(r"resumed from \S+ at epoch (\d+)", second[1])
    expect(resumed and int(resumed.group(1)) >= 1, f"the second start did not resume from a checkpoint:\n{second[1]}")
    accuracy = re.search(r"final test accuracy: ([\d.]+)%", second[1])
    expect(accuracy and float(accuracy.group(1)) > 50, f"the resumed run did not finish training:\n{second[1]}")
    assert resumed is not None and accuracy is not None
    print(f"ok: requeued job {job} resumed at epoch {resumed.group(1)} and reached {accuracy.group(1)}% "
          f"(Restarts={restarts})")


def check_signal_requeue(slurm: LocalSlurm, log_dir: pathlib.Path, example: str, work: pathlib.Path) -> None:
    """USR1 as Slurm sends it before the time limit (scancel --signal: every task of the job's
    steps): the ranks agree on a step, save the checkpoint there, exit 75, and the script requeues
    the job, whose second start resumes at that step (mid-epoch) and finishes."""
    checkpoint = work / "signal.safetensors"
    rc, out, err = tool(f"--log-dir={log_dir}", "--ntasks-per-node=2", f"--checkpoint={checkpoint}",
                        "--signal-before=90", "--time=10", "--comm-timeout=60", "--", example, "--epochs=3",
                        "--limit=8192", "--batch=32", env=slurm.env(), timeout=30)
    match = re.search(r"submitted job (\d+)", out)
    expect(rc == 0 and match, f"signal job not submitted: {out}{err}")
    assert match is not None
    job = match.group(1)
    rank0_log = pathlib.Path(log_dir) / f"job-{job}" / "rank-0.log"
    deadline = time.monotonic() + JOB_TIMEOUT
    # Training has begun when rank 0 prints its first progress line of epoch 1.
    while not (rank0_log.exists() and re.search(r"epoch 1/3 \d+/", rank0_log.read_text())):
        state = job_state(slurm, job)[0]
        expect(state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {job} is {state} before training began")
        expect(time.monotonic() < deadline, f"job {job} did not begin training in {JOB_TIMEOUT} s")
        time.sleep(0.1)
    signalled = subprocess.run(["scancel", "--signal=USR1", job], env=slurm.env(), capture_output=True, text=True,
                               timeout=10)
    expect(signalled.returncode == 0, f"scancel --signal=USR1 {job}: {signalled.stderr}")
    state, exit_code, restarts = wait_until_ended(slurm, job, deadline)
    batch = (pathlib.Path(log_dir) / f"job-{job}.out").read_text()
    expect(state == "COMPLETED" and exit_code == "0:0", f"signalled job ended {state} {exit_code}:\n{batch}")
    expect("requeueing job" in batch and restarts == "1" and "=== start 2 of job" in batch,
           f"the job did not requeue itself once (Restarts={restarts}):\n{batch}")
    first, second = rank0_log.read_text().split("=== start 2 ===", 1)
    stopped = re.search(r"stopped by SIGUSR1 after step (\d+) \(epoch (\d+), batch (\d+) of (\d+)\)", first)
    expect(stopped, f"the first start did not stop on SIGUSR1 at a step:\n{first[-2000:]}")
    assert stopped is not None
    step = int(stopped.group(1))
    resumed = re.search(r"resumed from \S+ at epoch (\d+), step (\d+)", second)
    expect(resumed and int(resumed.group(2)) == step,
           f"the second start did not resume at step {step}:\n{second[:2000]}")
    accuracy = re.search(r"final test accuracy: ([\d.]+)%", second)
    expect(accuracy and float(accuracy.group(1)) > 50, f"the resumed run did not finish training:\n{second[-2000:]}")
    assert resumed is not None and accuracy is not None
    print(f"ok: SIGUSR1 stopped job {job} at step {step} (epoch {stopped.group(2)}, batch {stopped.group(3)} of "
          f"{stopped.group(4)}); requeued, it resumed there and reached {accuracy.group(1)}%")


# Example 19's training in the elastic job: 3 epochs of 4,096 images (the replacement has about 4 s
# to join), replicas compared every step.
ELASTIC_ARGS = ("--epochs=3", "--limit=4096", "--check-every=1")


def check_elastic_kill(slurm: LocalSlurm, log_dir: pathlib.Path, program: str, victim_slot: int = 2,
                       delay: float = 0.0) -> dict[str, object]:
    """--elastic --replace 1 (issue 51, "joining"): rank VICTIM_SLOT of 4 is killed (SIGKILL)
    DELAY s into training; the others go on as 3, the batch script starts a replacement job step,
    which joins as that rank with the others' parameters, and the job succeeds with 4 ranks.
    Returns what was measured (bench/slurm_elastic_campaign.py repeats it)."""
    job = subprocess.Popen([sys.executable, str(TOOL), "--wait", f"--log-dir={log_dir}", "--ntasks-per-node=4",
                            "--elastic", "--replace=1", "--comm-timeout=2", "--", program, *ELASTIC_ARGS],
                           env=slurm.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        assert job.stdout is not None
        first = job.stdout.readline()  # "submitted job N: ..." comes before the wait
        match = re.search(r"submitted job (\d+)", first)
        expect(match, f"no job submitted: {first}")
        assert match is not None
        job_id = match.group(1)
        rank0 = log_dir / f"job-{job_id}" / "rank-0.log"
        while not (rank0.exists() and re.search(r"epoch 1/\d+ \d+/", rank0.read_text())):
            expect(job.poll() is None and time.monotonic() < deadline, "the elastic job did not begin training")
            time.sleep(0.05)
        time.sleep(delay)
        others = [r for r in range(4) if r != victim_slot]
        victim = slot_pid(program, job_id, victim_slot)
        survivors = [slot_pid(program, job_id, r) for r in others]
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        times = watch_changes(job, rank0.parent, killed, JOB_TIMEOUT, 4)
        out = first + job.communicate(timeout=JOB_TIMEOUT)[0]
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    logs = log_dir / f"job-{job_id}"
    batch = (log_dir / f"job-{job_id}.out").read_text()
    v = victim_slot
    check_not_too_late(logs, [v])
    expect(job.returncode == 0, f"the elastic job exited {job.returncode} after rank {v} was killed:\n{out}\n{batch}")
    expect(re.search(rf"rank {v} \({slurm.node}\): exit 137 \(signal 9\); replacement 1 of 1 started on {slurm.node}",
                     out), f"the summary does not show rank {v}'s death and replacement:\n{out}")
    for r in range(4):
        expect(f"rank {r} ({slurm.node}): exit 0" in out, f"rank {r}'s slot did not end with exit 0:\n{out}")
    record = check_regrouped(logs, 4, [v])
    # The survivors were not restarted: each slot but the victim's kept its first process (member r.0).
    text = (logs / "rank-0.log").read_text()
    expect(all(re.search(rf"member {r}\.0: rank \d+ of 4", (logs / f"rank-{r}.log").read_text()) for r in others),
           f"a survivor was restarted (its member id is not r.0 at the end):\n{text[-2000:]}")
    record.update(times, job=job_id, job_end_s=round(time.monotonic() - killed, 2))
    print(f"ok: elastic job {job_id}: rank {v} killed, pids {survivors} went on {times.get('recovery_s')} s after; "
          f"{record['line']}; 4 ranks again {times.get('rejoined_s')} s after the kill, the job ended "
          f"{record['job_end_s']} s after, exit 0")
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mpi-program", required=True, help="the MPI conformance suite (tests/conformance_mpi)")
    parser.add_argument("--gloo-program", required=True, help="the Gloo conformance suite (tests/conformance_gloo)")
    parser.add_argument("--example", required=True, help="examples/04_data_parallel_gloo, for the requeue test")
    parser.add_argument("--elastic-example", required=True, help="examples/19_elastic_gloo, for the elastic job")
    args = parser.parse_args()
    programs = {"mpi": str(pathlib.Path(args.mpi_program).resolve()),
                "gloo": str(pathlib.Path(args.gloo_program).resolve())}
    work = pathlib.Path(tempfile.mkdtemp(prefix="tessera-slurm-test-"))
    try:
        check_scripts(programs, work)
        try:
            slurm = LocalSlurm(work / "slurm").__enter__()
        except Unavailable as e:
            print(f"skipped: cannot start a local Slurm: {e}")
            return 77
        try:
            log_dir = work / "jobs"
            for tasks in (2, 4):
                check_job(slurm, log_dir, "mpi", programs["mpi"], tasks)
                check_job(slurm, log_dir, "gloo", programs["gloo"], tasks)
            if shutil.which("redis-server") and shutil.which("redis-cli"):
                check_job(slurm, log_dir, "gloo", programs["gloo"], 2, extra=("--store=redis",))
            else:
                print("note: redis-server/redis-cli not installed; the Redis store job is not run")
            check_failure(slurm, log_dir, work)
            check_requeue(slurm, log_dir, str(pathlib.Path(args.example).resolve()), work)
            check_signal_requeue(slurm, log_dir, str(pathlib.Path(args.example).resolve()), work)
            check_elastic_kill(slurm, log_dir, str(pathlib.Path(args.elastic_example).resolve()))
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
    shutil.rmtree(work, ignore_errors=True)
    print("all Slurm checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
