"""tessera-simulate's subcommands: dp, pipeline, tp, allreduce, profile and fit."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from tessera_tools.simulate import schedules
from tessera_tools.simulate.collectives import allreduce_s
from tessera_tools.simulate.data_parallel import BUCKET_BYTES, FIRST_BUCKET_BYTES, DpOptions, dp_rows
from tessera_tools.simulate.inputs import (ALGORITHMS, FLAT_ALGORITHMS, InputError, Network, Profile, load_network,
                                           load_profile, parse_algorithms, parse_workers)
from tessera_tools.simulate.measure import fit_network, profile_from_trace
from tessera_tools.simulate.model_parallel import simulate_pipeline, simulate_tp
from tessera_tools.simulate.output import Column, OutputOptions, emit, ms

SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "zbh1", "zbv")

DESCRIPTION = """Scaling simulator: predicted step time and scaling efficiency of data-parallel, pipeline and
tensor-parallel training for 1 to 1024 workers, from a model profile (per-layer backward time and
gradient bytes, measured by a profiling run) and a network description (alpha-beta per link).
The equations are in docs/simulator.md; example inputs in tools/simulator/.

  tessera-simulate dp --profile P.json --network N.json [--algorithm ring,hierarchical]
                      [--workers 1,2,4,...] [--bucket-bytes B] [--first-bucket-bytes B] [--baseline P0]
                      [--jitter CV] [--set FIELD=VALUE ...] [--measured M.json] [--plot F.png] [--json]
  tessera-simulate pipeline --profile P.json --network N.json --micro-batches M [--stages 1,2,4]
                            [--schedule gpipe|1f1b|interleaved1f1b|zbh1|zbv] [--stages-per-rank V]
                            [--table T.csv (torch.distributed.pipelining's CSV, in place of --schedule)]
  tessera-simulate tp --profile P.json --network N.json [--workers 1,2,4,8] [--allreduces-per-layer 2]
  tessera-simulate allreduce --network N.json --bytes N [--algorithm A] [--workers ...]
  tessera-simulate profile --trace trace.json --checkpoint ckpt.safetensors --bucket-kib K --batch B
  tessera-simulate fit --collectives bench/out/collectives_X.json --comm gloo --ranks 2

Python 3 standard library only; matplotlib is imported for --plot alone.
"""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tessera-simulate", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    def model_args(p: argparse.ArgumentParser, workers_default: str = "1,2,4,8,16,32,64,128,256,512,1024") -> None:
        p.add_argument("--profile", required=True, help="model profile JSON")
        p.add_argument("--network", required=True, help="network JSON")
        p.add_argument("--set", action="append", metavar="FIELD=VALUE", help="override a network field")
        p.add_argument("--workers", default=workers_default, help="comma list of worker counts")
        p.add_argument("--json", action="store_true", help="JSON instead of a table")
        p.add_argument("--plot", metavar="FILE.png", help="efficiency against workers (needs matplotlib)")
        p.add_argument("--measured", metavar="M.json", help="measured points to compare and plot")

    dp = sub.add_parser("dp", help="data parallelism (DataParallel's buckets)")
    model_args(dp)
    dp.add_argument("--algorithm", help=f"comma list of {', '.join(ALGORITHMS)} (default: the network's)")
    dp.add_argument("--bucket-bytes", type=int, default=BUCKET_BYTES)
    dp.add_argument("--first-bucket-bytes", type=int, default=FIRST_BUCKET_BYTES)
    dp.add_argument("--baseline", type=int, default=1, help="efficiency relative to this worker count")
    dp.add_argument("--jitter", type=float, metavar="CV",
                    help="coefficient of variation of a worker's forward + backward time (the slowest of P "
                         "sets the pace); default: the profile's compute_cv, else 0")
    pp = sub.add_parser("pipeline", help="pipeline parallelism (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V)")
    model_args(pp, "1,2,4,8")
    pp.add_argument("--stages", dest="workers", help="the same as --workers: the pipeline's workers")
    pp.add_argument("--micro-batches", type=int, required=True)
    pp.add_argument("--schedule", choices=SCHEDULES, default="1f1b",
                    help="interleaved1f1b runs --stages-per-rank stages per worker, zbv 2 (in a V)")
    pp.add_argument("--stages-per-rank", type=int, default=2, help="interleaved 1F1B's v (default 2)")
    pp.add_argument("--table", metavar="T.csv",
                    help="a schedule in torch.distributed.pipelining's CSV form (one row per worker) in place "
                         "of --schedule; its rows set the workers and its micro-batches --micro-batches")
    tp = sub.add_parser("tp", help="tensor parallelism (Megatron)")
    model_args(tp, "1,2,4,8")
    tp.add_argument("--allreduces-per-layer", type=int, default=2,
                    help="all-reduces of the activation per layer in forward, as many in backward "
                         "(2: a transformer layer, attention + MLP)")
    ar = sub.add_parser("allreduce", help="time of one all-reduce")
    ar.add_argument("--network", required=True)
    ar.add_argument("--set", action="append", metavar="FIELD=VALUE")
    ar.add_argument("--bytes", type=float, required=True)
    ar.add_argument("--algorithm", default=",".join(ALGORITHMS))
    ar.add_argument("--workers", default="1,2,4,8,16,32,64,128,256,512,1024")
    pr = sub.add_parser("profile", help="a model profile from a Timeline trace and a checkpoint")
    pr.add_argument("--trace", required=True, help="Chrome trace of a run with DataParallel (example 04 --trace)")
    pr.add_argument("--checkpoint", required=True, help="safetensors checkpoint of the same model (names, sizes)")
    pr.add_argument("--bucket-kib", type=int, required=True, help="the run's --bucket-kib")
    pr.add_argument("--batch", type=int, required=True, help="the run's batch per worker")
    pr.add_argument("--skip", type=int, default=3, help="warm-up steps to ignore")
    pr.add_argument("--name")
    pr.add_argument("-o", "--output")
    fit = sub.add_parser("fit", help="a single-node network fitted to bench/collectives results")
    fit.add_argument("--collectives", required=True)
    fit.add_argument("--comm", required=True, help="threads, mpi or gloo")
    fit.add_argument("--ranks", default="2")
    fit.add_argument("--algorithm", default="ring", choices=FLAT_ALGORITHMS)
    fit.add_argument("--cpu-cores", type=int, help="cores of this machine (time-sharing beyond them)")
    fit.add_argument("--max-bytes", type=int, help="fit only messages up to this size (the model's buckets)")
    fit.add_argument("--workers-per-node", type=int, help="ranks this machine hosts (default: the largest --ranks)")
    fit.add_argument("-o", "--output")
    return ap


def write_document(out: dict[str, Any], output: str | None) -> None:
    text = json.dumps(out, indent=1) + "\n"
    if output:
        with open(output, "w") as f:
            f.write(text)
        print(f"wrote {output}", file=sys.stderr)
    else:
        sys.stdout.write(text)


def run_dp(args: argparse.Namespace, profile: Profile, network: Network, workers: list[int],
           header: dict[str, str]) -> None:
    algs = parse_algorithms(args.algorithm, network)
    if args.bucket_bytes <= 0 or args.first_bucket_bytes <= 0:
        raise InputError("--bucket-bytes and --first-bucket-bytes must be > 0")
    if args.baseline < 1:
        raise InputError("--baseline must be >= 1")
    if args.jitter is not None and not (0 <= args.jitter < 1):
        raise InputError(f"--jitter {args.jitter}: a coefficient of variation in [0, 1)")
    rows = dp_rows(profile, network, workers, algs, DpOptions(bucket_bytes=args.bucket_bytes,
                                                              first_bucket_bytes=args.first_bucket_bytes,
                                                              jitter=args.jitter, baseline=args.baseline))
    header.update(title=f"data parallel: {profile.name}\n{network.name}",
                  buckets=f"{args.bucket_bytes} B (first {args.first_bucket_bytes} B)",
                  baseline=f"efficiency = step time at P={args.baseline} / step time at P")
    columns: list[Column] = [
        ("algorithm", 16, lambda r: r.algorithm), ("P", 5, lambda r: str(r.workers)),
        ("nodes", 5, lambda r: str(r.nodes)), ("step ms", 10, ms("step_s")),
        ("compute ms", 10, ms("compute_s")), ("comm ms", 9, ms("comm_s")),
        ("exposed ms", 10, ms("exposed_s")),
        ("hidden", 6, lambda r: f"{r.hidden:.0%}" if r.hidden is not None else None),
        ("img/s", 10, lambda r: f"{r.images_per_s:.0f}"),
        ("efficiency", 10, lambda r: f"{r.efficiency:.1%}")]
    series = [(a, [r.workers for r in rows if r.algorithm == a],
               [r.efficiency or 0.0 for r in rows if r.algorithm == a]) for a in algs]
    emit(output_options(args), header, columns, rows, series, "workers P (log2)", [r.algorithm for r in rows])


def run_pipeline(args: argparse.Namespace, profile: Profile, network: Network, workers: list[int],
                 header: dict[str, str]) -> None:
    if args.micro_batches < 1:
        raise InputError("--micro-batches must be >= 1")
    if args.stages_per_rank < 1:
        raise InputError("--stages-per-rank must be >= 1")
    table = None
    if args.table:
        try:
            with open(args.table) as f:
                table = schedules.parse_csv(f.read(), args.table)
        except OSError as e:
            raise InputError(f"{args.table}: cannot read: {e.strerror}") from None
        if table.micro_batches != args.micro_batches:
            raise InputError(f"{args.table}: runs {table.micro_batches} micro-batches, --micro-batches is "
                             f"{args.micro_batches}")
        workers = [table.ranks]
    rows = [simulate_pipeline(profile, network, p, args.micro_batches, args.schedule, args.stages_per_rank, table)
            for p in workers]
    # Strong scaling of one replica: speedup / workers, against the whole model on one worker
    # (one stage: every schedule is then the same sequence of forwards and backwards).
    one = simulate_pipeline(profile, network, 1, args.micro_batches, "gpipe")
    for r in rows:
        r.efficiency = one.step_s / (r.workers * r.step_s)
    columns: list[Column] = [
        ("stages", 6, lambda r: str(r.stages)), ("M", 4, lambda r: str(r.micro_batches)),
        ("step ms", 10, ms("step_s")), ("compute ms", 10, ms("compute_s")),
        ("p2p ms", 9, ms("p2p_s")), ("bubble", 7, lambda r: f"{r.bubble_ideal:.1%}"),
        ("idle", 7, lambda r: f"{r.idle:.1%}"), ("efficiency", 10, lambda r: f"{r.efficiency:.1%}")]
    name = table.name if table else rows[0].schedule if rows else args.schedule
    header["title"] = f"pipeline ({name}, M={args.micro_batches}): {profile.name}"
    header["baseline"] = "efficiency = step time on 1 worker / (P x step time on P)"
    emit(output_options(args), header, columns, rows,
         [(args.command, [r.workers for r in rows], [r.efficiency or 0.0 for r in rows])], "workers P (log2)")


def run_tp(args: argparse.Namespace, profile: Profile, network: Network, workers: list[int],
           header: dict[str, str]) -> None:
    if args.allreduces_per_layer < 0:
        raise InputError("--allreduces-per-layer must be >= 0")
    rows = [simulate_tp(profile, network, p, args.allreduces_per_layer) for p in workers]
    one = simulate_tp(profile, network, 1, args.allreduces_per_layer)
    for r in rows:  # strong scaling of one replica: speedup / workers
        r.efficiency = one.step_s / (r.workers * r.step_s)
    columns: list[Column] = [
        ("P", 5, lambda r: str(r.workers)), ("step ms", 10, ms("step_s")), ("compute ms", 10, ms("compute_s")),
        ("comm ms", 9, ms("comm_s")), ("efficiency", 10, lambda r: f"{r.efficiency:.1%}")]
    header["title"] = f"tensor parallel ({args.allreduces_per_layer}+{args.allreduces_per_layer} " \
                      f"all-reduces per layer): {profile.name}"
    header["baseline"] = "efficiency = step time on 1 worker / (P x step time on P)"
    emit(output_options(args), header, columns, rows,
         [(args.command, [r.workers for r in rows], [r.efficiency or 0.0 for r in rows])], "workers P (log2)")


def output_options(args: argparse.Namespace) -> OutputOptions:
    return OutputOptions(json=args.json, plot=args.plot, measured=args.measured)


def run(args: argparse.Namespace) -> int:
    if args.command == "profile":
        out = profile_from_trace(args.trace, args.checkpoint, args.bucket_kib, args.batch, args.skip, args.name)
        load_profile("(generated profile)", out)  # what we write must load
        write_document(out, args.output)
        return 0
    if args.command == "fit":
        out = fit_network(args.collectives, args.comm, [int(r) for r in args.ranks.split(",")], args.algorithm,
                          args.cpu_cores, args.max_bytes, args.workers_per_node)
        write_document(out, args.output)
        return 0
    network = load_network(args.network, args.set)
    workers = parse_workers(args.workers)
    if args.command == "allreduce":
        algs = parse_algorithms(args.algorithm, network)
        print(f"{'workers':>7} " + " ".join(f"{a:>16}" for a in algs) + "   (ms)")
        for p in workers:
            print(f"{p:>7} " + " ".join(f"{allreduce_s(network, a, p, args.bytes) * 1e3:>16.4f}" for a in algs))
        return 0
    profile = load_profile(args.profile)
    header = {"profile": profile.name, "network": network.name}
    if args.command == "dp":
        run_dp(args, profile, network, workers, header)
    elif args.command == "pipeline":
        run_pipeline(args, profile, network, workers, header)
    else:
        run_tp(args, profile, network, workers, header)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run(args)
    except InputError as e:
        print(f"tessera-simulate: {e}", file=sys.stderr)
        return 2
