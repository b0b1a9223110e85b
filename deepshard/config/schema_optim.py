"""The ``optimizer`` and ``scheduler`` sections: a type name and type-specific params.

Defaults are DeepSpeed's: its FusedAdam / CPU Adam for Adam and AdamW (DeepSpeed's "Adam"
decouples weight decay unless ``adam_w_mode`` is false), FusedLamb for LAMB, torch's SGD,
and ``deepspeed/runtime/lr_schedules.py`` for the schedules. A type DeepSpeed accepts and
deepshard does not implement yet is an error that says so; an unknown one gets a "did you
mean". ``params`` is validated by the params model of the type.
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, ClassVar, Literal

from pydantic import SerializeAsAny, ValidationInfo, model_validator

from deepshard.config.schema_base import (
    Betas,
    Bool,
    Float,
    KeyLog,
    LearningRate,
    NonNegFloat,
    NonNegInt,
    PosInt,
    Section,
    UnitFloat,
    did_you_mean,
    doc,
    fail,
    key_log,
    one_of,
    validate_section,
)
from deepshard.errors import UsageError

# ---- optimizers ---------------------------------------------------------------------------


class OptimizerParams(Section):
    """Base of the per-type ``optimizer.params`` models."""

    lr: NonNegFloat = doc("Learning rate.", default=1e-3)
    weight_decay: NonNegFloat = doc("Weight decay coefficient.", default=0.0)


_TORCH_ADAM_ONLY = frozenset({"fp32_optimizer_states", "foreach", "set_grad_none", "maximize",
                              "capturable", "differentiable", "fused",
                              "decoupled_weight_decay"})


class AdamWParams(OptimizerParams):
    """``optimizer.params`` of type AdamW (DeepSpeed: FusedAdam / CPU Adam, decoupled
    weight decay)."""

    ds_only_keys: ClassVar[frozenset[str]] = _TORCH_ADAM_ONLY | {"adam_w_mode"}

    betas: Betas = doc("Coefficients of the running averages of the gradient and its "
                       "square.", default=(0.9, 0.999))
    eps: NonNegFloat = doc("Term added to the denominator for numerical stability.",
                           default=1e-8)
    bias_correction: Bool = doc("Correct the bias of the moment estimates.", default=True)
    amsgrad: Bool = doc("Use the AMSGrad variant (DeepSpeed's fused kernels reject it).",
                        default=False)
    torch_adam: Bool = doc("Use torch's own Adam/AdamW implementation instead of a fused "
                           "one.", default=False)


class AdamParams(AdamWParams):
    """``optimizer.params`` of type Adam (DeepSpeed: AdamW-style decay unless
    ``adam_w_mode`` is false)."""

    ds_only_keys: ClassVar[frozenset[str]] = _TORCH_ADAM_ONLY

    adam_w_mode: Bool = doc("Decouple weight decay from the gradient (AdamW); false: "
                            "classic L2 Adam.", default=True)


class SGDParams(OptimizerParams):
    """``optimizer.params`` of type SGD (torch.optim.SGD's defaults)."""

    ds_only_keys: ClassVar[frozenset[str]] = frozenset({"maximize", "foreach",
                                                        "differentiable", "fused"})

    momentum: NonNegFloat = doc("Momentum factor.", default=0.0)
    dampening: NonNegFloat = doc("Dampening for momentum.", default=0.0)
    nesterov: Bool = doc("Use Nesterov momentum.", default=False)


class LambParams(OptimizerParams):
    """``optimizer.params`` of type LAMB (DeepSpeed's FusedLamb)."""

    betas: Betas = doc("Coefficients of the running averages of the gradient and its "
                       "square.", default=(0.9, 0.999))
    eps: NonNegFloat = doc("Term added to the denominator for numerical stability.",
                           default=1e-8)
    bias_correction: Bool = doc("Correct the bias of the moment estimates.", default=True)
    max_coeff: NonNegFloat = doc("Upper bound of the layer-wise trust ratio.", default=10.0)
    min_coeff: NonNegFloat = doc("Lower bound of the layer-wise trust ratio.", default=0.01)
    eps_inside_sqrt: Bool = doc("Add eps inside the square root of the second moment.",
                                default=False)
    amsgrad: Bool = doc("Must be false: LAMB has no AMSGrad variant (kept for DeepSpeed "
                        "configs that spell it out).", default=False)

    @model_validator(mode="after")
    def _no_amsgrad(self, info: ValidationInfo) -> LambParams:
        if self.amsgrad:
            raise fail(key_log(info) or KeyLog(), "amsgrad", "LAMB has no AMSGrad variant",
                       "remove amsgrad, or use type Adam")
        return self


class AdagradParams(OptimizerParams):
    """``optimizer.params`` of type Adagrad: DeepSpeed's CPU Adagrad under optimizer
    offload, torch's Adagrad otherwise (keys of either; one the built optimizer lacks must
    keep its default)."""

    lr: NonNegFloat = doc("Learning rate.", default=1e-2)
    eps: NonNegFloat = doc("Term added to the denominator for numerical stability.",
                           default=1e-10)
    amsgrad: Bool = doc("Must be false: Adagrad has no AMSGrad variant.", default=False)
    fp32_optimizer_states: Bool = doc("Keep the accumulator in fp32 (CPU Adagrad).",
                                      default=True)
    lr_decay: NonNegFloat = doc("Learning-rate decay (torch's Adagrad only).", default=0.0)
    initial_accumulator_value: NonNegFloat = doc(
        "Starting value of the accumulator (torch's Adagrad only).", default=0.0)


class LionParams(OptimizerParams):
    """``optimizer.params`` of type Lion: DeepSpeed's CPU Lion under optimizer offload,
    FusedLion otherwise."""

    betas: Betas = doc("Coefficients of the update's interpolation and of the momentum.",
                       default=(0.9, 0.999))
    fp32_optimizer_states: Bool = doc("Keep the momentum in fp32 (CPU Lion).", default=True)
    set_grad_none: Bool = doc("Set gradients to None on zero_grad (FusedLion).",
                              default=True)


CommBackend = Annotated[Literal["nccl", "mpi", "compressed"],
                        one_of("nccl", "mpi", "compressed", case_insensitive=True)]


class OneBitParams(OptimizerParams):
    """What the 1-bit optimizers share (DeepSpeed's OnebitAdam/ZeroOneAdam/OnebitLamb
    signatures): their compressed all-reduce runs on the job's data-parallel process group,
    whatever ``comm_backend_name`` names."""

    betas: Betas = doc("Coefficients of the running averages of the gradient and its "
                       "square.", default=(0.9, 0.999))
    eps: NonNegFloat = doc("Term added to the denominator for numerical stability.",
                           default=1e-8)
    eps_inside_sqrt: Bool = doc("Add eps inside the square root of the second moment.",
                                default=False)
    bias_correction: Bool = doc("Accepted as DeepSpeed's (its 1-bit updates never correct "
                                "the bias).", default=True)
    amsgrad: Bool = doc("Must be false: no AMSGrad variant (DeepSpeed rejects it too).",
                        default=False)
    cuda_aware: Bool = doc("Accepted for DeepSpeed configs: MPI's CUDA-aware transfers; the "
                           "process group decides here.", default=False)
    comm_backend_name: CommBackend = doc(
        "DeepSpeed's compressed backend: nccl, mpi or compressed; all run on the job's "
        "process group (gloo or NCCL).", default="nccl")

    @model_validator(mode="after")
    def _no_amsgrad(self, info: ValidationInfo) -> OneBitParams:
        if self.amsgrad:
            raise fail(key_log(info) or KeyLog(), "amsgrad", "the 1-bit optimizers have no "
                       "AMSGrad variant", "remove amsgrad")
        return self


class OneBitAdamParams(OneBitParams):
    """``optimizer.params`` of OneBitAdam: Adam for ``freeze_step`` steps, then frozen
    variance and 1-bit compressed momentum."""

    freeze_step: NonNegInt = doc("Steps of uncompressed Adam before compression starts.",
                                 default=100000)


class ZeroOneAdamParams(OneBitParams):
    """``optimizer.params`` of ZeroOneAdam (0/1 Adam): adaptive variance freezing and
    skipped synchronisation rounds."""

    var_freeze_step: NonNegInt = doc("Step after which the variance is never updated "
                                     "again.", default=100000)
    var_update_scaler: PosInt = doc("Growth of the interval between variance updates.",
                                    default=16)
    local_step_scaler: PosInt = doc("Growth of the interval between synchronisations once "
                                    "the variance is frozen.", default=32678)
    local_step_clipper: PosInt = doc("Largest interval between synchronisations (steps).",
                                     default=16)


class OneBitLambParams(OneBitParams):
    """``optimizer.params`` of OneBitLamb: LAMB for ``freeze_step`` steps, then frozen
    layer-wise scaling coefficients and 1-bit compressed momentum."""

    freeze_step: NonNegInt = doc("Steps of uncompressed LAMB before compression starts.",
                                 default=100000)
    max_coeff: NonNegFloat = doc("Upper bound of the layer-wise trust ratio.", default=10.0)
    min_coeff: NonNegFloat = doc("Lower bound of the layer-wise trust ratio.", default=0.01)
    coeff_beta: UnitFloat = doc("Running-average coefficient of the trust ratios during "
                                "warm-up.", default=0.9)
    factor_max: NonNegFloat = doc("Upper bound of the compressed phase's scaling factor.",
                                  default=4.0)
    factor_min: NonNegFloat = doc("Lower bound of the compressed phase's scaling factor.",
                                  default=0.5)
    factor_threshold: NonNegFloat = doc("Largest change of the scaling factor per step.",
                                        default=0.1)


OPTIMIZER_PARAMS: Mapping[str, type[OptimizerParams]] = MappingProxyType({
    "Adam": AdamParams, "AdamW": AdamWParams, "SGD": SGDParams, "LAMB": LambParams,
    "Adagrad": AdagradParams, "Lion": LionParams,
    "OneBitAdam": OneBitAdamParams, "ZeroOneAdam": ZeroOneAdamParams,
    "OneBitLamb": OneBitLambParams})
"""Supported optimizer types (canonical spelling) and their params models; DeepSpeed's
spellings of the 1-bit ones (``OnebitAdam``, ``onebitlamb``) match in any letter case."""

ONEBIT_OPTIMIZERS = frozenset({"OneBitAdam", "ZeroOneAdam", "OneBitLamb"})
"""The optimizers that communicate in their own step (compressed): ZeRO stages 0-1."""

# What DeepSpeed accepts as optimizer.type besides the above: its own optimizers
# (runtime/config.py) and any torch.optim class by name.
DEEPSPEED_ONLY_OPTIMIZERS = (
    "MuAdam", "MuAdamW",
    "MuSGD", "Muon", "ASGD", "Adadelta", "Adafactor", "Adamax", "LBFGS", "NAdam", "RAdam",
    "RMSprop", "Rprop", "SparseAdam")


def _canonical(given: str, names: Any) -> str | None:
    return next((n for n in names if n.lower() == given.lower()), None)


class OptimizerConfig(Section):
    """``optimizer``: which optimizer the engine builds, and its hyperparameters."""

    ds_only_keys: ClassVar[frozenset[str]] = frozenset({"legacy_fusion"})

    type: Literal["Adam", "AdamW", "SGD", "LAMB", "Adagrad", "Lion", "OneBitAdam",
                  "ZeroOneAdam", "OneBitLamb"] = doc(
        "Optimizer: Adam, AdamW, SGD, LAMB, Adagrad, Lion, OneBitAdam, ZeroOneAdam or "
        "OneBitLamb (any letter case; stored as spelled here).")
    params: SerializeAsAny[OptimizerParams] = doc(
        "Hyperparameters, validated by the type's model (AdamParams, AdamWParams, SGDParams, "
        "LambParams, AdagradParams, LionParams, OneBitAdamParams, ZeroOneAdamParams, "
        "OneBitLambParams).",
        default_factory=AdamWParams)

    @classmethod
    def params_model(cls, given: object) -> builtins.type[Section] | None:
        """The params model of optimizer type ``given``, if it is supported."""
        name = _canonical(given, OPTIMIZER_PARAMS) if isinstance(given, str) else None
        return OPTIMIZER_PARAMS.get(name) if name else None

    @classmethod
    def section_of(cls, key: str, data: dict[str, Any]) -> builtins.type[Section] | None:
        return cls.params_model(data.get("type")) if key == "params" else None

    @classmethod
    def prepare(cls, data: dict[str, Any], log: KeyLog) -> dict[str, Any]:
        if "type" not in data:
            return data  # pydantic reports the missing key
        name = _choose_type(data["type"], OPTIMIZER_PARAMS, DEEPSPEED_ONLY_OPTIMIZERS,
                            "optimizer", log, case_insensitive=True)
        params = data.get("params")
        if isinstance(params, dict) and "max_grad_norm" in params:
            raise UsageError("not supported as an optimizer parameter",
                             where=log.where("params", "max_grad_norm"),
                             hint="remove it and set the top-level gradient_clipping "
                                  "instead (DeepSpeed rejects it too)")
        return {**data, "type": name,
                "params": validate_section(OPTIMIZER_PARAMS[name], params or {}, log,
                                           "params")}

    @model_validator(mode="after")
    def _params_match_type(self) -> OptimizerConfig:
        # params of another type's model can only arrive by constructing the model directly
        expected = OPTIMIZER_PARAMS[self.type]
        if type(self.params) is not expected:
            raise ValueError(f"params must be {expected.__name__} for {self.type}")
        return self


def _choose_type(given: Any, supported: Any, deepspeed_only: Any, section: str, log: KeyLog,
                 *, case_insensitive: bool) -> str:
    """The canonical supported type name for ``given``, or a UsageError saying why not."""
    accepted = ", ".join(supported)
    if not isinstance(given, str):
        raise UsageError(f"expected a type name, got {given!r}", where=log.where("type"),
                         hint=f"use one of: {accepted}")
    if given in supported:
        return given
    found = _canonical(given, supported) if case_insensitive else None
    if found:
        return found
    if _canonical(given, deepspeed_only):
        raise UsageError(f"{given!r} is not yet supported by deepshard",
                         where=log.where("type"),
                         hint=f"use one of the supported types: {accepted}")
    suggestion = did_you_mean(given, [*supported, *deepspeed_only])
    guess = f", did you mean {suggestion!r}" if suggestion else ""
    raise UsageError(f"unknown {section} type {given!r}{guess}", where=log.where("type"),
                     hint=f"use one of: {accepted}")


# ---- LR schedules -------------------------------------------------------------------------

WarmupType = Annotated[Literal["log", "linear"], one_of("log", "linear")]

_SCHEDULER_ONLY = frozenset({"last_batch_iteration"})


class WarmupLRParams(Section):
    """``scheduler.params`` of WarmupLR: warm up from min to max LR, then hold."""

    ds_only_keys: ClassVar[frozenset[str]] = _SCHEDULER_ONLY

    warmup_min_lr: LearningRate = doc("Learning rate at step 0.", default=0.0)
    warmup_max_lr: LearningRate | None = doc(
        "Learning rate reached after warmup; None: the optimizer's lr (DeepSpeed 0.19).",
        default=None)
    warmup_num_steps: PosInt = doc("Steps of warmup.", default=1000)
    warmup_type: WarmupType = doc("Warmup curve: 'log' or 'linear'.", default="log")


class WarmupDecayLRParams(WarmupLRParams):
    """``scheduler.params`` of WarmupDecayLR: WarmupLR, then linear decay to 0 at
    ``total_num_steps``."""

    total_num_steps: PosInt = doc("Total training steps (the LR reaches 0 there).")
    warmup_max_lr: LearningRate = doc("Learning rate reached after warmup.", default=0.001)


class WarmupCosineLRParams(Section):
    """``scheduler.params`` of WarmupCosineLR: ratios of the optimizer's lr, warmup then
    cosine decay."""

    ds_only_keys: ClassVar[frozenset[str]] = _SCHEDULER_ONLY

    total_num_steps: PosInt = doc("Total training steps (the cosine ends there).")
    warmup_min_ratio: UnitFloat = doc("LR ratio at step 0.", default=0.0)
    warmup_num_steps: PosInt = doc("Steps of warmup up to ratio 1.", default=1000)
    cos_min_ratio: UnitFloat = doc("LR ratio at the end of the cosine.", default=0.0001)
    warmup_type: WarmupType = doc("Warmup curve: 'log' or 'linear'.", default="log")


class OneCycleParams(Section):
    """``scheduler.params`` of OneCycle: the 1Cycle LR (and momentum) policy."""

    ds_only_keys: ClassVar[frozenset[str]] = _SCHEDULER_ONLY

    cycle_min_lr: LearningRate = doc("Lower LR bound of the cycle.")
    cycle_max_lr: LearningRate = doc("Upper LR bound of the cycle.")
    decay_lr_rate: NonNegFloat = doc("LR decay rate after the cycle.", default=0.0)
    cycle_first_step_size: PosInt = doc("Steps of the first (rising) half.", default=2000)
    cycle_second_step_size: NonNegInt | None = doc(
        "Steps of the second half; None: cycle_first_step_size.", default=None)
    cycle_first_stair_count: NonNegInt = doc("Stairs in the first half (0: smooth).",
                                             default=0)
    cycle_second_stair_count: NonNegInt | None = doc(
        "Stairs in the second half; None: cycle_first_stair_count.", default=None)
    decay_step_size: NonNegInt = doc("Steps between decays after the cycle (0: no decay).",
                                     default=0)
    cycle_momentum: Bool = doc("Cycle momentum inversely to the LR.", default=True)
    cycle_min_mom: Float = doc("Lower momentum bound.", default=0.8)
    cycle_max_mom: Float = doc("Upper momentum bound.", default=0.9)
    decay_mom_rate: NonNegFloat = doc("Momentum decay rate after the cycle.", default=0.0)


class LRRangeTestParams(Section):
    """``scheduler.params`` of LRRangeTest: the LR grows from ``lr_range_test_min_lr`` by
    ``step_rate`` every ``step_size`` steps (a search for the largest usable LR)."""

    ds_only_keys: ClassVar[frozenset[str]] = _SCHEDULER_ONLY

    lr_range_test_min_lr: LearningRate = doc("LR at step 0.", default=1e-3)
    lr_range_test_step_size: PosInt = doc("Steps per unit of growth.", default=2000)
    lr_range_test_step_rate: NonNegFloat = doc("Growth per unit: lr = min_lr * (1 + rate * "
                                               "steps / step_size).", default=1.0)
    lr_range_test_staircase: Bool = doc("Grow in whole units (stairs) instead of smoothly.",
                                        default=False)


SCHEDULER_PARAMS: Mapping[str, type[Section]] = MappingProxyType({
    "WarmupLR": WarmupLRParams, "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams, "OneCycle": OneCycleParams,
    "LRRangeTest": LRRangeTestParams})
"""Supported LR schedules (DeepSpeed's names, case-sensitive) and their params models."""

# DeepSpeed's own LRRangeTest, and torch.optim.lr_scheduler classes it falls back to by name
DEEPSPEED_ONLY_SCHEDULERS = (
    "LambdaLR", "MultiplicativeLR", "StepLR", "MultiStepLR", "ConstantLR",
    "LinearLR", "ExponentialLR", "SequentialLR", "PolynomialLR", "CosineAnnealingLR",
    "ChainedScheduler", "ReduceLROnPlateau", "CyclicLR", "CosineAnnealingWarmRestarts",
    "OneCycleLR")


class SchedulerConfig(Section):
    """``scheduler``: the learning-rate schedule the engine steps after each optimizer
    step."""

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle",
                  "LRRangeTest"] = doc(
        "Schedule: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle or LRRangeTest "
        "(case-sensitive, as in DeepSpeed).")
    params: SerializeAsAny[Section] = doc(
        "Schedule parameters, validated by the type's model (WarmupLRParams, "
        "WarmupDecayLRParams, WarmupCosineLRParams, OneCycleParams).",
        default_factory=WarmupLRParams)

    @classmethod
    def params_model(cls, given: object) -> builtins.type[Section] | None:
        """The params model of schedule type ``given``, if it is supported."""
        return SCHEDULER_PARAMS.get(given) if isinstance(given, str) else None

    @classmethod
    def section_of(cls, key: str, data: dict[str, Any]) -> builtins.type[Section] | None:
        return cls.params_model(data.get("type")) if key == "params" else None

    @classmethod
    def prepare(cls, data: dict[str, Any], log: KeyLog) -> dict[str, Any]:
        if "type" not in data:
            return data
        name = _choose_type(data["type"], SCHEDULER_PARAMS, DEEPSPEED_ONLY_SCHEDULERS,
                            "scheduler", log, case_insensitive=False)
        return {**data, "type": name,
                "params": validate_section(SCHEDULER_PARAMS[name], data.get("params") or {},
                                           log, "params")}

    @model_validator(mode="after")
    def _params_match_type(self) -> SchedulerConfig:
        # params of another type's model can only arrive by constructing the model directly
        expected = SCHEDULER_PARAMS[self.type]
        if type(self.params) is not expected:
            raise ValueError(f"params must be {expected.__name__} for {self.type}")
        return self
