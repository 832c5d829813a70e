"""The sbatch script tessera-sbatch writes: #SBATCH lines, then plain bash a reader can follow."""
from __future__ import annotations

import datetime
import pathlib
import shlex
from collections.abc import Sequence

from tessera_tools.sbatch.options import JobOptions


def absolute(path: str) -> str:
    """Paths in the script are absolute: the job may start in another directory."""
    return str(pathlib.Path(path).expanduser().resolve())


def quote_all(words: Sequence[str]) -> str:
    return " ".join(shlex.quote(w) for w in words)


def preflight(args: JobOptions) -> list[str]:
    """A job on several nodes: one task per node checks what would otherwise surface only as a
    rendezvous timeout (cli.py's help, "multi-node checks")."""
    check = (
        'd=${TESSERA_STORE#file://}; '
        'if [ "$d" != "$TESSERA_STORE" ] && [ ! -d "$d" ]; then '
        'echo "error: node $(hostname) cannot see the rendezvous directory $d: --log-dir must be on a file system '
        'every node mounts (home or scratch, not /tmp), or use --store redis"; exit 1; fi; ')
    if args.backend == "gloo" and not args.iface:
        check += (
            'a=$(getent ahosts "$(hostname)" | awk \'NR == 1 {print $1}\'); '
            'case "$a" in 127.*|::1|"") echo "error: the host name of node $(hostname) resolves to ${a:-nothing}, '
            'not an address the other nodes can reach: give tessera-sbatch --iface with the interface the nodes '
            'share (ib0, eth0, ...)"; exit 1;; esac')
    return [
        "",
        "# Before the ranks start, one task per node checks the store and the network (cli.py, multi-node checks).",
        f"PREFLIGHT={shlex.quote(check)}",
        'if ! srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 '
        '--kill-on-bad-exit=1 bash -c "$PREFLIGHT"; then',
        '  echo "job $SLURM_JOB_ID: a node failed the checks above; no rank was started"; exit 2',
        "fi",
    ]


