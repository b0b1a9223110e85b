"""fp16 loss scaling with DeepSpeed's rules, so a job's loss-scale history matches DeepSpeed's.

fp16 gradients underflow unless the loss is multiplied by a large factor before backward.
:class:`DynamicLossScaler` keeps that factor as high as the gradients allow: on an overflow
(inf/nan gradients, the step is skipped) it halves it, after ``scale_window`` clean iterations
it doubles it. :func:`has_overflow` is the check; :func:`build_loss_scaler` reads the ``fp16``
section of a DeepSpeed config.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from deepshard.errors import UsageError

logger = logging.getLogger(__name__)


class LossScaleAtMinimumError(RuntimeError):
    """The gradients overflowed while the loss scale was already at its minimum."""


class StaticLossScaler:
    """A fixed loss scale (``fp16.loss_scale > 0``); overflows skip the step and change nothing."""

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        self.cur_scale = float(scale)

    @property
    def loss_scale(self) -> float:
        """The factor to multiply the loss by before backward."""
        return self.cur_scale

    def update_scale(self, overflow: bool) -> None:
        """Record one iteration's outcome (a no-op for a static scale)."""

    def state_dict(self) -> dict[str, Any]:
        """The scale, for checkpoints."""
        return {"cur_scale": self.cur_scale}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        self.cur_scale = float(state["cur_scale"])


