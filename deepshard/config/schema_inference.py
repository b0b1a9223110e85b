"""``init_inference``'s config: DeepSpeed 0.19.8's ``DeepSpeedInferenceConfig``, read into a
frozen :class:`InferenceSpec`. Torch-free: a ``torch.dtype`` is recognised by its ``str``.

``config`` is None, a dict or a path to a JSON (or YAML) file; keyword arguments join it. A
key given both ways with different values is an error, as in DeepSpeed (which compares raw
values, so ``"fp16"`` against ``torch.half`` conflicts there and not here, and which takes
``tp`` and ``tensor_parallel`` for two keys). ``"auto"`` values are dropped, as DeepSpeed
drops them. Each of DeepSpeed's keys is a *field* (honoured: a field of the spec), *none*
(accepted with no effect: it changes no result, in DeepSpeed's engine either), or *refused*
(a one-line :class:`UsageError` naming the key and what to do instead). Any other key is
an error with "did you mean".

============================================  =======  =========================================
key (aliases)                                 kind     handling
============================================  =======  =========================================
tensor_parallel (tp).tp_size                  field    ``tp_size``, >= 1 (DeepSpeed takes 0, -1)
tensor_parallel.tp_group                      field    ``tp_group``, passed through
tensor_parallel.enabled                       field    false with tp_size > 1 refused (DeepSpeed
                                                       ignores it)
tensor_parallel.tp_grain_size                 none     where uneven AutoTP shards end, not results
tensor_parallel.mpu, mpu                      refused  unless None: give tp_group and tp_size
mp_size                                       field    deprecated: read as tp_size with a note; a
                                                       different tensor_parallel.tp_size refused
dtype                                         field    fp32, fp16 (default, as DeepSpeed), bf16,
                                                       int8 (weights); None: keep the model's
replace_with_kernel_inject (kernel_inject)    field    ``kernel_inject``
injection_policy (injection_dict)             field    passed through; with kernel_inject refused
checkpoint                                    field    a directory (kept), or a JSON file or dict
                                                       describing one (CheckpointDescription)
base_dir                                      field    ``base_dir``
max_out_tokens (max_tokens)                   field    > 0
min_out_tokens (min_tokens)                   field    >= 0
keep_module_on_host, return_tuple             field    as given
enable_cuda_graph                             field    with tp_size > 1 refused (DeepSpeed asserts)
quant.enabled, quant.weight.enabled           field    with dtype int8 (``int8``, ``quant_bits``
                                                       8, symmetric, per output channel); false
                                                       refused; otherwise a note (DeepSpeed never
                                                       reads quant)
quant.weight.num_bits                         refused  unless 8
quant.weight.q_type                           refused  unless symmetric
quant.weight.quantized_initialization         refused  unless empty (per-module settings)
quant.weight.post_init_quant                  refused  unless empty (per-module settings)
quant.activation                              refused  when given, unless enabled is false
quant.qkv.enabled                             refused  when false: every linear is quantized
quant.*.q_groups                              none     scales are per output channel
triangular_masking (tm)                       none     DeepSpeed passes it on and never reads it
triton_autotune                               none     only read with use_triton
moe (a bool or a mapping)                     none     DeepSpeed reads only moe.ep_size
moe.enabled, moe.type, moe_type               none     never read by DeepSpeed
moe.moe_experts (num_experts), moe_experts    none     never read by DeepSpeed
moe.ep_size, ep_size                          refused  above 1: expert parallelism
moe.ep_group (expert_group), moe.ep_mp_group  refused  unless None: expert parallelism
ep_group (expert_group)                       refused  unless None: expert parallelism
ep_mp_group (expert_mp_group)                 refused  unless None: expert parallelism
zero                                          none     stage 0 (DeepSpeed's init_inference never
                                                       reads it); a stage > 0 refused
checkpoint_config (ckpt_config)               none     never read by DeepSpeed; a note when set
replace_method                                none     deprecated by DeepSpeed; a note when given
use_triton                                    refused  when true: Triton kernels
set_empty_params, transposed_mode             refused  when true: DeepSpeed hybrid-engine internals
save_mp_checkpoint_path                       refused  unless None: shards are cut at load time
training_mp_size                              refused  unless 1: the description states it
injection_policy_tuple, config (args)         refused  unless None: DeepSpeed's internals
============================================  =======  =========================================
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, cast

from pydantic import AliasChoices, BeforeValidator
from pydantic_core import PydanticCustomError

from deepshard.config.dialect import read_config_source
from deepshard.config.schema_base import (
    Bool,
    KeyLog,
    NonNegInt,
    PosInt,
    Section,
    doc,
    one_of,
    unknown_key_error,
    validate_section,
)
from deepshard.config.schema_zero import ZeroConfig
from deepshard.errors import UsageError

DType = Literal["fp32", "fp16", "bf16", "int8"]
ORIGIN = "init_inference"
_DTYPES: dict[str, DType] = {
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "bf16": "bf16", "bfloat16": "bf16",
    "bfloat": "bf16", "fp32": "fp32", "float32": "fp32", "float": "fp32", "int8": "int8"}
_DTYPE_KIND = ("a dtype: torch.float16, torch.bfloat16, torch.float32 or torch.int8 (or "
               "'fp16', 'bf16', 'fp32', 'int8'), or None to keep the model's")
_OPAQUE = frozenset({"injection_policy", "config", "replace_method", "checkpoint"})
_WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt")
_DESCRIPTION = '{"type": "ds_model", "checkpoints": ["shard1.pt", ...], "version": 1.0}'


def dtype_name(value: object) -> DType | None:
    """``value`` (a ``torch.dtype``, its ``str``, or a DeepSpeed dtype name, any letter case)
    as "fp32", "fp16", "bf16" or "int8"; None stays None. ValueError for anything else."""
    if value is None:
        return None
    text = value if isinstance(value, str) else None
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        text = str(value)  # torch.half -> "torch.float16", without importing torch
    name = _DTYPES.get(text.lower().removeprefix("torch.")) if text is not None else None
    if name is None:
        raise ValueError(f"not a dtype init_inference takes: {value!r}")
    return name


def _dtype_check(value: Any) -> Any:
    try:
        return dtype_name(value)
    except ValueError:
        raise PydanticCustomError("expected", "expected {kind}", {"kind": _DTYPE_KIND}) from None


def _files(value: Any) -> Any:
    if isinstance(value, list):
        value = {"tp": value}
    if (isinstance(value, dict) and "tp" in value and set(value) <= {"tp", "non_tp"}
            and all(isinstance(v, list) and all(isinstance(s, str) for s in v)
                    for v in value.values()) and any(value.values())):
        return {"tp": tuple(value["tp"]), "non_tp": tuple(value.get("non_tp", ()))}
    raise PydanticCustomError("expected", "expected {kind}", {
        "kind": 'a list of checkpoint file names, or {"tp": [...], "non_tp": [...]}'})


InferenceDType = Annotated[DType | None, BeforeValidator(_dtype_check)]
MoEType = Annotated[Literal["standard", "residual"], one_of("standard", "residual")]
QType = Annotated[Literal["symmetric", "asymmetric"], one_of("symmetric", "asymmetric")]
Files = Annotated[dict[str, tuple[str, ...]], BeforeValidator(_files)]


def _aka(alias: str, text: str, **kwargs: Any) -> Any:
    """A field also spelled ``alias`` (DeepSpeed's alias; the field's name works too)."""
    return doc(text, validation_alias=AliasChoices(alias), **kwargs)


class _Strict(Section):
    """A section refusing every key it does not know, with "did you mean" (DeepSpeed's
    inference models forbid extra keys); a bool stands for ``{"enabled": ...}``. The
    module's table says what each key does."""

    @classmethod
    def coerce(cls, data: Any, log: KeyLog) -> Any:
        if isinstance(data, bool) and "enabled" in cls.model_fields:
            return {"enabled": data}
        for key in data if isinstance(data, Mapping) else ():
            if str(key) not in cls.known_keys():
                raise unknown_key_error(cls, str(key), log)
        return data


