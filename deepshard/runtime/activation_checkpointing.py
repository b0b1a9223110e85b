"""Activation checkpointing with DeepSpeed's ``deepspeed.checkpointing`` API, on torch's.

A checkpointed function keeps only its inputs from the forward and recomputes the rest
during backward: :func:`torch.utils.checkpoint.checkpoint` with ``use_reentrant=False``
and ``preserve_rng_state=True``, so dropout draws the same mask in the recomputation.
``cpu_checkpointing`` wraps that call in :func:`torch.autograd.graph.save_on_cpu`: the
inputs torch saves for the recomputation go to (pinned) host memory until backward, while
everything saved inside the function is still dropped and recomputed.

State. The settings are a frozen :class:`CheckpointingConfig`; a :class:`Checkpointer`
applies one. Code that can pass a callable around should hold a ``Checkpointer`` and pass
``checkpointer.checkpoint``, with no shared state at all. DeepSpeed scripts instead call
the module functions :func:`configure` and :func:`checkpoint` from different places (the
training script configures, the model's forward checkpoints), so those need one shared
holder: the context variable ``_ACTIVE``, set by :func:`configure` to a new immutable
``Checkpointer`` and read by :func:`checkpoint`. A context variable rather than a module
global, so a test or a library can scope a configuration with
``contextvars.copy_context().run(...)`` without leaking it, and so concurrent asyncio tasks
do not see each other's. The cost: a thread started afterwards starts from an empty
context and sees the defaults (as before any ``configure``) unless it is started with
``contextvars.copy_context().run``. Until ``configure`` is called, :func:`checkpoint` uses
the defaults, as DeepSpeed does.

``partition_activations``, ``contiguous_memory_optimization`` (both need tensor
parallelism and preallocated GPU buffers), ``synchronize_checkpoint_boundary`` and
``profile`` are accepted and have no effect; :func:`configure` returns a note for each
that is set, for the caller to log.

Two DeepSpeed names are this module: ``deepspeed.checkpointing`` and
``deepspeed.runtime.activation_checkpointing.checkpointing``. Python imports a dotted name
only under a package, so the module has an (empty) ``__path__``: without it, importing the
second name fails on its parent, ``deepspeed.runtime.activation_checkpointing`` (this
module too), not being a package.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from os import PathLike
from typing import Any

import torch
import torch.utils.checkpoint

__all__ = ["Checkpointer", "CheckpointingConfig", "checkpoint", "configure", "is_configured",
           "non_reentrant_checkpoint", "reset"]

__path__: list[str] = []  # see the module docstring: a package with no submodules


@dataclass(frozen=True)
class CheckpointingConfig:
    """DeepSpeed's ``activation_checkpointing`` section, field for field."""

    partition_activations: bool = False
    """Split saved inputs across tensor-parallel ranks. No effect here."""
    contiguous_memory_optimization: bool = False
    """Copy saved inputs into one preallocated buffer. No effect here."""
    cpu_checkpointing: bool = False
    """Keep the saved inputs in host memory between forward and backward."""
    number_checkpoints: int | None = None
    """Checkpoints per forward; DeepSpeed sizes the contiguous buffer with it. Unused here."""
    synchronize_checkpoint_boundary: bool = False
    """Device synchronize around each checkpoint (a debugging aid). No effect here."""
    profile: bool = False
    """Log each checkpoint's forward/backward time. No effect here."""

    def notes(self) -> list[str]:
        """One line for each setting that is set but has no effect."""
        ignored = {
            "partition_activations": "activations are not partitioned (needs tensor "
                                     "parallelism); each rank keeps whole inputs",
            "contiguous_memory_optimization": "no contiguous checkpoint buffer is "
                                              "preallocated; the caching allocator is used",
            "synchronize_checkpoint_boundary": "no device synchronize around checkpoints",
            "profile": "checkpoint forward/backward times are not logged",
        }
        return [f"activation_checkpointing.{key}=true has no effect: {why}"
                for key, why in ignored.items() if getattr(self, key)]


_FIELDS = tuple(f.name for f in dataclasses.fields(CheckpointingConfig))


