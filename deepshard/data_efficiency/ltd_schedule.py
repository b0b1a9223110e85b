"""The random-LTD kept-token schedule: how many tokens the dropping layers keep at each step.

Random layerwise token dropping (https://arxiv.org/abs/2211.11586) runs some transformer
layers on a random subset of each sequence's tokens. The subset's size grows with the
training step from ``min_value`` to ``max_value`` (the sequence length, where nothing is
dropped). This module holds the schedule only, torch-free: :class:`RandomLtdSpec` is the
validated ``data_efficiency.data_routing.random_ltd`` section, :class:`RandomLtdState`
the values a checkpoint keeps, and :class:`RandomLtdSchedule` steps them. Values,
consumed layer tokens and the checkpoint entry equal DeepSpeed 0.19.8's
``RandomLTDScheduler`` (the unit tests compare against values recorded from it), so a
DeepSpeed checkpoint's ``random_ltd`` entry loads here and ours loads there.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deepshard.errors import UsageError

PATH = "data_efficiency.data_routing.random_ltd"
"""The key path of the config section, the prefix of every error's ``where``."""

SCHEDULE_TYPES = ("fixed_linear",)
MODEL_TYPES = ("decoder", "encoder")
HIDDEN_STATE_ORDERS = ("batch_seq_dim", "seq_batch_dim")

# The checkpoint entry's keys, spelled as DeepSpeed's data_pipeline/constants.py does
CONSUMED_LAYER_TOKENS = "consumed_layer_tokens"
CURRENT_STEPS = "current_steps"
CURRENT_VALUE = "current_value"
MIN_VALUE = "min_value"
MAX_VALUE = "max_value"
STATE_KEYS = (CONSUMED_LAYER_TOKENS, CURRENT_STEPS, CURRENT_VALUE, MIN_VALUE, MAX_VALUE)

_TOP_KEYS = frozenset({
    "enabled", "total_layer_num", "random_ltd_layer_num", "random_ltd_layer_id",
    "model_mask_name", "model_type", "hidden_state_order", "micro_batch_size",
    "global_batch_size", "random_ltd_schedule", "layer_token_lr_schedule"})
_SCHEDULE_KEYS = frozenset({"min_value", "max_value", "schedule_type", "schedule_config"})
_PARAM_KEYS = frozenset({"require_steps", "seq_per_step"})
_LR_KEYS = frozenset({"enabled", "total_layer_tokens", "warmup_type", "warmup_layer_tokens"})