class TensorParallelSection(_Strict):
    """``tensor_parallel`` (``tp``): DeepSpeed's ``DeepSpeedTPConfig``."""

    enabled: Bool = doc("false needs tp_size 1 (DeepSpeed ignores it).", default=True)
    tp_size: PosInt = doc("Ranks each layer is split over.", default=1)
    tp_grain_size: PosInt = doc("Granularity of uneven AutoTP splits: no effect.", default=64)
    mpu: Any = doc("A Megatron model-parallel unit: refused unless None.", default=None)
    tp_group: Any = doc("The process group to split over, passed through.", default=None)


class MoESection(_Strict):
    """``moe``: DeepSpeed's ``DeepSpeedMoEConfig``; no effect, ``ep_size`` > 1 refused."""

    enabled: Bool = True
    ep_size: PosInt = 1
    moe_experts: list[PosInt] = _aka("num_experts", "No effect.", default_factory=lambda: [1])
    type: MoEType = "standard"
    ep_mp_group: Any = None
    ep_group: Any = _aka("expert_group", "Refused unless None.", default=None)


class QuantBitsSection(_Strict):
    """``quant.activation`` (refused when given enabled), the base of ``quant.weight``."""

    enabled: Bool = True
    num_bits: PosInt = doc("Bits per value: 8 only.", default=8)
    q_type: QType = doc("'symmetric' only.", default="symmetric")
    q_groups: PosInt = doc("No effect: one scale per output channel.", default=1)


