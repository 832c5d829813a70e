"""tessera-sbatch: run a Tessera program on a Slurm cluster from a short description.

    tools/tessera-sbatch --nodes 2 --ntasks-per-node 4 --cpus-per-task 8 --backend mpi \\
        --time 01:00:00 -- build/examples/04_data_parallel_mpi --epochs=5

writes a readable sbatch script (print it with --dry-run), submits it, and inside the allocation
launches the ranks the right way for the backend. Standard library only. Modules: cli (options,
submission, main), script (the sbatch script).
"""
from __future__ import annotations

from tessera_tools.sbatch.cli import main

__all__ = ["main"]
