"""Does an attention module's forward still compute attention when it holds 1/T of the
heads? A shape-only trial run, so that AutoTP does not guess silently.

Sharding attention by heads only works when the module's forward derives its reshapes
from the head-count attribute AutoTP divides (or from ``-1``). ``examples/gpt.py``'s
``Block``, for one, reshapes with the width of its *input*
(``view(b, t, 3, self.n_head, d // self.n_head)`` and ``reshape(b, t, d)``), which stays the
full model width under tensor parallelism; with 1/T of the heads that view fails, and a
variant like ``view(b, t, 3, -1, d // self.n_head)`` would not fail but would silently
regroup the head dimension.

The trial calls the module's ``forward(x)`` on a tiny input (2 sequences of 3 tokens)
twice, under a :class:`TorchFunctionMode` that records every torch call's output shapes:
once as it is, once with views of this rank's shard shapes in place of the sharded
parameters and with the divided head counts (on a shallow copy: the module itself is not
modified, and nothing is allocated but the tiny activations). Head sharding is
*compatible* when both runs make the same calls and every output shape equals the dense
one except for at most one dimension divided by exactly T (heads, or sharded features),
with the module's first output's shape unchanged (further outputs, like T5's position
bias of one value per head, may hold the rank's heads). Only shapes are compared, so the
values of the views do not matter, and a module on the meta device (deferred initialisation) works
too. A forward that needs more inputs than the hidden states (LLaMA's also takes position
embeddings and a mask) cannot be called here: the verdict is then *unverified*, and AutoTP
follows the attribute, as DeepSpeed's AutoTP does.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Literal

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

Shapes = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class TrialResult:
    """The verdict on sharding one attention module by heads, and why."""

    verdict: Literal["compatible", "incompatible", "unverified"]
    detail: str


class _ShapeTrace(TorchFunctionMode):
    """Records ``(function name, output tensor shapes)`` of every top-level torch call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, Shapes]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = out if isinstance(out, (tuple, list)) else (out,)
        self.calls.append((getattr(func, "__name__", repr(func)),
                           tuple(tuple(t.shape) for t in flat if isinstance(t, torch.Tensor))))
        return out


def _required_positionals(module: nn.Module) -> int | None:
    """How many positional arguments ``module.forward`` requires (None: it also requires
    keyword-only ones, or has no inspectable signature)."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in params if p.default is inspect.Parameter.empty
                and p.kind not in (inspect.Parameter.VAR_POSITIONAL,
                                   inspect.Parameter.VAR_KEYWORD)]
    if any(p.kind not in positional for p in required):
        return None
    return len(required)


def _trace(module: nn.Module, tensors: Mapping[str, torch.Tensor], x: torch.Tensor
           ) -> tuple[list[tuple[str, Shapes]], Shapes]:
    with torch.no_grad(), _ShapeTrace() as trace:
        out = torch.func.functional_call(module, dict(tensors), (x,), strict=False)
    flat = out if isinstance(out, (tuple, list)) else (out,)
    return trace.calls, tuple(tuple(t.shape) for t in flat if isinstance(t, torch.Tensor))


def _corner(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A view of ``t`` with the (smaller) ``shape``: stands in for a shard, no copy."""
    return t[tuple(slice(0, size) for size in shape)]


def _mismatch(dense: list[tuple[str, Shapes]], local: list[tuple[str, Shapes]],
              tp_size: int) -> str | None:
    if [name for name, _ in dense] != [name for name, _ in local]:
        return "its forward made other calls with fewer heads"
    for (name, dense_shapes), (_, local_shapes) in zip(dense, local, strict=True):
        for full, part in zip(dense_shapes, local_shapes, strict=False):
            diff = [(a, b) for a, b in zip(full, part, strict=False) if a != b]
            if (len(full) != len(part) or len(dense_shapes) != len(local_shapes)
                    or len(diff) > 1 or (diff and diff[0][0] != diff[0][1] * tp_size)):
                return (f"{name}() gives shape {list(part)} where the dense {list(full)} "
                        f"with one dimension divided by {tp_size} is expected")
    return None


def trial_head_sharding(module: nn.Module, local_shapes: Mapping[str, tuple[int, ...]],
                        local_heads: Mapping[str, int], width: int, tp_size: int
                        ) -> TrialResult:
    """Judge head sharding of ``module`` (the attention module: the owner of q, k, v).

    Args:
        module: the dense module; it is read, never modified.
        local_shapes: this rank's shape of each parameter that tensor parallelism splits,
            by name relative to ``module``.
        local_heads: the divided value of each head-count attribute.
        width: the width of the module's input (the model width).
        tp_size: the tensor-parallel size T.
    """
    if _required_positionals(module) != 1:
        return TrialResult("unverified", f"{type(module).__name__}.forward needs more than "
                                         "one input, so it was not tried")
    named = dict(chain(module.named_parameters(remove_duplicate=False),
                       module.named_buffers(remove_duplicate=False)))
    like = next((t for t in named.values() if t.is_floating_point()), torch.zeros(()))
    x = torch.zeros(2, 3, width, device=like.device, dtype=like.dtype)
    try:
        dense_calls, dense_out = _trace(module, named, x)
    except Exception as exc:  # any failure here only means "could not try"
        return TrialResult("unverified", f"a trial run of {type(module).__name__}.forward "
                                         f"failed even unsharded ({_brief(exc)})")
    shallow = copy.copy(module)  # shares parameters and children; own plain attributes
    for attr, value in local_heads.items():
        setattr(shallow, attr, value)
    local = named | {name: _corner(named[name], shape) for name, shape in local_shapes.items()}
    try:
        local_calls, local_out = _trace(shallow, local, x)
    except Exception as exc:  # the forward cannot run with fewer heads
        return TrialResult("incompatible", f"with 1/{tp_size} of the heads its forward "
                                           f"fails: {_brief(exc)}")
    problem = _mismatch(dense_calls, local_calls, tp_size)
    if problem is None and (local_out[:1] != dense_out[:1] or _mismatch(
            [("out", dense_out[1:])], [("out", local_out[1:])], tp_size)):
        problem = f"its output shape {local_out} differs from the dense {dense_out}"
    if problem:
        return TrialResult("incompatible", problem)
    return TrialResult("compatible", f"a trial run with 1/{tp_size} of the heads "
                                     "keeps every shape consistent")


def _brief(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:160]