class WeightQuantSection(QuantBitsSection):
    """``quant.weight``; its per-module settings are refused unless empty."""

    quantized_initialization: dict[str, Any] = doc("Refused.", default_factory=dict)
    post_init_quant: dict[str, Any] = doc("Refused.", default_factory=dict)


class QKVQuantSection(_Strict):
    """``quant.qkv``: quantize the QKV projection (false refused)."""

    enabled: Bool = True


class QuantSection(_Strict):
    """``quant``: DeepSpeed's ``QuantizationConfig``, read with dtype int8."""

    enabled: Bool = True
    activation: QuantBitsSection = doc("Refused.", default_factory=QuantBitsSection)
    weight: WeightQuantSection = doc("Weights.", default_factory=WeightQuantSection)
    qkv: QKVQuantSection = doc("The QKV projection.", default_factory=QKVQuantSection)


class CheckpointPathsSection(_Strict):
    """``checkpoint_config`` (``ckpt_config``): DeepSpeed 0.19.8 never reads it."""

    checkpoint_dir: str | None = None
    save_mp_checkpoint_path: str | None = None
    base_dir: str | None = None


class CheckpointSection(_Strict):
    """A checkpoint description, the form DeepSpeed's ``get_sd_loader_json`` reads."""

    type: Annotated[Literal["ds_model", "bloom", "Megatron"],
                    one_of("ds_model", "bloom", "Megatron", case_insensitive=True)] = doc(
        "The checkpoint's kind (any letter case).")
    checkpoints: Files = doc("File names: a list, or {'tp': [...], 'non_tp': [...]}.")
    version: float | int | str = doc("The format's version (required, as in DeepSpeed).")
    parallelization: Annotated[Literal["pp", "tp"], one_of("pp", "tp")] = doc(
        "'pp': files of whole tensors; 'tp': tensor-parallel shards.", default="pp")
    tp_size: PosInt | None = doc("The degree the files were saved at.", default=None)
    mp_size: PosInt | None = doc("tp_size's older name.", default=None)
    base_dir: str | None = doc("The files' directory.", default=None)
    dtype: InferenceDType = doc("The files' dtype.", default=None)


