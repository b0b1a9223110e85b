"""DeepSpeed's ``instrument_w_nvtx``: a function's calls as named ranges in a profile.

On CUDA each call is an NVTX range named after the function (Nsight Systems shows it on
the timeline), through the accelerator's ``range_push``/``range_pop``; on the CPU
accelerator those do nothing, and under ``torch.compile`` tracing the range is left out
(it would break the graph), as DeepSpeed does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from deepshard.accelerator import get_accelerator

__all__ = ["instrument_w_nvtx"]

F = TypeVar("F", bound=Callable[..., Any])


def instrument_w_nvtx(func: F) -> F:
    """``func`` wrapped so that each call is a range named ``func.__qualname__`` (see the
    module docstring); its result and exceptions are ``func``'s, and the range is closed
    either way."""

    @functools.wraps(func)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return func(*args, **kwargs)
        accelerator = get_accelerator()
        accelerator.range_push(func.__qualname__)
        try:
            return func(*args, **kwargs)
        finally:
            accelerator.range_pop()

    return wrapped  # type: ignore[return-value]