def elastic_monitor(args: JobOptions) -> list[str]:
    """--elastic: instead of waiting on srun, the script watches the ranks (cli.py's help, "elastic
    jobs"). A rank that fails, or whose node Slurm marks down, while others still run gets a new
    job step in the allocation (srun --overlap: the running step still holds every CPU) that joins
    the running group as the same slot (TESSERA_RANK, TESSERA_ELASTIC_JOIN=1), --replace in all."""
    q = shlex.quote
    replacement = ["srun", "--overlap", "--nodes=1", "--ntasks=1", '--nodelist="$node"', "--kill-on-bad-exit=0",
                   "--cpus-per-task=$SLURM_CPUS_PER_TASK", '--output="$LOG_DIR/rank-$r.log"', "--open-mode=append"]
    return [
        "",
        f"# --elastic --replace {args.replace}: the ranks are watched every 0.5 s (the nodes' states every 2 s).",
        f"REPLACEMENTS_LEFT={args.replace}",
        "REPLACEMENTS_USED=0",
        "REPLACEMENT_PIDS=()",
        "declare -A SETTLED  # slots whose failure was recorded without a replacement",
        "declare -A DOWN     # node -> 1 (Slurm marks it down, failed or not responding) or 0",
        ': > "$LOG_DIR/replacements.txt"',
        "# One sinfo call for every node of the job (one request to slurmctld per refresh, however many",
        "# nodes): a state ending in * is not responding.",
        "refresh_down() {",
        "  DOWN=()",
        "  local node state",
        "  while read -r node state; do",
        "    case \"$state\" in down*|fail*|*'*') DOWN[$node]=1;; *) DOWN[$node]=0;; esac",
        '  done < <(sinfo -h -N -n "$SLURM_JOB_NODELIST" -o "%N %T" 2>/dev/null)',
        "}",
        "node_down() {",
        '  [ "${DOWN[$1]:-0}" = 1 ]',
        "}",
        "# Slots still in the running group, slot $1 left out: started, no exit status, not given up.",
        "running_slots() {",
        "  local n=0 r",
        "  for r in $(seq 0 $((SLURM_NTASKS - 1))); do",
        '    [ "$r" != "$1" ] && [ -f "$LOG_DIR/rank-$r.node" ] && [ ! -f "$LOG_DIR/rank-$r.exit" ] '
        '&& [ -z "${SETTLED[$r]+set}" ] && n=$((n + 1))',
        "  done",
        "  echo $n",
        "}",
        "# The node of the allocation, not marked down, that runs the fewest ranks (for a lost node's slot).",
        "emptiest_node() {",
        "  local best='' fewest=999999 node count",
        '  for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null); do',
        '    node_down "$node" && continue',
        '    count=$(cat "$LOG_DIR"/rank-*.node 2>/dev/null | grep -cx "$node")',
        '    [ "$count" -lt "$fewest" ] && best=$node && fewest=$count',
        "  done",
        '  echo "$best"',
        "}",
        "describe_exit() {",
        '  case "$1" in 129|13[0-9]|14[0-9]|15[0-9]) echo "$1 (signal $(($1 - 128)))";; *) echo "$1";; esac',
        "}",
        "start_replacement() {  # slot, what happened to it, node",
        "  local r=$1 node=$3",
        "  REPLACEMENTS_LEFT=$((REPLACEMENTS_LEFT - 1)); REPLACEMENTS_USED=$((REPLACEMENTS_USED + 1))",
        f'  echo "rank $r ($(cat "$LOG_DIR/rank-$r.node")): $2; replacement $REPLACEMENTS_USED of {args.replace} '
        'started on $node at $(date +%T)" >> "$LOG_DIR/replacements.txt"',
        '  [ -f "$LOG_DIR/rank-$r.exit" ] && mv "$LOG_DIR/rank-$r.exit" "$LOG_DIR/rank-$r.exit-$REPLACEMENTS_USED"',
        '  echo "$node" > "$LOG_DIR/rank-$r.node"  # its own wrapper writes it again as it starts',
        '  echo "=== replacement $REPLACEMENTS_USED: joins the running group ===" >> "$LOG_DIR/rank-$r.log"',
        f"  TESSERA_RANK=$r TESSERA_WORLD_SIZE=$SLURM_NTASKS TESSERA_LOCAL_RANK=$((r % {args.ntasks_per_node})) "
        "TESSERA_ELASTIC_JOIN=1 \\",
        f'    {" ".join(replacement)} bash -c "$TASK" rank "${{PROGRAM[@]}}" &',
        "  REPLACEMENT_PIDS+=($!)",
        "}",
        "POLLS=0",
        'while [ -z "$STOPPED" ]; do',
        "  # The watch ends when srun and every replacement have ended, or when no slot runs any more",
        "  # (srun may wait on for the tasks of a node that died).",
        '  active=""',
        '  for p in "$SRUN_PID" "${REPLACEMENT_PIDS[@]}"; do kill -0 "$p" 2>/dev/null && active=1; done',
        '  [ -n "$active" ] || break',
        '  started=$(ls "$LOG_DIR"/rank-*.node 2>/dev/null | wc -l)',
        '  [ "$started" -ge "$SLURM_NTASKS" ] && [ "$(running_slots -1)" = 0 ] && break',
        "  POLLS=$((POLLS + 1))",
        "  [ $((POLLS % 4)) = 0 ] && refresh_down",
        "  for r in $(seq 0 $((SLURM_NTASKS - 1))); do",
        '    [ -f "$LOG_DIR/rank-$r.node" ] && [ -z "${SETTLED[$r]+set}" ] || continue',
        '    node=$(cat "$LOG_DIR/rank-$r.node")',
        '    if [ -f "$LOG_DIR/rank-$r.exit" ]; then',
        '      code=$(cat "$LOG_DIR/rank-$r.exit")',
        '      case "$code" in 0|75) continue;; esac',
        '      what="exit $(describe_exit "$code")"; target=$node',
        "    elif [ $((POLLS % 4)) = 0 ] && node_down \"$node\"; then",
        '      what="lost with $node (Slurm marks it down)"; target=""',
        "    else",
        "      continue",
        "    fi",
        '    if [ -n "$target" ] && node_down "$target"; then target=""; fi',
        '    [ -n "$target" ] || target=$(emptiest_node)',
        '    if [ "$REPLACEMENTS_LEFT" -gt 0 ] && [ -n "$target" ] && [ "$(running_slots "$r")" -gt 0 ]; then',
        '      start_replacement "$r" "$what" "$target"',
        "    else",
        "      SETTLED[$r]=1",
        '      if [ "$REPLACEMENTS_LEFT" -le 0 ]; then why="no replacement left (--replace ' + str(args.replace) + ')"',
        '      elif [ -z "$target" ]; then why="no node of the allocation is up"',
        '      else why="no other rank was running"; fi',
        '      echo "rank $r ($node): $what; not replaced: $why" >> "$LOG_DIR/replacements.txt"',
        "    fi",
        "  done",
        "  sleep 0.5",
        "done",
        "# srun still waiting on a node that died, or stopped by SIGTERM: given 5 s, then stopped.",
        'for p in "$SRUN_PID" "${REPLACEMENT_PIDS[@]}"; do',
        '  for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done',
        '  kill "$p" 2>/dev/null',
        "done",
        'wait "$SRUN_PID"',
        "STATUS=$?",
    ]