class InferenceSection(_Strict):
    """``init_inference``'s whole config: DeepSpeed's ``DeepSpeedInferenceConfig``, its
    defaults (measured) and aliases. Fields without a description are refused unless they
    hold their default, or have no effect: see the module's table."""

    replace_with_kernel_inject: Bool = _aka("kernel_inject", "The fused path.", default=False)
    dtype: InferenceDType = doc("The model's dtype (None: keep it).", default="fp16")
    tensor_parallel: TensorParallelSection = _aka(
        "tp", "Tensor parallelism.", default_factory=TensorParallelSection)
    enable_cuda_graph: Bool = doc("Capture and replay CUDA graphs.", default=False)
    use_triton: Bool = False
    triton_autotune: Bool = False
    zero: dict[str, Any] = doc("ZeRO-Inference: stage 0 only.", default_factory=dict)
    triangular_masking: Bool = _aka("tm", "No effect.", default=True)
    moe: MoESection = doc("Mixture of experts.", default_factory=MoESection)
    keep_module_on_host: Bool = doc("Keep weights on the host until sharded.", default=False)
    quant: QuantSection = doc("Int8 weights, with dtype int8.", default_factory=QuantSection)
    checkpoint: Any = doc("A directory, a JSON description or a dict.", default=None)
    base_dir: str = doc("The directory of a description's files.", default="")
    set_empty_params: Bool = False
    save_mp_checkpoint_path: str | None = None
    checkpoint_config: CheckpointPathsSection = _aka(
        "ckpt_config", "No effect.", default_factory=CheckpointPathsSection)
    return_tuple: Bool = doc("Fused layers return tuples.", default=True)
    training_mp_size: PosInt = 1
    replace_method: str = doc("Deprecated, no effect.", default="auto")
    injection_policy: dict[Any, Any] | None = _aka(
        "injection_dict", "{ModuleClass: ('name.of.linear', ...)}.", default=None)
    injection_policy_tuple: Any = None
    config: Any = _aka("args", "Refused unless None.", default=None)
    max_out_tokens: PosInt = _aka("max_tokens", "Most tokens, input and output.", default=1024)
    min_out_tokens: NonNegInt = _aka("min_tokens", "Fewest tokens generated.", default=1)
    transposed_mode: Bool = False
    mp_size: PosInt | None = doc("Deprecated tp_size (None: not given).", default=None)
    mpu: Any = None
    ep_size: PosInt = 1
    ep_group: Any = _aka("expert_group", "Refused unless None.", default=None)
    ep_mp_group: Any = _aka("expert_mp_group", "Refused unless None.", default=None)
    moe_experts: list[PosInt] = doc("No effect.", default_factory=lambda: [1])
    moe_type: MoEType = "standard"


_MPU = ("a model-parallel unit (mpu) is not taken", "pass mpu.get_model_parallel_group() as "
        "tensor_parallel.tp_group and its size as tensor_parallel.tp_size")
_EP = ("expert parallelism at inference is not implemented",
       "remove it: MoE layers run whole on each rank; split the model with tp_size")
_PER_MODULE = ("per-module quantization settings are not implemented",
               "remove it: dtype int8 quantizes every linear weight")
_REFUSED: dict[str, tuple[str, str]] = {
    "use_triton": ("DeepSpeed's Triton inference kernels are not implemented",
                   "remove it; replace_with_kernel_inject selects the fused path"),
    "set_empty_params": ("empty injected layers (DeepSpeed's hybrid engine) are not "
                         "implemented", "remove it"),
    "transposed_mode": ("transposed injected weights (DeepSpeed's hybrid engine) are not "
                        "implemented", "remove it"),
    "save_mp_checkpoint_path": ("saving a resharded checkpoint is not implemented", "remove "
                                "it: a checkpoint is sharded as it loads, at any tp_size"),
    "training_mp_size": ("a checkpoint's training degree is not taken from here", "remove "
                         "it; state it as tp_size in the checkpoint's description"),
    "injection_policy_tuple": ("it is DeepSpeed's internal copy of injection_policy",
                               "remove it and set injection_policy"),
    "config": ("a model config other than the model's own is not taken",
               "remove it: the model's .config is read"),
    "mpu": _MPU, "tensor_parallel.mpu": _MPU,
    "ep_size": _EP, "ep_group": _EP, "ep_mp_group": _EP,
    "moe.ep_size": _EP, "moe.ep_group": _EP, "moe.ep_mp_group": _EP,
}
"""Keys refused unless they hold DeepSpeed's default: (what, the fix)."""

_QUANT_REFUSED: dict[str, tuple[str, str]] = {
    "quant.weight.num_bits": ("weights of other than 8 bits are not implemented",
                              "set it to 8"),
    "quant.weight.q_type": ("asymmetric quantization is not implemented",
                            "set it to 'symmetric' (one scale per output channel)"),
    "quant.weight.quantized_initialization": _PER_MODULE,
    "quant.weight.post_init_quant": _PER_MODULE,
    "quant.qkv.enabled": ("leaving the QKV projection in float is not implemented",
                          "remove it: every linear weight is quantized"),
}
"""``quant`` keys refused, when quant is given enabled, unless they hold the default."""