class Checkpointer:
    """Applies one :class:`CheckpointingConfig`; holds no other state."""

    def __init__(self, config: CheckpointingConfig | None = None):
        self.config = config or CheckpointingConfig()

    def checkpoint(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``function(*args, **kwargs)``, keeping only the inputs for backward.

        Gradients flow to tensors in ``args`` and ``kwargs`` and to the parameters
        ``function`` uses, exactly as without checkpointing. The result is what
        ``function`` returns.
        """
        if kwargs:  # as positional inputs: saved (and offloaded) like the others
            function, args = _with_kwargs_as_args(function, args, kwargs)
        offload = contextlib.nullcontext()
        if self.config.cpu_checkpointing:  # pinned host memory for device tensors only
            on_device = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
            offload = torch.autograd.graph.save_on_cpu(pin_memory=on_device)
        with offload:
            return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                                     preserve_rng_state=True)


def _with_kwargs_as_args(function: Callable[..., Any], args: tuple, kwargs: dict):
    keys, count = tuple(kwargs), len(args)

    def call(*all_args: Any) -> Any:
        return function(*all_args[:count], **dict(zip(keys, all_args[count:], strict=True)))

    return call, (*args, *kwargs.values())


_ACTIVE: contextvars.ContextVar[Checkpointer] = contextvars.ContextVar(
    "deepshard_activation_checkpointer")
_DEFAULT = Checkpointer()  # immutable: used until configure() is called


def configure(mpu_: Any = None, deepspeed_config: Any = None,
              partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None,
              num_checkpoints: int | None = None, checkpoint_in_cpu: bool | None = None,
              synchronize: bool | None = None, profile: bool | None = None) -> list[str]:
    """Set the checkpointing used by :func:`checkpoint` (DeepSpeed's signature).

    Args:
        mpu_: the model-parallel unit; only partitioning uses it, so it is ignored.
        deepspeed_config: where the ``activation_checkpointing`` settings come from: a
            DeepSpeed config file (JSON in DeepSpeed's dialect, or YAML) or dict, read and
            validated as ``deepshard.initialize`` does; the section alone as a dict; or an
            object with attributes named like its keys (our parsed config or its section).
            Absent keys take the defaults, as in DeepSpeed; keywords given here override.
        partition_activations, contiguous_checkpointing, num_checkpoints,
        checkpoint_in_cpu, synchronize, profile: override the fields
            ``partition_activations``, ``contiguous_memory_optimization``,
            ``number_checkpoints``, ``cpu_checkpointing``,
            ``synchronize_checkpoint_boundary`` and ``profile``.

    Returns:
        Notes on settings that have no effect here, for the caller to log.

    Raises:
        UsageError: the config file or section is unreadable or invalid (with its key path).
    """
    config = _from_deepspeed_config(deepspeed_config)
    overrides: dict[str, Any] = {
        "partition_activations": partition_activations,
        "contiguous_memory_optimization": contiguous_checkpointing,
        "number_checkpoints": num_checkpoints,
        "cpu_checkpointing": checkpoint_in_cpu,
        "synchronize_checkpoint_boundary": synchronize,
        "profile": profile,
    }
    config = dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None})
    _ACTIVE.set(Checkpointer(config))
    return config.notes()


def _from_deepspeed_config(source: Any) -> CheckpointingConfig:
    if source is None:
        return CheckpointingConfig()
    if isinstance(source, (Mapping, str, PathLike)):
        section = _read_section(source)
    else:  # a parsed config, or its section
        section = getattr(source, "activation_checkpointing", source)
    return CheckpointingConfig(**{k: getattr(section, k) for k in _FIELDS
                                  if getattr(section, k, None) is not None})


def _read_section(source: Mapping | str | PathLike) -> Any:
    """The validated ``activation_checkpointing`` section of a config dict or file."""
    from deepshard.config.dialect import read_config_source
    from deepshard.config.schema import ActivationCheckpointingConfig
    from deepshard.config.schema_base import KeyLog

    data, origin = read_config_source(source)
    if "activation_checkpointing" in data:
        section, path = data["activation_checkpointing"], ["activation_checkpointing"]
    else:  # the section itself, or a whole config without one (the defaults)
        section, path = (data if set(data) & set(_FIELDS) else {}), []
    return ActivationCheckpointingConfig.model_validate(
        section, context={"keys": KeyLog(origin=origin, path=path)})


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """DeepSpeed's ``deepspeed.checkpointing.checkpoint``: see :meth:`Checkpointer.checkpoint`.

    Uses the settings of the last :func:`configure` in this context, else the defaults.
    """
    return _ACTIVE.get(_DEFAULT).checkpoint(function, *args, **kwargs)


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """DeepSpeed's ``non_reentrant_checkpoint(function, *args)``: :func:`checkpoint`, which
    is always non-reentrant here (torch's ``use_reentrant=False``); works without
    :func:`configure`."""
    return checkpoint(function, *args)


def is_configured() -> bool:
    """Whether :func:`configure` has been called in this context."""
    return _ACTIVE.get(None) is not None


def reset() -> None:
    """DeepSpeed frees its contiguous checkpoint buffers here; there are none to free."""
