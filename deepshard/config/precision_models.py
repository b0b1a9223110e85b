"""DeepSpeed's ``deepspeed.runtime.precision_config``: the ``bf16`` and ``fp16`` sections as
DeepSpeed's pydantic models, with every field and default of DeepSpeed 0.19.8.

For code that builds or reads these models itself (``get_bfloat16_config(ds_config)``).
deepshard's engine reads the same sections through its schema
(:class:`deepshard.config.schema.BF16Config`, :class:`~deepshard.config.schema.FP16Config`),
which accepts every key here and warns about those it does not act on
(``immediate_grad_update``, ``check_grad_overflow``, ``bf16_master_weights_and_grads``,
``bf16_optimizer_states``, ``fp16_master_weights_and_grads``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationInfo, field_validator, model_validator

from deepshard.config.config_model import DeepSpeedConfigModel
from deepshard.config.key_names import (
    BFLOAT16,
    BFLOAT16_OLD,
    CONSECUTIVE_HYSTERESIS,
    DELAYED_SHIFT,
    FP16,
    INITIAL_LOSS_SCALE,
    MIN_LOSS_SCALE,
    SCALE_WINDOW,
)

__all__ = ["DeepSpeedBF16Config", "DeepSpeedFP16Config", "get_bfloat16_config",
           "get_float16_config"]


class DeepSpeedBF16Config(DeepSpeedConfigModel):
    """The ``bf16`` section (alias ``bfloat16``)."""

    enabled: bool = False
    """Train in bf16 mixed precision."""
    immediate_grad_update: bool = False
    """Apply gradient updates immediately rather than at the step (DeepSpeed's)."""
    check_grad_overflow: bool = True
    """Skip the step when the gradients overflow."""
    bf16_master_weights_and_grads: bool = False
    """Keep ZeRO's master weights and gradients in bf16."""
    bf16_optimizer_states: bool = False
    """Keep optimizer states in bf16 (with ``bf16_master_weights_and_grads``)."""


class DeepSpeedFP16Config(DeepSpeedConfigModel):
    """The ``fp16`` section: fp16 mixed precision and its loss scaling."""

    enabled: bool = False
    """Train in fp16 mixed precision."""
    auto_cast: bool = False
    """Cast the model's floating inputs to fp16."""
    loss_scale: float = 0
    """Static loss scale; 0 selects dynamic loss scaling."""
    initial_scale_power: int = 16
    """Dynamic scaling starts at ``2**initial_scale_power``."""
    loss_scale_window: int = 1000
    """Steps without overflow before the dynamic scale is raised."""
    hysteresis: int = 2
    """Overflows tolerated before the dynamic scale is lowered."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis after every step without overflow."""
    min_loss_scale: int = 1
    """Lower bound of the dynamic loss scale."""
    fp16_master_weights_and_grads: bool = False
    """Keep master weights in fp16 (DeepSpeed's CPU Adam only)."""

    @field_validator("loss_scale", mode="before")
    @classmethod
    def _finite_non_negative(cls, value: Any) -> float:
        if isinstance(value, bool):
            raise ValueError("fp16.loss_scale must be a number, not bool")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError("fp16.loss_scale must be a number") from None
        if not math.isfinite(number) or number < 0:
            raise ValueError("fp16.loss_scale must be a finite number >= 0 (0 enables "
                             "dynamic loss scaling)")
        return number

    @field_validator("loss_scale_window", "min_loss_scale", mode="before")
    @classmethod
    def _integer(cls, value: Any, info: ValidationInfo) -> Any:
        name = f"fp16.{info.field_name}"
        if isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value)):
            raise ValueError(f"{name} must be a finite integer")
        try:
            int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be an integer") from None
        return value

    @model_validator(mode="after")
    def _dynamic_scaling_bounds(self) -> DeepSpeedFP16Config:
        if self.enabled and self.loss_scale == 0:
            for name in ("loss_scale_window", "min_loss_scale"):
                if getattr(self, name) <= 0:
                    raise ValueError(f"fp16.{name} must be > 0 when dynamic loss scaling is "
                                     "enabled (loss_scale=0)")
        return self

    def initial_dynamic_scale(self) -> int:
        """The dynamic loss scale at the start."""
        return int(2**self.initial_scale_power)

    def dynamic_loss_scale_args(self) -> dict[str, Any]:
        """The dynamic loss scaler's arguments, by DeepSpeed's names."""
        return {INITIAL_LOSS_SCALE: 2**self.initial_scale_power,
                SCALE_WINDOW: self.loss_scale_window, DELAYED_SHIFT: self.hysteresis,
                CONSECUTIVE_HYSTERESIS: self.consecutive_hysteresis,
                MIN_LOSS_SCALE: self.min_loss_scale}


def get_bfloat16_config(param_dict: Mapping[str, Any]) -> DeepSpeedBF16Config:
    """The ``bf16`` (else ``bfloat16``) section of a config dict as a model."""
    section = param_dict.get(BFLOAT16)
    if section is None:
        section = param_dict.get(BFLOAT16_OLD, {})
    return DeepSpeedBF16Config(**section)


def get_float16_config(param_dict: Mapping[str, Any]) -> DeepSpeedFP16Config:
    """The ``fp16`` section of a config dict as a model."""
    return DeepSpeedFP16Config(**param_dict.get(FP16, {}))
