"""What tessera-sbatch was asked to do, after its checks."""
from __future__ import annotations

from dataclasses import dataclass, field

BACKENDS = ("mpi", "gloo", "nccl", "threads")


@dataclass
class JobOptions:
    command: list[str]
    backend: str
    job_name: str
    nodes: int = 1
    ntasks_per_node: int = 1
    cpus_per_task: int = 1
    gpus_per_task: int = 0
    time: str = "00:30:00"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    sbatch_arg: list[str] = field(default_factory=list)
    mpi: str = "pmix"
    store: str = "file"
    iface: str | None = None
    comm_timeout: int | None = None
    log_dir: str = "tessera-jobs"
    checkpoint: str | None = None
    signal_before: int = 0  # seconds before the time limit that Slurm sends USR1 (0: none)
    isolate_gpus: bool = False  # nccl: Slurm binds GPUs per task instead of per node
    no_requeue: bool = False
    elastic: bool = False  # gloo: a failed rank does not stop the others (ElasticTrainer goes on)
    replace: int = 0  # --elastic: replacements to start in all, one per failed rank (a new job step)
    env: list[str] = field(default_factory=list)
    dry_run: bool = False
    script: str | None = None
    wait: bool = False
    sbatch: str = "sbatch"
