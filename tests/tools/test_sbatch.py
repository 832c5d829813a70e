"""tools/tessera-sbatch without Slurm: the generated sbatch scripts (flags, per-backend launch
lines) and the refusal of bad input. tests/slurm/test_slurm.py runs the same checks on the real
programs before its jobs on a local Slurm.

    python3 -m pytest -q tests/tools/test_sbatch.py
"""
from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

from conftest import ROOT

TOOL = ROOT / "tools" / "tessera-sbatch"
JOB_TIMEOUT = 180  # seconds any one job may take, queueing included


class CheckFailed(AssertionError):
    pass


def expect(condition: object, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def tool(*args: str, env: dict[str, str] | None = None, timeout: float = JOB_TIMEOUT) -> tuple[int, str, str]:
    done = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)
    return done.returncode, done.stdout, done.stderr


def check_scripts(programs: dict[str, str], work: pathlib.Path) -> None:
    """The scripts for each backend and option, and the refusals of bad input; `programs`: the
    mpi and gloo programs (they need not exist: dry runs only)."""
    mpi, gloo = programs["mpi"], programs["gloo"]
    rc, script, err = tool("--dry-run", "--nodes=2", "--ntasks-per-node=4", "--cpus-per-task=3", "--time=10",
                           "--", mpi, "--no-large")
    expect(rc == 0, f"dry run for mpi failed: {err}")
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --cpus-per-task=3",
                 "#SBATCH --time=10", "#SBATCH --requeue", "export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}"):
        expect(line in script, f"mpi script lacks '{line}':\n{script}")
    expect("srun --mpi=pmix --kill-on-bad-exit=1" in script, f"mpi script does not launch with srun --mpi=pmix:\n{script}")
    expect("TESSERA_STORE" not in script, "an mpi job needs no rendezvous store")
    expect(f"PROGRAM=({mpi} --no-large)" in script, f"mpi script does not run the program by absolute path:\n{script}")
    syntax = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    expect(syntax.returncode == 0, f"the generated script is not valid bash: {syntax.stderr}")

    rc, script, err = tool("--dry-run", "--mpi=pmi2", "--backend=mpi", "--", mpi)
    expect(rc == 0 and "srun --mpi=pmi2" in script, "--mpi=pmi2 is not passed to srun")

    rc, script, err = tool("--dry-run", "--ntasks-per-node=2", "--", gloo)
    expect(rc == 0, f"dry run for gloo failed: {err}")
    expect('export TESSERA_STORE="file://$LOG_DIR/store-$START"' in script, f"gloo script has no file store:\n{script}")
    expect("--mpi=" not in script, "a gloo job must not ask srun for an MPI plugin")
    rc, script, err = tool("--dry-run", "--store=redis", "--iface=eth0", "--comm-timeout=60", "--", gloo)
    expect(rc == 0 and "redis-server \"$LOG_DIR/redis-$START.conf\" --port" in script
           and 'TESSERA_STORE="redis://$(hostname):$REDIS_PORT"' in script,
           f"--store=redis does not start a server on the host of task 0:\n{script}")
    # The server wants a fresh password, kept off command lines: in a 0600 file and the ranks' environment.
    expect("export TESSERA_REDIS_PASSWORD=" in script and 'printf "requirepass %s' in script and "umask 077" in script
           and "--requirepass" not in script, f"the Redis store has no password, or shows it on a command line:\n{script}")
    expect("export TESSERA_GLOO_IFACE=eth0" in script and "export TESSERA_COMM_TIMEOUT=60" in script,
           "--iface/--comm-timeout not exported")
    rc, script, err = tool("--dry-run", "--store=redis://10.1.2.3:6379", "--", gloo)
    expect(rc == 0 and "export TESSERA_STORE=redis://10.1.2.3:6379" in script, "a store URL is not used as given")

    # NCCL: every task of a node sees the node's GPUs (GPU-to-GPU paths), unless asked to isolate them.
    rc, script, err = tool("--dry-run", "--backend=nccl", "--ntasks-per-node=4", "--iface=ib0", "--", gloo)
    expect(rc == 0 and "#SBATCH --gpus-per-node=4" in script and "--gpus-per-task" not in script,
           f"nccl does not give each node's tasks its GPUs:\n{script}")
    expect("export NCCL_SOCKET_IFNAME=ib0" in script and "TESSERA_GLOO_IFACE" not in script,
           f"--iface does not reach NCCL:\n{script}")
    rc, script, err = tool("--dry-run", "--backend=nccl", "--isolate-gpus", "--gpus-per-task=2", "--", gloo)
    expect(rc == 0 and "#SBATCH --gpus-per-task=2" in script, f"--isolate-gpus does not bind per task:\n{script}")
    ckpt = work / "ck.safetensors"
    rc, script, err = tool("--dry-run", f"--checkpoint={ckpt}", "--", gloo)
    expect(rc == 0 and f"CHECKPOINT={ckpt}" in script and 'RESUME=(--resume="$CHECKPOINT")' in script,
           f"--checkpoint does not resume:\n{script}")
    # The time limit: USR1 120 s before it by default, the wrapper survives it, and ranks that all
    # stopped with their checkpoint (exit 75) put the job back in the queue.
    expect("#SBATCH --signal=USR1@120" in script and "trap : USR1 TERM" in script
           and 'scontrol requeue "$SLURM_JOB_ID"' in script, f"--checkpoint has no signal and requeue:\n{script}")
    rc, script, err = tool("--dry-run", f"--checkpoint={ckpt}", "--signal-before=300", "--time=10", "--", gloo)
    expect(rc == 0 and "#SBATCH --signal=USR1@300" in script, f"--signal-before=300 not kept:\n{script}")
    rc, script, err = tool("--dry-run", f"--checkpoint={ckpt}", "--signal-before=0", "--", gloo)
    expect(rc == 0 and "--signal=" not in script, f"--signal-before=0 still asks for a signal:\n{script}")
    rc, script, err = tool("--dry-run", "--no-requeue", f"--checkpoint={ckpt}", "--", gloo)
    expect(rc == 0 and "#SBATCH --no-requeue" in script and "scontrol requeue" not in script,
           "--no-requeue is not kept")
    # --elastic: neither a failed task nor a dead node ends the step; --replace starts new steps.
    rc, script, err = tool("--dry-run", "--elastic", "--replace=2", "--ntasks-per-node=4", "--", gloo)
    expect(rc == 0 and "srun --kill-on-bad-exit=0 --wait=0 --no-kill" in script and "#SBATCH --no-kill" in script
           and "srun --overlap --nodes=1 --ntasks=1" in script and "REPLACEMENTS_LEFT=2" in script
           and "TESSERA_ELASTIC_JOIN=1" in script, f"--elastic --replace 2 does not watch and replace:\n{script}")
    syntax = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    expect(syntax.returncode == 0, f"the elastic script is not valid bash: {syntax.stderr}")
    expect("unset TESSERA_RANK TESSERA_WORLD_SIZE" in script, "a TESSERA_RANK from the submitting shell reaches the ranks")
    print("ok: scripts (mpi with pmix and pmi2, gloo with file, redis and URL stores, nccl, checkpoint, signal, elastic)")

    # Several nodes: one task per node checks the rendezvous directory and (gloo without --iface)
    # that the host name is reachable, before any rank starts. The check itself, run here.
    rc, script, err = tool("--dry-run", "--nodes=2", "--", gloo)
    expect(rc == 0 and "PREFLIGHT=" in script and "--ntasks-per-node=1" in script, f"no multi-node checks:\n{script}")
    rc, one_node, err = tool("--dry-run", "--", gloo)
    expect("PREFLIGHT=" not in one_node, "a one-node job runs the multi-node checks")
    preflight = next(line for line in script.splitlines() if line.startswith("PREFLIGHT="))
    check = subprocess.run(["bash", "-c", preflight + '; bash -c "$PREFLIGHT"'], capture_output=True, text=True,
                           env={"PATH": "/usr/bin:/bin", "TESSERA_STORE": "file:///nonexistent/tessera-store"})
    expect(check.returncode == 1 and "cannot see the rendezvous directory /nonexistent/tessera-store" in check.stdout,
           f"a store directory a node cannot see passes the check: {check.stdout}{check.stderr}")
    resolved = subprocess.run(["getent", "ahosts", socket.gethostname()], capture_output=True, text=True).stdout.split()
    check = subprocess.run(["bash", "-c", preflight + '; bash -c "$PREFLIGHT"'], capture_output=True, text=True,
                           env={"PATH": "/usr/bin:/bin", "TESSERA_STORE": f"file://{work}"})
    loopback = not resolved or resolved[0].startswith("127.") or resolved[0] == "::1"
    expect((check.returncode == 1 and "give tessera-sbatch --iface" in check.stdout) if loopback
           else check.returncode == 0, f"host name resolving to {resolved[:1]}: {check.stdout}{check.stderr}")
    rc, script, err = tool("--dry-run", "--nodes=2", "--iface=eth0", "--", gloo)
    expect("getent" not in script, "with --iface the host name is checked anyway")
    print("ok: multi-node checks (store directory seen by every node, host name not loopback)")

    bad = [
        (["--", "/bin/true"], "cannot tell the backend"),
        (["--backend=threads", "--ntasks-per-node=2", "--", gloo], "one task per node"),
        (["--backend=threads", "--nodes=2", "--", gloo], "independent trainings writing one checkpoint"),
        (["--signal-before=60", "--", gloo], "needs --checkpoint"),
        (["--checkpoint=/tmp/c", "--signal-before=600", "--time=10", "--", gloo], "is not before the time limit"),
        (["--isolate-gpus", "--", gloo], "--isolate-gpus is for the nccl backend"),
        (["--backend=mpi", "--gpus-per-task=1", "--", mpi], "for the nccl backend"),
        (["--time=soon", "--", mpi], "not a Slurm time limit"),
        (["--nodes=0", "--", mpi], "must be at least 1"),
        (["--store=tcp://x", "--", gloo], "--store=tcp://x"),
        (["--env=1X=2", "--", gloo], "is not NAME=VALUE"),
        (["--elastic", "--backend=mpi", "--", mpi], "Open MPI without ULFM"),
        (["--replace=1", "--", gloo], "needs --elastic"),
        (["--elastic", "--replace=1", "--backend=nccl", "--", gloo], "--replace is for the gloo backend"),
        (["--elastic", "--replace=-1", "--", gloo], "must be 0 or more"),
        (["--backend=mpi"], "no program given"),
        (["--backend=mpi", "--", str(work / "no-such-program")], "does not exist"),
    ]
    for args, message in bad:
        rc, out, err = tool(*args)
        expect(rc != 0 and message in err, f"tessera-sbatch {' '.join(args)}: expected an error with '{message}', "
                                           f"got exit {rc}: {err.strip()}")
    print(f"ok: {len(bad)} kinds of bad input refused with a message")


