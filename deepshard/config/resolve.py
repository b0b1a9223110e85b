"""Load a config: read it, resolve "auto" values and the batch triad, validate it.

"auto" is how the HF Trainer and DeepSpeed's own docs leave values to be filled in at run
time. We resolve it as they do: the caller's ``auto_values`` first (dotted key path ->
value, what the HF integration computes from its own arguments), then the ZeRO bucket
sizes from the model's hidden size, then a batch-triad member the other two determine.
Whatever "auto" is left is one error naming every such key, rather than DeepSpeed's silent
fallback to defaults.

The batch triad follows DeepSpeed: ``train_batch_size = train_micro_batch_size_per_gpu *
gradient_accumulation_steps * data-parallel size``; any two imply the third, a micro batch
alone or a train batch alone means one accumulation step, and a contradiction is an error
that shows the arithmetic.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from deepshard.config.dialect import read_config_source
from deepshard.config.schema import DeepShardConfig, find_auto_keys, validate_config
from deepshard.config.schema_zero import ZeroConfig
from deepshard.contract import ELASTIC
from deepshard.elasticity import compute as compute_elastic
from deepshard.errors import UsageError

TBS, MICRO, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", \
    "gradient_accumulation_steps"
TRIAD = (TBS, MICRO, GAS)

# zero_optimization keys sized from the model's hidden size when "auto" (as HF does):
# field name -> (spellings DeepSpeed accepts, size from hidden)
_MODEL_SIZED = MappingProxyType({
    "reduce_bucket_size": (("reduce_bucket_size",), lambda h: h * h),
    "stage3_prefetch_bucket_size": (("stage3_prefetch_bucket_size", "prefetch_bucket_size"),
                                    lambda h: int(0.9 * h * h)),
    "stage3_param_persistence_threshold": (("stage3_param_persistence_threshold",
                                            "param_persistence_threshold"),
                                           lambda h: 10 * h),
})


@dataclass(frozen=True)
class LoadedConfig:
    """A validated config and what the caller should tell the user about it."""

    config: DeepShardConfig
    """The config; from :func:`load_config`, with the batch triad resolved to three ints
    (:func:`parse_config` leaves it as written)."""
    unimplemented: tuple[str, ...]
    """Dotted paths of keys DeepSpeed knows that deepshard ignores (log one warning)."""
    origin: str
    """Where the config came from: its path, or ``<dict>``."""
    unknown: tuple[str, ...] = ()
    """Dotted paths of keys neither deepshard nor DeepSpeed knows (log one warning)."""
    skipped: tuple[str, ...] = ()
    """Sections left out because nothing uses them (a ``scheduler`` without an optimizer)."""
    given: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The config as read, before "auto" values and skipped sections (DeepSpeed's
    ``engine.config``)."""


def load_config(source: object, *, world_size: int, model: Any = None,
                auto_values: Mapping[str, object] | None = None) -> LoadedConfig:
    """Read, resolve and validate a DeepSpeed-style config: :func:`parse_config`, then
    :func:`with_batch_triad` for ``world_size``.

    Args:
        source: a dict, or a path to a JSON (DeepSpeed's dialect: comments allowed) or YAML
            file.
        world_size: the data-parallel size the batch triad is checked against.
        model: optional; duck-typed (``model.parameters()`` with ``p.shape``, or
            ``model.config.hidden_size``) to size "auto" ZeRO buckets.
        auto_values: dotted key path -> value for keys whose value is "auto", e.g.
            ``{"optimizer.params.lr": 3e-4, "train_batch_size": 16}``.

    Raises:
        UsageError: unreadable or invalid config, "auto" values left unresolved (all named
            in one error), or a batch triad inconsistent with ``world_size``.
    """
    return with_batch_triad(parse_config(source, model=model, auto_values=auto_values),
                            world_size)


