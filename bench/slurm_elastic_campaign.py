#!/usr/bin/env python3
"""Elastic jobs under Slurm, repeated: replacements started by Slurm (issue 51, "joining").

  python3 bench/slurm_elastic_campaign.py --fault kill --trials 50
  python3 bench/slurm_elastic_campaign.py --fault node --trials 10

Each trial is one check of the Slurm tests, run against a Slurm started once for the campaign:
  kill   tests/slurm/test_slurm.py's elastic job on a local Slurm (one node, 4 tasks of example
         19, tessera-sbatch --elastic --replace 1, TESSERA_COMM_TIMEOUT=2): a random rank is
         killed (SIGKILL) at a random time in the first --max-delay s of training; the batch
         script starts a replacement job step (srun --overlap) that joins as that rank
  node   tests/slurm/test_slurm_two_nodes.py's elastic job on two nodes in network namespaces
         (2 tasks each, --replace 2, TESSERA_COMM_TIMEOUT=5): node2 is taken down (link down,
         every process killed) at a random time; ranks 0 and 1 go on as 2, and once Slurm marks
         node2 down (SlurmdTimeout=6) the script starts replacements for ranks 2 and 3 on node1;
         node2 is brought back (a new slurmd) before the next trial

A trial passes when the check does: the job exits 0; the summary names the failure and the
replacement; the group shrank at the step the survivors failed after (no step lost) and grew
back to 4; every member's checksum agreed at the step the replacements joined; the survivors
kept their processes (kill). Measured per trial: recovery_s (from the fault to the new group's
first line in rank 0's log, polled every 50 ms), rejoined_s (to the line that brings it back to 4
ranks), the job's end, and the final test accuracy against an uninterrupted job of the same
settings (run first). A trial whose replacement came after the training ended (the group says
so to it) is drawn again and counted in too_late_redrawn. Results: one JSON line in --out (default
bench/out/slurm_elastic_campaign_<date>.json), with the CPU model; failed trials' messages too.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "slurm"))
sys.path.insert(0, str(ROOT / "tests" / "tools"))
from bench_common import cpu_model  # noqa: E402
from elastic_logs import TooLate  # noqa: E402
from local_slurm import LocalSlurm  # noqa: E402
from test_sbatch import JOB_TIMEOUT, TOOL, CheckFailed  # noqa: E402


def uninterrupted(slurm: LocalSlurm, log_dir: pathlib.Path, options: list[str], program: str,
                  args: tuple[str, ...]) -> float:
    """The final test accuracy of the same job without a fault."""
    done = subprocess.run([sys.executable, str(TOOL), "--wait", f"--log-dir={log_dir}", *options, "--", program, *args],
                          env=slurm.env(), capture_output=True, text=True, timeout=JOB_TIMEOUT)
    job = re.search(r"submitted job (\d+)", done.stdout)
    if done.returncode != 0 or not job:
        raise SystemExit(f"the uninterrupted job failed (exit {done.returncode}):\n{done.stdout}{done.stderr}")
    final = re.search(r"test accuracy ([\d.]+)%", (log_dir / f"job-{job.group(1)}" / "rank-0.log").read_text())
    if not final:
        raise SystemExit("the uninterrupted job printed no final accuracy")
    return float(final.group(1))


def summarize(records: list[dict[str, object]], baseline: float) -> dict[str, object]:
    ok = [r for r in records if "error" not in r]

    def stats(key: str) -> list[float]:
        return sorted(float(r[key]) for r in ok if key in r)  # type: ignore[arg-type]

    def median_max(key: str) -> list[float] | None:
        values = stats(key)
        return [round(statistics.median(values), 3), round(values[-1], 3)] if values else None
    deltas = sorted(abs(float(r["accuracy"]) - baseline) for r in ok)  # type: ignore[arg-type]
    return {
        "trials": len(records), "passed": len(ok), "failed": len(records) - len(ok),
        "hangs": sum(1 for r in records if r.get("hang")),
        "recovery_s_median_max": median_max("recovery_s"),
        "rejoined_s_median_max": median_max("rejoined_s"),
        "job_end_s_median_max": median_max("job_end_s"),
        "uninterrupted_accuracy": baseline,
        "accuracy_delta_median_max": [round(statistics.median(deltas), 3), round(deltas[-1], 3)] if deltas else None,
        "failures": [r["error"] for r in records if "error" in r][:10],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=str(ROOT / "build"))
    ap.add_argument("--fault", choices=("kill", "node"), default="kill")
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--max-delay", type=float, default=1.0, help="fault at a random time this long into training")
    ap.add_argument("--random-seed", type=int, default=12345)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    program = str(pathlib.Path(args.build, "examples", "19_elastic_gloo").resolve())
    rng = random.Random(args.random_seed)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `finally` stops Slurm, removes the namespaces
    work = pathlib.Path(tempfile.mkdtemp(prefix="tessera-slurm-campaign-"))
    records: list[dict[str, object]] = []
    if args.fault == "kill":
        import test_slurm
        slurm: LocalSlurm = LocalSlurm(work / "slurm")
        options = ["--ntasks-per-node=4", "--comm-timeout=2"]
        elastic_args = test_slurm.ELASTIC_ARGS
    else:
        import test_slurm_two_nodes
        from two_node_slurm import TwoNodeSlurm
        slurm = TwoNodeSlurm(work / "slurm")
        options = ["--nodes=2", "--ntasks-per-node=2", "--backend=gloo", "--iface=eth0", "--comm-timeout=5"]
        elastic_args = test_slurm_two_nodes.ELASTIC_ARGS
    try:
        slurm.__enter__()
        log_dir = work / "jobs"
        baseline = uninterrupted(slurm, log_dir, options, program, elastic_args)
        print(f"uninterrupted job: test accuracy {baseline:.2f}%", flush=True)
        too_late = 0
        while len(records) < args.trials and too_late <= args.trials:  # bounded: every trial too late ends it
            trial = len(records)
            delay = rng.uniform(0, args.max_delay)
            try:
                if args.fault == "kill":
                    victim = rng.randrange(4)
                    record = test_slurm.check_elastic_kill(slurm, log_dir, program, victim, delay)
                    record["victim_slot"] = victim
                else:
                    record = test_slurm_two_nodes.check_elastic_node_down(slurm, log_dir, program, delay)
            except TooLate as e:  # the training ended before the replacement was in: drawn again
                too_late += 1
                print(f"trial {trial}: drawn again: {e}", flush=True)
                continue
            except (CheckFailed, subprocess.TimeoutExpired) as e:
                text = str(e)
                record = {"error": text[:1000] + (" [...] " + text[-1000:] if len(text) > 2000 else text[1000:]),
                          "hang": isinstance(e, subprocess.TimeoutExpired) or "still waiting" in text}
                print(f"trial {trial}: FAILED: {text[:300]} [...] {text[-300:]}", flush=True)
            finally:
                if args.fault == "node":
                    slurm.bring_back("node2")  # type: ignore[attr-defined]
            record.pop("line", None)
            record["delay_s"] = round(delay, 3)
            records.append(record)
            if "error" not in record:  # a passed trial's store and logs go; a failed one's stay
                shutil.rmtree(log_dir / f"job-{record['job']}", ignore_errors=True)
    finally:
        slurm.stop()
    row = summarize(records, baseline)
    row.update(fault=args.fault, too_late_redrawn=too_late, cpu=cpu_model(), ranks=4, backend="gloo", launcher="tessera-sbatch --elastic",
               example_args=list(elastic_args), options=options, max_delay_s=args.max_delay,
               date=datetime.datetime.now().isoformat(timespec="seconds"))
    out = pathlib.Path(args.out or ROOT / "bench" / "out" / f"slurm_elastic_campaign_{datetime.date.today()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row))
    if row["failed"] == 0:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"the failed trials' logs are in {work}/jobs")
    return 0 if row["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