@dataclass(frozen=True, slots=True, kw_only=True)
class RandomLtdSpec:
    """The ``random_ltd`` section, validated: what is dropped, where, and on which schedule.

    Field names are DeepSpeed's keys. Construct it directly or with :meth:`from_dict`; both
    raise :class:`UsageError` with the key path for an invalid value.
    """

    total_layer_num: int
    """The model's transformer layers (dropping and not)."""
    random_ltd_layer_num: int
    """How many layers drop tokens: must equal ``len(random_ltd_layer_id)``."""
    random_ltd_layer_id: tuple[int, ...]
    """The 0-based indices of the dropping layers in the model's layer list."""
    global_batch_size: int
    """Samples per optimizer step, for the consumed-layer-token count (the engine's
    ``train_batch_size``, which DeepSpeed injects into the section)."""
    min_value: int
    """Tokens kept at step 0."""
    max_value: int
    """Tokens kept once the schedule is done (the sequence length: nothing dropped)."""
    require_steps: int
    """Steps the kept count takes to grow from ``min_value`` to ``max_value``."""
    seq_per_step: int = 1
    """The kept count is rounded down to a multiple of this."""
    schedule_type: str = "fixed_linear"
    """How the count grows; DeepSpeed implements only ``fixed_linear``."""
    model_mask_name: str | None = None
    """The keyword argument that carries the layers' attention mask (gathered with the
    kept tokens), or None."""
    model_type: str = "decoder"
    """``decoder`` or ``encoder``. Kept tokens stay in sequence order either way, so a
    causal mask stays causal."""
    hidden_state_order: str = "batch_seq_dim"
    """The layers' hidden-state layout: ``batch_seq_dim`` ([b, s, h], HF) or
    ``seq_batch_dim`` ([s, b, h], Megatron)."""

    def __post_init__(self) -> None:
        _check_int(self.total_layer_num, "total_layer_num", minimum=1)
        _check_int(self.random_ltd_layer_num, "random_ltd_layer_num", minimum=0)
        _check_int(self.global_batch_size, "global_batch_size", minimum=1)
        sched = "random_ltd_schedule"
        _check_int(self.min_value, f"{sched}.min_value", minimum=1)
        _check_int(self.max_value, f"{sched}.max_value", minimum=self.min_value)
        _check_int(self.require_steps, f"{sched}.schedule_config.require_steps", minimum=1)
        _check_int(self.seq_per_step, f"{sched}.schedule_config.seq_per_step", minimum=1)
        if self.seq_per_step > self.min_value:
            raise UsageError(
                f"seq_per_step {self.seq_per_step} is larger than min_value {self.min_value}: "
                "the first steps would keep 0 tokens",
                where=f"{PATH}.{sched}.schedule_config.seq_per_step",
                hint="make min_value a multiple of seq_per_step")
        _check_choice(self.schedule_type, f"{sched}.schedule_type", SCHEDULE_TYPES)
        _check_choice(self.model_type, "model_type", MODEL_TYPES)
        _check_choice(self.hidden_state_order, "hidden_state_order", HIDDEN_STATE_ORDERS)
        if self.model_mask_name is not None and not isinstance(self.model_mask_name, str):
            raise UsageError(f"expected a keyword name or null, got {self.model_mask_name!r}",
                             where=f"{PATH}.model_mask_name")
        self._check_layer_ids()

    def _check_layer_ids(self) -> None:
        where = f"{PATH}.random_ltd_layer_id"
        ids = self.random_ltd_layer_id
        for layer_id in ids:
            _check_int(layer_id, "random_ltd_layer_id", minimum=0)
        if len(set(ids)) != len(ids):
            raise UsageError(f"layer ids repeat: {list(ids)}", where=where)
        beyond = [i for i in ids if i >= self.total_layer_num]
        if beyond:
            raise UsageError(f"layer ids {beyond} are not below total_layer_num "
                             f"{self.total_layer_num}", where=where)
        if self.random_ltd_layer_num != len(ids):
            raise UsageError(
                f"random_ltd_layer_num {self.random_ltd_layer_num} must equal the number of "
                f"random_ltd_layer_id entries ({len(ids)})", where=f"{PATH}.random_ltd_layer_num",
                hint=f"set random_ltd_layer_num to {len(ids)}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *,
                  global_batch_size: int | None = None) -> RandomLtdSpec:
        """The spec of DeepSpeed's ``random_ltd`` dict (``enabled`` is ignored: the caller
        decides).

        ``global_batch_size`` overrides the dict's key of that name (DeepSpeed's engine
        writes ``train_batch_size`` there). Unknown keys, missing required keys and an
        enabled ``layer_token_lr_schedule`` (DeepSpeed raises NotImplementedError) are
        :class:`UsageError` naming the key path.
        """
        _check_keys(d, _TOP_KEYS, PATH)
        schedule = _section(d, "random_ltd_schedule", _SCHEDULE_KEYS, required=True)
        params = _section(schedule, "schedule_config", _PARAM_KEYS, required=True,
                          path=f"{PATH}.random_ltd_schedule")
        lr = _section(d, "layer_token_lr_schedule", _LR_KEYS, required=False)
        if lr.get("enabled"):
            raise UsageError("the layer-token learning-rate schedule is not implemented "
                             "(DeepSpeed raises NotImplementedError too)",
                             where=f"{PATH}.layer_token_lr_schedule.enabled",
                             hint="set it to false and use the scheduler section")
        gbs = global_batch_size if global_batch_size is not None else d.get("global_batch_size")
        if gbs is None:
            raise UsageError("the global batch size is not set", where=f"{PATH}.global_batch_size",
                             hint="pass the engine's train_batch_size")
        layer_ids = d.get("random_ltd_layer_id") or ()
        if not isinstance(layer_ids, (list, tuple)):
            raise UsageError(f"expected a list of layer indices, got {layer_ids!r}",
                             where=f"{PATH}.random_ltd_layer_id")
        return cls(
            total_layer_num=_required(d, "total_layer_num", PATH),
            random_ltd_layer_num=_required(d, "random_ltd_layer_num", PATH),
            random_ltd_layer_id=tuple(layer_ids),
            global_batch_size=gbs,
            min_value=_required(schedule, "min_value", f"{PATH}.random_ltd_schedule"),
            max_value=_required(schedule, "max_value", f"{PATH}.random_ltd_schedule"),
            require_steps=_required(params, "require_steps",
                                    f"{PATH}.random_ltd_schedule.schedule_config"),
            seq_per_step=_optional(params, "seq_per_step", 1),
            schedule_type=_optional(schedule, "schedule_type", "fixed_linear"),
            model_mask_name=d.get("model_mask_name"),
            model_type=_optional(d, "model_type", "decoder"),
            hidden_state_order=_optional(d, "hidden_state_order", "batch_seq_dim"))


