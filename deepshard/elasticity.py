"""DeepSpeed's ``elasticity`` arithmetic: one train batch size that many world sizes share.

Pure and torch-free: the launcher imports it to learn which world sizes a job may run at
(``ds-run --elastic_training`` starts only those), the runtime to set the batch triad for
the world size it runs at. The results are those of ``compute_elastic_config`` in
DeepSpeed 0.18.9, the last release that had elasticity (0.19 removed the section and
rejects it), with upstream's later fix that keeps the batch within
``max_train_batch_size``; ``tests/unit/test_elastic_compute.py`` holds its outputs for a
grid of inputs.

Version 0.1 scales each micro batch size (and their least common multiple) by the largest
highly composite number that keeps it within ``max_train_batch_size``, then keeps the
candidate with the most valid GPU counts in ``[min_gpus, max_gpus]`` (the larger or the
smaller batch on a tie, by ``prefer_larger_batch``). Version 0.2 does the same per node
(``num_gpus_per_node``, ``model_parallel_size``) and, for a world size outside that set,
falls back to the largest batch the current data-parallel size can take.

Also here, for ``--elastic_training`` without an ``elasticity`` section: which world sizes
keep ``train_batch_size`` with a fixed micro batch (:func:`fits_batch`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from deepshard.errors import UsageError

HIGHLY_COMPOSITE = (
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040,
    7560, 10080, 15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320,
    221760, 277200, 332640, 498960, 554400, 665280, 720720)
"""The 38 smallest highly composite numbers (DeepSpeed's list: batch sizes up to 720K)."""

LATEST_VERSION = 0.2
SECTION = "elasticity"


@dataclass(frozen=True, kw_only=True)
class ElasticSpec:
    """The ``elasticity`` section with DeepSpeed's keys and defaults."""

    enabled: bool = False
    max_train_batch_size: int = 2000
    micro_batch_sizes: tuple[int, ...] = (2, 4, 6)
    min_gpus: int = 1
    max_gpus: int = 10000
    min_time: float = 0
    """Minutes a scheduler should keep the job at one size (accepted; DeepSpeed's
    scheduler hint, it changes no arithmetic)."""
    version: float = LATEST_VERSION
    prefer_larger_batch: bool = True
    ignore_non_elastic_batch_info: bool = False
    model_parallel_size: int = 1
    num_gpus_per_node: int = 1


@dataclass(frozen=True)
class ElasticBatch:
    """What the arithmetic gives for one world size."""

    train_batch_size: int
    valid_world_sizes: tuple[int, ...]
    micro_batch_size: int

    def accumulation(self, world_size: int) -> int:
        return self.train_batch_size // (self.micro_batch_size * world_size)


def _candidates(bases: list[int], cap: int) -> list[int]:
    """Each base scaled by the largest highly composite number that keeps it within
    ``cap``; a base above the cap is no candidate (DeepSpeed 0.18.9 kept it as it was, a
    batch over ``max_train_batch_size``: 120 for a cap of 100 and micro batches 8, 10, 12,
    where the fixed upstream algorithm, DeepSpeed #8237, gives 96)."""
    found = set()
    for base in bases:
        if base > cap:
            continue
        factor = max((h for h in HIGHLY_COMPOSITE if h <= cap // base),
                     default=HIGHLY_COMPOSITE[-1])
        found.add(factor * base)
    return sorted(found)


def _valid_gpus(batch: int, micros: tuple[int, ...], lo: int, hi: int) -> tuple[int, ...]:
    """GPU counts in [lo, hi] at which ``batch`` splits into whole micro batches of one of
    ``micros`` (each count dividing ``batch // micro``)."""
    valid = set()
    for micro in micros:
        if batch % micro:
            continue
        most = batch // micro
        if lo <= most <= hi:
            valid.add(most)
        valid.update(i for i in range(max(lo, 1), min(hi, most // 2) + 1) if most % i == 0)
    return tuple(sorted(valid))


def _v01(micros: tuple[int, ...], cap: float, lo: int | None, hi: int | None,
         prefer_larger: bool) -> tuple[int, tuple[int, ...]]:
    lo = lo or 1
    hi = hi or int(cap // min(micros))
    if any(m > cap for m in micros):
        raise UsageError(f"every micro batch size must be at most max_train_batch_size "
                         f"{cap:g}", where=f"{SECTION}.micro_batch_sizes",
                         hint="drop the larger micro batch sizes or raise "
                              "max_train_batch_size")
    lcm = math.lcm(*micros)
    best_valid: tuple[int, ...]
    best, best_valid, count = min(micros), (), 0
    for batch in _candidates([*micros, lcm], int(cap)):
        valid = _valid_gpus(batch, micros, lo, hi)
        better = batch > best if prefer_larger else batch < best
        if len(valid) > count or (len(valid) == count and better):
            best, best_valid, count = batch, valid, len(valid)
    return int(best), best_valid


def _largest_micro(spec: ElasticSpec, batch: int, world_size: int) -> int | None:
    """The largest micro batch size dividing each rank's share of ``batch``."""
    share = batch // world_size
    return next((m for m in sorted(set(spec.micro_batch_sizes), reverse=True)
                 if share % m == 0), None)


def _v02(spec: ElasticSpec, world_size: int) -> tuple[int, tuple[int, ...]]:
    gpn, mp = spec.num_gpus_per_node, spec.model_parallel_size
    if gpn % mp:
        raise UsageError(f"num_gpus_per_node {gpn} is not divisible by model_parallel_size "
                         f"{mp}", where=f"{SECTION}.num_gpus_per_node",
                         hint="version 0.2 places whole model-parallel groups on each node")
    per_node = gpn // mp
    # DeepSpeed's arithmetic, floats and truncations included
    batch, nodes = _v01(spec.micro_batch_sizes, int(spec.max_train_batch_size / per_node),
                        int(spec.min_gpus / gpn), int(spec.max_gpus / gpn),
                        spec.prefer_larger_batch)
    valid = tuple(n * per_node for n in nodes)
    if world_size // mp in valid:
        return batch * per_node, valid
    current = (world_size / gpn) * per_node
    sizes = [math.floor(spec.max_train_batch_size / (m * current)) * m * current
             for m in spec.micro_batch_sizes]
    return int(max(sizes) if spec.prefer_larger_batch else min(sizes)), (int(current),)


def check_spec(spec: ElasticSpec) -> None:
    """Raise :class:`UsageError` for a section DeepSpeed would refuse."""
    for key in ("min_gpus", "max_gpus", "model_parallel_size", "num_gpus_per_node"):
        if getattr(spec, key) < 1:
            raise UsageError(f"must be at least 1, got {getattr(spec, key)}",
                             where=f"{SECTION}.{key}", hint="use a positive count")
    if spec.max_gpus < spec.min_gpus:
        raise UsageError(f"max_gpus {spec.max_gpus} is below min_gpus {spec.min_gpus}",
                         where=f"{SECTION}.max_gpus", hint="swap or widen them")
    if spec.min_time < 0:
        raise UsageError(f"must be >= 0, got {spec.min_time}", where=f"{SECTION}.min_time",
                         hint="use 0 or more minutes")
    if spec.model_parallel_size > 1 and float(spec.version) != 0.2:
        raise UsageError(f"version {spec.version:g} does not support model parallelism "
                         f"(model_parallel_size {spec.model_parallel_size})",
                         where=f"{SECTION}.version", hint="use version 0.2")
    if float(spec.version) > LATEST_VERSION or float(spec.version) not in (0.1, 0.2):
        raise UsageError(f"unknown version {spec.version:g}", where=f"{SECTION}.version",
                         hint="use 0.1 or 0.2 (DeepSpeed's)")


def compute(spec: ElasticSpec, world_size: int) -> ElasticBatch:
    """DeepSpeed's ``compute_elastic_config(config, version, world_size)`` for a world
    size (as DeepSpeed passes it: every rank of the job)."""
    check_spec(spec)
    if float(spec.version) == 0.1:
        batch, valid = _v01(spec.micro_batch_sizes, spec.max_train_batch_size, spec.min_gpus,
                            spec.max_gpus, spec.prefer_larger_batch)
    else:
        batch, valid = _v02(spec, world_size)
    if world_size not in valid:
        shown = ", ".join(map(str, valid[:12])) + (", ..." if len(valid) > 12 else "")
        raise UsageError(f"world size {world_size} is not one of the sizes this section "
                         f"allows ({shown or 'none'})", where=SECTION,
                         hint="run at one of those sizes (ds-run --elastic_training picks "
                              "them), or widen min_gpus/max_gpus/micro_batch_sizes")
    micro = _largest_micro(spec, batch, world_size)
    if micro is None:
        raise UsageError(f"no micro batch size divides {batch} // {world_size}",
                         where=f"{SECTION}.micro_batch_sizes",
                         hint="add a micro batch size that divides it")
    return ElasticBatch(batch, valid, micro)


def allows(spec: ElasticSpec, world_size: int) -> bool:
    """Whether the section lets the job run at ``world_size``."""
    try:
        compute(spec, world_size)
    except UsageError:
        return False
    return True


def fits_batch(train_batch_size: int, micro_batch: int, world_size: int) -> bool:
    """Whether ``world_size`` ranks keep ``train_batch_size`` with whole accumulation
    steps of ``micro_batch``."""
    return world_size > 0 and train_batch_size % (micro_batch * world_size) == 0


_FIELDS: dict[str, type | tuple[type, ...]] = {
    "enabled": bool, "max_train_batch_size": int, "micro_batch_sizes": list,
    "min_gpus": int, "max_gpus": int, "min_time": (int, float), "version": (int, float),
    "prefer_larger_batch": bool, "ignore_non_elastic_batch_info": bool,
    "model_parallel_size": int, "num_gpus_per_node": int,
}


def spec_from_mapping(section: Mapping[str, object], where: str = SECTION) -> ElasticSpec:
    """The section as written (for the launcher, which reads the file without pydantic);
    a wrong key or type is a :class:`UsageError` naming it."""
    values: dict[str, object] = {}
    for key, value in section.items():
        kind = _FIELDS.get(key)
        if kind is None:
            raise UsageError(f"unknown key {key!r}", where=f"{where}.{key}",
                             hint=f"use one of {', '.join(_FIELDS)}")
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        if key == "micro_batch_sizes":
            ok = ok and bool(value) and all(
                isinstance(m, int) and not isinstance(m, bool) and m > 0
                for m in value)  # type: ignore[attr-defined]
            value = tuple(value) if ok else value  # type: ignore[arg-type]
        if not ok:
            raise UsageError(f"bad value {value!r}", where=f"{where}.{key}",
                             hint="see DeepSpeed's elasticity section for its types")
        values[key] = value
    spec = ElasticSpec(**values)  # type: ignore[arg-type]
    if spec.enabled and not {"max_train_batch_size", "micro_batch_sizes"} <= set(values):
        raise UsageError("an enabled elasticity section needs max_train_batch_size and "
                         "micro_batch_sizes", where=where, hint="add both keys")
    return spec
