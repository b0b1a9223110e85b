"""Curriculum difficulty schedules: how hard the data may be at each curriculum step.

One :class:`CurriculumMetric` (a frozen spec) per entry of
``data_efficiency.data_sampling.curriculum_learning.curriculum_metrics``, and one
:class:`CurriculumScheduler` (its running difficulty) per metric in the sampler. The values
equal DeepSpeed 0.19.8's ``CurriculumScheduler`` step by step, including its rounding of the
first difficulties up to the first multiple of ``difficulty_step`` at or above
``min_difficulty`` (``tests/data/data_efficiency/curriculum_schedule_ds0198.json``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from deepshard.errors import UsageError

METRICS_PATH = "data_efficiency.data_sampling.curriculum_learning.curriculum_metrics"
SCHEDULE_TYPES = ("fixed_discrete", "fixed_linear", "fixed_root", "custom")
DIFFICULTY_TYPES = ("value", "percentile")
SINGLE_CLUSTER = "single_cluster"

ScheduleFunction = Callable[[int], float]
"""A ``custom`` schedule: curriculum step -> difficulty."""


@dataclass(frozen=True)
class CurriculumMetric:
    """One curriculum metric, as configured (DeepSpeed's per-metric dict, validated).

    ``single_cluster`` metrics (``seqlen_truncate``, ``seqlen_reshape``) filter no sample:
    the batch is changed after it is drawn. Any other clustering type names an index that a
    data analyzer built: ``index_to_sample_path`` rows of sample ids, one row per metric
    value, and for value-based difficulties ``index_to_metric_path`` rows holding each row's
    value.
    """

    name: str
    """The metric's key in ``curriculum_metrics``."""
    min_difficulty: float
    """The difficulty at the start (an int stays an int)."""
    max_difficulty: float
    """The last difficulty; once reached the schedule stops updating."""
    schedule_type: str
    """One of :data:`SCHEDULE_TYPES`."""
    difficulty: tuple[float, ...] = ()
    """fixed_discrete: the difficulties in order."""
    max_step: tuple[int, ...] = ()
    """fixed_discrete: the last step of each difficulty but the last."""
    total_curriculum_step: int = 0
    """fixed_linear/fixed_root: steps from min to max difficulty."""
    difficulty_step: int = 1
    """fixed_linear/fixed_root: difficulties are multiples of this."""
    root_degree: float = 1
    """fixed_root: 2 is a square root (fixed_linear is degree 1)."""
    difficulty_type: str = "value"
    """``value`` (metric values) or ``percentile`` (percentiles of the samples)."""
    clustering_type: str = SINGLE_CLUSTER
    """``single_cluster``: no sample filter; anything else: filter through the index."""
    index_to_sample_path: str | None = None
    """Path prefix of the analyzer's index-to-sample files (index metrics)."""
    index_to_metric_path: str | None = None
    """Path prefix of the analyzer's index-to-metric files (value-based index metrics)."""

    @property
    def single_cluster(self) -> bool:
        """Whether the metric leaves the set of eligible samples alone."""
        return self.clustering_type == SINGLE_CLUSTER

    @classmethod
    def from_dict(cls, metric_name: str, d: Mapping[str, Any]) -> CurriculumMetric:
        """The spec of ``curriculum_metrics.<metric_name>`` (DeepSpeed's keys).

        Raises:
            UsageError: a missing or malformed key, with its dotted key path as ``where``.
        """
        where = f"{METRICS_PATH}.{metric_name}"
        if not isinstance(d, Mapping):
            raise UsageError("a curriculum metric must be an object", where=where)
        low = _number(d, "min_difficulty", where)
        high = _number(d, "max_difficulty", where)
        if high < low:
            raise UsageError(f"max_difficulty {high} is below min_difficulty {low}",
                             where=f"{where}.max_difficulty")
        schedule_type = _required(d, "schedule_type", where)
        if schedule_type not in SCHEDULE_TYPES:
            raise UsageError(f"unknown schedule_type {schedule_type!r}",
                             where=f"{where}.schedule_type",
                             hint=f"use one of {', '.join(SCHEDULE_TYPES)}")
        kinds = _kinds(metric_name, d, where)
        if kinds["difficulty_type"] == "percentile" and high <= 0:
            raise UsageError(f"a percentile metric's max_difficulty is its last percentile "
                             f"(e.g. 100), not {high}", where=f"{where}.max_difficulty")
        params = _schedule_params(schedule_type, d.get("schedule_config"),
                                  f"{where}.schedule_config")
        return cls(name=metric_name, min_difficulty=low, max_difficulty=high,
                   schedule_type=schedule_type, **kinds, **params)

    def difficulty_at(self, step: int, custom: ScheduleFunction | None = None) -> float:
        """The schedule's difficulty at curriculum ``step`` (``custom``: the user function
        of a ``custom`` schedule)."""
        if self.schedule_type == "fixed_discrete":
            for last_step, value in zip(self.max_step, self.difficulty[:-1], strict=True):
                if step <= last_step:
                    return value
            return self.difficulty[-1]
        if self.schedule_type == "custom":
            if custom is None:
                raise UsageError(f"curriculum metric {self.name} has schedule_type custom but "
                                 "no schedule function was set",
                                 where=f"{METRICS_PATH}.{self.name}.schedule_type",
                                 hint="call engine.set_custom_curriculum_learning_schedule("
                                      f"{{{self.name!r}: fn}}) before the first batch")
            return custom(step)
        degree = 1 if self.schedule_type == "fixed_linear" else self.root_degree
        return self._root(step, degree)

    def _root(self, step: int, degree: float) -> float:
        progress: float = (float(step) / self.total_curriculum_step) ** (1.0 / degree)
        span = self.max_difficulty - self.min_difficulty
        value = math.floor(progress * span + self.min_difficulty)
        value -= value % self.difficulty_step
        # floored to a multiple of the step, the value can fall below min_difficulty:
        # DeepSpeed 0.19.8 raises it to the first multiple at or above min_difficulty
        first = -(-self.min_difficulty // self.difficulty_step) * self.difficulty_step
        return min(max(value, first), self.max_difficulty)


class CurriculumScheduler:
    """A metric's running difficulty (DeepSpeed's ``CurriculumScheduler``).

    Starts at ``min_difficulty``; :meth:`update_difficulty` follows the schedule while the
    difficulty is below ``max_difficulty`` and keeps it once reached.
    """

    def __init__(self, spec: CurriculumMetric | Mapping[str, Any]) -> None:
        """``spec``: a metric's spec, or its DeepSpeed dict (as DeepSpeed's constructor
        takes; errors then name ``curriculum_metrics.metric``)."""
        self.spec = spec if isinstance(spec, CurriculumMetric) else \
            CurriculumMetric.from_dict("metric", spec)
        self.current_difficulty: float = self.spec.min_difficulty
        self.custom_get_difficulty: ScheduleFunction | None = None

    def set_custom_get_difficulty(self, schedule_function: ScheduleFunction) -> None:
        """Use ``schedule_function(step) -> difficulty`` (a ``custom`` schedule)."""
        self.custom_get_difficulty = schedule_function

    def get_difficulty(self, global_steps: int) -> float:
        """The schedule's difficulty at ``global_steps``, whatever the current one."""
        return self.spec.difficulty_at(global_steps, self.custom_get_difficulty)

    def update_difficulty(self, global_steps: int) -> float:
        """Move to the difficulty of ``global_steps`` unless the max is reached; returns it."""
        if self.current_difficulty < self.spec.max_difficulty:
            self.current_difficulty = self.get_difficulty(global_steps)
        return self.current_difficulty


def metrics_from_config(curriculum_learning: Mapping[str, Any]) -> tuple[CurriculumMetric, ...]:
    """The specs of a ``curriculum_learning`` dict's ``curriculum_metrics``, in order."""
    where = METRICS_PATH
    metrics = curriculum_learning.get("curriculum_metrics")
    if not isinstance(metrics, Mapping) or not metrics:
        raise UsageError("curriculum learning is enabled but curriculum_metrics is missing "
                         "or empty", where=where,
                         hint='add a metric, e.g. {"seqlen_truncate": {...}}')
    return tuple(CurriculumMetric.from_dict(str(name), d) for name, d in metrics.items())


# ---- reading the per-metric dict ----


def _required(d: Mapping[str, Any], key: str, where: str) -> Any:
    value = d.get(key)
    if value is None:
        raise UsageError(f"{key} is required", where=f"{where}.{key}")
    return value


def _number(d: Mapping[str, Any], key: str, where: str) -> float:
    value = _required(d, key, where)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"{key} must be a number, not {value!r}", where=f"{where}.{key}")
    return value


def _positive_int(d: Mapping[str, Any], key: str, where: str) -> int:
    value = _required(d, key, where)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UsageError(f"{key} must be a positive integer, not {value!r}",
                         where=f"{where}.{key}")
    return value


def _kinds(name: str, d: Mapping[str, Any], where: str) -> dict[str, Any]:
    difficulty_type = d.get("difficulty_type") or "value"
    if difficulty_type not in DIFFICULTY_TYPES:
        raise UsageError(f"unknown difficulty_type {difficulty_type!r}",
                         where=f"{where}.difficulty_type",
                         hint=f"use one of {', '.join(DIFFICULTY_TYPES)}")
    clustering_type = d.get("clustering_type") or SINGLE_CLUSTER
    sample_path, metric_path = d.get("index_to_sample_path"), d.get("index_to_metric_path")
    if clustering_type != SINGLE_CLUSTER:
        if not sample_path:
            raise UsageError(f"the index metric {name} needs its data analyzer's index",
                             where=f"{where}.index_to_sample_path",
                             hint="set index_to_sample_path, or clustering_type "
                                  "single_cluster for a metric that filters no sample")
        if difficulty_type == "value" and not metric_path:
            raise UsageError(f"the value-based index metric {name} needs the index's values",
                             where=f"{where}.index_to_metric_path",
                             hint="set index_to_metric_path, or difficulty_type percentile")
    return {"difficulty_type": difficulty_type, "clustering_type": clustering_type,
            "index_to_sample_path": sample_path, "index_to_metric_path": metric_path}


def _schedule_params(schedule_type: str, config: Any, where: str) -> dict[str, Any]:
    if schedule_type == "custom":
        return {}
    if not isinstance(config, Mapping):
        raise UsageError(f"a {schedule_type} schedule needs its schedule_config", where=where)
    if schedule_type == "fixed_discrete":
        return _discrete_params(config, where)
    params: dict[str, Any] = {
        "total_curriculum_step": _positive_int(config, "total_curriculum_step", where),
        "difficulty_step": _positive_int(config, "difficulty_step", where)}
    if schedule_type == "fixed_root":
        degree = _number(config, "root_degree", where)
        if degree <= 0:
            raise UsageError(f"root_degree must be positive, not {degree!r}",
                             where=f"{where}.root_degree")
        params["root_degree"] = degree
    return params


def _discrete_params(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    difficulty, max_step = (_required(config, k, where) for k in ("difficulty", "max_step"))
    for key, values in (("difficulty", difficulty), ("max_step", max_step)):
        if not isinstance(values, (list, tuple)) or not values or any(
                isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
            raise UsageError(f"{key} must be a non-empty list of numbers, not {values!r}",
                             where=f"{where}.{key}")
    if len(difficulty) != len(max_step) + 1:
        raise UsageError(f"difficulty has {len(difficulty)} entries and max_step "
                         f"{len(max_step)}: difficulty needs exactly one more (the last "
                         "difficulty holds after the last max_step)",
                         where=f"{where}.difficulty")
    if any(b <= a for a, b in itertools.pairwise(max_step)):
        raise UsageError(f"max_step must increase, not {max_step!r}", where=f"{where}.max_step")
    return {"difficulty": tuple(difficulty), "max_step": tuple(max_step)}
