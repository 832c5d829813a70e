#!/usr/bin/env python3
"""Elastic fault campaign: a rank of a 4-rank elastic Gloo job is killed (kill -9), stopped
(SIGSTOP) or cut off (its network link taken down) at a random time of training; the survivors
must go on without restarting, and with --replace a new process must join and the group return to 4.

  python3 bench/elastic_campaign.py [--build build] [--faults kill,stop,link] [--replace 0,1]
                                    [--trials 100] [--timeout 2] [--netns] [--strategy dp|zero1|fsdp2|fsdp3] [--out FILE]

--netns (as root; needed for the link fault) puts each rank on a host of its own: a Linux network
namespace joined to the others by a bridge (tests/net/netns_test.py's Network, created per
campaign and always deleted), started through tessera-run --hosts with `ip netns exec` and
--iface eth0. A link fault takes the victim's eth0 down; it comes back up once the others have
formed their new generation (the victim must then find itself left out and exit).

Each trial runs `tools/tessera-run -n 4 --elastic [--replace 1]` on examples/19_elastic_gloo
(LeNet-5, Fashion-MNIST, --check-every=1: DataParallel compares the replicas' parameter checksums
after every step; --strategy zero1, fsdp2, fsdp3: ZeRO-1 or FSDP with replicated shards, the example's
--zero=1, 2, 3, compare them too) with TESSERA_COMM_TIMEOUT=<timeout>. Once rank 0 reports training progress it
waits a random delay (uniform in [0, --max-delay] s), then signals a random rank's process; a
stopped one is continued after the job's final line (it must then find itself left out and exit).
Per trial it records:

  hang         the job had not ended --budget seconds after the fault (killed then; goal 0)
  continued    a new generation of 3 ranks formed and the job printed its final line
  kept         the survivors' processes, when the new generation formed, were the ones started at
               launch (the same pids: nothing was restarted)
  steps_lost   optimizer steps the group went back: the largest step a survivor reported at the
               failure minus the step it healed to (goal 0: at most the step in flight is redone)
  diverged     the members' parameter checksums differ after a change or at the end, or
               DataParallel's per-step comparison failed (goal 0)
  rejoined     (--replace) the final line says 4 ranks and the replacement's checksum at its join
               equals the others'
  recovery_s   from the fault to the new generation's first line (detection + check-in + mesh +
               heal); a stop costs the timeout first
  accuracy     the final test accuracy, and its difference from an uninterrupted run's (same
               settings, run first)

Results: one JSON line per (fault, replace) in --out (default bench/out/elastic_campaign_<date>.json),
with the CPU model and medians; a table at the end. tests/parallel/elastic_fault_test.py runs one
trial of each kind through run_trial().
"""
import argparse
import datetime
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fault_campaign  # noqa: E402  (its Job: the launcher with its output read by a thread)
FINAL_RE = re.compile(r"final: (\d+) ranks \(generation (\d+), (\d+) change\(s\)\), test accuracy ([\d.]+)%, "
                      r"replicas identical \(([0-9a-f]+)\)")
GEN_RE = re.compile(r"elastic: generation (\d+): (\d+) -> (\d+) ranks.* at step (\d+), state from rank (\d+); "
                    r"membership ([\d.]+) s, heal ([\d.]+) s")
# --strategy: the example's --zero (0: DataParallel; 1: ZeRO-1; 2, 3: FSDP; shards on two ranks each).
STRATEGIES = {"dp": 0, "zero1": 1, "fsdp2": 2, "fsdp3": 3}
MEMBER_RE = re.compile(r"member (\S+): rank (\d+) of (\d+) at step (\d+), parameters ([0-9a-f]+)")
FAIL_RE = re.compile(r"tessera: elastic: member (\S+) .* after step (\d+): ")


