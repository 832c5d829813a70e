#!/usr/bin/env python3
"""tools/tessera-simulate against measurement on this machine: LeNet-5 data-parallel steps.

    python3 bench/simulator_validation.py [--build build] [--rounds 3] [--rates 50,200,1000]

Per round, in this order, so that a noisy minute hits prediction and measurement alike:
  1. the profile: example 04 at one rank with --bucket-kib=1 and --trace, turned into the model
     profile by `tessera-simulate profile` (per-layer backward times from the bucket spans);
  2. measured step times of bench/dp_scaling (batch 64 per rank, 1 thread per rank, default
     buckets): 1 rank (plain training), then 2 and 4 ranks over ThreadComm, MPI and Gloo on this
     machine (loopback, shared memory);
  3. with root: Gloo at 2 ranks in two network namespaces joined by a bridge, host 1's link limited
     by a tc token bucket (tbf) at each of --rates Mbit/s (tests/net/netns_test.py's network).
Predictions use each round's own profile and the networks in tools/simulator/ (loopback_<comm>.json,
fitted to bench/collectives; netns_tbf_100mbit.json), twice:
  nominal inputs: the simulator's time-sharing estimate of compute on a shared node (P x threads /
    cores) and, across namespaces, the tbf's rate as the link bandwidth;
  measured inputs: the node's co-run slowdown (compute_slowdown: 2 and 4 independent 1-rank
    trainings at once, this round, against one alone; no communication in it) and the link's
    goodput measured by a separate all_reduce benchmark (tests/net/bandwidth_main.cpp, 4 MiB). The table reports medians
over rounds, the errors (predicted - measured) / measured, and whether they are within 15%. Writes bench/out/simulator_validation_<date>.json, a markdown table for
docs/simulator.md (--markdown) and, with matplotlib, a plot of efficiency against P (--plot).
"""
import argparse
import datetime
import importlib.util
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "tessera-simulate"
NETWORKS = ROOT / "tools" / "simulator"
BATCH = 64
TOLERANCE = 0.15


def cpu_model():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def run(argv, env=None, timeout=300, what=None):
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=env, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"{what or argv[0]} failed (exit {done.returncode}): {' '.join(map(str, argv))}\n"
                           f"{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout


def json_line(text, what):
    for line in text.splitlines():
        line = line.split("] ", 1)[-1] if line.startswith("[rank") else line
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{what} printed no JSON line:\n{text[-2000:]}")


def env_for_runs():
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", TESSERA_COMM_TIMEOUT="120")
    env.pop("OMP_NUM_THREADS", None)  # --threads=1 is given; nothing else should choose
    return env


def make_profile(build, work, round_index):
    trace, ckpt = work / f"trace-{round_index}.json", work / f"ckpt-{round_index}.safetensors"
    profile = work / f"profile-{round_index}.json"
    run([build / "examples" / "04_data_parallel_threads", "--ranks=1", "--threads=1", "--epochs=1", "--limit=6400",
         "--bucket-kib=1", f"--trace={trace}", f"--checkpoint={ckpt}"], env=env_for_runs(), what="example 04 profile run")
    run([sys.executable, TOOL, "profile", "--trace", trace, "--checkpoint", ckpt, "--bucket-kib", "1", "--batch",
         str(BATCH), "--name", f"LeNet-5, batch {BATCH}, 1 thread (round {round_index})", "-o", profile],
        what="tessera-simulate profile")
    return profile


def measure_local(build, comm, ranks, steps):
    binary = build / "bench" / f"dp_scaling_{comm}"
    args = ["--model=lenet", f"--batch={BATCH}", "--threads=1", f"--steps={steps}", "--warmup=5"]
    env = env_for_runs()
    if comm == "threads":
        out = run([binary, f"--ranks={ranks}", *args], env=env, what=f"dp_scaling_threads {ranks}")
    elif comm == "mpi":
        out = run(["mpirun", "--oversubscribe", "-n", str(ranks), binary, *args], env=env, what=f"dp_scaling_mpi {ranks}")
    else:
        out = run([sys.executable, ROOT / "tools" / "tessera-run", "-n", str(ranks), binary, *args], env=env,
                  what=f"dp_scaling_gloo {ranks}")
    r = json_line(out, f"dp_scaling_{comm}")
    return r["seconds"] / r["steps"]  # the slowest rank's seconds per step


