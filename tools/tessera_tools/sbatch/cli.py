"""tessera-sbatch's command line: its options and their checks, the submission, main()."""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from tessera_tools.sbatch.options import BACKENDS, JobOptions
from tessera_tools.sbatch.script import absolute, render

DESCRIPTION = "tessera-sbatch: run a Tessera program on a Slurm cluster from a short description."

EPILOG = """\
how each backend is launched inside the allocation:
  mpi      srun --mpi=pmix (or --mpi=pmi2): Open MPI ranks wire up through Slurm's PMI, no
           mpirun. MpiComm reads its rank from MPI itself.
  gloo     srun with a rendezvous store, in TESSERA_STORE: a directory under the log folder
           (--store file, the default; the log folder must then be on a file system every node
           mounts, as a cluster's home or scratch is), a redis-server that the batch script
           starts on the host of task 0 (--store redis; needs redis-server there and TCP
           between nodes), or a URL given as is (--store redis://host:port). GlooComm reads
           SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID itself.
  nccl     as gloo (the store carries NCCL's unique id). Slurm gives each node
           --ntasks-per-node x --gpus-per-task GPUs that every task of the node sees, and each
           rank takes GPU SLURM_LOCALID: NCCL then reaches the node's other GPUs directly
           (NVLink, PCIe peer to peer). --isolate-gpus binds GPUs per task instead, as some
           clusters require; where the binding uses cgroups NCCL falls back to copies through
           host memory between the ranks of a node. --iface sets NCCL_SOCKET_IFNAME.
  threads  one process on one node; the program's ranks are threads (--ranks=N is the program's
           flag). More tasks or nodes would each train alone and write the same checkpoint:
           refused here, and by the program itself.
  Every backend: OMP_NUM_THREADS=SLURM_CPUS_PER_TASK, the compute threads of each rank (Tessera's
  programs take it as the default of their --threads flag).

logs and failures:
  The batch script's own output goes to LOG_DIR/job-<id>.out, each rank's to
  LOG_DIR/job-<id>/rank-<r>.log. srun stops the other ranks when one fails
  (--kill-on-bad-exit; not with --elastic); the script then writes
  LOG_DIR/job-<id>/summary.txt (also at the end of job-<id>.out): each rank's node and exit
  status, and the failed rank's error lines and last lines. A rank that left no exit status on a node Slurm marks DOWN or NOT_RESPONDING is named
  as lost with that node ("rank 2 (node2): exit none: node2 stopped answering Slurm ..."). A
  SIGTERM to the script (scancel, the time limit, a node failure that ends the job) still
  leaves the summary. With --wait, tessera-sbatch waits for the job, prints the summary (and the
  job's final state when it is not COMPLETED: NODE_FAIL, TIMEOUT, ...) and exits with the job's
  status.

requeue and checkpoints:
  With --checkpoint PATH, the program is given --checkpoint=PATH, and also --resume=PATH when
  that file exists as the job (re)starts. The job is submitted with --requeue, so a job that
  Slurm requeues (preemption with PreemptMode=REQUEUE, a node failure, `scontrol requeue`)
  starts again from its last checkpoint; job-<id>.out is appended to, and the rank logs of
  each start are marked "=== start N ===". Tessera's examples write checkpoints atomically
  (temporary file, rename), so a rank killed mid-write leaves the previous one.

time limits (--signal-before):
  With --checkpoint, Slurm sends SIGUSR1 to every rank --signal-before seconds (default 120;
  Slurm may send it up to a minute early) before the time limit: #SBATCH --signal=USR1@S.
  A Tessera program given --checkpoint saves it at the next step that all ranks agree on and
  exits 75; when every rank did, the script requeues the job (scontrol requeue, unless
  --no-requeue) and the next start resumes at that step. SIGTERM (the limit itself, scancel,
  preemption) saves the checkpoint the same way when the step ends in time. --checkpoint-every=N,
  a flag of the program, also saves every N steps, for losses no signal announces.

elastic jobs (--elastic, --replace K; gloo):
  For a program built on ElasticTrainer (examples/19_elastic): a rank that fails does not stop
  the others, which go on as a smaller group. srun runs the ranks with --kill-on-bad-exit=0
  --wait=0 --no-kill and the job is submitted with --no-kill, so neither a failed task nor a
  node that dies ends the step or the allocation. The batch script watches the ranks (every
  0.5 s; the nodes' states every 2 s, in one sinfo call): with --replace K, a rank that exits
  non-zero, or whose node Slurm marks DOWN or NOT_RESPONDING, while others still run gets a new
  job step in the
  allocation (srun --overlap -N 1 -n 1: the running step still holds every CPU of the
  allocation), on its own node, or on the node of the allocation running the fewest ranks when
  its node is down. The replacement is the same slot (TESSERA_RANK=r, TESSERA_WORLD_SIZE,
  TESSERA_ELASTIC_JOIN=1), joins the group at its next step boundary and receives the model,
  optimizer, loader and random state from a healthy peer; its output is appended to
  rank-<r>.log. K replacements in all. The summary lists each failure and what was done about
  it, then each slot's last process; the job succeeds when a rank finished the training. MPI
  cannot go on without a rank (Open MPI has no ULFM here) and --replace is gloo's only: a
  replacement NCCL rank would need the GPU that the running step still holds.

multi-node checks (before the ranks start, gloo and nccl):
  A job on several nodes first runs one task per node that checks that the node sees the
  rendezvous directory (a --log-dir on a node-local disk would leave the ranks waiting out the
  rendezvous timeout) and, for gloo without --iface, that the node's host name does not resolve
  to a loopback address (127.0.1.1 on many installs: the other nodes could not reach it). Either
  failure ends the job at once with the fix.
"""



