"""DeepSpeed's ``deepspeed.utils.groups``: the process groups of the running job, by kind.

DeepSpeed keeps the ``mpu`` that ``initialize`` was given (or built) in this module and
answers from it; tools read it without an engine at hand (transformers' and Accelerate's
Ulysses sequence-parallel loss reads ``groups._get_sequence_parallel_group()``). deepshard
does the same: :func:`deepshard.initialize` records its layout's groups (or the user's
``mpu``) with :func:`set_mpu`; without one, data parallelism is the world and every other
kind is size 1.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["_get_data_parallel_group", "_get_data_parallel_rank",
           "_get_data_parallel_world_size", "_get_model_parallel_group",
           "_get_model_parallel_rank", "_get_model_parallel_world_size",
           "_get_sequence_data_parallel_group", "_get_sequence_data_parallel_rank",
           "_get_sequence_data_parallel_world_size", "_get_sequence_parallel_group",
           "_get_sequence_parallel_rank", "_get_sequence_parallel_world_size", "get_mpu",
           "set_mpu"]


class _Current:
    """The job's ``mpu`` (DeepSpeed's module global ``groups.mpu``)."""

    mpu: Any = None


def set_mpu(mpu: Any) -> None:
    """Record the groups ``initialize`` runs with (``None``: plain data parallelism)."""
    _Current.mpu = mpu


def get_mpu() -> Any:
    """The recorded groups, or ``None``."""
    return _Current.mpu


def _ask(method: str, default: Any) -> Any:
    mpu = _Current.mpu
    if mpu is not None and hasattr(mpu, method):
        return getattr(mpu, method)()
    return default() if callable(default) else default


def _get_sequence_parallel_group() -> Any:
    """The Ulysses sequence-parallel group; ``KeyError`` when the job has none (as
    DeepSpeed)."""
    mpu = _Current.mpu
    if mpu is None or not hasattr(mpu, "get_sequence_parallel_group"):
        raise KeyError("No sequence parallel group found")
    return mpu.get_sequence_parallel_group()


def _get_sequence_parallel_world_size() -> int:
    return _ask("get_sequence_parallel_world_size", 1)


def _get_sequence_parallel_rank() -> int:
    return _ask("get_sequence_parallel_rank", 0)


def _get_data_parallel_group() -> Any:
    return _ask("get_data_parallel_group", lambda: dist.group.WORLD)


def _get_data_parallel_world_size() -> int:
    return _ask("get_data_parallel_world_size", dist.get_world_size)


def _get_data_parallel_rank() -> int:
    return _ask("get_data_parallel_rank", dist.get_rank)


def _get_sequence_data_parallel_group() -> Any:
    return _ask("get_sequence_data_parallel_group", _get_data_parallel_group)


def _get_sequence_data_parallel_world_size() -> int:
    return _ask("get_sequence_data_parallel_world_size", _get_data_parallel_world_size)


def _get_sequence_data_parallel_rank() -> int:
    return _ask("get_sequence_data_parallel_rank", _get_data_parallel_rank)


def _get_model_parallel_group() -> Any:
    return _ask("get_model_parallel_group", None)


def _get_model_parallel_world_size() -> int:
    return _ask("get_model_parallel_world_size", 1)


def _get_model_parallel_rank() -> int:
    return _ask("get_model_parallel_rank", 0)
