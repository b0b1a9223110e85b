"""SLURM hostlist expressions: ``node[01-04,07],gpu-a[1-2]`` → the host names, in order.

Pure and torch-free, used by both the launcher (resources from an allocation) and the
runtime (the master address of an ``srun``-started job). Several bracket groups in one
name (``rack[1-2]-n[01-02]``) expand as a cartesian product, leftmost group slowest, and
zero padding follows the width of the range's start, as SLURM does.
"""

from __future__ import annotations

import re

from deepshard.errors import UsageError

_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?\Z")


def expand_hostlist(text: str) -> list[str]:
    """All host names of a hostlist expression; raises :class:`UsageError` when malformed."""
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        if item:
            hosts.extend(_expand_item(item, text))
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return items


def _expand_item(item: str, whole: str) -> list[str]:
    open_at = item.find("[")
    if open_at < 0:
        if "]" in item:
            raise _malformed(whole)
        return [item]
    close_at = item.find("]", open_at)
    if close_at < 0:
        raise _malformed(whole)
    prefix, body, rest = item[:open_at], item[open_at + 1:close_at], item[close_at + 1:]
    tails = _expand_item(rest, whole) if rest else [""]
    names: list[str] = []
    for part in body.split(","):
        match = _RANGE.match(part.strip())
        if not match:
            raise _malformed(whole)
        lo_text, hi_text = match.group(1), match.group(2) or match.group(1)
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise _malformed(whole)
        width = len(lo_text)
        for n in range(lo, hi + 1):
            names.extend(f"{prefix}{n:0{width}d}{tail}" for tail in tails)
    return names


def _malformed(text: str) -> UsageError:
    return UsageError(f"malformed hostlist {text!r}", where="SLURM_JOB_NODELIST",
                      hint="expected names like node[01-04,07],gpu-a1")