def parse_config(source: object, *, model: Any = None,
                 auto_values: Mapping[str, object] | None = None,
                 without_optimizer: bool = False) -> LoadedConfig:
    """Read, resolve "auto" values and validate a config, leaving the batch triad as
    written: what a caller needs to learn the layout (pipeline stages, tensor-parallel
    size) and so the data-parallel size the triad is checked against. Arguments and
    errors as :func:`load_config`'s; ``without_optimizer``: the caller brings no optimizer,
    so a ``scheduler`` section with no ``optimizer`` section is left out unread, as
    DeepSpeed builds no scheduler then (transformers' evaluation-only ``deepspeed_init``
    passes a training config whose ``total_num_steps`` it filled with 0)."""
    data, origin = read_config_source(source)
    given = copy.deepcopy(data)  # data is filled in below
    skipped: tuple[str, ...] = ()
    if without_optimizer and "optimizer" not in data and "scheduler" in data:
        del data["scheduler"]
        skipped = ("scheduler",)
    substitute_auto_values(data, auto_values or {})
    resolve_model_sized(data, model_hidden_size(model))
    _drop_determined_triad_autos(data)
    unresolved = find_auto_keys(data)
    if unresolved:
        raise UsageError(f"'auto' left unresolved for {', '.join(unresolved)}", where=origin,
                         hint="write concrete values there, or pass them as "
                              "load_config(auto_values={'<key.path>': value, ...})")
    config, unimplemented, unknown = validate_config(data, origin=origin)
    return LoadedConfig(config, unimplemented, origin, unknown, skipped, given)


def with_batch_triad(loaded: LoadedConfig, world_size: int) -> LoadedConfig:
    """``loaded`` with its batch triad resolved against the data-parallel ``world_size``
    (see :func:`resolve_batch_triad`)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return dataclasses.replace(
        loaded, config=resolve_batch_triad(loaded.config, world_size, loaded.origin))


def substitute_auto_values(data: dict[str, Any], auto_values: Mapping[str, object]) -> None:
    """Put ``auto_values[path]`` into ``data`` (in place) where the value at the dotted
    ``path`` is "auto"; other paths are left alone."""
    for dotted, value in auto_values.items():
        *parents, last = dotted.split(".")
        node: Any = data
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(last) == "auto":
            node[last] = copy.deepcopy(value)


def model_hidden_size(model: Any) -> int | None:
    """The model's hidden size: ``model.config.hidden_size`` (or the largest of
    ``hidden_sizes``), else the most common last dimension of its 2-D parameters."""
    if model is None:
        return None
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None)
    if not _positive_int(hidden):
        sizes = getattr(config, "hidden_sizes", None)
        hidden = max(sizes) if isinstance(sizes, (list, tuple)) and sizes else None
    if _positive_int(hidden):
        return hidden
    counts: Counter[int] = Counter(tuple(p.shape)[-1] for p in model.parameters()
                                   if len(p.shape) == 2)
    if not counts:
        return None
    return max(counts, key=lambda dim: (counts[dim], dim))


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def resolve_model_sized(data: dict[str, Any], hidden: int | None) -> None:
    """Replace "auto" ZeRO bucket sizes (in place): from ``hidden`` as the HF integration
    does, or DeepSpeed's defaults without a model."""
    zero = data.get("zero_optimization")
    if not isinstance(zero, dict):
        return
    for name, (spellings, size) in _MODEL_SIZED.items():
        for key in spellings:
            if zero.get(key) == "auto":
                default = ZeroConfig.model_fields[name].default
                zero[key] = size(hidden) if hidden else default


def _drop_determined_triad_autos(data: dict[str, Any]) -> None:
    """An "auto" triad member is left out when the other two are given: it is derived."""
    autos = [key for key in TRIAD if data.get(key) == "auto"]
    given = [key for key in TRIAD if data.get(key) not in (None, "auto")]
    if len(autos) == 1 and len(given) == 2:
        del data[autos[0]]


def resolve_batch_triad(config: DeepShardConfig, world_size: int,
                        origin: str = "<dict>", *, elastic: bool | None = None
                        ) -> DeepShardConfig:
    """``config`` with train_batch_size, train_micro_batch_size_per_gpu and
    gradient_accumulation_steps all set and consistent with ``world_size``.

    An enabled ``elasticity`` section sets all three (DeepSpeed's arithmetic). Under
    ``ds-run --elastic_training`` (``elastic``; ``None``: the launcher's
    ``DEEPSHARD_ELASTIC``) the world size changes between relaunches: the train batch and
    the micro batch stay, and the accumulation steps follow the world size."""
    if config.elasticity.enabled:
        return _elastic_section(config, world_size, origin)
    if elastic is None:
        elastic = os.environ.get(ELASTIC) == "1"
    if elastic:
        config = _elastic_world(config, world_size, origin)
    tbs, micro, gas = (getattr(config, key) for key in TRIAD)
    where = origin
    if tbs is not None and micro is not None and gas is not None:
        if tbs != micro * gas * world_size:
            raise _inconsistent(tbs, micro, gas, world_size, where)
    elif tbs is not None and micro is not None:
        gas = _divide(tbs, micro, world_size, MICRO, GAS, where)
    elif tbs is not None and gas is not None:
        micro = _divide(tbs, gas, world_size, GAS, MICRO, where)
    elif micro is not None and gas is not None:
        tbs = micro * gas * world_size
    elif tbs is not None:
        if tbs % world_size:
            raise UsageError(f"{TBS} {tbs} is not divisible by the world size {world_size}",
                             where=where, hint=f"use a {TBS} that is a multiple of "
                                               f"{world_size}, or set {MICRO}")
        gas, micro = 1, tbs // world_size
    elif micro is not None:
        gas, tbs = 1, micro * world_size
    elif gas is not None:
        raise UsageError("alone it does not give the batch size",
                         where=f"{origin}: {GAS}",
                         hint=f"also set {MICRO} (or {TBS})")
    else:
        raise UsageError("no batch size given", where=origin,
                         hint=f"set {TBS} or {MICRO} (and optionally {GAS})")
    return config.model_copy(update={TBS: tbs, MICRO: micro, GAS: gas})


