"""ALST's tiled compute: the MLP and the logits + loss over tiles of tokens.

At long sequences two activations dominate memory: the ``[tokens, vocab]`` logits (with
their fp32 copy and the softmax gradient, ~12 bytes a token per vocabulary entry) and the
MLP's ``[tokens, intermediate]`` intermediates that autograd keeps for backward. Both are
per-token, so they can be computed a tile of tokens at a time:

- :func:`tiled_mlp` runs a module over tiles under ``no_grad`` and keeps only its input;
  backward recomputes one tile at a time and differentiates it, so one tile's intermediates
  live at a time.
- :func:`tiled_logits_loss` computes the head and the cross-entropy tile by tile, never the
  whole logits. Like DeepSpeed's ``TiledFusedLogitsLoss`` it differentiates each tile right
  in the forward (the loss is the last op, its gradient is linear in the incoming one): one
  pass over the head fewer than a recompute, and it keeps the input gradient instead of the
  input. Unlike DeepSpeed's it returns the exact mean over valid tokens (a sum over tiles
  divided by the count), equal to the untiled loss whatever the tiling. A plain ``Linear``
  head skips autograd altogether: :mod:`.fused_ce` differentiates it by hand in one reused
  logits buffer (``benchmarks/long_seq.py``: 1.47x DeepSpeed's tokens/s at SP 2, 1.38x at SP 4).

Gradients of the module's parameters. DeepSpeed's functions call ``torch.autograd.backward``
per tile, so a parameter's ``.grad`` is accumulated once per tile (inside the forward, for
the loss) and ZeRO is told to wait with ``ds_grad_is_ready``. Here the tiles differentiate
detached aliases of the parameters (swapped into the module while a tile runs) and the
function returns the summed gradients as those of its parameter inputs: autograd delivers
each parameter's gradient once, at its place in the backward, so every gradient hook and
data-parallel strategy sees one ordinary gradient. The tiled function must therefore use
only ``module``'s own parameters (any other parameter it touches would get no gradient).

:class:`TiledMLP` and :class:`TiledFusedLogitsLoss` take DeepSpeed 0.19.8's ``apply``
arguments (``deepspeed.runtime.sequence_parallel.ulysses_sp``), computed as above.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from deepshard.errors import UsageError
from deepshard.sequence.fused_ce import LinearCrossEntropy, fusable, tile_bounds

__all__ = ["TiledFusedLogitsLoss", "TiledMLP", "auto_logits_shards", "auto_mlp_shards",
           "tiled_logits_loss", "tiled_mlp"]

LOGITS_TILE_BYTES = 256 * 2**20
"""The automatic logits tile: at most this many bytes of fp32 logits (ArcticTraining picks
1 GiB for GPUs; a quarter keeps the transient tile small beside CPU-sized budgets)."""


def auto_mlp_shards(tokens: int, hidden: int) -> int:
    """DeepSpeed's rule for the MLP: tiles of about ``hidden`` tokens."""
    return max(1, math.ceil(tokens / max(1, hidden)))


def auto_logits_shards(tokens: int, vocab: int) -> int:
    """Tiles of at most :data:`LOGITS_TILE_BYTES` of fp32 logits."""
    return max(1, math.ceil(tokens * vocab * 4 / LOGITS_TILE_BYTES))


def _trainable(module: torch.nn.Module, extra: Sequence[torch.Tensor] | None,
               what: str) -> tuple[list[str], list[torch.nn.Parameter]]:
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if extra:
        known = {id(p) for _, p in module.named_parameters(remove_duplicate=False)}
        if any(id(p) not in known for p in extra):
            raise UsageError(f"{what}: compute_params holds a parameter that is not one of "
                             f"the module's", where=what,
                             hint="pass the module whose parameters the function uses")
    return [n for n, _ in named], [p for _, p in named]


@contextlib.contextmanager
def _swapped(module: torch.nn.Module, names: Sequence[str],
             values: Sequence[torch.Tensor]) -> Iterator[None]:
    """``module``'s parameters ``names`` read as ``values`` inside the block."""
    slots = []
    for name in names:
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        slots.append((owner, leaf, owner._parameters[leaf]))
    try:
        for (owner, leaf, _), value in zip(slots, values, strict=True):
            owner._parameters[leaf] = value
        yield
    finally:
        for owner, leaf, original in slots:
            owner._parameters[leaf] = original


def _aliases(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().requires_grad_(True) for p in params]


def _add(total: list[torch.Tensor | None], grads: Sequence[torch.Tensor | None]) -> None:
    for i, g in enumerate(grads):
        if g is not None:
            # one copy (a tile's gradient may be a view), then summed in place: a new
            # weight-sized tensor per tile was most of the tiled loss's transient memory
            t = total[i]
            total[i] = g.clone() if t is None else t.add_(g)


