"""Hostfiles in DeepSpeed's format: ``hostname slots=N`` per line.

``#`` starts a comment anywhere on a line; blank lines are ignored. Everything else is an
error that names ``file:line`` and shows a valid line: a missing or non-positive ``slots``,
a duplicate host, or any other token. (DeepSpeed skips some of these silently.)
"""

from __future__ import annotations

import re
from pathlib import Path

from deepshard.errors import UsageError
from deepshard.launcher.resources import Host, Resources

_HOSTNAME = re.compile(r"[A-Za-z0-9_:][A-Za-z0-9_.:\-]*\Z")
_SLOTS = re.compile(r"slots=(.*)\Z")
_EXAMPLE = "write it as 'worker-1 slots=4'"


def parse_hostfile(text: str, path: str) -> Resources:
    """Parse hostfile ``text``; ``path`` is only used to name lines in errors."""
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.split("\n"), start=1):
        where = f"{path}:{lineno}"
        tokens = raw.split("#", 1)[0].split()
        if not tokens:
            continue
        name, rest = tokens[0], tokens[1:]
        if not _HOSTNAME.match(name):
            raise UsageError(f"{name!r} is not a hostname", where=where, hint=_EXAMPLE)
        if name in seen:
            raise UsageError(
                f"host {name!r} is listed twice (first on line {seen[name]})",
                where=where,
                hint="list each host once with its total slots",
            )
        slots = _parse_slots(rest, where)
        seen[name] = lineno
        hosts.append(Host(name, tuple(range(slots)), where))
    if not hosts:
        raise UsageError(
            "the hostfile names no hosts", where=path, hint=f"add one line per host: {_EXAMPLE}"
        )
    return Resources(tuple(hosts), path)


def _parse_slots(tokens: list[str], where: str) -> int:
    if not tokens:
        raise UsageError("missing 'slots=N'", where=where, hint=_EXAMPLE)
    match = _SLOTS.match(tokens[0])
    if not match:
        raise UsageError(f"unexpected {tokens[0]!r}, expected 'slots=N'", where=where,
                         hint=_EXAMPLE)
    value = match.group(1)
    if not re.fullmatch(r"[0-9]+", value) or int(value) < 1:
        raise UsageError(f"slots must be a positive integer, got {value!r}", where=where,
                         hint=_EXAMPLE)
    if len(tokens) > 1:
        raise UsageError(f"unexpected {tokens[1]!r} after {tokens[0]!r}", where=where,
                         hint=f"{_EXAMPLE}; put comments after '#'")
    return int(value)


def read_hostfile(path: str | Path) -> Resources:
    """Read and parse the hostfile at ``path``; a missing or unreadable file is an error."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(
            "hostfile not found", where=str(path),
            hint="check the --hostfile path, or omit --hostfile to run on this machine",
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read hostfile ({exc})", where=str(path),
                         hint="give a readable UTF-8 text file of 'host slots=N' lines"
                         ) from None
    return parse_hostfile(text, str(path))