class DynamicLossScaler:
    """DeepSpeed's dynamic loss scale: halve on overflow (with hysteresis), grow when stable.

    Call :meth:`update_scale` once per iteration with whether the gradients overflowed. The
    rules, DeepSpeed's exactly:

    * Overflow: if ``delayed_shift == 1`` or the hysteresis counter is at 1, the scale becomes
      ``max(scale / scale_factor, min_scale)``; an overflow with the scale already at
      ``min_scale`` raises :class:`LossScaleAtMinimumError` instead, when
      ``raise_error_at_min_scale``. Otherwise the hysteresis counter (which starts at
      ``delayed_shift``) drops by one and the scale stays. Either way the iteration becomes the
      last overflow. The counter is *not* refilled by a decrease: once at 1, every further
      overflow halves until it is refilled.
    * No overflow: with ``consecutive_hysteresis`` the counter is refilled to
      ``delayed_shift``. When ``stable = iteration - last_overflow_iteration - 1`` is positive
      and a multiple of ``scale_window``, the scale is multiplied by ``scale_factor`` (and,
      without ``consecutive_hysteresis``, the counter is refilled). Iterations count from 0
      and the last overflow starts at -1, so the first growth is at iteration
      ``scale_window``, i.e. on the ``scale_window + 1``-th clean iteration.

    Args:
        init_scale: the starting scale.
        scale_factor: the factor for each decrease and increase (> 1).
        scale_window: clean iterations between increases (>= 1).
        min_scale: the floor of the scale (> 0).
        delayed_shift: the hysteresis: overflows tolerated before the first decrease (>= 1).
        consecutive_hysteresis: refill the hysteresis on every clean iteration.
        raise_error_at_min_scale: raise when an overflow finds the scale at ``min_scale``.
    """

    dynamic = True

    def __init__(
        self,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        delayed_shift: int = 1,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = True,
    ) -> None:
        _require(init_scale > 0, "init_scale", init_scale, "> 0")
        _require(scale_factor > 1, "scale_factor", scale_factor, "> 1")
        _require(scale_window >= 1, "scale_window", scale_window, ">= 1")
        _require(min_scale > 0, "min_scale", min_scale, "> 0")
        _require(delayed_shift >= 1, "delayed_shift", delayed_shift, ">= 1")
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.delayed_shift = int(delayed_shift)
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.cur_scale = float(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = self.delayed_shift

    @property
    def loss_scale(self) -> float:
        """The factor to multiply the loss by before backward."""
        return self.cur_scale

    def update_scale(self, overflow: bool) -> None:
        """Record one iteration's outcome and adjust the scale by the rules above.

        Raises:
            LossScaleAtMinimumError: an overflow at ``min_scale`` with
                ``raise_error_at_min_scale``; the scaler's state is left unchanged.
        """
        if overflow:
            self._on_overflow()
        else:
            self._on_clean()
        self.cur_iter += 1

    def _on_overflow(self) -> None:
        if self.delayed_shift == 1 or self.cur_hysteresis == 1:
            if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                raise LossScaleAtMinimumError(
                    f"the loss keeps overflowing (inf/nan gradients) with the fp16 loss scale "
                    f"already at its minimum {self.min_scale:g}, so it cannot be lowered further. "
                    "HINT: the model is likely diverging or overflowing fp16 by itself: lower "
                    "the learning rate, set gradient_clipping, look for inf/nan in the data or "
                    "loss, or train in bf16; lowering fp16.min_loss_scale only helps if the "
                    "scale itself causes the overflow"
                )
            next_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            logger.debug(
                "fp16 overflow, skipping step; loss scale %g -> %g", self.cur_scale, next_scale
            )
            self.cur_scale = next_scale
        else:
            logger.debug(
                "fp16 overflow, skipping step; loss scale %g kept, hysteresis %d -> %d",
                self.cur_scale,
                self.cur_hysteresis,
                self.cur_hysteresis - 1,
            )
            self.cur_hysteresis -= 1
        self.last_overflow_iter = self.cur_iter

    def _on_clean(self) -> None:
        if self.consecutive_hysteresis:
            self.cur_hysteresis = self.delayed_shift
        stable = self.cur_iter - self.last_overflow_iter - 1
        if stable > 0 and stable % self.scale_window == 0:
            if not self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            self.cur_scale *= self.scale_factor

    def state_dict(self) -> dict[str, Any]:
        """The scaler's running state (not its settings), for checkpoints."""
        return {
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; settings stay those this scaler was built with."""
        self.cur_scale = float(state["cur_scale"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        self.cur_hysteresis = int(state["cur_hysteresis"])


LossScaler = StaticLossScaler | DynamicLossScaler


def _require(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {rule}, got {value!r}")


def has_overflow(tensors: Iterable[torch.Tensor | None]) -> bool:
    """Whether any of ``tensors`` (e.g. gradients; ``None`` entries skipped) holds an inf or nan.

    Uses the max-abs norm, which is inf or nan exactly when a value is: unlike the 2-norm it
    cannot overflow on large finite fp16 values. One host sync per device.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        if tensor.is_sparse:
            tensor = tensor._values()
        if tensor.numel() == 0:
            continue
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    flags: dict[torch.device, torch.Tensor] = {}
    for (device, _), group in groups.items():
        norms = torch.stack(torch._foreach_norm(group, math.inf))
        bad = torch.isfinite(norms).logical_not().any()
        flags[device] = bad if device not in flags else flags[device] | bad
    return any(bool(flag) for flag in flags.values())


def _field(section: object, name: str) -> Any:
    if isinstance(section, Mapping):
        return section[name]
    return getattr(section, name)


def build_loss_scaler(fp16_section: object) -> StaticLossScaler | DynamicLossScaler:
    """The loss scaler a DeepSpeed ``fp16`` section describes.

    Args:
        fp16_section: an object or mapping with DeepSpeed's fp16 field names: ``loss_scale``
            (0 means dynamic), ``initial_scale_power``, ``loss_scale_window``, ``hysteresis``,
            ``consecutive_hysteresis``, ``min_loss_scale``.

    Raises:
        UsageError: a value the scaler rejects, with its ``fp16.*`` key path.
    """
    loss_scale = float(_field(fp16_section, "loss_scale"))
    if loss_scale < 0 or not math.isfinite(loss_scale):
        raise UsageError(
            f"loss_scale must be 0 (dynamic) or a positive number, got {loss_scale:g}",
            where="fp16.loss_scale",
        )
    if loss_scale > 0:
        return StaticLossScaler(loss_scale)
    window = _field(fp16_section, "loss_scale_window")
    hysteresis = _field(fp16_section, "hysteresis")
    min_scale = _field(fp16_section, "min_loss_scale")
    for key, value, ok, rule in (
        ("loss_scale_window", window, window >= 1, ">= 1"),
        ("hysteresis", hysteresis, hysteresis >= 1, ">= 1"),
        ("min_loss_scale", min_scale, min_scale > 0, "> 0"),
    ):
        if not ok:
            raise UsageError(
                f"{key} must be {rule} with dynamic loss scaling (loss_scale 0), got {value!r}",
                where=f"fp16.{key}",
            )
    return DynamicLossScaler(
        init_scale=2.0 ** _field(fp16_section, "initial_scale_power"),
        scale_window=window,
        min_scale=min_scale,
        delayed_shift=hysteresis,
        consecutive_hysteresis=bool(_field(fp16_section, "consecutive_hysteresis")),
    )


def backward_factor(accumulation: int, world: int, scaler) -> float:
    """What a micro-batch's loss is multiplied by before backward: ``1 / (accumulation ×
    data-parallel world)`` (the reduced gradient sum is then the mean, with no division
    pass) times the fp16 loss scale when there is a ``scaler``."""
    factor = 1.0 / (accumulation * world)
    return factor * scaler.loss_scale if scaler is not None else factor


def inverse_scale(scaler) -> float:
    """The factor that undoes ``scaler``'s loss scale on the gradients (1 without one)."""
    return 1.0 / scaler.loss_scale if scaler is not None else 1.0