def measure_corun(build, k, steps):
    """One worker's step time when k independent 1-rank trainings run at once on this machine:
    what sharing the node costs compute alone (cores, caches, memory bandwidth), no communication."""
    argv = [str(build / "bench" / "dp_scaling_threads"), "--ranks=1", "--model=lenet", f"--batch={BATCH}",
            "--threads=1", f"--steps={steps}", "--warmup=5"]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_for_runs(),
                              stdin=subprocess.DEVNULL) for _ in range(k)]
    times = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"co-run of {k} dp_scaling_threads failed (exit {proc.returncode}):\n{err[-2000:]}")
        r = json_line(out, "co-run dp_scaling_threads")
        times.append(r["seconds"] / r["steps"])
    return statistics.mean(times)


def netns_module():
    spec = importlib.util.spec_from_file_location("netns_test", ROOT / "tests" / "net" / "netns_test.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure_netns(netns, net, build, rate_mbit, steps):
    """Step time of 2-rank Gloo training across the limited link, and the link's goodput as a
    separate all_reduce benchmark measures it (4 MiB, the bandwidth regime): the network
    description's measured bandwidth, which a tbf at a high rate does not reach."""
    net.limit(1, rate_mbit)
    try:
        env = env_for_runs()
        launcher = [sys.executable, ROOT / "tools" / "tessera-run", "--hosts", ",".join(net.hosts[:2]), "--rsh",
                    "ip netns exec {host} sh -c", "--iface", "eth0", "--timeout", "120", "--"]
        argv = launcher + [build / "bench" / "dp_scaling_gloo", "--model=lenet", f"--batch={BATCH}", "--threads=1",
                           f"--steps={steps}", "--warmup=3"]
        r = json_line(run(argv, env=env, timeout=600, what=f"dp_scaling_gloo over {rate_mbit} Mbit/s"), "netns run")
        bw = json_line(run(launcher + [build / "tests" / "net_bandwidth_gloo", "--bytes", str(4 << 20), "--seconds",
                                       "1"], env=env, timeout=300, what=f"net_bandwidth_gloo over {rate_mbit} Mbit/s"),
                       "netns bandwidth")
    finally:
        net.unlimit(1)
    return r["seconds"] / r["steps"], bw["busbw_MBps"] * 1e6


def predict(profile, network, workers, settings=()):
    argv = [sys.executable, TOOL, "dp", "--profile", profile, "--network", network, "--workers",
            ",".join(map(str, workers)), "--json"]
    for s in settings:
        argv += ["--set", s]
    rows = json.loads(run(argv, what="tessera-simulate dp"))["rows"]
    return {row["workers"]: row["step_s"] for row in rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=str(ROOT / "build"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60, help="timed steps per local run")
    ap.add_argument("--rates", default="50,200,1000", help="tbf rates in Mbit/s for the namespace runs ('' for none)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" /
                                         f"simulator_validation_{datetime.date.today().isoformat()}.json"))
    ap.add_argument("--markdown", help="also write the table as markdown here")
    ap.add_argument("--plot", help="efficiency against P, predicted lines and measured points (matplotlib)")
    ap.add_argument("--replot", metavar="JSON", help="only draw --plot from an earlier run's JSON")
    args = ap.parse_args()
    if args.replot:
        if not args.plot:
            sys.exit("simulator_validation: --replot needs --plot FILE.png")
        earlier = json.loads(pathlib.Path(args.replot).read_text())
        plot(earlier["rows"], args.plot, earlier)
        return 0
    build = pathlib.Path(args.build).resolve()
    for target in ("examples/04_data_parallel_threads", "bench/dp_scaling_threads", "bench/dp_scaling_mpi",
                   "bench/dp_scaling_gloo"):
        if not (build / target).exists():
            sys.exit(f"simulator_validation: {build / target} is missing: ninja -C {build} {target}")
    rates = [int(r) for r in args.rates.split(",") if r.strip()]
    if rates and not (build / "tests" / "net_bandwidth_gloo").exists():
        sys.exit(f"simulator_validation: {build / 'tests' / 'net_bandwidth_gloo'} is missing: "
                 f"ninja -C {build} tests/net_bandwidth_gloo")
    netns, net, why_not = None, None, None
    if rates:
        netns = netns_module()
        why_not = netns.can_run()
        if why_not is None:
            netns.remove_stale_namespaces()
            net = netns.Network(2)
            net.up()
        else:
            print(f"note: no namespace runs: {why_not}", file=sys.stderr)
    cases = [("local", "threads", 1)] + [("local", c, p) for p in (2, 4) for c in ("threads", "mpi", "gloo")]
    cases += [("netns", "gloo", rate) for rate in (rates if net else [])]
    samples = {c: {"measured": [], "predicted": [], "predicted_corun": []} for c in cases}
    slowdowns, goodputs = [], {}
    work = pathlib.Path(tempfile.mkdtemp(prefix="tessera-simval-"))
    started = time.monotonic()
    try:
        for k in range(args.rounds):
            profile = make_profile(build, work, k)
            # What sharing this machine costs compute alone, measured this round: 2 and 4
            # independent 1-rank trainings at once against one alone.
            alone = measure_local(build, "threads", 1, args.steps)
            slowdown = {n: measure_corun(build, n, args.steps) / alone for n in (2, 4)}
            slowdowns.append(slowdown)
            corun = [f"compute_slowdown.{n}={f:.4f}" for n, f in slowdown.items()]
            predictions = {comm: predict(profile, NETWORKS / f"loopback_{comm}.json", [1, 2, 4])
                           for comm in ("threads", "mpi", "gloo")}
            with_corun = {comm: predict(profile, NETWORKS / f"loopback_{comm}.json", [1, 2, 4], corun)
                          for comm in ("threads", "mpi", "gloo")}
            for case in cases:
                kind, comm, x = case
                if kind == "local":
                    measured = alone if x == 1 else measure_local(build, comm, x, args.steps)
                    predicted, predicted_corun = predictions[comm][x], with_corun[comm][x]
                else:
                    measured, goodput = measure_netns(netns, net, build, x, max(20, args.steps // 3))
                    goodputs.setdefault(x, []).append(goodput)
                    predicted = predict(profile, NETWORKS / "netns_tbf_100mbit.json", [2],
                                        [f"inter.beta_Bps={x * 1e6 / 8:g}"])[2]
                    # Measured inputs: the link's goodput, and (one worker per namespace "node", but
                    # both namespaces share this machine's cores) the 2-process co-run slowdown.
                    predicted_corun = predict(profile, NETWORKS / "netns_tbf_100mbit.json", [2],
                                              [f"inter.beta_Bps={goodput:g}",
                                               f"compute_slowdown.1={slowdown[2]:.4f}"])[2]
                samples[case]["measured"].append(measured)
                samples[case]["predicted"].append(predicted)
                samples[case]["predicted_corun"].append(predicted_corun)
                print(f"round {k + 1}: {kind} {comm} {x}: measured {measured * 1e3:.3f} ms, predicted "
                      f"{predicted * 1e3:.3f} ms, with the co-run slowdown {predicted_corun * 1e3:.3f} ms",
                      file=sys.stderr, flush=True)
    finally:
        if net:
            net.down()
    rows = []
    for (kind, comm, x), s in samples.items():
        measured, predicted = statistics.median(s["measured"]), statistics.median(s["predicted"])
        predicted_corun = statistics.median(s["predicted_corun"])
        error = (predicted - measured) / measured
        error_corun = (predicted_corun - measured) / measured
        rows.append({"where": "this machine (loopback)" if kind == "local" else "2 network namespaces, tc tbf",
                     "comm": comm, "ranks": x if kind == "local" else 2,
                     "link_Mbit": x if kind == "netns" else None,
                     "measured_step_ms": round(measured * 1e3, 4), "predicted_step_ms": round(predicted * 1e3, 4),
                     "error": round(error, 4), "within_15pct": abs(error) <= TOLERANCE,
                     "predicted_corun_step_ms": round(predicted_corun * 1e3, 4), "error_corun": round(error_corun, 4),
                     "within_15pct_corun": abs(error_corun) <= TOLERANCE,
                     "measured_runs_ms": [round(v * 1e3, 4) for v in s["measured"]],
                     "predicted_runs_ms": [round(v * 1e3, 4) for v in s["predicted"]],
                     "predicted_corun_runs_ms": [round(v * 1e3, 4) for v in s["predicted_corun"]]})
    result = {"bench": "simulator_validation", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "cpu": cpu_model(), "cores": os.cpu_count(), "model": "LeNet-5", "batch_per_rank": BATCH,
              "threads_per_rank": 1, "rounds": args.rounds, "tolerance": TOLERANCE,
              "networks": {c: f"tools/simulator/loopback_{c}.json" for c in ("threads", "mpi", "gloo")} |
                          {"netns": "tools/simulator/netns_tbf_100mbit.json with inter.beta_Bps = rate / 8"},
              "namespaces": why_not or ("used" if net else "not asked for"),
              "seconds": round(time.monotonic() - started, 1), "rows": rows,
              "corun_slowdown": {str(n): round(statistics.median(d[n] for d in slowdowns), 4) for n in (2, 4)},
              "corun_slowdown_runs": [{str(n): round(f, 4) for n, f in d.items()} for d in slowdowns],
              "netns_goodput_MBps": {str(rate): round(statistics.median(v) / 1e6, 2) for rate, v in goodputs.items()},
              "within_15pct": sum(r["within_15pct"] for r in rows),
              "within_15pct_corun": sum(r["within_15pct_corun"] for r in rows), "cases": len(rows)}
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    lines = ["| where | comm | ranks | link | measured step (ms) | predicted, nominal inputs (ms) | error "
             "| predicted, measured inputs (ms) | error |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        link = f"{r['link_Mbit']} Mbit/s" if r["link_Mbit"] else "loopback"
        mark = "" if r["within_15pct"] else " (outside 15%)"
        mark_corun = "" if r["within_15pct_corun"] else " (outside 15%)"
        lines.append(f"| {r['where']} | {r['comm']} | {r['ranks']} | {link} | {r['measured_step_ms']:.3f} | "
                     f"{r['predicted_step_ms']:.3f} | {r['error'] * 100:+.1f}%{mark} | "
                     f"{r['predicted_corun_step_ms']:.3f} | {r['error_corun'] * 100:+.1f}%{mark_corun} |")
    table = "\n".join(lines) + "\n"
    print(table)
    print(f"co-run slowdown of compute (medians): {result['corun_slowdown']}; namespace link goodput (MB/s): "
          f"{result['netns_goodput_MBps']}")
    print(f"{result['within_15pct']} of {result['cases']} within 15% with nominal inputs, "
          f"{result['within_15pct_corun']} with measured inputs; JSON: {args.out}")
    if args.markdown:
        pathlib.Path(args.markdown).write_text(table)
    if args.plot:
        plot(rows, args.plot, result)
    return 0


def plot(rows, path, result):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed (Debian: python3-matplotlib); no plot", file=sys.stderr)
        return
    base = next(r for r in rows if r["ranks"] == 1)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for comm, colour in (("threads", "tab:blue"), ("mpi", "tab:orange"), ("gloo", "tab:green")):
        local = [r for r in rows if r["comm"] == comm and r["link_Mbit"] is None and r["ranks"] > 1]
        xs = [1] + [r["ranks"] for r in local]
        # Weak scaling: efficiency = step time at 1 rank / step time at P.
        ax.plot(xs, [1] + [base["predicted_step_ms"] / r["predicted_step_ms"] for r in local], ":", color=colour,
                label=f"{comm}: predicted, nominal inputs")
        if "predicted_corun_step_ms" in base:
            ax.plot(xs, [1] + [base["predicted_corun_step_ms"] / r["predicted_corun_step_ms"] for r in local], "-",
                    color=colour, label=f"{comm}: predicted, measured inputs")
        ax.plot(xs, [1] + [base["measured_step_ms"] / r["measured_step_ms"] for r in local], "o", color=colour,
                label=f"{comm}: measured")
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 2, 4])
    ax.set_xticklabels(["1", "2", "4"])
    ax.set_xlabel("ranks P (1 thread each, on a 2-core machine)")
    ax.set_ylabel("scaling efficiency = step(1) / step(P)")
    ax.set_ylim(0, 1.1)
    ax.set_title(f"LeNet-5 data parallel, batch {BATCH} per rank: simulator vs measured\n{result['cpu']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