@dataclass(frozen=True, kw_only=True)
class CheckpointDescription:
    """A checkpoint described as DeepSpeed's inference loader takes it."""

    type: Literal["ds_model", "bloom", "Megatron"]
    """The checkpoint's kind."""
    checkpoints: tuple[str, ...]
    """The files (the ``"tp"`` ones of the mapping form), relative to ``base_dir``."""
    non_tp: tuple[str, ...] = ()
    """The files of the parts tensor parallelism does not split (``"non_tp"``)."""
    version: float | int | str
    """The format's version, as written."""
    parallelization: Literal["pp", "tp"] = "pp"
    """'pp': each file holds whole tensors of some layers; 'tp': tensor-parallel shards."""
    tp_size: int | None = None
    """The degree the files were saved at (``mp_size`` or ``tp_size``); None: not stated."""
    base_dir: str | None = None
    """The files' directory; None: :attr:`InferenceSpec.base_dir`."""
    dtype: DType | None = None
    """The files' dtype, when stated."""
    source: str | None = None
    """The JSON file the description was read from; None: given as a dict."""


@dataclass(frozen=True, kw_only=True)
class InferenceSpec:
    """What ``init_inference`` does, parsed once; the defaults are DeepSpeed 0.19.8's."""

    tp_size: int = 1
    """Ranks each layer is split over."""
    tp_group: object | None = None
    """The process group to split over, as given; None: the engine makes one."""
    dtype: DType | None = "fp16"
    """The model's dtype; "int8": int8 weights, other tensors keep theirs; None: keep all."""
    dtype_given: bool = False
    """Whether ``dtype`` was given (DeepSpeed's default fp16 then applies only on CUDA)."""
    kernel_inject: bool = False
    """Use the fused inference path (``replace_with_kernel_inject``)."""
    injection_policy: Mapping[Any, Any] | None = None
    """DeepSpeed's ``{ModuleClass: ("name.of.linear", ...)}``, as given."""
    checkpoint: CheckpointDescription | str | None = None
    """The weights to load: a description, a directory, or None (the model's own)."""
    base_dir: str = ""
    """The directory a description's files are in, unless it names its own."""
    max_out_tokens: int = 1024
    """Most tokens (input and output) a sequence may reach."""
    min_out_tokens: int = 1
    """Fewest tokens the engine must be able to generate."""
    keep_module_on_host: bool = False
    """Keep the weights in host memory until sharded, instead of moving the model first."""
    return_tuple: bool = True
    """Fused layers return tuples, as the layers they replace."""
    enable_cuda_graph: bool = False
    """Capture the forward in a CUDA graph and replay it."""
    int8: bool = False
    """Weights quantized to int8: symmetric, one scale per output channel."""
    quant_bits: int = 8
    """Bits per quantized weight (8 only)."""
    notes: tuple[str, ...] = ()
    """One-line warnings (deprecated or ignored keys) for the engine to log on rank 0."""

    @property
    def float_dtype(self) -> DType | None:
        """The dtype floating-point tensors are cast to: :attr:`dtype`, or None (keep the
        model's) for None and "int8" (DeepSpeed casts no model for int8)."""
        return None if self.dtype == "int8" else self.dtype


@dataclass
class _Log(KeyLog):
    """A KeyLog naming, per top-level key, where it came from (the file or init_inference)."""

    origins: dict[str, str] = field(default_factory=dict)

    def where(self, *keys: object) -> str:
        parts = [*self.path, *(str(k) for k in keys)]
        if not parts:
            return self.origin
        return f"{self.origins.get(parts[0], self.origin)}: {'.'.join(parts)}"


def parse_inference_config(config: object = None,
                           kwargs: Mapping[str, Any] | None = None) -> InferenceSpec:
    """``init_inference(model, config, **kwargs)``'s settings as an :class:`InferenceSpec`.

    Args:
        config: None, a dict, or a path (``str``/``os.PathLike``) to a JSON or YAML file.
        kwargs: the keyword arguments; a key in both with different values is an error.

    Raises:
        UsageError: one line naming the file or ``init_inference``, and the key path.
    """
    data, origin = _read(config)
    cfg, kw = _canonical(data, origin), _canonical(kwargs or {}, ORIGIN)
    for name in cfg.keys() & kw.keys():
        if not _same(name, cfg[name], kw[name]):
            raise UsageError(f"{cfg[name]!r} in the config and {kw[name]!r} as a keyword "
                             "argument", where=f"{ORIGIN}: {name}",
                             hint="give it once, or the same value both ways")
    log = _Log(origin=ORIGIN, origins=dict.fromkeys(cfg, origin))
    section = InferenceSection.model_validate(_drop_auto({**cfg, **kw}), context={"keys": log})
    return _spec(section, log)


