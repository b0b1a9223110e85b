"""ALST's activation-checkpoint offload: checkpointed activations wait in host memory.

With activation checkpointing, what a layer keeps from its forward to its backward is its
input (``[tokens, hidden]`` per layer: at millions of tokens the largest thing left on the
device). :class:`HostOffload` is a ``saved_tensors_hooks`` pair that moves every tensor
autograd saves inside it to host memory (pinned, copied without blocking) and brings it
back to its device when backward unpacks it; around a checkpointed call (reentrant or not,
torch saves the checkpoint's inputs through these hooks) that is exactly the checkpointed
inputs, as torch's ``save_on_cpu`` and ArcticTraining's ``activation_checkpoint_cpu_offload``.
A tensor already in host memory stays where it is (there is nothing to move on a CPU-only
machine); :class:`OffloadStats` counts what was packed and moved either way, which is what the
tests observe there.

:func:`offload_gradient_checkpointing` applies it to a Hugging Face model whose gradient
checkpointing is enabled, by wrapping the checkpoint function each layer calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from deepshard.errors import UsageError

__all__ = ["HostOffload", "OffloadStats", "OffloadedCheckpoint",
           "offload_gradient_checkpointing"]


@dataclass
class OffloadStats:
    """What a :class:`HostOffload` packed (mutable counters; runtime state, not a spec)."""

    tensors: int = 0
    """Tensors autograd saved inside the hooks."""
    bytes: int = 0
    """Their bytes."""
    moved_bytes: int = 0
    """Bytes copied from a device to host memory (0 on a CPU-only machine)."""
    unpacked: int = 0
    """Tensors backward brought back."""


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Inside this context, tensors saved for backward are kept in host memory."""

    def __init__(self, stats: OffloadStats | None = None, pin_memory: bool = True):
        counters = stats if stats is not None else OffloadStats()

        def pack(tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
            counters.tensors += 1
            size = tensor.numel() * tensor.element_size()
            counters.bytes += size
            if tensor.device.type == "cpu":
                return tensor.device, tensor
            host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout,
                               pin_memory=pin_memory and torch.cuda.is_available())
            host.copy_(tensor, non_blocking=True)
            counters.moved_bytes += size
            return tensor.device, host

        def unpack(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
            counters.unpacked += 1
            device, tensor = packed
            return tensor.to(device, non_blocking=True)

        super().__init__(pack, unpack)
        self.stats = counters


class OffloadedCheckpoint:
    """A checkpoint function (HF's ``_gradient_checkpointing_func``) whose saved inputs wait
    in host memory: ``checkpoint(function, *args, **kwargs)`` inside :class:`HostOffload`."""

    def __init__(self, checkpoint: Callable[..., Any], stats: OffloadStats | None = None):
        self.checkpoint = checkpoint
        self.stats = stats if stats is not None else OffloadStats()

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with HostOffload(self.stats):
            return self.checkpoint(function, *args, **kwargs)


def offload_gradient_checkpointing(model: torch.nn.Module,
                                   stats: OffloadStats | None = None) -> OffloadStats:
    """Make every checkpointed layer of a Hugging Face ``model`` keep its saved inputs in
    host memory; returns the counters they share.

    Raises:
        UsageError: the model has no layer with gradient checkpointing enabled.
    """
    counters = stats if stats is not None else OffloadStats()
    wrapped = 0
    for module in model.modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if func is None or not getattr(module, "gradient_checkpointing", False):
            continue
        if isinstance(func, OffloadedCheckpoint):
            func = func.checkpoint
        module._gradient_checkpointing_func = OffloadedCheckpoint(func, counters)
        wrapped += 1
    if not wrapped:
        raise UsageError(f"activation_checkpoint_cpu_offload offloads checkpointed "
                         f"activations, but {type(model).__name__} checkpoints none",
                         where="sequence_parallel.activation_checkpoint_cpu_offload",
                         hint="call model.gradient_checkpointing_enable() before "
                              "deepshard.initialize, or set the key to false")
    return counters
