"""The commonly imported helpers of DeepSpeed's ``deepspeed.runtime.utils``, with its names.

``set_random_seed``, ``see_memory_usage``, ``get_global_norm``, ``clip_grad_norm_`` and
``RepeatingLoader`` (DeepSpeed's is in ``runtime/dataloader.py``;
``deepshard.utils`` re-exports it as DeepSpeed's ``deepspeed.utils`` does). The rest of
DeepSpeed's module is its engine's internals and has no counterpart here.
"""

from __future__ import annotations

import gc
import logging
import math
import random
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from deepshard.runtime.precision import global_norm

__all__ = ["RepeatingLoader", "clip_grad_norm_", "get_global_norm", "see_memory_usage",
           "set_random_seed"]

logger = logging.getLogger("deepshard")
GIB = 1024**3


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch (every device), as
    DeepSpeed does: NumPy takes ``seed mod 2**32``, torch ``seed mod 2**63``."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed % (2**63))


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log ``message`` with the accelerator's allocated / reserved memory (current and peak,
    GiB) and the host's used virtual memory, on rank 0 only, when ``force`` (DeepSpeed's
    switch: without it nothing happens). Resets the accelerator's peak counters."""
    if not force or (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
        return
    import psutil

    gc.collect()  # so that freed tensors are gone from the numbers
    lines = [message]
    if torch.cuda.is_available():
        c = torch.cuda
        lines.append(f"MA {c.memory_allocated() / GIB:.2f} GB Max_MA "
                     f"{c.max_memory_allocated() / GIB:.2f} GB CA "
                     f"{c.memory_reserved() / GIB:.2f} GB Max_CA "
                     f"{c.max_memory_reserved() / GIB:.2f} GB")
        c.reset_peak_memory_stats()
    vm = psutil.virtual_memory()
    rss = psutil.Process().memory_info().rss
    lines.append(f"CPU Virtual Memory:  used = {(vm.total - vm.available) / GIB:.2f} GB, "
                 f"percent = {vm.percent}%, this process's RSS = {rss / GIB:.2f} GB")
    logger.info("\n".join(lines))


def get_global_norm(norm_list: Iterable[float]) -> float:
    """The norm of the concatenation of pieces whose L2 norms are ``norm_list``:
    ``sqrt(sum n²)``; ``inf`` when any is inf, nan or -1 (DeepSpeed's "invalid" marker)."""
    total = 0.0
    for norm in norm_list:
        value = float(norm)
        if value == -1 or not math.isfinite(value):
            return float("inf")
        total += value * value
    return math.sqrt(total)


@torch.no_grad()
def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2, mpu: Any = None) -> torch.Tensor:
    """Scale the gradients of ``parameters`` in place so that their total ``norm_type``
    norm is at most ``max_norm``; returns that norm before clipping (a 1-element tensor).

    As DeepSpeed's: with ``mpu``, the norm is summed (max for ``inf``) over its model-parallel
    group, parameters not marked ``model_parallel``/``tensor_model_parallel`` counted on
    model-parallel rank 0 only; then it is averaged over the data-parallel group (``mpu``'s,
    else the whole job) when a process group exists. The clip factor is
    ``max_norm / (norm + 1e-6)``, capped at 1.
    """
    params: list[torch.Tensor] = [parameters] if torch.is_tensor(parameters) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(1)
    total = _local_norm(params, float(norm_type), mpu).reshape(1).to(grads[0].device)
    if dist.is_available() and dist.is_initialized():
        group = mpu.get_data_parallel_group() if mpu is not None else None
        total = total / dist.get_world_size(group=group)
        dist.all_reduce(total, group=group)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef.to(grads[0].dtype).reshape(()))
    return total


def _local_norm(params: list[torch.Tensor], norm_type: float, mpu: Any) -> torch.Tensor:
    """The ``norm_type`` norm of the gradients, reduced over ``mpu``'s model-parallel group."""
    with_grad = [p for p in params if p.grad is not None]
    if mpu is None:
        counted = with_grad
    else:
        first = mpu.get_model_parallel_rank() == 0
        counted = [p for p in with_grad if first or _model_parallel(p)]
    grads = [p.grad.detach() for p in counted]
    if norm_type == math.inf:
        norm = (torch.stack([g.abs().max().float() for g in grads]).max() if grads
                else torch.zeros(()))
        op = dist.ReduceOp.MAX
    elif norm_type == 2:
        norm = global_norm(grads).square()
        op = dist.ReduceOp.SUM
    else:
        norm = sum((torch.linalg.vector_norm(g.float(), norm_type) ** norm_type for g in grads),
                   torch.zeros(()))
        op = dist.ReduceOp.SUM
    if mpu is not None:
        norm = norm.reshape(1)
        dist.all_reduce(norm, op=op, group=mpu.get_model_parallel_group())
    return norm if norm_type == math.inf else norm ** (1.0 / norm_type)


def _model_parallel(p: torch.Tensor) -> bool:
    return bool(getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False))


class RepeatingLoader:
    """An endless iterator over ``loader``: when it is exhausted, it is started again
    (``iter(loader)`` anew, so a ``DataLoader`` reshuffles). DeepSpeed's semantics: the
    first ``iter`` is taken at construction, and an empty ``loader`` raises
    ``StopIteration`` on the first ``next``."""

    def __init__(self, loader: Iterable[Any]):
        self.loader = loader
        self.data_iter: Iterator[Any] = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


def move_to_device(item: Any, device: Any, criterion_func: Any = None) -> Any:
    """DeepSpeed's ``runtime.utils.move_to_device``: ``item`` (a tensor, or lists, tuples
    and dicts of them, nested) on ``device``. A tensor ``criterion_func`` accepts is moved in
    place (its ``.data`` replaced) and returned itself; others are ``.to(device)`` copies."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device)