def _read(config: object) -> tuple[dict[str, Any], str]:
    if config is None:
        return {}, ORIGIN
    if isinstance(config, Mapping):
        return dict(config), ORIGIN  # not deep-copied: values may be process groups
    if isinstance(config, (str, os.PathLike)):
        return read_config_source(config)
    raise UsageError(f"expected a dict or a path to a JSON file, got {type(config).__name__}",
                     where=f"{ORIGIN}: config", hint="pass a dict, a path, or nothing")


def _canonical(source: Mapping[Any, Any], origin: str) -> dict[str, Any]:
    """``source`` with DeepSpeed's aliases renamed to field names (unknown keys as given)."""
    known = InferenceSection.known_keys()
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in source.items():
        name = known.get(str(key), str(key))
        if name in out and not _same(name, out[name], value):
            raise UsageError(f"given twice, as {spelled[name]!r} and {key!r}",
                             where=f"{origin}: {name}", hint="keep one of the two")
        out[name], spelled[name] = value, str(key)
    return out


def _same(name: str, a: Any, b: Any) -> bool:
    if name == "dtype":
        try:
            return dtype_name(a) == dtype_name(b)
        except ValueError:
            pass
    try:
        return bool(a == b)
    except Exception:  # objects whose == is elementwise, or raises
        return a is b


