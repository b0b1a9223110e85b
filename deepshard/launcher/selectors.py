"""``--include`` / ``--exclude`` selectors in DeepSpeed's grammar.

``host[:slot[,slot...]][@host[:slot[,slot...]]...]``, e.g. ``worker-0:0,2@worker-1``. A host
named without slots means all of its slots. Unlike DeepSpeed, nothing is dropped silently:
an unknown host, a slot the host does not have, a host named twice or an empty part is an
error naming the flag.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import UsageError
from .resources import Host, Resources

_SLOT = re.compile(r"[0-9]+\Z")


@dataclass(frozen=True)
class Selection:
    """One host of a selector; ``slots`` is ``None`` for "all of its slots"."""

    host: str
    slots: tuple[int, ...] | None


def parse_selector(text: str, flag: str) -> tuple[Selection, ...]:
    """Parse a selector string given to ``flag`` (used in error messages)."""
    hint = "write it as host or host:0,1 joined by @, e.g. worker-0:0,2@worker-1"
    parts = text.split("@")
    selections: list[Selection] = []
    for part in parts:
        host, sep, slot_text = part.partition(":")
        host = host.strip()
        if not host:
            raise UsageError(f"empty host in {text!r}", where=flag, hint=hint)
        slots: tuple[int, ...] | None = None
        if sep:
            items = [s.strip() for s in slot_text.split(",")]
            bad = [s for s in items if not _SLOT.match(s)]
            if bad:
                raise UsageError(f"slot {bad[0]!r} of host {host!r} is not a non-negative "
                                 "integer", where=flag, hint=hint)
            values = [int(s) for s in items]
            if len(set(values)) != len(values):
                raise UsageError(f"a slot of host {host!r} is named twice", where=flag,
                                 hint=hint)
            slots = tuple(sorted(values))
        if any(s.host == host for s in selections):
            raise UsageError(f"host {host!r} is named twice", where=flag,
                             hint="name each host once and list its slots after ':'")
        selections.append(Selection(host, slots))
    return tuple(selections)


def _check_known(resources: Resources, selections: tuple[Selection, ...], flag: str) -> None:
    for sel in selections:
        host = resources.get(sel.host)
        if host is None:
            raise UsageError(
                f"unknown host {sel.host!r}; {resources.origin} has "
                + ", ".join(resources.names()),
                where=flag,
                hint="name a host from the hostfile",
            )
        missing = [s for s in sel.slots or () if s not in host.slots]
        if missing:
            raise UsageError(
                f"host {sel.host!r} has no slot {missing[0]} (its slots: "
                + ",".join(map(str, host.slots)) + ")",
                where=flag,
                hint="pick slots the host has",
            )


def include(resources: Resources, selections: tuple[Selection, ...], flag: str) -> Resources:
    """Only the selected hosts and slots, in the resources' host order."""
    _check_known(resources, selections, flag)
    chosen = {s.host: s.slots for s in selections}
    hosts = tuple(
        Host(h.name, h.slots if (slots := chosen[h.name]) is None else slots, h.where)
        for h in resources.hosts
        if h.name in chosen
    )
    return Resources(hosts, resources.origin)


def exclude(resources: Resources, selections: tuple[Selection, ...], flag: str) -> Resources:
    """All hosts and slots except the selected ones; hosts left with no slot are dropped."""
    _check_known(resources, selections, flag)
    removed = {s.host: s.slots for s in selections}
    hosts = []
    for h in resources.hosts:
        if h.name not in removed:
            hosts.append(h)
            continue
        drop = removed[h.name]
        keep = () if drop is None else tuple(s for s in h.slots if s not in drop)
        if keep:
            hosts.append(Host(h.name, keep, h.where))
    if not hosts:
        raise UsageError("the exclusion leaves no slot to run on", where=flag,
                         hint="exclude fewer hosts or slots")
    return Resources(tuple(hosts), resources.origin)
