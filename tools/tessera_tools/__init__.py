"""Tessera's Python tools: the launchers (tessera-run, tessera-sbatch), the scaling simulator
(tessera-simulate), the performance report (tessera-report), the repository checks and the
checkpoint reader. Each command is a thin script in tools/ (or the install's bindir) that calls
the `main` of its module here; the modules use the standard library only, except where a module
says otherwise (matplotlib for plots, numpy for checkpoints), and import those on first use."""
