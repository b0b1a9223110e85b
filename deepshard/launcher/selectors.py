"""``--include`` / ``--exclude`` selectors in DeepSpeed's grammar.

``host[:slot[,slot...]][@host[:slot[,slot...]]...]``, e.g. ``worker-0:0,2@worker-1``. A host
named without slots means all of its slots. As in DeepSpeed, naming a host or a slot more
than once is a union (``worker-0:1,1`` is slot 1, ``worker-0:1@worker-0:0,1`` slots 0 and 1).

Stricter than DeepSpeed, so that a mistake stops the launch instead of changing it: an
unknown host, a slot the host does not have and an empty part are one-line errors naming
the flag (DeepSpeed: a ``ValueError`` traceback), and so is a host named both alone and with
slots (``worker-0@worker-0:1``), which DeepSpeed reads as "only slot 1" and a union would
read as "all slots". An exclusion that leaves nothing is an error too (DeepSpeed returns no
hosts). ``CUDA_VISIBLE_DEVICES`` as DeepSpeed's implicit ``--include``:
:func:`visible_devices_pool`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from deepshard.errors import UsageError
from deepshard.launcher.resources import Host, Resources, gpu_ids

_SLOT = re.compile(r"[0-9]+\Z")
_HINT = "write it as host or host:0,1 joined by @, e.g. worker-0:0,2@worker-1"


@dataclass(frozen=True)
class Selection:
    """One host of a selector; ``slots`` is ``None`` for "all of its slots"."""

    host: str
    slots: tuple[int, ...] | None


def parse_selector(text: str, flag: str) -> tuple[Selection, ...]:
    """Parse a selector string given to ``flag`` (used in error messages).

    One :class:`Selection` per host, in the order hosts first appear; a host's repeated
    parts are merged into one set of slots (ascending).
    """
    merged: dict[str, set[int] | None] = {}
    for part in text.split("@"):
        host, slots = _parse_part(part, text, flag)
        if host not in merged:
            merged[host] = slots
            continue
        known = merged[host]
        if (known is None) != (slots is None):
            listed = sorted(known if known is not None else slots or ())
            raise UsageError(
                f"host {host!r} is named both alone (all its slots) and with slots "
                + ",".join(map(str, listed)),
                where=flag,
                hint=f"write {host} for all its slots or {host}:"
                     + ",".join(map(str, listed)) + " for those only")
        if known is not None and slots is not None:
            known |= slots
    return tuple(Selection(h, None if s is None else tuple(sorted(s)))
                 for h, s in merged.items())


def _parse_part(part: str, text: str, flag: str) -> tuple[str, set[int] | None]:
    """``host`` or ``host:slot,slot`` → (host, slots or ``None`` for all)."""
    host, sep, slot_text = part.partition(":")
    host = host.strip()
    if not host:
        raise UsageError(f"empty host in {text!r}", where=flag, hint=_HINT)
    if not sep:
        return host, None
    items = [s.strip() for s in slot_text.split(",")]
    bad = [s for s in items if not _SLOT.match(s)]
    if bad:
        raise UsageError(f"slot {bad[0]!r} of host {host!r} is not a non-negative integer",
                         where=flag, hint=_HINT)
    return host, {int(s) for s in items}


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


def visible_devices_pool(local: Resources, visible: str, physical: tuple[int, ...], *,
                         include_text: str | None = None, exclude_text: str | None = None,
                         num_gpus: int | None = None) -> tuple[Resources, str]:
    """``CUDA_VISIBLE_DEVICES=<ids>`` in ds-run's environment, with no hostfile.

    DeepSpeed's runner turns it into ``--include localhost:<ids>`` over the machine's
    physical GPUs when no ``--include``/``--exclude``/``--num_gpus`` is given, and ignores
    it otherwise. Here the listed GPUs are this machine's pool either way: alone they are
    exactly DeepSpeed's ``--include``; a selector or ``--num_gpus`` chooses among them, and a
    selector naming a GPU the variable hides is an error rather than DeepSpeed's silent
    override. ``local`` is :func:`~.resources.probe_local`'s answer for the variable;
    ``physical`` the GPU ids the driver lists (empty when it cannot tell: then the ids are
    trusted). Returns the pool (its origin names the variable) and the line ``--dry_run``
    shows.
    """
    ids = gpu_ids({"CUDA_VISIBLE_DEVICES": visible})
    shown = ",".join(map(str, ids))
    where = f"CUDA_VISIBLE_DEVICES={visible}"
    if len(set(ids)) != len(ids):
        raise UsageError("a GPU is listed twice", where=where, hint="list each GPU id once")
    absent = [i for i in ids if physical and i not in physical]
    if absent:
        raise UsageError(f"this machine has no GPU {absent[0]} (its GPUs: "
                         + ",".join(map(str, physical)) + ")", where=where,
                         hint="list GPUs this machine has, or unset CUDA_VISIBLE_DEVICES")
    host = local.hosts[0].name
    for flag, text in (("--include", include_text), ("--exclude", exclude_text)):
        if text is None:
            continue
        for sel in parse_selector(text, flag):
            hidden = [s for s in sel.slots or () if sel.host == host and s not in ids]
            if hidden:
                raise UsageError(
                    f"GPU {hidden[0]} is hidden by {where} (DeepSpeed would ignore the "
                    "variable when a selector is given)", where=flag,
                    hint=f"name only GPUs {shown}, or unset CUDA_VISIBLE_DEVICES to choose "
                         "among all GPUs")
    chosen = next((f for f, v in (("--include", include_text), ("--exclude", exclude_text),
                                  ("--num_gpus", num_gpus)) if v is not None), None)
    if chosen is None:
        note = f"{where}: --include localhost:{shown} (as DeepSpeed does)"
    else:
        note = (f"{where}: {chosen} chooses among GPUs {shown} (DeepSpeed would ignore the "
                "variable here)")
    return Resources(local.hosts, f"this machine ({where})"), note