def stub_program(path: pathlib.Path) -> pathlib.Path:
    """An executable that does nothing: a program for tessera-sbatch to name (it resolves and
    checks the path; nothing runs it here)."""
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_scripts(tmp_path: pathlib.Path) -> None:
    programs = {}
    for backend in ("mpi", "gloo"):
        programs[backend] = str(stub_program(tmp_path / f"conformance_{backend}"))
    check_scripts(programs, tmp_path)


def fake_slurm(bin_dir: pathlib.Path, states: list[str], accounting: str | None = None) -> pathlib.Path:
    """An sbatch that submits job 42, and an scontrol that answers `show job` with each of STATES
    in turn (the last one for good; PURGED: slurmctld's error for a job it no longer knows) and
    logs every call; with ACCOUNTING, an sacct that prints it."""
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text("#!/bin/sh\necho 42\n")
    answers = bin_dir / "answers"
    answers.write_text("".join(f"JobId=42 JobName=t JobState={s}\n" for s in states))
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"""#!/bin/sh
echo "$@" >> {bin_dir}/calls
n=$(wc -l < {bin_dir}/calls)
line=$(sed -n "${{n}}p" {answers})
[ -n "$line" ] || line=$(tail -n 1 {answers})
case "$line" in
  *PURGED*) echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1 ;;
esac
echo "$line"
""")
    scontrol.chmod(0o755)
    sbatch.chmod(0o755)
    if accounting is not None:
        sacct = bin_dir / "sacct"
        sacct.write_text(f"#!/bin/sh\necho '{accounting}'\n")
        sacct.chmod(0o755)
    return sbatch