def _drop_auto(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without its "auto" values, at every level (as DeepSpeed's config models)."""
    return {k: _drop_auto(v) if isinstance(v, dict) and k not in _OPAQUE else v
            for k, v in data.items() if k in _OPAQUE or not (isinstance(v, str) and v == "auto")}


def _refuse(c: InferenceSection, log: _Log, table: Mapping[str, tuple[str, str]]) -> None:
    """Raise for the first key of ``table`` not holding its default."""
    for path, (what, hint) in table.items():
        *parents, name = path.split(".")
        owner: Section = c
        for part in parents:
            owner = getattr(owner, part)
        default = type(owner).model_fields[name].get_default(call_default_factory=True)
        if not _same(name, getattr(owner, name), default):
            raise UsageError(what, where=log.where(*path.split(".")), hint=hint)


def _fail(log: KeyLog, path: str, message: str, hint: str) -> UsageError:
    return UsageError(message, where=log.where(*path.split(".")), hint=hint)


def _spec(c: InferenceSection, log: _Log) -> InferenceSpec:
    _refuse(c, log, _REFUSED)
    if c.injection_policy is not None and c.replace_with_kernel_inject:
        raise _fail(log, "injection_policy", "injection_policy and replace_with_kernel_inject "
                    "are both set", "keep one (DeepSpeed refuses both too)")
    notes: list[str] = []
    tp_size = _tp_size(c, log, notes)
    if not c.tensor_parallel.enabled and tp_size > 1:
        raise _fail(log, "tensor_parallel.enabled", f"enabled is false with tp_size {tp_size}",
                    "set tp_size to 1, or remove enabled: false")
    if c.enable_cuda_graph and tp_size > 1:
        raise _fail(log, "enable_cuda_graph", "CUDA graphs with tensor parallelism are not "
                    "implemented (nor in DeepSpeed)", "set it to false, or tp_size to 1")
    stage = cast(ZeroConfig, validate_section(ZeroConfig, c.zero, log, "zero")).stage
    if log.unknown:  # ZeroConfig records a key it does not know; DeepSpeed refuses it
        raise _fail(log, log.unknown[0], "unknown key", "remove it")
    if stage:
        raise _fail(log, "zero.stage", f"ZeRO-Inference (stage {stage}) is not implemented",
                    "remove zero: split the model with tensor_parallel.tp_size, or load it "
                    "from a checkpoint with keep_module_on_host")
    if "replace_method" in c.model_fields_set:
        notes.append(f"{log.where('replace_method')}: deprecated, no effect. HINT: remove it")
    if c.checkpoint_config.model_fields_set:
        notes.append(f"{log.where('checkpoint_config')}: no effect (DeepSpeed does not read "
                     "it either). HINT: use checkpoint and base_dir")
    return InferenceSpec(
        tp_size=tp_size, tp_group=c.tensor_parallel.tp_group, dtype=c.dtype,
        dtype_given="dtype" in c.model_fields_set,
        kernel_inject=c.replace_with_kernel_inject, injection_policy=c.injection_policy,
        checkpoint=_checkpoint(c.checkpoint, log), base_dir=c.base_dir,
        max_out_tokens=c.max_out_tokens, min_out_tokens=c.min_out_tokens,
        keep_module_on_host=c.keep_module_on_host, return_tuple=c.return_tuple,
        enable_cuda_graph=c.enable_cuda_graph, int8=_int8(c, log, notes), quant_bits=8,
        notes=tuple(notes))


def _tp_size(c: InferenceSection, log: _Log, notes: list[str]) -> int:
    tp = c.tensor_parallel
    if c.mp_size is None:
        return tp.tp_size
    if "tp_size" in tp.model_fields_set and tp.tp_size != c.mp_size:
        raise _fail(log, "mp_size", f"mp_size is {c.mp_size} and tensor_parallel.tp_size is "
                    f"{tp.tp_size}",
                    "remove mp_size (deprecated): tensor_parallel.tp_size is the degree")
    notes.append(f"{log.where('mp_size')}: deprecated, read as tensor_parallel.tp_size="
                 f"{c.mp_size}. HINT: write tensor_parallel={{'tp_size': {c.mp_size}}}")
    return c.mp_size


def _int8(c: InferenceSection, log: _Log, notes: list[str]) -> bool:
    q = c.quant
    if c.dtype == "int8" and not (q.enabled and q.weight.enabled):
        raise _fail(log, "quant.enabled" if not q.enabled else "quant.weight.enabled",
                    "weight quantization is off with dtype int8",
                    "remove it, or set dtype to fp16, bf16 or fp32 to keep float weights")
    if "quant" not in c.model_fields_set or not q.enabled:
        return c.dtype == "int8"
    _refuse(c, log, _QUANT_REFUSED)
    if "activation" in q.model_fields_set and q.activation.enabled:
        raise _fail(log, "quant.activation.enabled", "activation quantization is not "
                    "implemented (weights only)", "set it to false")
    if c.dtype != "int8":
        notes.append(f"{log.where('quant')}: no effect unless dtype is int8 (as in "
                     "DeepSpeed). HINT: set dtype to int8, or remove quant")
    return c.dtype == "int8"


def _checkpoint(value: Any, log: _Log) -> CheckpointDescription | str | None:
    if value is None:
        return None
    if isinstance(value, Mapping):
        section = validate_section(CheckpointSection, dict(value), log, "checkpoint")
        return _description(cast(CheckpointSection, section), None, log)
    if not isinstance(value, (str, os.PathLike)):
        raise _fail(log, "checkpoint", f"expected a path or a mapping, got "
                    f"{type(value).__name__}", "give a directory, or a JSON description")
    path, text = Path(value), str(os.fspath(value))
    if path.is_dir():
        return text
    if not path.is_file():
        raise _fail(log, "checkpoint", f"{text!r} does not exist", "give a checkpoint "
                    f"directory, or a JSON file describing the checkpoint: {_DESCRIPTION}")
    if path.suffix.lower() in _WEIGHT_SUFFIXES:
        raise _fail(log, "checkpoint", f"{text!r} is a weights file", "give its directory, "
                    f"or a JSON file listing it: {_DESCRIPTION}")
    data, origin = read_config_source(path)
    section = CheckpointSection.model_validate(data, context={"keys": KeyLog(origin=origin)})
    return _description(section, text, log)


def _description(s: CheckpointSection, source: str | None,
                 log: _Log) -> CheckpointDescription:
    if None not in (s.tp_size, s.mp_size) and s.tp_size != s.mp_size:
        raise UsageError(f"mp_size is {s.mp_size} and tp_size is {s.tp_size}", hint="keep one",
                         where=f"{source}: mp_size" if source else log.where("checkpoint",
                                                                              "mp_size"))
    return CheckpointDescription(
        type=s.type, checkpoints=s.checkpoints["tp"], non_tp=s.checkpoints["non_tp"],
        version=s.version, parallelization=s.parallelization,
        tp_size=s.mp_size or s.tp_size, base_dir=s.base_dir, dtype=s.dtype, source=source)


__all__ = ["CheckpointDescription", "DType", "InferenceSpec", "dtype_name",
           "parse_inference_config"]
