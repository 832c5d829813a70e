"""tessera-run's command line: its options, their checks, and main()."""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence

from tessera_tools.launch.guards import MAX_RANKS_PER_CPU, ensure_descriptors, linked_mpi_library, usable_cpus
from tessera_tools.launch.hosts import DEFAULT_RSH, Host, host_list
from tessera_tools.launch.options import LaunchOptions
from tessera_tools.launch.ranks import Launcher

EPILOG = """\
environment of each rank:
  TESSERA_RANK, TESSERA_LOCAL_RANK               0 .. N-1 (with --hosts, LOCAL_RANK counts
                                                 from 0 on each host)
  TESSERA_WORLD_SIZE, TESSERA_LOCAL_WORLD_SIZE   N (with --hosts, LOCAL_WORLD_SIZE is the
                                                 number of ranks on the rank's host)
  TESSERA_STORE         file:///<temp dir> made for this run (tempfile prefix tessera-run-)
                        and removed when the launcher exits; with --store, that URL as given
                        and nothing is removed
  TESSERA_STORE_PREFIX  run-<host>-<pid>-<time>, one per launch (unless already set), so
                        that jobs sharing a --store never pair their ranks
  TESSERA_GLOO_IFACE    with --iface
  TESSERA_COMM_TIMEOUT  with --timeout
  The rest of the launcher's environment is inherited, except OMPI_COMM_WORLD_RANK,
  OMPI_COMM_WORLD_SIZE, SLURM_PROCID and SLURM_NTASKS, which are removed so that they
  cannot override the TESSERA_* values. Ranks read stdin from /dev/null.

hosts (--hosts):
  --hosts h1,h2:2,h3 places ranks on hosts in list order, filling each host's slots (default
  1) before the next, as mpirun does by slot: here rank 0 on h1, ranks 1 and 2 on h2, rank 3
  on h3. -n defaults to the total number of slots and may not exceed it. Each rank is started
  as the --rsh command with {host} replaced by the host's name (appended after the command when
  no word holds {host}), followed by ONE argument: a shell command line
      cd <launcher's working directory> && exec env TESSERA_...=... program args...
  (every word shell-quoted), which the remote-exec command must run with a shell. ssh does;
  for a network namespace of this machine write `ip netns exec {host} sh -c`. The rank's
  environment is what the remote side gives it plus, set explicitly on the command line,
  the TESSERA_* variables above and every TESSERA_* variable of the launcher's environment
  (ssh does not pass the rest on; `ip netns exec` inherits everything).
  The program and the working directory must exist on every host; the MPI guard below applies
  when the program is found here too, and the per-CPU rank bound does not apply (slots do).
  The default store is a temporary directory on THIS machine: it serves namespaces of this
  machine, but ranks on other machines need --store file:///shared/dir (a filesystem every
  host mounts at that path) or --store redis://host:port. Gloo binds the address of
  TESSERA_GLOO_IFACE (--iface, the same name on every host), else TESSERA_GLOO_HOSTNAME, else
  the host's name resolved on that host. Stopping a rank signals the local remote-exec process:
  `ip netns exec` and `sh -c '... exec'` replace themselves, so that is the rank itself; over
  ssh, the remote rank learns of it when its connection closes, and otherwise ends by its own
  TESSERA_COMM_TIMEOUT once its peers are gone.

processes and output:
  Each rank runs in its own process group (new session); stopping a rank signals the whole
  group, so the rank's children stop with it. Each line a rank writes to stdout/stderr is
  copied to the launcher's stdout/stderr as "[rank R] line" (invalid UTF-8 is replaced).

failures and signals:
  When a rank exits non-zero (other than 77) or is killed by a signal, the launcher says so
  on stderr, sends SIGTERM and then SIGCONT to the other running ranks (a stopped rank only
  handles SIGTERM once continued), waits --grace seconds, SIGKILLs what is left and exits
  with that rank's status (128+S for signal S). SIGINT, SIGTERM or SIGHUP
  to the launcher stops all ranks the same way and exits 128+signal (130 for SIGINT, 143
  for SIGTERM); another signal while stopping skips the rest of the grace period. SIGUSR1 goes
  on to every rank and the launcher waits: a Tessera program given --checkpoint saves it at the
  next step and exits 75, which does not stop the others; when ranks exit 75 and none failed,
  the launcher exits 75 too (run again with --resume to continue).
  --elastic: a rank that fails does not stop the others (a program built on ElasticTrainer goes
  on without it); with --replace K, each failed rank's slot gets a new process (the same
  TESSERA_RANK, TESSERA_ELASTIC_JOIN=1), K in all, which joins the running group. The launcher
  then exits 0 when the ranks still running at the end all succeed, else with the last
  failure's status.

guards (usage errors, before any rank starts):
  MPI programs    a program linking an MPI library (libmpi*, libmpich*; found with ldd, or in
                  the program's ELF dynamic section where ldd is missing) is refused: under
                  tessera-run each rank would be its own 1-rank MPI world and N copies of the
                  job would run side by side. Start it with `mpirun -n N program` instead;
                  --allow-mpi starts it anyway (a program that links MPI but communicates
                  through Gloo or NCCL).
  rank count      -n at most 64 per CPU this process may run on (os.sched_getaffinity), and
                  within the open-file limit (2 pipes per rank, soft limit raised up to the
                  hard one when needed).

OpenMP threads:
  With OMP_NUM_THREADS unset and more than one rank on this machine, each rank gets
  OMP_NUM_THREADS = max(1, CPUs / ranks) (1 with --bind-to core), as torchrun sets it, and the
  launcher says so on stderr; otherwise every rank's OpenMP runtime would start a thread per
  CPU and the ranks' threads would spin against each other. A value the user set is kept;
  ranks on --hosts get none (their cores are not known here).

binding (--bind-to core):
  Rank r gets the r-th CPU of the launcher's own CPU set (os.sched_getaffinity), so -n may
  not exceed that set's size, and --hosts is refused (bind there with the remote side's own
  tools, e.g. srun --cpu-bind=cores). A rank pinned to one CPU owns that core: GlooComm then
  busy-polls its sockets while it waits for a peer, as MPI does, instead of sleeping and
  being woken (see communicators/gloo/include/tessera/comm/gloo.hpp). Two jobs bound on one
  machine share the same first CPUs, as with mpirun; bind only when the job has the machine.

exit status:
  0 all ranks exited 0; 77 (Meson's "skipped") all ranks exited 0 or 77, at least one 77;
  75 ranks stopped on a signal with their checkpoint saved (75), none failed;
  the first failed rank's status; 2 usage errors or a rank that could not be started.

examples:
  tessera-run -n 4 ./prog --epochs 1
  tessera-run -n 2 --store redis://127.0.0.1:6379 --iface lo --timeout 60 -- ./prog -x
  tessera-run --hosts node1:2,node2:2 --store file:///shared/job1 --iface eth0 /shared/prog
  tessera-run --hosts ns0,ns1 --rsh 'ip netns exec {host} sh -c' --iface eth0 ./prog
      (ranks in network namespaces ns0 and ns1 of this machine, as tests/net/netns_test.py does)

equivalent launches without tessera-run:
  mpirun --allow-run-as-root --oversubscribe -n 4 ./prog
      the communicators read OMPI_COMM_WORLD_RANK / OMPI_COMM_WORLD_SIZE
  mpirun --allow-run-as-root --host node1:2,node2:2 --mca btl tcp,self ./prog
      MPI ranks on other hosts: mpirun places them itself (--mca plm_rsh_agent sets its
      remote-exec command; tests/net/netns_test.py uses one that enters a network namespace)
  TESSERA_STORE=file:///shared/dir srun -n 4 ./prog
      the communicators read SLURM_PROCID / SLURM_NTASKS; Gloo needs a store that all
      nodes can reach, such as a file store on a shared filesystem
"""