def test_wait_follows_the_job_to_its_end(tmp_path: pathlib.Path) -> None:
    """--wait polls scontrol (0.2 s, growing) through PENDING, RUNNING and a requeue, and exits
    with the job's status: the batch script's code, 128 + a signal, 1 for a job with none."""
    cases = [
        (["PENDING ExitCode=0:0", "RUNNING ExitCode=0:0", "COMPLETED ExitCode=0:0"], 0),
        (["RUNNING ExitCode=0:0", "REQUEUED ExitCode=0:0", "PENDING ExitCode=0:0", "FAILED ExitCode=3:0"], 3),
        (["RUNNING ExitCode=0:0", "CANCELLED ExitCode=0:9"], 137),
        (["PENDING ExitCode=0:0", "CANCELLED ExitCode=0:0"], 1),
        (["RUNNING ExitCode=0:0", "NODE_FAIL ExitCode=0:0 Reason=NodeDown"], 1),
    ]
    program = stub_program(tmp_path / "prog_gloo")
    for i, (states, status) in enumerate(cases):
        bin_dir = tmp_path / f"bin{i}"
        sbatch = fake_slurm(bin_dir, states)
        rc, out, err = tool("--wait", f"--sbatch={sbatch}", f"--log-dir={tmp_path / f'logs{i}'}", "--", str(program),
                            timeout=60)
        expect(rc == status, f"states {states}: exit {rc}, expected {status}: {out}{err}")
        expect("submitted job 42" in out and "job 42 wrote no summary" in out, f"states {states}: {out}{err}")
        final = states[-1].split()[0]
        said = f"job 42 ended {final}" in out if final != "COMPLETED" else "ended" not in out
        expect(said, f"states {states}: the final state is not said (only when not COMPLETED): {out}")
        expect("Reason=NodeDown" in out or "NodeDown" not in states[-1], f"the reason is not given: {out}")
        calls = (bin_dir / "calls").read_text().splitlines()
        expect(len(calls) == len(states) and all(c == "show job --oneliner 42" for c in calls),
               f"states {states}: scontrol called {calls}")


