"""What a worker does at interpreter exit, after ``init_distributed`` joined a group.

The hazard (seen under gdb): gloo's worker thread drops a finished collective's work a
moment *after* Python's ``wait()`` returned, and if Python has dropped one of its tensors
meanwhile, that release takes the GIL (``~AsyncWork`` -> ``decref_pyobject`` ->
``gil_scoped_acquire``). Once the interpreter is finalizing, a thread taking the GIL is
made to exit in place, which C++ reports as ``terminate called without an active
exception`` (SIGABRT, after the script did all its work); and a group destructed while the
main thread holds the GIL waits for that thread forever (``~ProcessGroupGloo`` joins it).

So at exit a worker (1) hands the GIL to gloo's worker threads until none has been
runnable for a few consecutive releases (bounded), (2) keeps every process group alive to
the end of the process: destructing one joins its threads, which also waits for any
collective still in flight (a rank that raised mid-step); the OS reclaims them, as it
reclaims the WORLD group torch itself keeps, and (3) calls ``destroy_process_group()``, as
torch asks.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import time

GLOO_WORKER = "pt_gloo_runloop"  # torch's name for ProcessGroupGloo's worker threads
SETTLE_LIMIT_S = 0.5
SETTLE_CLEAN_CHECKS = 3


def register() -> None:
    """Run :func:`at_exit` when the interpreter exits (a second run does nothing)."""
    atexit.register(at_exit)


def at_exit() -> None:
    """Let gloo's workers finish, keep the groups from being destructed, destroy them."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    settle(GLOO_WORKER)
    for group in _all_groups():
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))  # never freed: see above
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _all_groups() -> list:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    world = getattr(distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", {}) or {})
    return groups or [dist.group.WORLD]


def settle(thread_name: str, limit_s: float = SETTLE_LIMIT_S,
           clean_checks: int = SETTLE_CLEAN_CHECKS) -> None:
    """Release the GIL in 1 ms sleeps until no thread of this process named
    ``thread_name`` was runnable at ``clean_checks`` checks in a row, or ``limit_s`` has
    passed. Consecutive checks, because a thread blocked on the GIL shows as sleeping:
    the next release lets it run."""
    deadline = time.monotonic() + limit_s
    clean = 0
    while clean < clean_checks and time.monotonic() < deadline:
        time.sleep(0.001)
        clean = 0 if thread_name in runnable_threads() else clean + 1


def runnable_threads() -> list[str]:
    """Names of this process's threads that are running or runnable (Linux ``/proc``;
    elsewhere an empty list)."""
    names = []
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return names
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        # "tid (comm) state ...": comm may itself hold spaces and parentheses
        head, _, tail = stat.rpartition(")")
        if tail.split()[:1] == ["R"]:
            names.append(head.partition("(")[2])
    return names
