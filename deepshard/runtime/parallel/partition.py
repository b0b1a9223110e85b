"""Splitting a sequence of layers into contiguous pipeline stages (pure).

A partition is given by its boundaries: ``parts`` stages over ``n`` layers are
``bounds[0] = 0 <= bounds[1] <= ... <= bounds[parts] = n``, stage ``s`` owning layers
``bounds[s] : bounds[s + 1]``, as DeepSpeed's ``PipelineModule.partitions()`` gives them.
Here every stage owns at least one layer: a stage with nothing to run is a mistake.
"""

from __future__ import annotations

from collections.abc import Sequence

from deepshard.errors import UsageError

__all__ = ["check_parts", "partition_layers", "partition_uniform"]


def check_parts(num_layers: int, parts: int, where: str = "pipeline.stages") -> None:
    """Raise :class:`UsageError` unless ``parts`` stages can each get a layer."""
    if parts < 1:
        raise UsageError(f"a pipeline needs at least one stage, got {parts}", where=where,
                         hint="set it to 1 or more")
    if num_layers < parts:
        raise UsageError(
            f"{parts} pipeline stages but only {num_layers} layer(s): every stage needs at "
            f"least one layer", where=where,
            hint=f"use at most {num_layers} stage(s), or give the PipelineModule more, "
                 f"smaller layers")


def partition_uniform(num_items: int, parts: int) -> tuple[int, ...]:
    """Boundaries giving each stage ``num_items // parts`` layers, the first
    ``num_items % parts`` stages one more (DeepSpeed's ``partition_uniform``)."""
    check_parts(num_items, parts)
    size, extra = divmod(num_items, parts)
    bounds = [0]
    for s in range(parts):
        bounds.append(bounds[-1] + size + (s < extra))
    return tuple(bounds)


def partition_layers(weights: Sequence[int | float], parts: int) -> tuple[int, ...]:
    """Boundaries of the contiguous split of ``weights`` into ``parts`` non-empty stages
    that minimises the heaviest stage (the linear partition problem).

    Among the splits with that heaviest stage, the most even one: least sum of squared
    stage weights, then least sum of squared layer counts (so zero-weight layers, such as
    lambdas, spread out too), then the most layers on earlier stages (so equal weights
    give :func:`partition_uniform`'s answer). Weights must be non-negative.
    """
    n = len(weights)
    check_parts(n, parts)
    if any(w < 0 for w in weights):
        raise ValueError(f"layer weights must be non-negative, got {list(weights)}")
    prefix: list[int | float] = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def heaviest(k: int, i: int, before: int | float) -> int | float:
        return max(before, prefix[i] - prefix[k])

    cap = _best_split(n, parts, heaviest, 0, float("inf"))[0][parts][n]

    def evenness(k: int, i: int, before: tuple) -> tuple:
        w = prefix[i] - prefix[k]
        if w > cap:
            return (float("inf"), float("inf"))
        return (before[0] + w * w, before[1] + (i - k) ** 2)

    split = _best_split(n, parts, evenness, (0, 0), (float("inf"), float("inf")))[1]
    bounds = [n]
    for j in range(parts, 0, -1):
        bounds.append(split[j][bounds[-1]])
    return tuple(reversed(bounds))


def _best_split(n: int, parts: int, extend, start, worst):
    """Dynamic programme over "the first ``i`` layers in ``j`` non-empty stages": ``best[j]
    [i]`` is the least value of ``extend(k, i, best[j - 1][k])`` over the last stage's first
    layer ``k``, and ``split[j][i]`` that ``k`` (the latest one on a tie)."""
    best = [[worst] * (n + 1) for _ in range(parts + 1)]
    split = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = start
    for j in range(1, parts + 1):
        # j stages need >= j layers; the remaining parts - j stages need parts - j more
        for i in range(j, n - (parts - j) + 1):
            for k in range(j - 1, i):
                candidate = extend(k, i, best[j - 1][k])
                if candidate <= best[j][i]:
                    best[j][i], split[j][i] = candidate, k
    return best, split