def test_wait_for_a_purged_job_asks_the_accounting(tmp_path: pathlib.Path) -> None:
    """A job slurmctld no longer knows (purged after MinJobAge) gets its status from sacct; with no
    final record there, tessera-sbatch says so instead of waiting on."""
    program = stub_program(tmp_path / "prog_gloo")
    sbatch = fake_slurm(tmp_path / "bin0", ["RUNNING ExitCode=0:0", "PURGED"], accounting="FAILED|2:0")
    rc, out, err = tool("--wait", f"--sbatch={sbatch}", f"--log-dir={tmp_path / 'logs0'}", "--", str(program),
                        timeout=60)
    expect(rc == 2, f"a purged job that failed with 2 in the accounting: exit {rc}: {out}{err}")
    sbatch = fake_slurm(tmp_path / "bin1", ["PURGED"], accounting="RUNNING|0:0")
    rc, out, err = tool("--wait", f"--sbatch={sbatch}", f"--log-dir={tmp_path / 'logs1'}", "--", str(program),
                        timeout=60)
    expect(rc != 0 and "no longer knows job 42" in err, f"a purged job without a final record: exit {rc}: {err}")


FAKE_NODES = {"node1": "State=IDLE", "node2": "State=DOWN+NOT_RESPONDING Reason=Not responding [root@2026-01-01]"}