def seconds(minimum_exclusive: bool) -> Callable[[str], str]:
    """argparse type: a number of seconds above (or, for the grace period, at least) zero.
    Returns the text unchanged so that it reaches the ranks exactly as written."""
    def parse(text: str) -> str:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
        if value < 0 or (minimum_exclusive and value == 0):
            raise argparse.ArgumentTypeError(f"out of range: {text!r}")
        return text
    return parse


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="tessera-run", usage="%(prog)s [options] (-n N | --hosts H1[:S],...) [--] program [args...]",
        description="Start N ranks of a Tessera program, on this machine or on --hosts, each with "
                    "TESSERA_RANK, TESSERA_WORLD_SIZE and a shared TESSERA_STORE, and forward their output.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--nproc", type=int, metavar="N",
                    help="number of ranks to start (at least 1; with --hosts, default: all slots)")
    ap.add_argument("--hosts", type=host_list, metavar="H1[:S],H2[:S],...",
                    help="start the ranks on these hosts, S slots (ranks) each, default 1 "
                         "(see hosts below)")
    ap.add_argument("--rsh", default=DEFAULT_RSH, metavar="COMMAND",
                    help="remote-exec command for --hosts, {host} replaced by the host; it must run "
                         f"its last argument as a shell command line (default: {DEFAULT_RSH!r}; "
                         "for network namespaces: 'ip netns exec {host} sh -c')")
    ap.add_argument("--store", metavar="URL",
                    help="rendezvous store passed as TESSERA_STORE, e.g. redis://127.0.0.1:6379 "
                         "or file:///shared/dir (default: a fresh temporary file store)")
    ap.add_argument("--iface", metavar="NAME", help="network interface for Gloo (TESSERA_GLOO_IFACE)")
    ap.add_argument("--timeout", type=seconds(True), metavar="SECONDS",
                    help="communication timeout for the ranks (TESSERA_COMM_TIMEOUT)")
    ap.add_argument("--grace", type=seconds(False), default="5", metavar="SECONDS",
                    help="time between SIGTERM and SIGKILL when stopping ranks (default 5)")
    ap.add_argument("--bind-to", choices=("none", "core"), default="none",
                    help="core: rank r runs on the r-th CPU this launcher may use, as mpirun's "
                         "--bind-to core (ranks on this machine only; see binding below)")
    ap.add_argument("--no-prefix", action="store_true",
                    help='forward output without the "[rank R] " prefix')
    ap.add_argument("--allow-mpi", action="store_true",
                    help="start a program that links an MPI library anyway (see guards below)")
    ap.add_argument("--elastic", action="store_true",
                    help="a failed rank does not stop the others (see failures and signals below)")
    ap.add_argument("--replace", type=int, default=0, metavar="K",
                    help="with --elastic: start a replacement for each failed rank, K in all (default 0)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return ap


def parse_args(argv: Sequence[str]) -> LaunchOptions:
    """The options, checked in this order; a usage error exits 2 (argparse's error())."""
    ap = parser()
    args = ap.parse_args(argv)
    command: list[str] = args.command[1:] if args.command[:1] == ["--"] else args.command
    hosts: list[Host] | None = args.hosts
    slots = sum(h.slots for h in hosts) if hosts else None
    nproc: int | None = args.nproc
    if nproc is None:
        if slots is None:
            ap.error("give -n N (the number of ranks) or --hosts")
        nproc = slots
    if nproc < 1:
        ap.error(f"-n must be at least 1, got {nproc}")
    if hosts and slots is not None and nproc > slots:
        ap.error(f"-n {nproc}: --hosts has only {slots} slot{'s' if slots > 1 else ''} "
                 f"({','.join(f'{h.name}:{h.slots}' for h in hosts)}); add slots as host:S")
    rsh: list[str] = []
    if hosts:
        try:
            rsh = shlex.split(args.rsh)
        except ValueError as error:
            ap.error(f"--rsh {args.rsh!r}: {error}")
        if not rsh:
            ap.error("--rsh is empty")
    cpus = usable_cpus()
    if hosts is None and nproc > MAX_RANKS_PER_CPU * cpus:
        ap.error(f"-n {nproc}: at most {MAX_RANKS_PER_CPU * cpus} ranks ({MAX_RANKS_PER_CPU} per CPU, "
                 f"{cpus} CPU{'s' if cpus > 1 else ''} usable here); every rank is a process with its own "
                 f"copy of the model and data, and ranks beyond the cores only take turns on them")
    if args.bind_to == "core":
        if hosts:
            ap.error("--bind-to core binds ranks on this machine only; with --hosts, bind on the hosts "
                     "(e.g. srun --cpu-bind=cores, or taskset in the remote command)")
        if nproc > cpus:
            ap.error(f"--bind-to core: -n {nproc} ranks but only {cpus} CPU{'s' if cpus > 1 else ''} usable "
                     f"here (one rank per core); leave out --bind-to or use fewer ranks")
    too_few_files = ensure_descriptors(nproc)
    if too_few_files:
        ap.error(too_few_files)
    if args.replace < 0:
        ap.error(f"--replace {args.replace}: must be >= 0")
    if args.replace > 0 and not args.elastic:
        ap.error("--replace needs --elastic (without it a failed rank stops the job)")
    if not command:
        ap.error("no program given")
    program = command[0]
    path = program if os.sep in program else shutil.which(program)
    if hosts and (path is None or not os.path.isfile(path)):
        path = None  # not here: it need only exist on the hosts
    elif os.sep in program:
        if not os.path.isfile(program):
            ap.error(f"program not found: {program}")
        if not os.access(program, os.X_OK):
            ap.error(f"program is not executable: {program}")
    elif path is None:
        ap.error(f"program not found in PATH: {program}")
    if path is not None and not args.allow_mpi:
        mpi = linked_mpi_library(path)
        if mpi:
            ap.error(f"{program} links the MPI library {mpi}: under tessera-run each rank would be its own "
                     f"1-rank MPI world, running {nproc} independent copies of the job. Start it with "
                     f"`mpirun -n {nproc} {program}` (add --allow-run-as-root --oversubscribe where "
                     f"needed), or pass --allow-mpi if it links MPI but communicates through Gloo or NCCL")
    return LaunchOptions(nproc=nproc, command=command, hosts=hosts, rsh=rsh, store=args.store, iface=args.iface,
                         timeout=args.timeout, grace=float(args.grace), bind_to=args.bind_to,
                         no_prefix=args.no_prefix, allow_mpi=args.allow_mpi, elastic=args.elastic,
                         replace=args.replace)


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(sys.argv[1:] if argv is None else argv)
    launcher = Launcher(options, options.store)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, launcher.on_signal)
    signal.signal(signal.SIGUSR1, launcher.on_usr1)
    temp_dir = None
    try:
        if options.store is None:
            temp_dir = tempfile.mkdtemp(prefix="tessera-run-")
            launcher.store = "file://" + temp_dir  # mkdtemp's path is absolute: file:///tmp/...
            launcher.temp_dir = temp_dir
        return launcher.run()
    finally:
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
