"""``timed_op``: what records a ``deepshard.comm`` op in the comms logger.

With the logger off, a decorated op costs one attribute test. With it on, a recorded call
is made blocking so that its latency is the op's: the accelerator is synchronised before
and after (CUDA), and an ``async_op=True`` collective's work is waited for inside the timed
region on a synchronous device (gloo on CPU, where synchronising does nothing), which is
what DeepSpeed's synchronise achieves on CUDA. Non-blocking point-to-point calls (``isend``,
``irecv``, ``batch_isend_irecv``) are timed to their return only: waiting there would
deadlock a pair of ranks that exchange (both send first). Time is ``time.perf_counter``.
"""

from __future__ import annotations

import functools
import inspect
import sys
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from deepshard.comm.logger import comms_logger

if TYPE_CHECKING:
    from types import FrameType

F = TypeVar("F", bound=Callable[..., Any])

# where each op takes the tensor(s) whose size is its message size (DeepSpeed's choice)
_TENSOR_ARGS = ("tensor", "tensors", "input_list", "input_tensor_list", "p2p_op_list")
_NON_BLOCKING = frozenset({"isend", "irecv", "batch_isend_irecv"})


def timed_op(func: F) -> F:
    """Record calls of ``func`` (which takes DeepSpeed's ``prof``/``log_name`` keywords)
    in :data:`~deepshard.comm.logger.comms_logger` while it is enabled."""
    signature = inspect.signature(func)
    log_param = signature.parameters.get("log_name")
    default_log_name = func.__name__ if log_param is None else log_param.default

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not comms_logger.enabled:
            return func(*args, **kwargs)
        arguments = signature.bind_partial(*args, **kwargs).arguments
        log_name = arguments.get("log_name", default_log_name)
        if not comms_logger.should_profile(log_name, bool(arguments.get("prof", False))):
            return func(*args, **kwargs)
        if comms_logger.debug:
            log_name = f"{log_name} | [Caller Func: {caller_name()}]"
        return _timed_call(func, args, kwargs, arguments, log_name)

    return wrapper  # type: ignore[return-value]


def _timed_call(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                arguments: Mapping[str, Any], log_name: str) -> Any:
    import torch.distributed as dist

    from deepshard.accelerator import get_accelerator

    accelerator = get_accelerator()
    blocking = func.__name__ not in _NON_BLOCKING
    if blocking:
        accelerator.synchronize()
    start = time.perf_counter()
    result = func(*args, **kwargs)
    if blocking:
        if arguments.get("async_op") and accelerator.is_synchronized_device() \
                and hasattr(result, "wait"):
            result.wait()
        accelerator.synchronize()
    latency_ms = (time.perf_counter() - start) * 1e3
    grouped = dist.is_initialized()
    world = dist.get_world_size(arguments.get("group")) if grouped else 1
    comms_logger.append(func.__name__, log_name, latency_ms, message_size(arguments),
                        world=world, rank=dist.get_rank() if grouped else 0)
    return result


def message_size(arguments: Mapping[str, Any]) -> int:
    """Bytes of the op's tensor argument (summed over a list; a ``P2POp`` counts its
    tensor); 0 for ops without one (barrier)."""
    for name in _TENSOR_ARGS:
        if arguments.get(name) is not None:
            value = arguments[name]
            tensors = value if isinstance(value, (list, tuple)) else [value]
            return sum(_nbytes(getattr(t, "tensor", t)) for t in tensors)
    return 0


def _nbytes(tensor: Any) -> int:
    return int(tensor.element_size() * tensor.nelement())


def caller_name() -> str:
    """The name of the function that called into ``deepshard.comm`` (for ``debug``)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(
            "deepshard.comm"):
        frame = frame.f_back
    return frame.f_code.co_name if frame is not None else "<unknown>"
