"""Which attention heads each rank of a sequence-parallel group attends over (pure).

Ulysses trades the sequence shard for a head shard: before the local attention every rank
holds the whole sequence for some of the heads. :func:`plan_heads` decides which, for any
head counts. With at least as many key/value heads as ranks, the key/value heads are
split into contiguous ranges as evenly as they go (the first ``heads % size`` ranks take
one more) and each rank takes the query heads of its key/value groups. With fewer, the
query heads are split so, and each rank receives the key/value heads its query heads read
under grouped-query attention (query head ``h`` reads key/value head
``h // (query_heads // kv_heads)``): key/value heads are replicated across ranks.

When a rank's query heads line up with whole key/value groups (or sit inside one group),
it gets each needed key/value head once and its local attention is ordinary GQA (or MHA,
or MQA). When they do not (8 query heads, 2 key/value heads, 3 ranks), the rank gets one
key/value head per query head, repeated, so that its local attention is plain MHA: the
sender's ``index_select`` repeats the head, and its backward sums the repeats' gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepshard.errors import UsageError


@dataclass(frozen=True)
class HeadPlan:
    """The head shard of every rank in a group of ``len(q_counts)`` ranks."""

    query_heads: int
    kv_heads: int
    q_counts: tuple[int, ...]
    """Query heads of each rank (contiguous, in rank order)."""
    kv_index: tuple[tuple[int, ...], ...]
    """The key/value heads each rank receives, in the order its local attention sees them
    (a head may repeat: see the module docstring)."""

    def q_start(self, rank: int) -> int:
        """The first query head of ``rank``."""
        return sum(self.q_counts[:rank])


def even_split(total: int, parts: int) -> tuple[int, ...]:
    """``total`` split into ``parts`` counts differing by at most one, larger ones first."""
    base, extra = divmod(total, parts)
    return tuple(base + (i < extra) for i in range(parts))


def plan_heads(query_heads: int, kv_heads: int, size: int) -> HeadPlan:
    """The head plan for ``query_heads`` query and ``kv_heads`` key/value heads over
    ``size`` ranks.

    Raises:
        UsageError: fewer query heads than ranks (a rank would attend over nothing), or
            query heads that are not a multiple of the key/value heads.
    """
    if query_heads < 1 or kv_heads < 1:
        raise UsageError(f"attention needs at least one head, got {query_heads} query and "
                         f"{kv_heads} key/value heads", where="DistributedAttention")
    if query_heads % kv_heads:
        raise UsageError(f"{query_heads} query heads is not a multiple of {kv_heads} "
                         "key/value heads", where="DistributedAttention",
                         hint="grouped-query attention needs query heads = kv heads x group")
    if query_heads < size:
        raise UsageError(f"{query_heads} query heads cannot be shared by {size} "
                         "sequence-parallel ranks: a rank would have no head",
                         where="sequence_parallel_size",
                         hint=f"use a sequence_parallel_size of at most {query_heads}")
    group = query_heads // kv_heads
    if kv_heads >= size:
        counts = tuple(group * c for c in even_split(kv_heads, size))
    else:
        counts = even_split(query_heads, size)
    starts = [sum(counts[:r]) for r in range(size)]
    index = tuple(_kv_for(start, count, group) for start, count in zip(starts, counts,
                                                                       strict=True))
    return HeadPlan(query_heads, kv_heads, counts, index)


def _kv_for(start: int, count: int, group: int) -> tuple[int, ...]:
    """The key/value heads query heads ``start .. start + count - 1`` read."""
    first, last = start // group, (start + count - 1) // group
    inside_one = first == last
    whole_groups = start % group == 0 and count % group == 0
    if inside_one or whole_groups:
        return tuple(range(first, last + 1))
    return tuple(h // group for h in range(start, start + count))
