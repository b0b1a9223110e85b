"""Joining the job and asking where this process sits: ``deepspeed.comm``'s group API.

There is no backend object of deepshard's own (DeepSpeed's ``cdb``): torch.distributed's
default group is the state, so a script that initialised torch.distributed itself can use
these functions too. :func:`init_distributed` delegates to
:func:`deepshard.comm.distributed.init_distributed` (the launcher contract, torchrun,
SLURM and MPI variables), with DeepSpeed's choices on top: the backend is the
accelerator's (``get_accelerator().communication_backend_name()``), ``DEEPSPEED_TIMEOUT``
(minutes) sets the collective timeout, and ``config`` configures the comms logger.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist

from deepshard.comm.distributed import DEFAULT_PORT, DistEnv, mpi_local_rank
from deepshard.errors import UsageError

TIMEOUT_ENV = "DEEPSPEED_TIMEOUT"


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = DEFAULT_PORT, verbose: bool = True,
                     timeout: datetime.timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None,
                     rank: int = -1, world_size: int = -1) -> DistEnv:
    """DeepSpeed's ``deepspeed.comm.init_distributed``: join the job's process group once.

    Args are DeepSpeed's. ``timeout=None``: ``DEEPSPEED_TIMEOUT`` minutes when set, else
    torch's default. ``config``: a deepshard config, or a ``ds_config`` mapping, whose
    ``comms_logger`` section (when present) configures the comms logger. Returns where
    this process sits (DeepSpeed returns ``None``).
    """
    from deepshard.accelerator import get_accelerator
    from deepshard.comm.distributed import init_distributed as join
    from deepshard.comm.settings import configure

    if config is not None:
        configure(deepspeed_config=config)
    return join(dist_backend=dist_backend or get_accelerator().communication_backend_name(),
                auto_mpi_discovery=auto_mpi_discovery, distributed_port=distributed_port,
                verbose=verbose, timeout=timeout or timeout_from_env(os.environ),
                init_method=init_method, dist_init_required=dist_init_required,
                rank=rank, world_size=world_size)


def timeout_from_env(environ: Mapping[str, str]) -> datetime.timedelta | None:
    """``DEEPSPEED_TIMEOUT`` (whole minutes) as a timedelta; None when unset."""
    text = environ.get(TIMEOUT_ENV)
    if text is None or text == "":
        return None
    if not text.strip().isdigit() or int(text) < 1:
        raise UsageError(f"{TIMEOUT_ENV}={text!r} is not a positive number of minutes",
                         where="environment", hint=f"set {TIMEOUT_ENV} to e.g. 30, or unset it")
    return datetime.timedelta(minutes=int(text))


def require_initialized(function: str) -> None:
    """Raise a one-line error when no process group exists yet."""
    if not dist.is_initialized():
        raise UsageError(f"deepshard.comm.{function}() was called before the process group "
                         "was initialised", where=f"deepshard.comm.{function}",
                         hint="call deepshard.comm.init_distributed() (or "
                              "deepshard.initialize()) first")


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def is_available() -> bool:
    """Whether the comm package can be used (torch.distributed is built in)."""
    return dist.is_available()


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (default: the world); -1 when not a member."""
    require_initialized("get_rank")
    return dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    """Ranks in ``group`` (default: the world); -1 when this process is not a member."""
    require_initialized("get_world_size")
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """This process's rank on its node: ``LOCAL_RANK``, else an MPI launcher's local rank
    (``OMPI_COMM_WORLD_LOCAL_RANK``, ``MPI_LOCALRANKID``...), else 0 (as DeepSpeed reads
    it; no group needed)."""
    value = os.environ.get("LOCAL_RANK") or mpi_local_rank(os.environ) or "0"
    return int(value)


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    """The world rank of ``group_rank`` of ``group`` (``None``: the world)."""
    require_initialized("get_global_rank")
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    """World ranks of ``group``'s members, in group-rank order."""
    require_initialized("get_all_ranks_from_group")
    return dist.get_process_group_ranks(dist.group.WORLD if group is None else group)


def get_world_group() -> Any:
    """The default (world) process group."""
    require_initialized("get_world_group")
    return dist.group.WORLD


def get_backend(group: Any = None) -> str:
    """The backend of ``group`` (``"gloo"``, ``"nccl"``...)."""
    require_initialized("get_backend")
    return dist.get_backend(group)


def new_group(ranks: Sequence[int], **kwargs: Any) -> Any:
    """A process group of ``ranks`` (every rank must call it). Keyword arguments go to
    ``torch.distributed.new_group`` (``timeout``, ``backend``...)."""
    from deepshard.comm import teardown

    require_initialized("new_group")
    group = dist.new_group(list(ranks), **kwargs)
    teardown.keep(group)  # never destructed mid-process: see deepshard.comm.teardown
    return group


def destroy_process_group(group: Any = None) -> None:
    """Destroy ``group`` (default: every group, and the world with them)."""
    dist.destroy_process_group(group)


def has_all_gather_into_tensor() -> bool:
    return hasattr(dist, "all_gather_into_tensor")


def has_reduce_scatter_tensor() -> bool:
    return hasattr(dist, "reduce_scatter_tensor")


def has_all_reduce_coalesced() -> bool:
    return hasattr(dist, "all_reduce_coalesced")


def has_coalescing_manager() -> bool:
    return hasattr(dist.distributed_c10d, "_coalescing_manager")


def initialize_mesh_device(mesh_shape: Sequence[int], mesh_dim_names: Sequence[str]) -> Any:
    """A ``DeviceMesh`` of ``mesh_shape`` over the world, on the accelerator's device."""
    from torch.distributed.device_mesh import init_device_mesh

    from deepshard.accelerator import get_accelerator

    require_initialized("initialize_mesh_device")
    return init_device_mesh(get_accelerator().device_name(), tuple(mesh_shape),
                            mesh_dim_names=tuple(mesh_dim_names))
