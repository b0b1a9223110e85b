"""``build_optimizer``: a DeepSpeed ``optimizer`` config section onto torch optimizers.

DeepSpeed maps ``Adam``/``AdamW`` onto its own ``FusedAdam`` and ``LAMB`` onto ``FusedLamb``.
Here ``Adam``/``AdamW`` become torch's AdamW or Adam (fused kernels where torch has them: on CPU
the fused AdamW is several times faster than the foreach one), ``SGD`` torch's SGD, and
``LAMB`` our CUDA :class:`~deepshard.runtime.optim.lamb.KernelLamb` when every parameter is on
a GPU and CuPy is installed, else our :class:`~deepshard.runtime.optim.lamb.Lamb` (same update).
``Adagrad`` and ``Lion`` are DeepSpeed's choice by offload (``engine.py``
``_configure_basic_optimizer``): with ``offload_optimizer`` on the CPU or NVMe, its CPU
optimizers (:class:`~deepshard.runtime.optim.adagrad.DeepSpeedCPUAdagrad`,
:class:`~deepshard.runtime.optim.lion.DeepSpeedCPULion`, ours in torch ops), else torch's
Adagrad and :class:`~deepshard.runtime.optim.lion.FusedLion`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import torch

from deepshard.errors import UsageError
from deepshard.runtime.optim.adagrad import DeepSpeedCPUAdagrad
from deepshard.runtime.optim.lamb import KernelLamb, Lamb
from deepshard.runtime.optim.lion import DeepSpeedCPULion, FusedLion

_FUSED_DEVICES = ("cpu", "cuda")
_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# DeepSpeed's defaults (FusedAdam's, torch SGD's, FusedLamb's) for keys a config leaves out.
_ADAM_DEFAULTS: Mapping[str, Any] = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 0.0,
    "bias_correction": True,
    "amsgrad": False,
    "adam_w_mode": True,
    "torch_adam": False,
}
_SGD_DEFAULTS: Mapping[str, Any] = {
    "lr": 1e-3,
    "momentum": 0.0,
    "dampening": 0.0,
    "weight_decay": 0.0,
    "nesterov": False,
}
_LAMB_DEFAULTS: Mapping[str, Any] = {
    "lr": 1e-3,
    "bias_correction": True,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "eps_inside_sqrt": False,
    "weight_decay": 0.0,
    "max_grad_norm": 0.0,
    "max_coeff": 10.0,
    "min_coeff": 0.01,
    "amsgrad": False,
}
# Adagrad and Lion take the keys of both optimizers a config may build (DeepSpeed passes the
# params to whichever it picks); a key the picked one lacks must keep its default.
_ADAGRAD_DEFAULTS: Mapping[str, Any] = {
    "lr": 1e-2,
    "eps": 1e-10,
    "weight_decay": 0.0,
    "amsgrad": False,
    "fp32_optimizer_states": True,  # DeepSpeedCPUAdagrad's
    "lr_decay": 0.0,  # torch's Adagrad's, as the two below
    "initial_accumulator_value": 0.0,
}
_LION_DEFAULTS: Mapping[str, Any] = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "weight_decay": 0.0,
    "fp32_optimizer_states": True,  # DeepSpeedCPULion's
    "set_grad_none": True,  # FusedLion's
}

ParamsT = Iterable[torch.Tensor] | Iterable[dict[str, Any]]


def build_optimizer(
    type_name: str, params: Mapping[str, object], model_parameters: ParamsT, *,
    group: Any = None, cpu_offload: bool = False,
) -> torch.optim.Optimizer:
    """Build the optimizer a DeepSpeed config's ``optimizer`` section names.

    ``Adam`` is decoupled-weight-decay AdamW unless ``adam_w_mode`` is false (then L2 decay,
    torch's Adam), as in DeepSpeed; ``AdamW`` is always AdamW. ``torch_adam`` changes nothing,
    both are torch's. Parameters all on CPU or CUDA with float dtypes get torch's fused kernel.
    ``Adagrad`` and ``Lion`` build DeepSpeed's CPU optimizers under ``cpu_offload``, else
    torch's ``Adagrad`` and ``FusedLion``, as DeepSpeed does.

    Args:
        type_name: ``Adam``, ``AdamW``, ``SGD``, ``LAMB``, ``Adagrad``, ``Lion``,
            ``OneBitAdam``, ``ZeroOneAdam`` or ``OneBitLamb`` (canonical spelling).
        params: the section's ``params``; keys left out take DeepSpeed's defaults.
        model_parameters: tensors, or param-group dicts as torch optimizers accept them.
        group: the data-parallel process group the 1-bit optimizers (``OneBitAdam``,
            ``ZeroOneAdam``, ``OneBitLamb``) communicate over (``None``: the default group).
        cpu_offload: ``zero_optimization.offload_optimizer.device`` is ``cpu`` or ``nvme``
            (DeepSpeed's ``zero_use_cpu_optimizer()``); picks the Adagrad and Lion built.

    Raises:
        UsageError: an unknown type or parameter, a setting torch cannot express
            (``bias_correction: false`` for Adam, ``amsgrad`` for LAMB and Adagrad, a key
            of the Adagrad or Lion not picked), or a value the optimizer rejects; with the
            config key path.
        ValueError: ``model_parameters`` is empty.
    """
    builder = _BUILDERS.get(type_name)
    if builder is None and type_name not in _ONEBIT:
        raise UsageError(
            f"unknown optimizer type {type_name!r}",
            where="optimizer.type",
            hint=f"use one of {', '.join([*_BUILDERS, *_ONEBIT])}",
        )
    groups = _materialise(model_parameters)
    if not _all_tensors(groups):
        raise ValueError("model_parameters holds no parameters to optimise")
    try:
        if builder is None:
            return _onebit(type_name, params, groups, group)
        return builder(type_name, params, groups, cpu_offload)
    except ValueError as err:
        raise UsageError(f"{type_name}: {err}", where="optimizer.params") from err


def _materialise(model_parameters: ParamsT) -> list[Any]:
    """A list of tensors or of group dicts (each with a list of params), read once."""
    items = list(model_parameters)
    return [
        {**item, "params": _as_list(item["params"])} if isinstance(item, dict) else item
        for item in items
    ]


def _as_list(params: torch.Tensor | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _all_tensors(groups: list[Any]) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    for item in groups:
        tensors.extend(item["params"] if isinstance(item, dict) else [item])
    return tensors


def _fusable(groups: list[Any]) -> bool:
    """Whether torch's fused Adam kernels take every parameter (plain dense float tensors)."""
    tensors = _all_tensors(groups)
    return bool(tensors) and all(
        type(t.data) is torch.Tensor
        and t.layout == torch.strided
        and t.device.type in _FUSED_DEVICES
        and t.dtype in _FUSED_DTYPES
        for t in tensors
    )


def _lamb_kernel_usable(groups: list[Any]) -> bool:
    """Whether :class:`~deepshard.runtime.optim.lamb.KernelLamb` takes every parameter: dense,
    contiguous fp32/fp16/bf16 tensors on CUDA, with CuPy importable."""
    tensors = _all_tensors(groups)
    if not tensors or not all(
        type(t.data) is torch.Tensor
        and t.is_cuda
        and t.is_contiguous()
        and t.dtype in (torch.float32, torch.float16, torch.bfloat16)
        for t in tensors
    ):
        return False
    return importlib.util.find_spec("cupy") is not None


def _settings(type_name: str, params: Mapping[str, object], defaults: Mapping[str, Any]) -> dict:
    """``params`` over ``defaults``, refusing keys the optimizer does not have."""
    for key in params:
        if key not in defaults:
            raise UsageError(
                f"{type_name} has no parameter {key!r}",
                where=f"optimizer.params.{key}",
                hint=f"{type_name} accepts {', '.join(sorted(defaults))}",
            )
    return {**defaults, **params}


def _adam(type_name: str, params: Mapping[str, object], groups: list[Any],
          cpu_offload: bool) -> torch.optim.Optimizer:
    s = _settings(type_name, params, _ADAM_DEFAULTS)
    if not s["bias_correction"]:
        raise UsageError(
            "bias_correction: false is not supported; torch's Adam always corrects the bias",
            where="optimizer.params.bias_correction",
            hint="remove bias_correction (true is the default)",
        )
    decoupled = type_name == "AdamW" or bool(s["adam_w_mode"])
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    extra = {"fused": True} if _fusable(groups) else {}
    return cls(
        groups,
        lr=s["lr"],
        betas=tuple(s["betas"]),
        eps=s["eps"],
        weight_decay=s["weight_decay"],
        amsgrad=bool(s["amsgrad"]),
        **extra,
    )


def _sgd(type_name: str, params: Mapping[str, object], groups: list[Any],
         cpu_offload: bool) -> torch.optim.Optimizer:
    s = _settings(type_name, params, _SGD_DEFAULTS)
    return torch.optim.SGD(
        groups,
        lr=s["lr"],
        momentum=s["momentum"],
        dampening=s["dampening"],
        weight_decay=s["weight_decay"],
        nesterov=bool(s["nesterov"]),
    )


def _lamb(type_name: str, params: Mapping[str, object], groups: list[Any],
          cpu_offload: bool) -> torch.optim.Optimizer:
    s = _settings(type_name, params, _LAMB_DEFAULTS)
    if s["amsgrad"]:
        raise UsageError(
            "LAMB has no amsgrad variant",
            where="optimizer.params.amsgrad",
            hint="remove amsgrad, or use Adam",
        )
    del s["amsgrad"]
    s["betas"] = tuple(s["betas"])
    # Adam/AdamW stay on torch's fused kernel: it is the bar .adam.KernelAdam (our kernel)
    # must beat and nobody has measured that yet (a user may pass KernelAdam as a client
    # optimizer). torch has no LAMB, and the foreach Lamb makes a dozen passes over memory
    # where the kernel makes two (not yet timed), so on GPUs LAMB takes our kernel; both
    # compute the same update (tests/kernels/test_lamb.py).
    if _lamb_kernel_usable(groups):
        return KernelLamb(groups, **s)
    return Lamb(groups, **s)


def _adagrad(type_name: str, params: Mapping[str, object], groups: list[Any],
             cpu_offload: bool) -> torch.optim.Optimizer:
    """DeepSpeedCPUAdagrad under offload, else torch's Adagrad (same update, with lr_decay
    and initial_accumulator_value; its state is ``sum``, not ``exp_avg_sq``)."""
    s = _settings(type_name, params, _ADAGRAD_DEFAULTS)
    if s["amsgrad"]:
        raise UsageError(
            "Adagrad has no AMSGrad variant",
            where="optimizer.params.amsgrad",
            hint="remove amsgrad (DeepSpeed's CPU Adagrad ignores it, torch's Adagrad "
            "rejects it)",
        )
    if not cpu_offload:
        _refuse_set(type_name, s, _ADAGRAD_DEFAULTS, ("fp32_optimizer_states",),
                    "torch.optim.Adagrad", cpu_offload)
        return torch.optim.Adagrad(
            groups,
            lr=s["lr"],
            lr_decay=s["lr_decay"],
            weight_decay=s["weight_decay"],
            initial_accumulator_value=s["initial_accumulator_value"],
            eps=s["eps"],
        )
    _refuse_set(type_name, s, _ADAGRAD_DEFAULTS, ("lr_decay", "initial_accumulator_value"),
                "DeepSpeedCPUAdagrad", cpu_offload)
    return DeepSpeedCPUAdagrad(
        groups,
        lr=s["lr"],
        eps=s["eps"],
        weight_decay=s["weight_decay"],
        fp32_optimizer_states=bool(s["fp32_optimizer_states"]),
    )


def _lion(type_name: str, params: Mapping[str, object], groups: list[Any],
          cpu_offload: bool) -> torch.optim.Optimizer:
    """DeepSpeedCPULion under offload, else FusedLion."""
    s = _settings(type_name, params, _LION_DEFAULTS)
    beta1, beta2 = cast(Iterable[float], s["betas"])
    betas = (float(beta1), float(beta2))
    if cpu_offload:
        _refuse_set(type_name, s, _LION_DEFAULTS, ("set_grad_none",), "DeepSpeedCPULion",
                    cpu_offload)
        return DeepSpeedCPULion(
            groups,
            lr=s["lr"],
            betas=betas,
            weight_decay=s["weight_decay"],
            fp32_optimizer_states=bool(s["fp32_optimizer_states"]),
        )
    _refuse_set(type_name, s, _LION_DEFAULTS, ("fp32_optimizer_states",), "FusedLion",
                cpu_offload)
    return FusedLion(
        groups,
        lr=s["lr"],
        betas=betas,
        weight_decay=s["weight_decay"],
        set_grad_none=bool(s["set_grad_none"]),
    )


def _refuse_set(type_name: str, settings: Mapping[str, Any], defaults: Mapping[str, Any],
                keys: Iterable[str], picked: str, cpu_offload: bool) -> None:
    """A UsageError for a key among ``keys`` set away from its default: the optimizer
    ``picked`` (by offload, as DeepSpeed picks) has no such parameter, and DeepSpeed would
    fail on it with a TypeError. (The key at its default may come from a filled-in schema,
    so it passes.)"""
    for key in keys:
        if settings[key] != defaults[key]:
            offload = "on" if cpu_offload else "off"
            raise UsageError(
                f"{type_name} with offload_optimizer {offload} builds {picked}, which has "
                f"no parameter {key!r}",
                where=f"optimizer.params.{key}",
                hint=f"remove {key}",
            )


def _onebit(type_name: str, params: Mapping[str, object], groups: list[Any],
            group: Any) -> torch.optim.Optimizer:
    """DeepSpeed's 1-bit optimizers, over the data-parallel group: the config's params are
    their constructors' keyword arguments (the schema filled DeepSpeed's defaults)."""
    module_name, class_name = _ONEBIT[type_name]
    module = importlib.import_module(f"{__package__}.onebit.{module_name}")
    s = {k: (tuple(cast(Iterable[float], v)) if k == "betas" else v) for k, v in params.items()}
    return getattr(module, class_name)(groups, **s, group=group)


_ONEBIT: Mapping[str, tuple[str, str]] = {
    "OneBitAdam": ("adam", "OneBitAdam"),
    "ZeroOneAdam": ("zoadam", "ZeroOneAdam"),
    "OneBitLamb": ("lamb", "OneBitLamb"),
}

_BUILDERS: Mapping[
    str, Callable[[str, Mapping[str, object], list[Any], bool], torch.optim.Optimizer]
] = {
    "Adam": _adam,
    "AdamW": _adam,
    "SGD": _sgd,
    "LAMB": _lamb,
    "Adagrad": _adagrad,
    "Lion": _lion,
}
