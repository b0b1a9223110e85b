"""The tree fan-out, as data: which hosts ds-run contacts itself, and whom each of them starts.

With ``K`` relays, the remote hosts (in hostfile order) are cut into ``K`` contiguous shares
as even as possible; the first host of each share is its relay. ds-run opens ``K`` SSH
connections instead of one per host; each relay's agent opens the connections to the rest
of its share, starts their agents, and carries their lines up its own channel (one stream,
written in batches) and ds-run's stop/kill requests down (:mod:`.relay`,
:mod:`.backends.tree`). The tree has two levels: at 4,096 hosts ``ceil(sqrt(N))`` = 64
relays of 64 hosts each keep every process's fan-out at 64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TREE_ABOVE = 64
"""Without ``--fanout``, a job on more remote hosts than this is started through a tree."""


@dataclass(frozen=True)
class Share:
    """One relay and the hosts whose agents it starts and supervises."""

    relay: str
    children: tuple[str, ...]


def relay_count(hosts: int, fanout: int | None) -> int:
    """How many relays ds-run contacts for ``hosts`` remote hosts (``0``: flat, no relay).

    ``fanout`` is ``--fanout``: ``None`` chooses (flat up to :data:`TREE_ABOVE` hosts, then
    ``ceil(sqrt(hosts))``), ``0`` is always flat, ``K`` is ``K`` relays (flat when ``K`` is
    at least the host count: every host would be a relay of nothing).
    """
    if fanout is None:
        fanout = math.ceil(math.sqrt(hosts)) if hosts > TREE_ABOVE else 0
    return 0 if fanout == 0 or fanout >= hosts else fanout


def plan_tree(hosts: tuple[str, ...], relays: int) -> tuple[Share, ...]:
    """``hosts`` cut into ``relays`` contiguous shares, the larger ones first."""
    if not 0 < relays <= len(hosts):
        raise ValueError(f"{relays} relays for {len(hosts)} hosts")
    size, extra = divmod(len(hosts), relays)
    shares = []
    start = 0
    for i in range(relays):
        end = start + size + (1 if i < extra else 0)
        shares.append(Share(hosts[start], hosts[start + 1:end]))
        start = end
    return tuple(shares)


def tree_note(shares: tuple[Share, ...]) -> str:
    """What ``--dry_run`` says of the tree."""
    sizes = sorted({len(s.children) for s in shares})
    each = "-".join(map(str, (sizes[0], sizes[-1]) if len(sizes) > 1 else sizes))
    return (f"ssh through {len(shares)} relay(s), each starting {each} other host(s): "
            + ", ".join(s.relay for s in shares) + " (--fanout; a host reached through "
            "ProxyJump makes it flat)")