def time_limit(text: str) -> str:
    """Slurm's time formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    if not re.fullmatch(r"(\d+-)?\d+(:\d+){0,2}", text):
        raise argparse.ArgumentTypeError(f"'{text}' is not a Slurm time limit (e.g. 30, 01:00:00, 1-12:00:00)")
    return text


def limit_seconds(text: str) -> int:
    """A Slurm time limit in seconds: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    days, _, clock = text.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days:
        hours, minutes, seconds = (parts + [0, 0])[:3]
        return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    return (parts[0] * 60 + parts[1]) * 60 + parts[2]


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least `minimum`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be {'at least 1' if minimum == 1 else '0 or more'}")
        return value
    return parse


positive = at_least(1)
not_negative = at_least(0)


def infer_backend(program: str) -> str | None:
    """04_data_parallel_mpi -> mpi: Tessera's builds name one binary per communicator."""
    name = pathlib.Path(program).name
    for backend in BACKENDS:
        if name.endswith("_" + backend):
            return backend
    return None


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tessera-sbatch", description=DESCRIPTION,
        usage="%(prog)s [options] -- PROGRAM [ARGS...]",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    shape = parser.add_argument_group("the allocation")
    shape.add_argument("-N", "--nodes", type=positive, default=1)
    shape.add_argument("--ntasks-per-node", type=positive, default=1, help="ranks per node (default 1)")
    shape.add_argument("-c", "--cpus-per-task", type=positive, default=1,
                       help="cores per rank; also its OMP_NUM_THREADS (default 1)")
    shape.add_argument("--gpus-per-task", type=int, default=0, help="GPUs per rank (nccl; default 1)")
    shape.add_argument("--isolate-gpus", action="store_true",
                       help="nccl: Slurm binds each task's GPUs (--gpus-per-task) instead of giving every task "
                            "of a node all of its GPUs (see nccl below)")
    shape.add_argument("-t", "--time", type=time_limit, default="00:30:00", help="time limit (default 00:30:00)")
    shape.add_argument("-J", "--job-name", help="default: tessera-<program name>")
    shape.add_argument("-p", "--partition")
    shape.add_argument("-A", "--account")
    shape.add_argument("--qos")
    shape.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                       help="one more #SBATCH line, as is (repeatable), e.g. --sbatch-arg=--exclusive")
    run = parser.add_argument_group("the launch")
    run.add_argument("--backend", choices=BACKENDS,
                     help="default: from the program's name (..._mpi, ..._gloo, ..._nccl, ..._threads)")
    run.add_argument("--mpi", choices=("pmix", "pmi2"), default="pmix", help="srun's PMI for mpi (default pmix)")
    run.add_argument("--store", default="file",
                     help="gloo/nccl rendezvous: file (default), redis, or a file:// or redis:// URL")
    run.add_argument("--iface", help="network interface the ranks use on every node (gloo: TESSERA_GLOO_IFACE; "
                                      "nccl: NCCL_SOCKET_IFNAME)")
    run.add_argument("--comm-timeout", type=positive, metavar="S",
                     help="seconds a collective may wait for a peer (TESSERA_COMM_TIMEOUT)")
    run.add_argument("--log-dir", default="tessera-jobs", help="where logs go (default ./tessera-jobs)")
    run.add_argument("--checkpoint", metavar="PATH",
                     help="pass --checkpoint=PATH, and --resume=PATH when it exists (requeue resumes)")
    run.add_argument("--signal-before", type=not_negative, metavar="S",
                     help="with --checkpoint: SIGUSR1 S seconds before the time limit, to checkpoint and requeue "
                          "(default 120; 0: no signal)")
    run.add_argument("--no-requeue", action="store_true", help="do not let Slurm requeue the job")
    run.add_argument("--elastic", action="store_true",
                     help="gloo, nccl: a failed rank does not stop the others (a program built on ElasticTrainer "
                          "goes on without it; see elastic jobs below)")
    run.add_argument("--replace", type=not_negative, default=0, metavar="K",
                     help="with --elastic (gloo): start a replacement job step for each rank that fails or is lost "
                          "with its node, K in all (default 0)")
    run.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                     help="an environment variable for every rank (repeatable)")
    out = parser.add_argument_group("what to do")
    out.add_argument("--dry-run", action="store_true", help="print the sbatch script; submit nothing")
    out.add_argument("-o", "--script", metavar="FILE",
                     help="also keep the script here (default: LOG_DIR/<job name>.sbatch when submitting)")
    out.add_argument("--wait", action="store_true",
                     help="wait for the job, print its summary, exit with its status")
    out.add_argument("--sbatch", default="sbatch", help="the sbatch command (default: sbatch on PATH)")
    return parser