def render(args: JobOptions, command: Sequence[str], log_dir: str, invocation: Sequence[str]) -> str:
    """The sbatch script; `invocation` is tessera-sbatch's own arguments, quoted in its header."""
    q = shlex.quote
    tasks = args.nodes * args.ntasks_per_node
    lines = [
        "#!/bin/bash",
        f"# Written by tessera-sbatch on {datetime.datetime.now().isoformat(timespec='seconds')}:",
        f"#   {quote_all(['tessera-sbatch', *invocation])}",
        f"# {tasks} rank(s) of {pathlib.Path(command[0]).name} over {args.backend}: "
        f"{args.nodes} node(s) x {args.ntasks_per_node} task(s), {args.cpus_per_task} CPU(s) per task.",
        f"#SBATCH --job-name={args.job_name}",
        f"#SBATCH --nodes={args.nodes}",
        f"#SBATCH --ntasks-per-node={args.ntasks_per_node}",
        f"#SBATCH --cpus-per-task={args.cpus_per_task}",
        f"#SBATCH --time={args.time}",
        f"#SBATCH --output={log_dir}/job-%j.out",
        "#SBATCH --open-mode=append",
    ]
    if args.gpus_per_task:
        # Per node by default: every task of a node sees all of the node's GPUs and takes the one
        # of its SLURM_LOCALID, so NCCL can reach the others directly (cli.py's help says more).
        lines.append(f"#SBATCH --gpus-per-task={args.gpus_per_task}" if args.isolate_gpus
                     else f"#SBATCH --gpus-per-node={args.gpus_per_task * args.ntasks_per_node}")
    if args.signal_before:
        lines.append(f"#SBATCH --signal=USR1@{args.signal_before}")
    for flag, value in (("partition", args.partition), ("account", args.account), ("qos", args.qos)):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    lines.append("#SBATCH --no-requeue" if args.no_requeue else "#SBATCH --requeue")
    if args.elastic:
        lines.append("#SBATCH --no-kill")  # a node that dies leaves the allocation to the others
    lines += [f"#SBATCH {a}" for a in args.sbatch_arg]
    lines += [
        "",
        "set -uo pipefail",
        "# sbatch passes on the submitting shell's environment: a TESSERA_RANK there would be every",
        "# rank's rank (it comes before SLURM_PROCID). Only a replacement is given one, below.",
        "unset TESSERA_RANK TESSERA_WORLD_SIZE TESSERA_LOCAL_RANK TESSERA_ELASTIC_JOIN",
        f"LOG_DIR={q(log_dir)}/job-$SLURM_JOB_ID",
        'START=$(( ${SLURM_RESTART_COUNT:-0} + 1 ))  # 1 on the first start, 2 after one requeue, ...',
        'mkdir -p "$LOG_DIR"',
        'echo "=== start $START of job $SLURM_JOB_ID on $SLURM_JOB_NODELIST at $(date -Is) ==="',
        "",
        "# Compute threads of each rank: the cores Slurm gave the task.",
        "export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}",
    ]
    for item in args.env:
        name, value = item.split("=", 1)
        lines.append(f"export {name}={q(value)}")
    if args.comm_timeout:
        lines.append(f"export TESSERA_COMM_TIMEOUT={args.comm_timeout}")
    if args.iface:
        lines.append(f"export {'NCCL_SOCKET_IFNAME' if args.backend == 'nccl' else 'TESSERA_GLOO_IFACE'}={q(args.iface)}")

    # --elastic: a task that fails or a node that dies ends neither the step nor its other tasks.
    stop = ["--kill-on-bad-exit=0", "--wait=0", "--no-kill"] if args.elastic else ["--kill-on-bad-exit=1"]
    srun = ["srun", *stop, "--cpus-per-task=$SLURM_CPUS_PER_TASK", '--output="$LOG_DIR/rank-%t.log"',
            "--open-mode=append"]
    if args.backend == "mpi":
        srun.insert(1, f"--mpi={args.mpi}")
    if args.backend in ("gloo", "nccl"):
        lines += ["", "# Rendezvous: every rank finds the others through this store."]
        if args.store == "file":
            lines += ["# A fresh directory per start, under the log folder (every node must see it).",
                      'export TESSERA_STORE="file://$LOG_DIR/store-$START"', 'mkdir -p "$LOG_DIR/store-$START"']
        elif args.store == "redis":
            lines += [
                "# A private redis-server on this node, the host of task 0, for the job's lifetime. Other",
                "# nodes must reach it, so it listens on every interface: a fresh password (in a file only",
                "# this user reads, never on a command line) keeps other users of the cluster out.",
                "REDIS_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind((\"\", 0)); print(s.getsockname()[1])')",
                "export TESSERA_REDIS_PASSWORD=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \\n')",
                '(umask 077; printf "requirepass %s\\n" "$TESSERA_REDIS_PASSWORD" > "$LOG_DIR/redis-$START.conf")',
                'redis-server "$LOG_DIR/redis-$START.conf" --port "$REDIS_PORT" --save "" --appendonly no '
                '--protected-mode no > "$LOG_DIR/redis-$START.log" 2>&1 &',
                "REDIS_PID=$!",
                'trap \'kill "$REDIS_PID" 2>/dev/null\' EXIT',
                'for _ in $(seq 100); do REDISCLI_AUTH="$TESSERA_REDIS_PASSWORD" redis-cli -p "$REDIS_PORT" ping 2>/dev/null '
                '| grep -q PONG && break; sleep 0.1; done',
                'export TESSERA_STORE="redis://$(hostname):$REDIS_PORT"',
            ]
        else:
            lines.append(f"export TESSERA_STORE={q(args.store)}")
        lines.append('export TESSERA_STORE_PREFIX="job-$SLURM_JOB_ID-start-$START"')
        if args.nodes > 1:
            lines += preflight(args)

    lines += ["", "# The program and its flags.", f"PROGRAM=({quote_all(command)})"]
    if args.checkpoint:
        checkpoint = q(absolute(args.checkpoint))
        lines += [
            "",
            "# Resume from the last checkpoint when there is one (after a requeue or a resubmission).",
            f"CHECKPOINT={checkpoint}",
            'RESUME=()',
            'if [ -s "$CHECKPOINT" ]; then RESUME=(--resume="$CHECKPOINT"); echo "resuming from $CHECKPOINT"; fi',
        ]
        lines.append('PROGRAM+=(--checkpoint="$CHECKPOINT" "${RESUME[@]}")')
    lines += [
        "",
        "# Each rank records its node as it starts (rank-<r>.node) and its exit status as it ends",
        "# (rank-<r>.exit), for the summary below; a rank that srun stopped after another one failed,",
        "# or whose node died, records no exit status.",
        'for r in $(seq 0 $((SLURM_NTASKS - 1))); do echo "=== start $START ===" >> "$LOG_DIR/rank-$r.log"; done',
        'rm -f "$LOG_DIR"/rank-*.exit "$LOG_DIR"/rank-*.node',
        "# The wrapper outlives the signals meant for the program (Slurm signals every process of",
        "# the step), so that it still records the program's exit status. A rank that stopped on a",
        "# signal with its checkpoint saved (75) exits 0 to srun: a bad exit would make srun kill the",
        "# ranks still finishing theirs, rank 0 perhaps while it writes the checkpoint.",
        "# A replacement (--elastic) is slot TESSERA_RANK; srun numbers its one task 0.",
        "TASK='trap : USR1 TERM; slot=${TESSERA_RANK:-$SLURM_PROCID}; "
        "echo \"${SLURMD_NODENAME:-$(hostname)}\" > \"$LOG_DIR/rank-$slot.node\"; "
        "\"$@\"; code=$?; echo $code > \"$LOG_DIR/rank-$slot.exit\"; [ $code = 75 ] && exit 0; exit $code'",
        "export LOG_DIR",
        f"LAUNCH=({' '.join(srun)})",
        'echo "launch: ${LAUNCH[*]} ${PROGRAM[*]}"',
        "# srun runs in the background so that a SIGTERM to this script (scancel, the time limit, a",
        "# requeue, a node failure that ends the job) still leaves the summary: bash runs a trap only",
        "# between commands, and a signal interrupts `wait`. srun got the SIGTERM too and stops the",
        "# ranks; it is given 2 s to collect their exit statuses (the script then exits 143).",
        'STOPPED=""',
        "trap 'STOPPED=1' TERM",
        '"${LAUNCH[@]}" bash -c "$TASK" rank "${PROGRAM[@]}" &',
        "SRUN_PID=$!",
    ]
    if args.elastic:
        lines += elastic_monitor(args)
    else:
        lines += [
            'wait "$SRUN_PID"',
            "STATUS=$?",
            '[ -n "$STOPPED" ] && for _ in $(seq 20); do kill -0 "$SRUN_PID" 2>/dev/null || break; sleep 0.1; done',
        ]
    lines += [
        "# From here a SIGTERM (the job ending as the summary is written) is ignored, by this shell and",
        "# the commands it starts; Slurm's SIGKILL, KillWait seconds later, still ends them.",
        "trap '' TERM",
        "",
        "# Summary: every rank's node and status, and what the failed ones said. A rank without an exit",
        "# status whose node Slurm marks DOWN or NOT_RESPONDING was lost with its node (power, network).",
        "declare -A NODE_STATE  # scontrol asked once per node, and only for ranks without an exit status",
        "{",
        '  if [ -n "$STOPPED" ]; then echo "job $SLURM_JOB_ID start $START: stopped by SIGTERM (scancel, the time '
        'limit, a requeue, or a node failure: see job-$SLURM_JOB_ID.out)"; '
        'else echo "job $SLURM_JOB_ID start $START: srun exited with $STATUS"; fi',
    ]
    if args.elastic:
        lines += [
            '  if [ -s "$LOG_DIR/replacements.txt" ]; then echo "elastic: the ranks that failed while others ran '
            '(a replacement joins as the same rank):"; sed "s/^/  /" "$LOG_DIR/replacements.txt"; fi',
            '  echo "elastic: each rank as it ended (the last process of its slot):"',
        ]
    lines += [
        '  lost=""',
        '  missing=""',
        '  for r in $(seq 0 $((SLURM_NTASKS - 1))); do',
        '    node=$(cat "$LOG_DIR/rank-$r.node" 2>/dev/null || echo "no node")',
        # A rank that srun stopped may still record its exit: 128 + the signal (143: SIGTERM), when
        # the wrapping shell outlives its program by an instant. Both say what happened.
        '    dead=""',
        '    if [ -f "$LOG_DIR/rank-$r.exit" ]; then',
        '      code=$(cat "$LOG_DIR/rank-$r.exit")',
        '    elif [ ! -f "$LOG_DIR/rank-$r.node" ]; then',
        '      code="none: it never started (srun\'s errors are in job-$SLURM_JOB_ID.out)"; missing="$missing $r"',
        "    else",
        '      missing="$missing $r"',
        '      [ -n "${NODE_STATE[$node]+set}" ] || '
        'NODE_STATE[$node]=$(scontrol show node "$node" --oneliner 2>/dev/null)',
        '      state=$(grep -o "State=[^ ]*" <<< "${NODE_STATE[$node]}")',
        '      case "$state" in *DOWN*|*NOT_RESPONDING*|*FAIL*)',
        '        dead=1; lost="$lost $r"',
        '        code="none: $node stopped answering Slurm ($state, $(grep -o "Reason=.*" <<< "${NODE_STATE[$node]}" '
        '|| echo "no reason given")): the node died or its network failed";;',
        '      *) code="none (stopped by Slurm after another rank failed, or killed)";;',
        "      esac",
        "    fi",
        '    case "$code" in 129|13[0-9]|14[0-9]|15[0-9]) '
        'code="$code (signal $((code - 128)): stopped by Slurm after another rank failed, or killed)";; '
        '75) code="75 (stopped on a signal with its checkpoint saved)";; esac',
        '    echo "rank $r ($node): exit $code"',
        '    if [ "$code" != 0 ] && [ -f "$LOG_DIR/rank-$r.exit" ]; then',
        '      echo "--- rank $r: error lines ---"; grep -i -m 10 -E "error|timed out" "$LOG_DIR/rank-$r.log"',
        '      echo "--- rank $r: last lines ---"; tail -n 15 "$LOG_DIR/rank-$r.log"',
        '    elif [ -n "$dead" ]; then',
        '      echo "--- rank $r: last lines before its node stopped answering ---"; tail -n 5 "$LOG_DIR/rank-$r.log"',
        "    fi",
        "  done",
        '  if [ -n "$lost" ]; then echo "ranks lost with their node:$lost"; fi',
    ]
    if args.elastic:
        # The group goes on without a failed rank, so srun's status (a killed task's) is not the
        # job's: the job succeeded when a rank finished the training, which the group's members do
        # together (a failure after that is reported above, as the launcher does).
        lines += [
            '  finished=""',
            '  for r in $(seq 0 $((SLURM_NTASKS - 1))); do '
            '[ "$(cat "$LOG_DIR/rank-$r.exit" 2>/dev/null)" = 0 ] && finished="$finished $r"; done',
            '  if [ -z "$STOPPED" ] && [ -n "$finished" ]; then',
            '    echo "elastic: the group finished (ranks$finished exited 0)"; STATUS=0',
            "  else",
            '    echo "elastic: no rank finished the training"; [ "$STATUS" = 0 ] && STATUS=1',
            "  fi",
        ]
    else:
        # srun (22.05) exits 0 when it could not launch the tasks: no rank may go missing in a success.
        lines += [
            '  if [ "$STATUS" = 0 ] && [ -n "$missing" ]; then',
            '    echo "srun exited 0, but ranks$missing left no exit status: the job failed"; STATUS=1',
            "  fi",
        ]
    lines += [
        '} > "$LOG_DIR/summary.txt"',
        'cat "$LOG_DIR/summary.txt"',
    ]
    if args.checkpoint:
        lines += [
            "",
            "# Every rank stopped on a signal (the time limit near) with the checkpoint saved: back to",
            "# the queue, and the next start resumes from it. Not when this script got a SIGTERM: Slurm",
            "# is then ending the job itself, or requeueing it (a node failure, an administrator).",
            'stopped=0',
            '[ -n "$STOPPED" ] || for r in $(seq 0 $((SLURM_NTASKS - 1))); do '
            '[ "$(cat "$LOG_DIR/rank-$r.exit" 2>/dev/null)" = 75 ] && stopped=$((stopped + 1)); done',
            'if [ "$stopped" -gt 0 ] && [ "$stopped" = "$SLURM_NTASKS" ]; then',
            ('  echo "every rank saved its checkpoint on a signal; --no-requeue: resubmit to resume from $CHECKPOINT"; '
             'STATUS=75' if args.no_requeue else
             '  echo "every rank saved its checkpoint on a signal: requeueing job $SLURM_JOB_ID to resume from it"\n'
             '  scontrol requeue "$SLURM_JOB_ID" && exit 0\n'
             '  echo "scontrol requeue failed: resubmit to resume from $CHECKPOINT"; STATUS=75'),
            'elif [ "$stopped" -gt 0 ]; then',
            '  echo "only $stopped of $SLURM_NTASKS ranks saved a checkpoint on the signal: not requeued"',
            '  [ "$STATUS" = 0 ] && STATUS=1',
            'fi',
        ]
    lines.append('exit "$STATUS"')
    return "\n".join(lines) + "\n"

