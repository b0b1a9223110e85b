"""What a worker does at interpreter exit, after ``init_distributed`` joined a group.

torch asks for ``destroy_process_group()`` before exit. Gloo needs one more thing. Its
worker threads release each finished collective's tensors a moment *after* ``wait()``
returns in Python. If the Python side already dropped such a tensor, that release has to
take the GIL. A thread that takes the GIL once the interpreter is finalizing is made to exit
in place, and C++ turns that into ``terminate called without an active exception``
(SIGABRT) after the script has done all its work. So the exit handler first gives the
workers the GIL until none is still running (bounded), then destroys the groups and collects
the garbage that still holds any, so that their threads are joined while the interpreter is
whole.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import time

GLOO_WORKER = "pt_gloo_runloop"  # torch's name for ProcessGroupGloo's worker threads
SETTLE_LIMIT_S = 0.5


def register() -> None:
    """Run :func:`at_exit` when the interpreter exits (a second run does nothing)."""
    atexit.register(at_exit)


def at_exit() -> None:
    """Let gloo's workers finish, destroy the process groups, free what held them."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    settle(GLOO_WORKER)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    gc.collect()


def settle(thread_name: str, limit_s: float = SETTLE_LIMIT_S) -> None:
    """Release the GIL (1 ms sleeps) until no thread of this process named ``thread_name``
    is runnable, or ``limit_s`` has passed. Always sleeps once: a thread blocked on the
    GIL shows as sleeping, and gets it then."""
    deadline = time.monotonic() + limit_s
    while True:
        time.sleep(0.001)
        if thread_name not in runnable_threads() or time.monotonic() > deadline:
            return


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