def parse(argv: Sequence[str]) -> JobOptions:
    parser = make_parser()
    argv = list(argv)
    if "--" in argv:
        cut = argv.index("--")
        options, command = argv[:cut], argv[cut + 1:]
    else:
        options, command = argv, []
    args = parser.parse_args(options)
    if not command:
        parser.error("no program given: put it after --, e.g. tessera-sbatch --backend mpi -- ./prog --epochs=1")
    if args.backend is None:
        inferred = infer_backend(command[0])
        if inferred is None:
            parser.error(f"cannot tell the backend from the program's name '{command[0]}': give --backend "
                         f"({', '.join(BACKENDS)})")
        args.backend = inferred
    if args.gpus_per_task < 0:
        parser.error(f"--gpus-per-task={args.gpus_per_task} must be 0 or more")
    if args.backend == "nccl" and args.gpus_per_task == 0:
        args.gpus_per_task = 1
    if args.backend != "nccl" and args.gpus_per_task:
        parser.error(f"--gpus-per-task is for the nccl backend, not {args.backend}")
    if args.isolate_gpus and args.backend != "nccl":
        parser.error(f"--isolate-gpus is for the nccl backend, not {args.backend}")
    if args.backend == "threads" and args.ntasks_per_node != 1:
        parser.error("the threads backend runs one task per node (its ranks are threads): "
                     "drop --ntasks-per-node, or use mpi or gloo for several processes")
    if args.backend == "threads" and args.nodes != 1:
        parser.error(f"the threads backend runs in one process (its ranks are threads), so -N {args.nodes} would "
                     f"run {args.nodes} independent trainings writing one checkpoint: use -N 1, or the program "
                     f"built for mpi or gloo to train across nodes")
    if args.signal_before is None:
        args.signal_before = 120 if args.checkpoint else 0
    if args.signal_before and not args.checkpoint:
        parser.error(f"--signal-before={args.signal_before} needs --checkpoint=PATH: on the signal the program saves "
                     f"its checkpoint there")
    if args.signal_before and args.signal_before >= limit_seconds(args.time):
        parser.error(f"--signal-before={args.signal_before} is not before the time limit --time={args.time} "
                     f"({limit_seconds(args.time)} s): give a longer --time or a smaller --signal-before")
    if args.store not in ("file", "redis") and not re.match(r"(file|redis)://", args.store):
        parser.error(f"--store={args.store}: give file, redis, file:///shared/dir or redis://host:port")
    for item in args.env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", item, re.S):
            parser.error(f"--env {item!r} is not NAME=VALUE")
    if args.elastic and args.backend not in ("gloo", "nccl"):
        parser.error(f"--elastic needs a backend whose ranks can go on without a dead one (gloo, nccl), not "
                     f"{args.backend}: " + ("Open MPI without ULFM ends every rank when one dies"
                                            if args.backend == "mpi" else "the threads backend is one process"))
    if args.replace and not args.elastic:
        parser.error(f"--replace {args.replace} needs --elastic (without it a failed rank stops the job)")
    if args.replace and args.backend != "gloo":
        parser.error(f"--replace is for the gloo backend, not {args.backend}: a replacement NCCL rank would need the "
                     f"GPU that the running step still holds")
    args.job_name = args.job_name or "tessera-" + pathlib.Path(command[0]).name
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", args.job_name):
        parser.error(f"--job-name={args.job_name!r}: use letters, digits and _.+- only")
    return JobOptions(
        command=command, backend=args.backend, job_name=args.job_name, nodes=args.nodes,
        ntasks_per_node=args.ntasks_per_node, cpus_per_task=args.cpus_per_task, gpus_per_task=args.gpus_per_task,
        time=args.time, partition=args.partition, account=args.account, qos=args.qos, sbatch_arg=args.sbatch_arg,
        mpi=args.mpi, store=args.store, iface=args.iface, comm_timeout=args.comm_timeout, log_dir=args.log_dir,
        checkpoint=args.checkpoint, signal_before=args.signal_before, isolate_gpus=args.isolate_gpus,
        no_requeue=args.no_requeue, elastic=args.elastic, replace=args.replace, env=args.env, dry_run=args.dry_run,
        script=args.script, wait=args.wait, sbatch=args.sbatch)


