"""``deepspeed.comm`` for deepshard: DeepSpeed's communication API over torch.distributed.

``from deepshard import comm as dist`` (or ``import deepshard.comm as dist``) in place of
``from deepspeed import comm as dist``: the same functions and signatures (collectives take
DeepSpeed's ``prof``/``log_name`` keywords), the same comms logger (``configure``,
``log_summary``), ``init_distributed`` over :func:`deepshard.init_distributed`.

Modules, one job each: ``process_group`` (joining, ranks, groups), ``collectives``,
``p2p``, ``timed`` (what records an op), ``logger`` (the records), ``summary``
(``log_summary``), ``settings`` (``configure``), ``config`` (the ``comms_logger`` section).
Names are resolved on first use (PEP 562), so ``deepshard.comm.config`` costs no torch
import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the lazy names deepshard itself calls, as type checkers see them
    from deepshard.comm.collectives import all_gather as all_gather
    from deepshard.comm.collectives import all_to_all_single as all_to_all_single
    from deepshard.comm.process_group import get_rank as get_rank
    from deepshard.comm.process_group import get_world_size as get_world_size
    from deepshard.comm.settings import configure as configure

_BY_MODULE = {
    "deepshard.comm.process_group": (
        "init_distributed", "is_initialized", "is_available", "get_rank", "get_world_size",
        "get_local_rank", "get_global_rank", "get_all_ranks_from_group", "get_world_group",
        "get_backend", "new_group", "destroy_process_group", "has_all_gather_into_tensor",
        "has_reduce_scatter_tensor", "has_all_reduce_coalesced", "has_coalescing_manager",
        "initialize_mesh_device"),
    "deepshard.comm.collectives": (
        "ReduceOp", "all_reduce", "inference_all_reduce", "all_reduce_coalesced", "reduce",
        "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_fn", "broadcast",
        "broadcast_object_list", "all_gather", "all_gather_object", "all_gather_into_tensor",
        "allgather_fn", "all_gather_coalesced", "gather", "scatter", "all_to_all_single",
        "all_to_all", "barrier", "monitored_barrier"),
    "deepshard.comm.p2p": ("send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv"),
    "deepshard.comm.settings": ("configure", "configure_from_config"),
    "deepshard.comm.summary": ("log_summary", "reset_log", "has_comm_data",
                               "get_comm_operation_count", "get_logged_comm_ops"),
    "deepshard.comm.logger": ("comms_logger", "CommsLogger"),
    "deepshard.comm.config": ("CommsLoggerConfig",),
    "deepshard.comm.timed": ("timed_op",),
    "deepshard.comm.constants": ("NCCL_BACKEND", "GLOO_BACKEND", "MPI_BACKEND", "CCL_BACKEND",
                                 "HCCL_BACKEND", "TORCH_DISTRIBUTED_DEFAULT_PORT"),
}
_LAZY = {name: module for module, names in _BY_MODULE.items() for name in names}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'deepshard.comm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted({*__all__, *globals()})