def run_batch_script(tmp_path: pathlib.Path, srun_body: str, *options: str, replacement: str = "",
                     nodes: dict[str, str] = FAKE_NODES) -> tuple[subprocess.Popen[str], pathlib.Path]:
    """The batch script of a 2-node, 4-rank gloo job (more tessera-sbatch OPTIONS), started under
    a fake srun (SRUN_BODY: what it does for the ranks; the multi-node checks, one task per node,
    pass; REPLACEMENT: what a replacement step, srun --overlap, does) and a fake scontrol that knows
    node1 (up) and node2 (not answering), or NODES. Returns the running script and its log folder."""
    program = stub_program(tmp_path / "prog_gloo")
    log_dir = tmp_path / "logs"
    rc, script, err = tool("--dry-run", "--nodes=2", "--ntasks-per-node=2", "--iface=eth0", f"--log-dir={log_dir}",
                           *options, "--", str(program))
    expect(rc == 0, f"dry run failed: {err}")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\ncase "$*" in *--ntasks-per-node=1*) exit 0;; esac\n'
                                  'case "$*" in *--overlap*)\n' + replacement + '\nexit 0;; esac\n'
                                  'for r in 0 1; do echo node1 > "$LOG_DIR/rank-$r.node"; done\n'
                                  'for r in 2 3; do echo node2 > "$LOG_DIR/rank-$r.node"; done\n' + srun_body)
    (bin_dir / "scontrol").write_text("#!/bin/sh\n[ \"$2\" = hostnames ] && { echo node1; echo node2; exit 0; }\n"
                                      "case \"$3\" in\n" + "".join(
        f"  {node}) echo 'NodeName={node} Arch=x86_64 {state}';;\n" for node, state in nodes.items()) + "esac\n")
    # sinfo -N -o "%N %T", as the elastic watch asks: a trailing * is a node not responding.
    (bin_dir / "sinfo").write_text("#!/bin/sh\n" + "".join(
        f"echo '{node} {'down*' if 'DOWN' in state else 'allocated'}'\n" for node, state in nodes.items()))
    for name in ("srun", "scontrol", "sinfo"):
        (bin_dir / name).chmod(0o755)
    (tmp_path / "job.sbatch").write_text(script)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_CPUS_PER_TASK": "1", "SLURM_JOB_NODELIST": "node[1-2]"}
    job = subprocess.Popen(["bash", str(tmp_path / "job.sbatch")], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return job, log_dir / "job-7"


def test_summary_names_the_node_of_a_lost_rank(tmp_path: pathlib.Path) -> None:
    """Each rank's node is in the summary; a rank without an exit status whose node Slurm marks
    DOWN or NOT_RESPONDING is named as lost with that node (tests/slurm/test_slurm_two_nodes.py
    takes a real node down)."""
    job, logs = run_batch_script(tmp_path, 'for r in 0 1; do echo 3 > "$LOG_DIR/rank-$r.exit"; echo "rank $r: '
                                           'CommError: no answer: rank 2; rank 3" >> "$LOG_DIR/rank-$r.log"; done\n'
                                           'exit 3\n')
    out = job.communicate(timeout=30)[0]
    expect(job.returncode == 3, f"the script did not exit with srun's status: {job.returncode}\n{out}")
    for r in (0, 1):
        expect(f"rank {r} (node1): exit 3" in out and f"rank {r}: CommError: no answer: rank 2; rank 3" in out,
               f"rank {r}'s node, status or error is missing:\n{out}")
    for r in (2, 3):
        expect(f"rank {r} (node2): exit none: node2 stopped answering Slurm (State=DOWN+NOT_RESPONDING, "
               "Reason=Not responding [root@2026-01-01]): the node died or its network failed" in out,
               f"rank {r} is not named as lost with node2:\n{out}")
    expect("ranks lost with their node: 2 3" in out and (logs / "summary.txt").read_text() in out,
           f"no list of the lost ranks, or no summary.txt:\n{out}")


def test_summary_written_when_the_job_is_stopped(tmp_path: pathlib.Path) -> None:
    """SIGTERM to every process of the batch step (scancel, the time limit, a node failure that
    ends the job) still leaves the summary, with what srun collected in the meantime."""
    job, logs = run_batch_script(tmp_path, "trap 'for r in 0 1; do echo 143 > \"$LOG_DIR/rank-$r.exit\"; done; "
                                           "exit 143' TERM\nsleep 30 & wait\n")
    deadline = time.monotonic() + 20
    while not (logs / "rank-3.node").exists():
        expect(time.monotonic() < deadline and job.poll() is None, "the fake ranks did not start")
        time.sleep(0.05)
    time.sleep(0.2)
    os.killpg(job.pid, signal.SIGTERM)
    out = job.communicate(timeout=30)[0]
    expect(job.returncode == 143 and "job 7 start 1: stopped by SIGTERM" in out, f"no summary after SIGTERM "
                                                                                  f"(exit {job.returncode}):\n{out}")
    expect("rank 0 (node1): exit 143 (signal 15" in out and "rank 3 (node2): exit none: node2 stopped answering" in out,
           f"the summary after SIGTERM lacks the ranks' states:\n{out}")


# A replacement step as the fake srun runs it: it records where it ran and how it was started.
REPLACEMENT = ('node=$(sed -n "s/.*--nodelist=\\([^ ]*\\).*/\\1/p" <<< "$*")\n'
               'echo "$node" > "$LOG_DIR/rank-$TESSERA_RANK.node"\n'
               'echo "slot $TESSERA_RANK of $TESSERA_WORLD_SIZE join=$TESSERA_ELASTIC_JOIN on $node" '
               '>> "$LOG_DIR/started.txt"\n'
               'sleep 0.3; echo 0 > "$LOG_DIR/rank-$TESSERA_RANK.exit"')


def test_elastic_replaces_a_failed_rank(tmp_path: pathlib.Path) -> None:
    """--elastic --replace 1: rank 2 exits 137 while the others run; the script starts one
    replacement step on rank 2's node as slot 2 (TESSERA_RANK=2, TESSERA_ELASTIC_JOIN=1), and the
    job succeeds though srun reports the killed task (tests/slurm/test_slurm.py: the real thing)."""
    job, logs = run_batch_script(tmp_path, 'sleep 0.3; echo 137 > "$LOG_DIR/rank-2.exit"; sleep 2\n'
                                           'for r in 0 1 3; do echo 0 > "$LOG_DIR/rank-$r.exit"; done; exit 137\n',
                                 "--elastic", "--replace=1", replacement=REPLACEMENT,
                                 nodes={"node1": "State=ALLOCATED", "node2": "State=ALLOCATED"})
    out = job.communicate(timeout=30)[0]
    expect(job.returncode == 0, f"the elastic job did not succeed (exit {job.returncode}):\n{out}")
    started = (logs / "started.txt").read_text()
    expect(started == "slot 2 of 4 join=1 on node2\n", f"the replacement was not slot 2 joining on node2: {started}")
    expect("rank 2 (node2): exit 137 (signal 9); replacement 1 of 1 started on node2" in out
           and "rank 2 (node2): exit 0" in out and "elastic: the group finished (ranks 0 1 2 3 exited 0)" in out,
           f"the summary does not show the failure, the replacement and its end:\n{out}")
    expect((logs / "rank-2.exit-1").read_text().strip() == "137", "the failed process's exit status was not kept")


def test_elastic_replaces_the_ranks_of_a_lost_node(tmp_path: pathlib.Path) -> None:
    """node2 stops answering (the fake scontrol says DOWN): its ranks 2 and 3 left no exit status.
    With --replace 1 one of them is replaced on node1, the node still up, and the other is recorded
    as not replaced; ranks 0 and 1 finish, so the job succeeds."""
    job, logs = run_batch_script(tmp_path, 'sleep 4; for r in 0 1; do echo 0 > "$LOG_DIR/rank-$r.exit"; done\n'
                                           'exit 0\n', "--elastic", "--replace=1", replacement=REPLACEMENT)
    out = job.communicate(timeout=30)[0]
    expect(job.returncode == 0, f"the elastic job did not succeed (exit {job.returncode}):\n{out}")
    started = (logs / "started.txt").read_text()
    expect(started == "slot 2 of 4 join=1 on node1\n", f"rank 2 was not replaced on node1: {started}")
    expect("rank 2 (node2): lost with node2 (Slurm marks it down); replacement 1 of 1 started on node1" in out
           and "rank 3 (node2): lost with node2 (Slurm marks it down); not replaced: no replacement left (--replace 1)"
           in out and "rank 2 (node1): exit 0" in out and "rank 3 (node2): exit none: node2 stopped answering" in out,
           f"the summary does not show the lost node's ranks and what was done:\n{out}")


def test_elastic_fails_when_no_rank_finishes(tmp_path: pathlib.Path) -> None:
    """Every rank fails: no replacement (none allowed), and the job fails with srun's status."""
    job, logs = run_batch_script(tmp_path, 'for r in 0 1 2 3; do echo 3 > "$LOG_DIR/rank-$r.exit"; done; exit 3\n',
                                 "--elastic")
    out = job.communicate(timeout=30)[0]
    expect(job.returncode == 3 and "elastic: no rank finished the training" in out,
           f"a job whose every rank failed did not fail (exit {job.returncode}):\n{out}")