@dataclass(slots=True)
class RandomLtdState:
    """What the schedule carries from step to step, and what a checkpoint keeps
    (``state_dict`` under DeepSpeed's key names)."""

    current_value: int
    """Tokens the dropping layers keep now."""
    min_value: int
    """The schedule's start (a loaded checkpoint's, which wins over the config's)."""
    max_value: int
    """The schedule's end (likewise the checkpoint's)."""
    consumed_layer_tokens: int = 0
    """Tokens processed by all layers over all steps counted so far."""
    current_steps: int = -1
    """The last global step counted (-1: none)."""

    @classmethod
    def initial(cls, spec: RandomLtdSpec) -> RandomLtdState:
        """The state before the first step: ``min_value`` kept, nothing consumed."""
        return cls(current_value=spec.min_value, min_value=spec.min_value,
                   max_value=spec.max_value)


class RandomLtdSchedule:
    """Steps the kept-token count, value for value as DeepSpeed's ``RandomLTDScheduler``.

    ``fixed_linear``: at step ``t`` the count is
    ``floor(t / require_steps * (max - min) + min)`` rounded down to a multiple of
    ``seq_per_step``, capped at ``max``. The engine calls :meth:`update_seq` before every
    training forward; the dropping layers read :meth:`get_current_seq`.

    Which tokens a layer keeps is drawn from :meth:`draw_key` (``seed``, ``rank`` — the
    data-parallel rank, so tensor-parallel ranks drop alike —, the engine's micro-step
    ``position`` and the layer), not from torch's global generator: a
    resumed run draws what the uninterrupted one drew whatever else consumed random numbers
    in between (a data loader's iterator does), and a recomputation under activation
    checkpointing draws the positions of its forward.
    """

    def __init__(self, spec: RandomLtdSpec, state: RandomLtdState | None = None, *,
                 seed: int = 1234, rank: int = 0):
        self.spec = spec
        self.state = state if state is not None else RandomLtdState.initial(spec)
        self.seed, self.rank = seed, rank
        self.position = 0
        """The micro-step being computed (the engine sets it before every forward)."""

    def draw_key(self, layer_id: int) -> int:
        """The seed of ``layer_id``'s kept positions at the current position (63 bits)."""
        key = 0
        for part in (self.seed, self.rank, self.position, layer_id):
            key = _mix64(key ^ (part & _MASK64))
        return key >> 1

    def get_value(self, global_steps: int) -> int:
        """The scheduled count at ``global_steps`` (with the state's min and max)."""
        lo, hi = self.state.min_value, self.state.max_value
        # DeepSpeed's float arithmetic, operation for operation, so floor() agrees
        fraction = float(global_steps) / self.spec.require_steps
        value = math.floor(fraction * (hi - lo) + lo)
        value -= value % self.spec.seq_per_step
        return min(value, hi)

    def update_seq(self, global_steps: int) -> None:
        """Move to ``global_steps``: recompute the count while it is below the maximum, and
        count the step's layer tokens once per distinct step (gradient-accumulation micro
        steps call this with the same step)."""
        state = self.state
        if state.current_value < state.max_value:
            state.current_value = self.get_value(global_steps)
        if global_steps != state.current_steps:
            spec = self.spec
            kept_layers = spec.random_ltd_layer_num
            full_layers = spec.total_layer_num - kept_layers
            state.consumed_layer_tokens += spec.global_batch_size * (
                state.current_value * kept_layers + state.max_value * full_layers)
            state.current_steps = global_steps

    def get_current_seq(self) -> int:
        """Tokens the dropping layers keep now."""
        return self.state.current_value

    def set_current_seq(self, seq_length: int) -> None:
        """Override the current count (DeepSpeed's method of that name)."""
        self.state.current_value = seq_length

    def get_random_ltd_layer_num(self) -> int:
        """How many layers drop tokens."""
        return self.spec.random_ltd_layer_num

    def get_total_layer_tokens(self, train_iters: int) -> int:
        """The consumed layer tokens after steps ``0 .. train_iters - 1``, continuing from the
        current state. DeepSpeed steps its own scheduler to compute this; this schedule's
        state is left unchanged (a copy is stepped)."""
        probe = RandomLtdSchedule(self.spec, dataclasses.replace(self.state))
        for step in range(train_iters):
            probe.update_seq(step)
        return probe.state.consumed_layer_tokens

    def state_dict(self) -> dict[str, int]:
        """The checkpoint entry (``random_ltd`` in DeepSpeed's model-states file)."""
        s = self.state
        return {CONSUMED_LAYER_TOKENS: s.consumed_layer_tokens, CURRENT_STEPS: s.current_steps,
                CURRENT_VALUE: s.current_value, MIN_VALUE: s.min_value, MAX_VALUE: s.max_value}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s entry (also DeepSpeed's); a missing key is a
        :class:`UsageError`."""
        missing = [k for k in STATE_KEYS if k not in state_dict]
        if missing:
            raise UsageError(f"the checkpoint's random_ltd entry lacks {', '.join(missing)}",
                             where="checkpoint random_ltd",
                             hint="load a checkpoint saved with random-LTD enabled")
        self.state = RandomLtdState(
            current_value=int(state_dict[CURRENT_VALUE]), min_value=int(state_dict[MIN_VALUE]),
            max_value=int(state_dict[MAX_VALUE]),
            consumed_layer_tokens=int(state_dict[CONSUMED_LAYER_TOKENS]),
            current_steps=int(state_dict[CURRENT_STEPS]))


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finaliser: a well-spread 64-bit hash of ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _check_int(value: object, key: str, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"expected an integer, got {value!r}", where=f"{PATH}.{key}")
    if value < minimum:
        raise UsageError(f"must be at least {minimum}, got {value}", where=f"{PATH}.{key}")


def _check_choice(value: object, key: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UsageError(f"unknown value {value!r}", where=f"{PATH}.{key}",
                         hint=f"use one of {', '.join(choices)}")


def _check_keys(d: Mapping[str, Any], known: frozenset[str], path: str) -> None:
    unknown = sorted(set(d) - known)
    if unknown:
        raise UsageError(f"unknown key {unknown[0]!r}", where=f"{path}.{unknown[0]}",
                         hint=f"known keys: {', '.join(sorted(known))}")


def _section(d: Mapping[str, Any], key: str, known: frozenset[str], *, required: bool,
             path: str = PATH) -> Mapping[str, Any]:
    value = d.get(key)
    if value is None:
        if required:
            raise UsageError("required when random_ltd is enabled", where=f"{path}.{key}")
        return {}
    if not isinstance(value, Mapping):
        raise UsageError(f"expected a mapping, got {value!r}", where=f"{path}.{key}")
    _check_keys(value, known, f"{path}.{key}")
    return value


def _required(d: Mapping[str, Any], key: str, path: str) -> Any:
    if d.get(key) is None:
        raise UsageError("required when random_ltd is enabled", where=f"{path}.{key}")
    return d[key]


def _optional(d: Mapping[str, Any], key: str, default: Any) -> Any:
    value = d.get(key)
    return default if value is None else value
