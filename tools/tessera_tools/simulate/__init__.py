"""tessera-simulate: predicted step time and scaling efficiency of data-parallel, pipeline and
tensor-parallel training for 1 to 1024 workers, from a model profile and a network description.
The equations are in docs/simulator.md; example inputs in tools/simulator/.

Modules: inputs (the profile, network and measured-points files), collectives (all-reduce
costs in the alpha-beta model), data_parallel (DataParallel's buckets and timeline),
model_parallel (pipeline and tensor parallelism), measure (a profile from a trace, a network
fitted to benchmark results), output (tables, JSON, plots), cli (the subcommands)."""
from __future__ import annotations

from tessera_tools.simulate.cli import main

__all__ = ["main"]