class _TiledModule(torch.autograd.Function):
    """``fn(module, x)`` over tiles of ``x``'s rows; only ``x`` is saved for backward."""

    @staticmethod
    def forward(ctx, fn, module, names, shards, x, *params):
        ctx.fn, ctx.module, ctx.names, ctx.shards = fn, module, names, shards
        ctx.save_for_backward(x)
        flat = x.reshape(-1, x.shape[-1])
        outs = [fn(module, flat[a:b]) for a, b in tile_bounds(flat.shape[0], shards)]
        out = torch.cat(outs, dim=0)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        module = ctx.module
        params = [module.get_parameter(n) for n in ctx.names]
        aliases = _aliases(params)
        flat = x.detach().reshape(-1, x.shape[-1])
        grad = grad.reshape(flat.shape[0], -1)
        x_grad = torch.empty_like(flat) if ctx.needs_input_grad[4] else None
        totals: list[torch.Tensor | None] = [None] * len(aliases)
        for a, b in tile_bounds(flat.shape[0], ctx.shards):
            tile = flat[a:b].requires_grad_(x_grad is not None)
            inputs = ([tile] if x_grad is not None else []) + aliases
            with torch.enable_grad(), _swapped(module, ctx.names, aliases):
                out = ctx.fn(module, tile)
            got = torch.autograd.grad(out, inputs, grad[a:b], allow_unused=True)
            if x_grad is not None:
                x_grad[a:b] = got[0] if got[0] is not None else 0
                got = got[1:]
            _add(totals, got)
        x_grad = None if x_grad is None else x_grad.view_as(x)
        return (None, None, None, None, x_grad, *totals)


def _call_forward(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module.forward(x)


def tiled_mlp(module: torch.nn.Module, x: torch.Tensor, shards: int | None = None,
              fn: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] | None = None
              ) -> torch.Tensor:
    """``fn(module, x)`` (default ``module.forward(x)``) computed over ``shards`` tiles of
    ``x``'s tokens (all leading dims flattened), recomputed tile by tile in backward.

    Args:
        module: owns every parameter ``fn`` uses; they get their gradients as usual.
        x: ``[..., hidden]``; ``fn`` must treat tokens independently (an MLP does).
        shards: tiles; None: tiles of ``hidden`` tokens (DeepSpeed's rule).
        fn: the per-tile computation; it must not be tiled itself.
    """
    tokens = x.numel() // max(1, x.shape[-1])
    shards = shards or auto_mlp_shards(tokens, x.shape[-1])
    names, params = _trainable(module, None, "tiled_mlp")
    return _TiledModule.apply(fn or _call_forward, module, tuple(names), shards, x, *params)


class _TiledLoss(torch.autograd.Function):
    """Sum of ``loss_fn(module, x_tile, *target_tiles)`` over tiles of rows, divided by
    ``denominator``; differentiated tile by tile in the forward. ``x`` and each of
    ``targets`` have the rows as their first dim."""

    @staticmethod
    def forward(ctx, loss_fn, module, names, shards, train, denominator, targets,
                x, *params):
        aliases = _aliases(params) if train else list(params)
        x_grad = torch.zeros_like(x) if train and x.requires_grad else None
        totals: list[torch.Tensor | None] = [None] * len(aliases)
        total = torch.zeros((), dtype=_loss_dtype(x), device=x.device)
        for a, b in tile_bounds(x.shape[0], shards):
            tile = x[a:b].detach().requires_grad_(x_grad is not None)
            grad_mode = torch.enable_grad() if train else contextlib.nullcontext()
            with grad_mode, _swapped(module, names, aliases):
                part = loss_fn(module, tile, *(t[a:b] for t in targets))
            if train:
                inputs = ([tile] if x_grad is not None else []) + aliases
                got = torch.autograd.grad(part, inputs, allow_unused=True)
                if x_grad is not None:
                    x_grad[a:b] = got[0] if got[0] is not None else 0
                    got = got[1:]
                _add(totals, got)
            total += part.detach().to(total.dtype)
        ctx.grads = (x_grad, *totals)
        ctx.denominator = denominator.to(total.dtype)
        return total / ctx.denominator

    @staticmethod
    def backward(ctx, grad):
        scale = grad / ctx.denominator
        grads = [None if g is None else g * scale.to(g.dtype) for g in ctx.grads]
        ctx.grads = ()
        return (None, None, None, None, None, None, None, *grads)