class Job(fault_campaign.Job):
    """fault_campaign's launcher job, its output lines timestamped as they arrive."""

    def _read(self):
        for line in iter(self.proc.stdout.readline, b""):
            self.lines.append((time.monotonic(), line.decode("utf-8", "replace")))

    def text(self):
        return "".join(text for _, text in self.lines)

    def first(self, pattern, after=0.0):
        for t, text in list(self.lines):
            if t >= after and re.search(pattern, text):
                return t, text
        return None

    def rank_pids(self):
        """The ranks' processes: the launcher's children other than its reaper (a python process)."""
        try:
            out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        except OSError:
            return []
        pids = []
        for word in out.split():
            try:
                with open(f"/proc/{word}/cmdline", "rb") as f:
                    cmd = f.read().split(b"\0")
            except OSError:
                continue
            if cmd and b"19_elastic" in cmd[0]:
                pids.append(int(word))
        return sorted(pids)

    def kill_all(self):
        pids = self.rank_pids()  # before the launcher goes: they are found as its children
        super().kill_all()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def example_args(args):
    zero = STRATEGIES[getattr(args, "strategy", "dp")]
    return [f"--epochs={args.epochs}", f"--limit={args.limit}", "--check-every=1", f"--settle={args.settle}",
            f"--seed={args.seed}", f"--zero={zero}"]


def launch(args, replace):
    program = os.path.join(args.build, "examples", "19_elastic_gloo")
    argv = [sys.executable, os.path.join(ROOT, "tools", "tessera-run"), "-n", "4", "--elastic"]
    if getattr(args, "network", None) is not None:
        argv += ["--hosts", ",".join(args.network.hosts), "--rsh", "ip netns exec {host} sh -c", "--iface", "eth0"]
    if replace:
        argv += ["--replace", "1"]
    argv += ["--timeout", str(args.timeout), program] + example_args(args)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return Job(argv, env)


def uninterrupted(args):
    """The accuracy of the same run without a fault."""
    job = launch(args, False)
    try:
        job.proc.wait(timeout=args.budget * 4)
    except subprocess.TimeoutExpired:
        job.kill_all()
        raise SystemExit("the uninterrupted run did not finish")
    m = FINAL_RE.search(job.text())
    if job.proc.returncode != 0 or not m:
        raise SystemExit(f"the uninterrupted run failed (exit {job.proc.returncode}):\n{job.text()[-3000:]}")
    return float(m.group(4))


