"""tessera-report's command line: the campaign's options (no subcommand), and the plot-metrics and
plot-trace subcommands."""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence

from tessera_tools.paths import SYSTEM_PYTHON
from tessera_tools.report import metrics_plot, trace_plot
from tessera_tools.report.campaign import ALL_SECTIONS, campaign
from tessera_tools.report.context import ROOT, SECTIONS
from tessera_tools.report.plotting import disable_plots, maybe_reexec_for_matplotlib

SUBCOMMANDS = ("plot-metrics", "plot-trace")


def parser() -> argparse.ArgumentParser:
    """Without a subcommand, the options run the campaign; plot-metrics and plot-trace draw one file."""
    ap = argparse.ArgumentParser(prog="tessera-report",
                                 usage="%(prog)s [options]   (the campaign)\n"
                                       "       %(prog)s {plot-metrics,plot-trace} FILE [options]",
                                 description="tessera-report: one command runs Tessera's performance campaign and "
                                             "writes a report.",
                                 epilog="Sections: " + ", ".join(SECTIONS) + ". Subcommands: plot-metrics RUN.jsonl "
                                        "[--out FILE.png], plot-trace TRACE.json [--out FILE.png] (see their --help).")
    ap.add_argument("--out", default="report", help="report directory (default: report/)")
    ap.add_argument("--build", default=os.path.join(ROOT, "build"),
                    help="meson build directory with bench and examples (default: build)")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="tiny settings: a smoke test of every section (~3 min)")
    size.add_argument("--full", action="store_true", help="adds ResNet-50 b8, 256 MiB messages, ResNet-20 scaling, "
                                                          "the MPI and Gloo timelines, more repeats (~1 h)")
    ap.add_argument("--only", help="comma-separated sections to run (default: all)")
    ap.add_argument("--python", default=SYSTEM_PYTHON if os.path.exists(SYSTEM_PYTHON) else sys.executable,
                    help="interpreter for the bench/ drivers (default: /usr/bin/python3; their PyTorch children "
                         "always run /usr/bin/python3)")
    ap.add_argument("--runs", type=int, help="training runs per model and thread count (overrides the profile)")
    ap.add_argument("--coretypes", help="OPENBLAS_CORETYPE values to probe (bench/peer.py --coretypes; 'unset' "
                                        "probes only malloc and wait policy; default: the profile's)")
    ap.add_argument("--timeout", type=float, help="seconds one program may run before it is killed (default: quick 300, "
                                                  "default 1200, full 3600)")
    ap.add_argument("--no-plots", action="store_true", help="tables and JSON only")
    ap.add_argument("--render-only", action="store_true", help="rewrite index.md and plots from OUT/raw/")
    sub = ap.add_subparsers(dest="command", metavar="{plot-metrics,plot-trace}",
                            help="draw one file instead of running the campaign")
    for name, module in (("plot-metrics", metrics_plot), ("plot-trace", trace_plot)):
        p = sub.add_parser(name, prog=f"tessera-report {name}", description=module.DESCRIPTION,
                           help=module.DESCRIPTION.split(" (")[0])
        module.add_arguments(p)
        p.set_defaults(subparser=p, run=module.run)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in SUBCOMMANDS:
        maybe_reexec_for_matplotlib(argv)
    ap = parser()
    args = ap.parse_args(argv)
    if args.command:
        result: int = args.run(args.subparser, args)
        return result
    if args.only:
        wanted = args.only.split(",")
        unknown = [s for s in wanted if s not in SECTIONS]
        if unknown:
            ap.error(f"--only {','.join(unknown)}: not a section (sections: {', '.join(SECTIONS)})")
    if args.no_plots:
        disable_plots()
    else:
        maybe_reexec_for_matplotlib(argv)
    chosen = args.only.split(",") if args.only else SECTIONS
    return campaign(args, [s for s in ALL_SECTIONS if s.name in chosen], "tools/tessera-report " + shlex.join(argv))