def _loss_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _head_ce(ignore_index: int) -> Callable[..., torch.Tensor]:
    def loss_fn(head: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = head(x)
        logits = logits.to(_loss_dtype(logits))  # HF's causal-LM loss upcasts too
        return F.cross_entropy(logits, y, ignore_index=ignore_index, reduction="sum")

    return loss_fn


def tiled_logits_loss(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor, *,
                      shards: int | None = None, ignore_index: int = -100,
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
    """Cross-entropy of ``head(hidden)`` against ``labels`` without the whole logits.

    ``labels`` are aligned with ``hidden`` (already shifted for a causal LM); tokens whose
    label is ``ignore_index`` do not count. The result equals
    ``F.cross_entropy(head(hidden).float().flatten(0, -2), labels.flatten(),
    ignore_index=ignore_index)`` (the mean over valid tokens), or the sum divided by
    ``num_items_in_batch`` when that is given (HF's gradient-accumulation form).

    Args:
        hidden: ``[batch, seq, hidden]`` or ``[tokens, hidden]``.
        head: the output projection (``model.lm_head``); its parameters get gradients.
        labels: ``hidden``'s leading shape, integer class ids.
        shards: tiles over the tokens; None: :func:`auto_logits_shards`.
    """
    if labels.shape != hidden.shape[:-1]:
        raise UsageError(f"tiled_logits_loss: labels {tuple(labels.shape)} do not match "
                         f"hidden states {tuple(hidden.shape)}", where="tiled_logits_loss",
                         hint="pass labels shaped like the hidden states without their "
                              "last dim (shifted for a causal LM)")
    names, params = _trainable(head, None, "tiled_logits_loss")
    tokens = labels.numel()
    vocab = getattr(head, "out_features", None) or 32000
    shards = shards or auto_logits_shards(tokens, vocab)
    if num_items_in_batch is None:
        denominator: Any = (labels != ignore_index).sum()
    else:
        denominator = torch.as_tensor(num_items_in_batch, device=hidden.device)
    train = torch.is_grad_enabled() and (hidden.requires_grad or bool(params))
    rows = hidden.reshape(-1, hidden.shape[-1])
    if fusable(head, rows):
        bias = head.bias
        need = (train and rows.requires_grad, train and head.weight.requires_grad,
                train and bias is not None and bias.requires_grad)
        return LinearCrossEntropy.apply(rows, labels.reshape(-1), denominator, ignore_index,
                                        shards, need, head.weight, bias)
    return _TiledLoss.apply(_head_ce(ignore_index), head, tuple(names), shards, train,
                            denominator, (labels.reshape(-1),), rows, *params)


class TiledMLP:
    """DeepSpeed's ``TiledMLP``: ``TiledMLP.apply(fn, self, x, shards, compute_params)``
    returns ``fn(self, x)`` computed over ``shards`` tiles (see :func:`tiled_mlp`).
    ``compute_params`` (DeepSpeed needs it for ZeRO) must be parameters of ``self``."""

    @staticmethod
    def apply(fn: Callable[[Any, torch.Tensor], torch.Tensor], self: torch.nn.Module,
              x: torch.Tensor, shards: int,
              compute_params: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        names, params = _trainable(self, compute_params, "TiledMLP")
        return _TiledModule.apply(fn, self, tuple(names), shards, x, *params)


class TiledFusedLogitsLoss:
    """DeepSpeed's ``TiledFusedLogitsLoss``: ``TiledFusedLogitsLoss.apply(fn, self, x, y,
    mask, shards, compute_params, output_reduction)`` with ``fn(self, x_tile, y_tile[,
    mask_tile])`` returning a tile's loss; the result is the mean (``"mean"``, DeepSpeed's
    mean of the tiles' results) or the sum of the tiles' results. ``x`` and ``y`` are
    ``[batch, seq, ...]``; every parameter ``fn`` uses must belong to ``self``."""

    @staticmethod
    def apply(fn: Callable[..., torch.Tensor], self: torch.nn.Module, x: torch.Tensor,
              y: torch.Tensor, mask: torch.Tensor | None, shards: int,
              compute_params: Sequence[torch.Tensor] | None = None,
              output_reduction: str = "mean") -> torch.Tensor:
        if output_reduction not in ("mean", "sum"):
            raise UsageError(f"TiledFusedLogitsLoss: output_reduction {output_reduction!r}",
                             where="TiledFusedLogitsLoss", hint='use "mean" or "sum"')
        if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
            raise UsageError(f"TiledFusedLogitsLoss: x {tuple(x.shape)} and y "
                             f"{tuple(y.shape)} must share their [batch, seq] dims",
                             where="TiledFusedLogitsLoss", hint="pass [batch, seq, ...] "
                             "hidden states and [batch, seq] labels")
        names, params = _trainable(self, compute_params, "TiledFusedLogitsLoss")
        rows = x.shape[0] * x.shape[1]
        tiles = len(tile_bounds(rows, shards))
        targets: tuple[torch.Tensor, ...] = (y.reshape(rows, *y.shape[2:]),)
        if mask is not None:
            targets += (mask.reshape(rows),)
        train = torch.is_grad_enabled() and (x.requires_grad or bool(params))
        denominator = torch.tensor(float(tiles) if output_reduction == "mean" else 1.0,
                                   device=x.device)
        flat = x.reshape(rows, *x.shape[2:])
        loss = _TiledLoss.apply(fn, self, tuple(names), shards, train, denominator, targets,
                                flat, *params)
        return loss
