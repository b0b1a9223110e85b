"""The LaunchPlan: for every node, the exact worker command lines and environments.

Pure: built from the options, the placement, the ``.deepspeed_env`` variables and the few
facts gathered by the CLI (master address and port, run id, Python, working directory).
A :class:`NodePlan` is also what the coordinator hands to each node's agent, as JSON.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deepshard import contract

EXPORT_PREFIXES = ("NCCL_", "PYTHON", "UCX_", "CUDA_", "GLOO_", "TORCH_", "MLFLOW", "MV2_",
                   "OMP_", "HF_", "TRANSFORMERS_", "WANDB_")
"""Variables of ds-run's environment sent to remote nodes (local workers inherit all)."""

if TYPE_CHECKING:  # the agent imports this module: keep its start-up lean
    from deepshard.launcher.options import LaunchOptions
    from deepshard.launcher.placement import Placement


@dataclass(frozen=True)
class WorkerPlan:
    """One worker process: its ranks, command line and its own contract variables."""

    rank: int
    local_rank: int
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class NodePlan:
    """Everything one agent needs to run its node's workers.

    ``env`` holds the variables common to the node (``.deepspeed_env`` and the contract);
    each worker's ``env`` adds its ranks. Workers inherit the agent's environment under both.
    """

    host: str
    node_rank: int
    local: bool
    cwd: str
    env: tuple[tuple[str, str], ...]
    workers: tuple[WorkerPlan, ...]
    log_dir: str | None = None
    bind_cores_to_rank: bool = False
    stop_grace: float = 5.0
    lease_timeout: float = 0.0
    """Stop the workers when the coordinator has not pinged for this long (0: never; the
    local agent needs no lease, its pipe cannot be silently lost)."""
    hang_timeout: float = 0.0
    """A worker that has heartbeaten and then stops for this long is hung (0: never)."""
    deepspeed_compat: bool = False
    """Put this node's deepshard ``deepspeed`` shim first on the workers' ``PYTHONPATH``
    (resolved by the agent: the install path may differ between nodes)."""

    def to_json(self) -> str:
        # not dataclasses.asdict: it deep-copies every env pair (~1 ms a node, per host)
        data = {**vars(self), "workers": [vars(w) for w in self.workers]}
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> NodePlan:
        data = json.loads(text)
        data["env"] = tuple(tuple(kv) for kv in data["env"])
        data["workers"] = tuple(
            WorkerPlan(w["rank"], w["local_rank"], tuple(w["argv"]),
                       tuple(tuple(kv) for kv in w["env"]))
            for w in data["workers"]
        )
        return cls(**data)


@dataclass(frozen=True)
class LaunchPlan:
    """The whole job: where the rendezvous is and what runs on each node."""

    run_id: str
    master_addr: str
    master_port: int
    world_size: int
    nodes: tuple[NodePlan, ...]
    notes: tuple[str, ...] = ()
    """Decisions the plan was built on that the command line does not show (e.g. an
    implicit ``--include`` from ``CUDA_VISIBLE_DEVICES``), printed by ``--dry_run``."""


def worker_argv(options: LaunchOptions, python: str, local_rank: int) -> tuple[str, ...]:
    """The command line of one worker, as DeepSpeed's launcher builds it."""
    if options.no_python:
        head: list[str] = [options.user_script]
    elif options.module:
        head = [python, "-u", "-m", options.user_script]
    else:
        head = [python, "-u", options.user_script]
    if not options.no_local_rank:
        head.append(f"--local_rank={local_rank}")
    return (*head, *options.user_args)


def build_plan(
    options: LaunchOptions,
    placement: Placement,
    env_vars: Mapping[str, str],
    *,
    python: str,
    cwd: str,
    master_addr: str,
    master_port: int,
    run_id: str,
    is_local: Mapping[str, bool],
    environ: Mapping[str, str] | None = None,
    hidden_devices: frozenset[str] = frozenset(),
    restart_count: int = 0,
    notes: tuple[str, ...] = (),
) -> LaunchPlan:
    """Build the plan; ``is_local`` tells, per host, whether it is this machine.

    A remote node's environment starts from ds-run's variables with :data:`EXPORT_PREFIXES`
    (from ``environ``); ``.deepspeed_env`` overrides those, and the contract overrides all.
    ``CUDA_VISIBLE_DEVICES`` lists each node's slots (as DeepSpeed does, on CPU-only hosts
    too), except on ``hidden_devices`` hosts: CPU slots where the user hid the GPUs with
    ``CUDA_VISIBLE_DEVICES=`` keep it empty.
    """
    world = placement.world_size
    exported = {k: v for k, v in (environ or {}).items() if k.startswith(EXPORT_PREFIXES)}
    nodes = []
    for node in placement.nodes:
        local = is_local[node.host]
        common = {} if local else dict(exported)
        common.update(env_vars)
        common.update({
            contract.WORLD_SIZE: str(world),
            contract.LOCAL_WORLD_SIZE: str(len(node.slots)),
            contract.NODE_RANK: str(node.node_rank),
            contract.MASTER_ADDR: master_addr,
            contract.MASTER_PORT: str(master_port),
            contract.CUDA_VISIBLE_DEVICES: "" if node.host in hidden_devices
            else ",".join(map(str, node.slots)),
            contract.RUN_ID: run_id,
            contract.RESTART_COUNT: str(restart_count),
        })
        if options.elastic_training:
            common[contract.ELASTIC] = "1"
        workers = tuple(
            WorkerPlan(
                rank=rank,
                local_rank=local_rank,
                argv=worker_argv(options, python, local_rank),
                env=((contract.RANK, str(rank)), (contract.LOCAL_RANK, str(local_rank))),
            )
            for local_rank, rank in enumerate(node.ranks)
        )
        nodes.append(NodePlan(
            host=node.host,
            node_rank=node.node_rank,
            local=local,
            cwd=cwd,
            env=tuple(common.items()),
            workers=workers,
            log_dir=options.log_dir,
            bind_cores_to_rank=options.bind_cores_to_rank,
            stop_grace=options.stop_grace,
            hang_timeout=options.hang_timeout or 0.0,
            deepspeed_compat=options.deepspeed_compat,
            # pdsh forwards no stdin, so no pings: its agents rely on the session's end
            lease_timeout=0.0 if local or options.launcher == "pdsh"
            else options.monitor_timeout,
        ))
    return LaunchPlan(run_id, master_addr, master_port, world, tuple(nodes), notes)
