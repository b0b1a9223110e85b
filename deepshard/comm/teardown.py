"""What a worker does at interpreter exit, after ``init_distributed`` joined a group.

The hazard (seen under gdb): gloo's worker thread drops a finished collective's work a
moment *after* Python's ``wait()`` returned, and if Python has dropped one of its tensors
meanwhile, that release takes the GIL (``~AsyncWork`` -> ``decref_pyobject`` ->
``gil_scoped_acquire``). Once the interpreter is finalizing, a thread taking the GIL is
made to exit in place, which C++ reports as ``terminate called without an active
exception`` (SIGABRT, after the script did all its work); and a group destructed while the
main thread holds the GIL waits for that thread forever (``~ProcessGroupGloo`` joins it).

So (1) every process group deepshard creates, and every one still registered at exit, is
kept alive to the end of the process (:func:`keep`): destructing one joins its threads,
which deadlocks on that GIL wait and also waits for any collective still in flight (a
rank that raised mid-step); the OS reclaims them, as it reclaims the WORLD group torch
itself keeps. (2) At exit a worker hands the GIL to gloo's worker threads until none has
been runnable for a long spell of consecutive releases (bounded), also when the script
already called ``destroy_process_group()`` itself (most do; the hazard is the same), and
(3) calls ``destroy_process_group()`` if the script did not, as torch asks.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import time

GLOO_WORKER = "pt_gloo_runloop"  # torch's name for ProcessGroupGloo's worker threads
SETTLE_LIMIT_S = 2.0
# a thread woken by a GIL release but not scheduled before the main thread takes it back
# looks asleep: 3 clean checks of 1 ms (the first design) let one through on a loaded
# 2-core machine (an abort at exit in CI), so the quiet spell must be long
SETTLE_CLEAN_CHECKS = 20
SETTLE_NAP_S = 0.002


def register() -> None:
    """Run :func:`at_exit` when the interpreter exits (once, however often this is
    called), and keep the default process group alive until then."""
    import torch.distributed as dist

    atexit.unregister(at_exit)
    atexit.register(at_exit)
    if dist.is_initialized():
        keep(dist.group.WORLD)


def keep(group: object) -> None:
    """Never free ``group`` (a process group): see the module docstring."""
    if group is not None:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


def at_exit() -> None:
    """Let gloo's workers finish, keep the groups from being destructed, destroy them."""
    import torch.distributed as dist

    settle(GLOO_WORKER)  # also after the script's own destroy_process_group()
    if not dist.is_initialized():
        return
    for group in _all_groups():
        keep(group)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _all_groups() -> list:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    world = getattr(distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", {}) or {})
    return groups or [dist.group.WORLD]


def settle(thread_name: str, limit_s: float = SETTLE_LIMIT_S,
           clean_checks: int = SETTLE_CLEAN_CHECKS, nap_s: float = SETTLE_NAP_S) -> None:
    """Release the GIL in ``nap_s`` sleeps until no thread of this process named
    ``thread_name`` was runnable at ``clean_checks`` checks in a row, or ``limit_s`` has
    passed. Consecutive checks, because a thread blocked on the GIL shows as sleeping:
    each release wakes it, and it must lose the GIL back to the main thread at every one
    of them to pass unseen."""
    if thread_name not in thread_names():
        return
    deadline = time.monotonic() + limit_s
    clean = 0
    while clean < clean_checks and time.monotonic() < deadline:
        time.sleep(nap_s)
        clean = 0 if thread_name in runnable_threads() else clean + 1


def runnable_threads() -> list[str]:
    """Names of this process's threads that are running or runnable (Linux ``/proc``;
    elsewhere an empty list)."""
    return [name for name, state in _threads() if state == "R"]


def thread_names() -> list[str]:
    """Names of this process's threads (Linux ``/proc``; elsewhere an empty list)."""
    return [name for name, _ in _threads()]


def _threads() -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return found
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        # "tid (comm) state ...": comm may itself hold spaces and parentheses
        head, _, tail = stat.rpartition(")")
        found.append((head.partition("(")[2], (tail.split() or [""])[0]))
    return found