def _elastic_world(config: DeepShardConfig, world_size: int, origin: str) -> DeepShardConfig:
    """The config with its accumulation steps left to derive from the world size."""
    tbs, micro = config.train_batch_size, config.train_micro_batch_size_per_gpu
    if tbs is None or micro is None:
        raise UsageError(f"elastic training needs both {TBS} and {MICRO}: it keeps them "
                         "when the world size changes", where=origin,
                         hint=f"set both ({GAS} then follows the world size)")
    if tbs % (micro * world_size):
        raise UsageError(f"{TBS} {tbs} does not split into whole accumulation steps of "
                         f"{MICRO} {micro} on {world_size} ranks", where=f"{origin}: {TBS}",
                         hint=f"run at a world size dividing {tbs // micro} (ds-run "
                              "--elastic_training picks those when the script is given "
                              f"--deepspeed_config), or a {TBS} that is a multiple of "
                              f"{micro * world_size}")
    return config.model_copy(update={GAS: None})


def _elastic_section(config: DeepShardConfig, world_size: int,
                     origin: str) -> DeepShardConfig:
    """The batch triad DeepSpeed's ``elasticity`` section gives for ``world_size``."""
    section = config.elasticity
    written = [key for key in TRIAD if key in config.model_fields_set
               and getattr(config, key) is not None]
    if written and not section.ignore_non_elastic_batch_info:
        raise UsageError(f"{', '.join(written)} given with an enabled elasticity section, "
                         "which sets the batch sizes itself", where=f"{origin}: {written[0]}",
                         hint="remove them, or set elasticity.ignore_non_elastic_batch_info "
                              "true to have them overridden (as DeepSpeed)")
    try:
        batch = compute_elastic(section.spec(), world_size)
    except UsageError as exc:
        raise UsageError(exc.message, where=f"{origin}: {exc.where}", hint=exc.hint) from None
    return config.model_copy(update={TBS: batch.train_batch_size,
                                     MICRO: batch.micro_batch_size,
                                     GAS: batch.accumulation(world_size)})


def _divide(tbs: int, given: int, world_size: int, given_key: str, derived_key: str,
            where: str) -> int:
    per_step = given * world_size
    if tbs % per_step:
        lower = max(per_step, tbs - tbs % per_step)
        raise UsageError(
            f"{TBS} {tbs} is not divisible by {given_key} {given} * world size {world_size} "
            f"= {per_step}, so {derived_key} cannot be derived", where=where,
            hint=f"use a {TBS} that is a multiple of {per_step} (e.g. {lower} or "
                 f"{lower + per_step}), or set {derived_key} explicitly")
    return tbs // per_step


def _inconsistent(tbs: int, micro: int, gas: int, world_size: int, where: str) -> UsageError:
    product = micro * gas * world_size
    fixes = [f"{TBS} {product}"]
    if tbs % (micro * world_size) == 0:
        fixes.append(f"{GAS} {tbs // (micro * world_size)}")
    if tbs % (gas * world_size) == 0:
        fixes.append(f"{MICRO} {tbs // (gas * world_size)}")
    implied = (f"; these values fit a data-parallel world size of {tbs // (micro * gas)}"
               if tbs % (micro * gas) == 0 else "")
    return UsageError(
        f"{TBS} {tbs} != {MICRO} {micro} * {GAS} {gas} * world size {world_size} = {product}",
        where=where,
        hint=f"set {' or '.join(fixes)}, or leave one of the three out to have it "
             f"derived{implied}")