def resolve_program(command: list[str]) -> list[str]:
    """The program as an absolute path when it names a file here (srun runs it on other nodes,
    from the submit directory, which must be the same path there)."""
    program = command[0]
    if os.sep in program:
        path = pathlib.Path(program)
        if not path.exists():
            sys.exit(f"tessera-sbatch: program '{program}' does not exist")
        if not os.access(path, os.X_OK):
            sys.exit(f"tessera-sbatch: program '{program}' is not executable")
        return [absolute(program), *command[1:]]
    if shutil.which(program) is None:
        sys.exit(f"tessera-sbatch: program '{program}' is not on PATH")
    return command


def submit(args: JobOptions, script: str, log_dir: str) -> int:
    pathlib.Path(log_dir).mkdir(parents=True, exist_ok=True)
    script_path = pathlib.Path(args.script or pathlib.Path(log_dir) / f"{args.job_name}.sbatch")
    script_path.write_text(script)
    script_path.chmod(0o755)
    sbatch = shutil.which(args.sbatch)
    if sbatch is None:
        sys.exit(f"tessera-sbatch: '{args.sbatch}' not found: is this a Slurm login node? "
                 f"(the script is in {script_path}; --dry-run prints it)")
    scontrol = shutil.which("scontrol", path=str(pathlib.Path(sbatch).parent)) or shutil.which("scontrol")
    if args.wait and scontrol is None:
        sys.exit(f"tessera-sbatch: --wait needs scontrol beside {sbatch} or on PATH to follow the job")
    done = subprocess.run([sbatch, "--parsable", str(script_path)], stdout=subprocess.PIPE, text=True)
    job_id = done.stdout.strip().split(";")[0]
    if done.returncode != 0 or not job_id.isdigit():
        sys.exit(f"tessera-sbatch: sbatch did not submit {script_path} (exit {done.returncode})")
    print(f"submitted job {job_id}: script {script_path}, logs {log_dir}/job-{job_id}.out and {log_dir}/job-{job_id}/",
          flush=True)
    if not args.wait:
        return 0
    assert scontrol is not None
    status = wait_for_job(scontrol, job_id)
    summary = pathlib.Path(log_dir) / f"job-{job_id}" / "summary.txt"
    if summary.exists():
        print(summary.read_text(), end="")
    else:
        print(f"job {job_id} wrote no summary (it may not have started); see {log_dir}/job-{job_id}.out")
    return status


# The states a job leaves only by a requeue (squeue(1), JOB STATE CODES); PENDING, RUNNING,
# REQUEUED and the rest are still on their way.
FINAL_STATES = frozenset({"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
                          "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT"})


