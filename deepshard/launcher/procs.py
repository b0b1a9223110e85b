"""Process trees: find every descendant, stop them all, leave nothing behind.

Both the agent and ds-run make themselves *child subreapers*: a process whose parent dies
is re-parented to the nearest subreaper above it instead of to init, so a worker's
orphaned children (data loader workers, a shell's background jobs, a killed agent's
workers) stay in our tree, where :func:`stop_tree` finds them. Only ``/proc`` and
``os`` are used: the agent starts on every host at once, and psutil costs 40 ms.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

TYPE_CHECKING = False  # no typing at run time: the agent starts on every host at once
if TYPE_CHECKING:
    from collections.abc import Set as AbstractSet

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Orphaned descendants get re-parented to this process (Linux; a no-op elsewhere)."""
    import ctypes  # only here: ctypes costs a few ms of every start

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _table() -> dict[int, tuple[int, str, int]]:
    """pid -> (ppid, state, pgid) for every process."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2:].split()
        table[int(entry.name)] = (int(fields[1]), fields[0].decode(), int(fields[2]))
    return table


def descendants(root: int | None = None) -> dict[int, tuple[int, str, int]]:
    """Every descendant of ``root`` (default: this process): pid -> (ppid, state, pgid)."""
    root = os.getpid() if root is None else root
    table = _table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = table[child]
            todo.append(child)
    return found


def has_children() -> bool:
    """Any child at all? For a subreaper, none means no descendant either (cheap)."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def _signal(groups: set[int], sig: signal.Signals) -> None:
    """``sig`` once to each group, and once to each descendant outside those groups."""
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    if not has_children():
        return
    for pid, (_, state, pgid) in descendants().items():
        if pgid not in groups and state != "Z":
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


def _reap_adopted(keep: set[int]) -> None:
    """Reap exited children that are not ``keep`` (those belong to a Popen's wait())."""
    me = os.getpid()
    for pid, (ppid, state, _) in descendants().items():
        if ppid == me and state == "Z" and pid not in keep:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


def stop_tree(groups: set[int], grace: float, keep: AbstractSet[int] = frozenset()) -> None:
    """Stop every descendant: SIGTERM once to each process group in ``groups`` and to every
    other descendant, up to ``grace`` seconds for *all* of them to exit, then SIGKILL.

    ``keep``: child pids whose exit status someone else collects (``Popen.wait``); they are
    signalled but never reaped here.
    """
    if not groups and not has_children():
        return
    _signal(groups, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while True:
        _reap_adopted(set(keep))
        live = [p for p, (_, state, _) in descendants().items() if state != "Z"]
        if not live or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    if live:
        _signal(groups, signal.SIGKILL)
        end = time.monotonic() + 5.0
        while time.monotonic() < end:
            _reap_adopted(set(keep))
            if not [p for p, (_, s, _) in descendants().items() if s != "Z"]:
                break
            time.sleep(0.02)
    _reap_adopted(set(keep))
