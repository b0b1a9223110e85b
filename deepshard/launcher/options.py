"""LaunchOptions: everything ``ds-run`` was asked to do, as one frozen value."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """The parsed command line of ``ds-run`` (DeepSpeed's flag names and meanings)."""

    user_script: str
    """The training script, module (``--module``) or program (``--no_python``) to run."""
    user_args: tuple[str, ...] = ()
    """Arguments passed to the script untouched, after ``--local_rank=N``."""
    hostfile: str | None = None
    """Hostfile path; ``None`` runs on this machine."""
    include: str | None = None
    exclude: str | None = None
    num_nodes: int | None = None
    num_gpus: int | None = None
    """Slots per node; on a machine without GPUs, the number of CPU workers (default 1)."""
    master_addr: str | None = None
    master_port: int | None = None
    """``None`` picks a free port, so two jobs on one machine never collide."""
    launcher: str = "ssh"
    """How agents start on nodes that are not this machine (this machine's are local);
    ``slurm`` starts every node's agent, this one's too, as an srun step."""
    launcher_args: str = ""
    """Extra arguments for pdsh or srun (``--launcher pdsh``/``slurm``)."""
    ssh_port: int | None = None
    remote_python: str | None = None
    """The Python on remote hosts; by default the one running ds-run (same path)."""
    ssh_connect_timeout: float = 10.0
    fanout: int | None = None
    """Relays ds-run contacts over ssh, each starting its share of the hosts
    (:mod:`.tree`); ``None``: flat up to 64 remote hosts, then ``ceil(sqrt(N))``; ``0``:
    always flat."""
    hang_timeout: float | None = None
    """Seconds without a heartbeat after which a worker that has sent some is hung."""
    max_restarts: int = 0
    """Relaunch the whole job up to this many times after a failure."""
    live: bool | None = None
    """The live per-rank view (default: when stdout is a terminal)."""
    monitor_timeout: float = 30.0
    """A node whose agent says nothing for this long is lost; its agent, in turn, stops
    its workers when the coordinator has been silent for as long."""
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    log_dir: str | None = None
    """Directory for per-rank log files (``rank_<N>.log``) on each node."""
    bind_cores_to_rank: bool = False
    deepspeed_compat: bool = False
    """Workers import deepshard as ``deepspeed`` (their agent puts the shim of
    :mod:`deepshard.compat` first on their ``PYTHONPATH``)."""
    dry_run: bool = False
    elastic_training: bool = False
    """Keep training on the remaining hosts when one is lost or keeps failing, and grow
    back when it returns (:mod:`.elastic`)."""
    min_elastic_nodes: int | None = None
    """Fewer usable nodes than this end an elastic job (default 1)."""
    max_elastic_nodes: int | None = None
    """An elastic job runs on at most this many nodes (default: every host)."""
    elastic_probe_interval: float = 60.0
    """Seconds between probes of the hosts an elastic job lost."""
    straggler_factor: float = 1.5
    """A rank whose own work per step (before it synchronises) stays at least this many
    times the other ranks' median is named a straggler (:mod:`.straggler`)."""
    summary_json: str | None = None
    """Where to write the job's JSON summary when ds-run ends (:mod:`.summary`)."""
    stop_grace: float = 5.0
    """Seconds between SIGTERM and SIGKILL when workers are stopped."""
