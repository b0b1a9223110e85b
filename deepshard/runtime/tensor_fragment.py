"""DeepSpeed's ``safe_get_full_*`` / ``safe_set_full_*`` / ``safe_get_local_*`` API: a
parameter's whole (or this rank's part of its) fp32 master, gradient and optimizer state,
wherever the engine's data-parallel strategy keeps them (fp32 masters, ZeRO shards, offload).

A parameter an engine manages carries ``param._deepshard_strategy``, the strategy that owns
it; these functions ask it (``full_fp32_param(param)``, ``full_grad(param)``,
``full_optimizer_state(param, key)``, ``set_full_*``, ``local_*``...). A parameter no engine
manages behaves as in DeepSpeed: the getters return ``None`` (``safe_get_full_grad``: its
``.grad``), the setters change nothing (``safe_set_full_grad``: copies into an existing
``.grad``), and the ``local`` ones, defined for ZeRO-3 parameters only, raise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from deepshard.errors import UsageError

__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
           "safe_update_full_grad_vectorized"]

ATTR = "_deepshard_strategy"
"""The attribute naming a managed parameter's strategy."""


def _strategy(param: torch.Tensor) -> Any:
    return getattr(param, ATTR, None)


def _managed(param: torch.Tensor, api: str) -> Any:
    strategy = _strategy(param)
    if strategy is None:
        raise UsageError(f"{api} is defined for parameters a ZeRO-3 engine partitions; this "
                         "one belongs to no engine", where=api,
                         hint="call it on engine.module's parameters after "
                              "deepshard.initialize with zero_optimization.stage 3")
    return strategy


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The whole fp32 master of ``param`` (gathered when sharded); ``None`` when unmanaged."""
    strategy = _strategy(param)
    return None if strategy is None else strategy.full_fp32_param(param)


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace the whole fp32 master of ``param`` (and the parameter) with ``value``."""
    strategy = _strategy(param)
    if strategy is not None:
        strategy.set_full_fp32_param(param, value)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str
                                  ) -> torch.Tensor | None:
    """The whole fp32 optimizer state ``optim_state_key`` (``"exp_avg"``...) of ``param``."""
    strategy = _strategy(param)
    return None if strategy is None else strategy.full_optimizer_state(param, optim_state_key)


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor,
                                  optim_state_key: str) -> None:
    """Replace the whole optimizer state ``optim_state_key`` of ``param`` with ``value``."""
    strategy = _strategy(param)
    if strategy is not None:
        strategy.set_full_optimizer_state(param, value, optim_state_key)


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The whole gradient of ``param`` in the dtype it is accumulated in; unmanaged: its
    ``.grad``."""
    strategy = _strategy(param)
    return param.grad if strategy is None else strategy.full_grad(param)


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace the whole gradient of ``param`` with ``value``."""
    strategy = _strategy(param)
    if strategy is not None:
        strategy.set_full_grad(param, value)
    elif param.grad is not None:
        param.grad.copy_(value)


def safe_update_full_grad_vectorized(param_list: Iterable[torch.Tensor],
                                     update_func: Callable[[torch.Tensor, torch.Tensor],
                                                           torch.Tensor]) -> None:
    """Replace each parameter's whole gradient ``g`` with ``update_func(g, param)``
    (parameters without a gradient are skipped)."""
    for param in param_list:
        grad = safe_get_full_grad(param)
        if grad is not None:
            safe_set_full_grad(param, update_func(grad, param))


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of the fp32 master of a ZeRO-3 parameter."""
    return _managed(param, "safe_get_local_fp32_param").local_fp32_param(param)


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace this rank's part of the fp32 master of a ZeRO-3 parameter."""
    _managed(param, "safe_set_local_fp32_param").set_local_fp32_param(param, value)


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of the gradient of a ZeRO-3 parameter."""
    return _managed(param, "safe_get_local_grad").local_grad(param)


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace this rank's part of the gradient of a ZeRO-3 parameter."""
    _managed(param, "safe_set_local_grad").set_local_grad(param, value)


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor:
    """This rank's part of the optimizer state ``optim_state_key`` of a ZeRO-3 parameter."""
    return _managed(param, "safe_get_local_optimizer_state").local_optimizer_state(
        param, optim_state_key)


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor,
                                   optim_state_key: str) -> None:
    """Replace this rank's part of the optimizer state ``optim_state_key``."""
    _managed(param, "safe_set_local_optimizer_state").set_local_optimizer_state(
        param, value, optim_state_key)