def run_trial(args, fault, replace, rng, baseline=None):
    """One trial; returns its record (see the module's docstring)."""
    job = launch(args, replace)
    record = {"fault": fault, "replace": replace}
    try:
        started = time.monotonic()
        while job.first(r"\] epoch 1/") is None and job.proc.poll() is None:
            if time.monotonic() - started > args.budget * 3:
                job.kill_all()
                return dict(record, error="training never started", output=job.text()[-3000:])
            time.sleep(0.01)
        pids = job.rank_pids()
        time.sleep(rng.uniform(0, args.max_delay))
        if job.proc.poll() is not None or len(pids) != 4:
            job.kill_all()
            return dict(record, too_late=True)
        victim = rng.choice(pids)
        slot = slot_of(victim)
        fault_at = time.monotonic()
        if fault == "link":
            args.network.link(slot, "down")
        else:
            os.kill(victim, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        record["victim_slot"] = slot
        survivors = [p for p in pids if p != victim]
        # The job must end within the budget. A stopped victim is continued once the others have
        # formed their new generation (a stall that ends after the timeout): it must find itself
        # left out and exit, and with --replace its slot gets a new process.
        continued_victim = False
        while job.proc.poll() is None and time.monotonic() - fault_at < args.budget:
            if fault != "kill" and not continued_victim and job.first(r"elastic: generation 1: ", fault_at):
                resume_victim(args, fault, victim, slot)
                continued_victim = True
            if "survivors_kept" not in record and job.first(r"elastic: generation 1: ", fault_at):
                record["survivors_kept"] = all(os.path.exists(f"/proc/{p}") for p in survivors)
            time.sleep(0.01)
        if fault != "kill" and not continued_victim:
            resume_victim(args, fault, victim, slot)
        record["hang"] = job.proc.poll() is None
        if record["hang"]:
            job.kill_all()
        job.proc.wait()
        job.reader.join(timeout=5)
        text = job.text()
        return dict(record, **judge(job, text, fault_at, replace, baseline))
    finally:
        job.kill_all()


def slot_of(pid):
    """The slot (TESSERA_RANK) a rank's process was started as."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for entry in f.read().split(b"\0"):
                if entry.startswith(b"TESSERA_RANK="):
                    return int(entry.split(b"=", 1)[1])
    except OSError:
        pass
    return -1


def resume_victim(args, fault, victim, slot):
    """Ends a stop or a link fault: the victim runs (or is reachable) again."""
    if fault == "stop":
        try:
            os.kill(victim, signal.SIGCONT)
        except ProcessLookupError:
            pass
    elif fault == "link":
        args.network.link(slot, "up")


def judge(job, text, fault_at, replace, baseline):
    out = {"exit": job.proc.returncode}
    final = FINAL_RE.search(text)
    first_change = job.first(r"elastic: generation 1: 4 -> 3", fault_at)
    out["continued"] = bool(final) and first_change is not None
    out["recovery_s"] = round(first_change[0] - fault_at, 4) if first_change else None
    gens = [m.groups() for m in GEN_RE.finditer(text)]
    # The survivors' reports of the first failure: those before the first new generation's line.
    first_gen = text.find("elastic: generation 1:")
    failures = [int(m.group(2)) for m in FAIL_RE.finditer(text[:first_gen if first_gen >= 0 else len(text)])]
    if gens and failures:
        out["steps_lost"] = max(failures) - int(gens[0][3])
    checks = {}
    for m in MEMBER_RE.finditer(text):
        checks.setdefault((m.group(3), m.group(4)), set()).add(m.group(5))
    out["diverged"] = (any(len(v) > 1 for v in checks.values()) or "disagree" in text or "differ" in text
                       or (final is None and out["continued"]))
    if final:
        out["final_ranks"] = int(final.group(1))
        out["accuracy"] = float(final.group(4))
        if baseline is not None:
            out["accuracy_delta"] = round(out["accuracy"] - baseline, 4)
    if replace:
        grew = [g for g in gens if g[1] == "3" and g[2] == "4"]
        out["rejoined"] = bool(final) and int(final.group(1)) == 4 and bool(grew) and all(
            len(v) == 1 for (size, _), v in checks.items() if size == "4")
    if gens:
        out["membership_s"] = float(gens[0][5])
        out["heal_s"] = float(gens[0][6])
    out["output"] = text
    return out


def summarize(records, fault, replace):
    rows = [r for r in records if not r.get("too_late")]
    rec = [r["recovery_s"] for r in rows if r.get("recovery_s") is not None]
    deltas = [abs(r["accuracy_delta"]) for r in rows if "accuracy_delta" in r]
    return {
        "fault": fault, "replace": replace, "trials": len(rows),
        "hangs": sum(1 for r in rows if r.get("hang")),
        "continued": sum(1 for r in rows if r.get("continued")),
        "survivors_kept": sum(1 for r in rows if r.get("survivors_kept")),
        "diverged": sum(1 for r in rows if r.get("diverged")),
        "rejoined": sum(1 for r in rows if r.get("rejoined")) if replace else None,
        "steps_lost_max": max((r["steps_lost"] for r in rows if "steps_lost" in r), default=None),
        "recovery_median_s": round(statistics.median(rec), 4) if rec else None,
        "recovery_max_s": round(max(rec), 4) if rec else None,
        "accuracy_delta_max": round(max(deltas), 4) if deltas else None,
        "accuracy_delta_median": round(statistics.median(deltas), 4) if deltas else None,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--faults", default="kill,stop")
    ap.add_argument("--replace", default="0,1", help="rows without (0) and with (1) a replacement")
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--timeout", type=float, default=2.0, help="TESSERA_COMM_TIMEOUT of the ranks")
    ap.add_argument("--settle", type=float, default=0.0, help="the example's --settle (0: the timeout)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--limit", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-delay", type=float, default=1.0, help="fault at a random time this long after training starts")
    ap.add_argument("--budget", type=float, default=60.0, help="seconds after the fault before a job counts as hung")
    ap.add_argument("--random-seed", type=int, default=12345)
    ap.add_argument("--netns", action="store_true", help="one network namespace per rank (root; the link fault needs it)")
    ap.add_argument("--strategy", choices=tuple(STRATEGIES), default="dp",
                    help="dp: DataParallel; zero1: ZeRO-1, fsdp2 / fsdp3: FSDP of that stage, each shard on two ranks "
                    "(the example's --zero=1, 2, 3)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.network = None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` deletes the namespaces
    if "link" in args.faults.split(",") and not args.netns:
        ap.error("the link fault needs --netns (a link to take down)")
    if args.netns:
        sys.path.insert(0, os.path.join(ROOT, "tests", "net"))
        import netns_test  # noqa: E402
        why = netns_test.can_run()
        if why:
            raise SystemExit(f"--netns: {why}")
        netns_test.remove_stale_namespaces()
        args.network = netns_test.Network(4)
        args.network.up()
    try:
        campaign(args)
    finally:
        if args.network is not None:
            args.network.down()


def campaign(args):
    rng = random.Random(args.random_seed)
    from bench_common import cpu_model  # noqa: E402
    baseline = uninterrupted(args)
    print(f"uninterrupted run: test accuracy {baseline:.2f}%", flush=True)
    out = args.out or os.path.join(ROOT, "bench", "out", f"elastic_campaign_{datetime.date.today()}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    rows = []
    for fault in args.faults.split(","):
        for replace in [int(x) for x in args.replace.split(",")]:
            records = []
            while len([r for r in records if not r.get("too_late")]) < args.trials:
                r = run_trial(args, fault, bool(replace), rng, baseline)
                records.append(r)
                bad = r.get("hang") or not r.get("continued") or r.get("diverged") or (replace and not r.get("rejoined"))
                if bad and not r.get("too_late"):
                    kept = f"{os.path.splitext(out)[0]}_bad_{fault}_{replace}_{len(records)}.txt"
                    with open(kept, "w") as f:
                        f.write(r.get("output", ""))
                    print(f"  {fault} replace={replace}: BAD trial (output in {kept}): "
                          f"{json.dumps({k: v for k, v in r.items() if k != 'output'})}", flush=True)
            row = summarize(records, fault, bool(replace))
            row.update(cpu=cpu_model(), timeout_s=args.timeout, ranks=4, backend="gloo", strategy=args.strategy,
                       epochs=args.epochs,
                       netns=args.network is not None,
                       limit=args.limit, uninterrupted_accuracy=baseline,
                       date=datetime.datetime.now().isoformat(timespec="seconds"))
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")
    print(f"\n{'fault':6} {'repl':4} {'trials':6} {'hangs':5} {'cont.':5} {'kept':5} {'div.':4} {'rejoin':6} "
          f"{'lost':4} {'recovery med/max s':18} {'|dacc| med/max':14}")
    for r in rows:
        print(f"{r['fault']:6} {int(r['replace']):4} {r['trials']:6} {r['hangs']:5} {r['continued']:5} "
              f"{r['survivors_kept']:5} {r['diverged']:4} {str(r['rejoined']):6} {str(r['steps_lost_max']):4} "
              f"{str(r['recovery_median_s']) + '/' + str(r['recovery_max_s']):18} "
              f"{r['accuracy_delta_median']}/{r['accuracy_delta_max']}")


if __name__ == "__main__":
    main()
