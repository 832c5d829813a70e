"""tessera-report: one command runs Tessera's performance campaign and writes a report.

    tools/tessera-report [--build build] [--out report] [--quick | --full] [--only SECTION[,SECTION]]
    tools/tessera-report --render-only --out report      # rebuild index.md and plots from report/raw/
    tools/tessera-report plot-metrics RUN.jsonl [--out FILE.png] [--x KEY] [--y KEY[,KEY]] [--series KEY]
    tools/tessera-report plot-trace TRACE.json [--out FILE.png] [--last-steps K] [--first-ms X] [--title TEXT]

In the spirit of Deep500: every number is measured next to a peer, on this machine, and the report
says which machine that was. The campaign does not re-implement the benchmarks; it runs the
scripts and programs of bench/ as subprocesses, keeps their JSON, and draws tables and plots:

  training     bench/compare_pytorch.py per thread count: images/s of training steps, Tessera
               (build/bench/train_throughput) against PyTorch at its best (bench/peer.py).
  collectives  bench/collectives.py, repeated: busbw per message size of ThreadComm, MpiComm and
               GlooComm, each binary timing Tessera's call and the raw library call (MPI_*, gloo::*)
               in alternating rounds; ThreadComm against the STREAM triad measured in the same run.
  dp_scaling   bench/dp_scaling.py: data-parallel scaling efficiency on 2 ranks, Tessera on each
               communicator against PyTorch DistributedDataParallel over Gloo.
  pipeline     build/bench/pipeline_bubble under mpirun, repeated: each stage's idle fraction
               against the ideal bubble (P-1)/(M+P-1), GPipe and 1F1B.
  overlap      examples/04_data_parallel --trace: per gradient bucket, how much of its all-reduce
               ran hidden behind backward and how long the rank waited for it afterwards.

Output: OUT/index.md (machine description, one section per part: table, plot, what the numbers
say), OUT/plots/*.png, OUT/raw/<section>.json (the parsed results, the exact commands, wall time,
errors) and the programs' own outputs beside them (OUT/raw/*.jsonl, traces). A section that fails
is reported as failed in index.md; the others still run.

Plotting is optional: matplotlib (Debian's python3-matplotlib) is imported only when a plot is
drawn. Where the interpreter running this script lacks it but /usr/bin/python3 has it (a pyenv
python3 first on PATH), the script re-executes itself under /usr/bin/python3; where none has it,
the tables and JSON are still written and the report says the plots were skipped.

Modules: cli (the command line), campaign (running and rendering the sections), context (settings
and running programs), machine (the machine description), one module per section (training,
collectives, dp_scaling, pipeline, overlap), metrics_plot and trace_plot (the subcommands),
formatting and plotting (shared helpers).
"""
from __future__ import annotations

from tessera_tools.report.cli import main

__all__ = ["main"]