def job_status(state: str, exit_code: str) -> int:
    """The exit status of a job that ended in STATE with ExitCode=code:signal: the batch script's
    code, 128 + the signal that killed it (as a shell gives; sbatch --wait says 1), or 1 for a job
    that ended without a status of its own (cancelled while pending, a node failure), where
    sbatch --wait would say 0."""
    code, _, signal = exit_code.partition(":")
    if code.isdigit() and int(code) != 0:
        return int(code)
    if signal.isdigit() and int(signal) != 0:
        return 128 + int(signal)
    return 0 if state == "COMPLETED" else 1


def final_from_accounting(scontrol: str, job_id: str) -> int | None:
    """The exit status that Slurm's accounting (sacct, beside scontrol or on PATH) has for a job
    slurmctld no longer knows (purged MinJobAge seconds after its end); None without accounting
    or a final record."""
    sacct = shutil.which("sacct", path=str(pathlib.Path(scontrol).parent)) or shutil.which("sacct")
    if sacct is None:
        return None
    try:
        done = subprocess.run([sacct, "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode"], capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in done.stdout.splitlines():
        state, _, exit_code = line.partition("|")
        state = state.split()[0] if state.strip() else ""
        if state in FINAL_STATES:
            return job_status(state, exit_code)
    return None


def wait_for_job(scontrol: str, job_id: str, poll_limit: float = 2.0, outage_limit: float = 600.0) -> int:
    """Polls `scontrol show job` until the job is in a final state; returns its exit status.

    `sbatch --wait` (Slurm 22.05) polls too, after 2 s, 10 s, 42 s, then every 32 s: a job of 3 s
    returned after 10 s, one of 11 s after 42 s. Here the interval starts at 0.2 s and grows by half
    up to POLL_LIMIT, so a job returns at most POLL_LIMIT seconds after it ended, and a long one
    costs slurmctld one small request every POLL_LIMIT seconds. A requeued job goes back to PENDING
    and is followed to its final end. slurmctld out of reach (a failover, an upgrade) is waited
    out for OUTAGE_LIMIT seconds; a job it no longer knows is looked up in the accounting."""
    interval = 0.2
    unreachable_since: float | None = None
    try:
        while True:
            try:
                done = subprocess.run([scontrol, "show", "job", "--oneliner", job_id], capture_output=True,
                                      text=True, timeout=60)
                answer, error = done.stdout, (done.stderr.strip() or done.stdout.strip())
                ok = done.returncode == 0
            except (OSError, subprocess.TimeoutExpired) as e:
                answer, error, ok = "", str(e), False
            if ok:
                unreachable_since = None
                fields = dict(re.findall(r"(\w+)=(\S*)", answer))
                state = fields.get("JobState", "")
                if state in FINAL_STATES:
                    if state != "COMPLETED":  # NODE_FAIL, TIMEOUT, ...: what the summary cannot say
                        reason = fields.get("Reason", "None")
                        print(f"job {job_id} ended {state} (ExitCode={fields.get('ExitCode', '?')}"
                              f"{'' if reason == 'None' else ', Reason=' + reason})", flush=True)
                    return job_status(state, fields.get("ExitCode", ""))
            elif "invalid job id" in error.lower():
                status = final_from_accounting(scontrol, job_id)
                if status is not None:
                    return status
                sys.exit(f"tessera-sbatch: slurmctld no longer knows job {job_id} (purged after it ended, "
                         f"MinJobAge) and there is no accounting (sacct) to ask: see its logs")
            else:
                now = time.monotonic()
                unreachable_since = now if unreachable_since is None else unreachable_since
                if now - unreachable_since > outage_limit:
                    sys.exit(f"tessera-sbatch: lost job {job_id}: scontrol show job has failed for "
                             f"{now - unreachable_since:.0f} s: {error} (the job may still run: squeue -j {job_id})")
            time.sleep(interval)
            interval = min(interval * 1.5, poll_limit)
    except KeyboardInterrupt:
        sys.exit(f"tessera-sbatch: stopped waiting; job {job_id} goes on (squeue -j {job_id}; scancel {job_id})")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    log_dir = absolute(args.log_dir)
    command = command_for(args)
    script = render(args, command, log_dir, argv)
    if args.dry_run:
        if args.script:
            pathlib.Path(args.script).write_text(script)
        print(script, end="")
        return 0
    return submit(args, script, log_dir)


def command_for(args: JobOptions) -> list[str]:
    """A dry run may describe a program built elsewhere: its path is made absolute, not checked."""
    if args.dry_run:
        program = args.command[0]
        return [absolute(program) if os.sep in program else program, *args.command[1:]]
    return resolve_program(args.command)

