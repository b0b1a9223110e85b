"""Liveness: ``deepshard.heartbeat(step)``, a worker's mark that its agent reads.

The agent gives each worker a small file (``DEEPSHARD_HEARTBEAT_FILE``, in ``/dev/shm``
where it exists); the worker maps it into memory once, and every heartbeat is a single
16-byte store of (``CLOCK_MONOTONIC`` in ns, step): no system call, no lock, no network,
well under a microsecond. The agent reads the file once a second and treats a worker
whose heartbeats stop for ``--hang_timeout`` seconds as hung. A worker that never calls
``heartbeat`` is never considered hung; outside ds-run the call does nothing.

Torch-free: ``import deepshard`` must stay cheap.
"""

from __future__ import annotations

import faulthandler
import functools
import io
import mmap
import os
import signal
import struct
import sys
import time

from . import contract

RECORD = struct.Struct("<qqq")
"""(monotonic ns of the last beat, step or -1, pid of the beating process); 0 ns = never
beaten. The pid is where the agent sends :data:`STACK_DUMP_SIGNAL`: the worker's own
process may be a wrapper (a shell, a launcher) that never registered the handler."""
STACK_DUMP_SIGNAL = signal.SIGUSR1
"""The agent sends this to a hung worker, whose faulthandler then prints every thread's
Python stack to stderr (its log)."""


def register_stack_dump() -> None:
    """Make :data:`STACK_DUMP_SIGNAL` dump all Python stacks (idempotent).

    The dump goes to ``sys.stderr``, or to the process's real stderr when ``sys.stderr``
    has been replaced by an object without a file descriptor (a notebook, a test capture).
    """
    try:
        faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True, chain=False)
    except (AttributeError, ValueError, io.UnsupportedOperation):
        if sys.__stderr__ is not None:  # None: no stderr at all (pythonw), no dumps
            faulthandler.register(STACK_DUMP_SIGNAL, file=sys.__stderr__, all_threads=True,
                                  chain=False)


class _Beater:
    """The mapped heartbeat file of this worker."""

    def __init__(self, path: str):
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, RECORD.size)
        finally:
            os.close(fd)
        self._pid = os.getpid()

    def beat(self, step: int) -> None:
        RECORD.pack_into(self._map, 0, time.monotonic_ns(), step, self._pid)


@functools.cache
def _beater(path: str) -> _Beater | None:
    try:
        beater = _Beater(path)
    except (OSError, ValueError):
        return None  # not under a deepshard agent, or its file is gone: nothing to mark
    register_stack_dump()
    return beater


def heartbeat(step: int | None = None) -> None:
    """Mark this worker alive (the engine calls it every optimizer step)."""
    path = os.environ.get(contract.HEARTBEAT_FILE)
    if path:
        beater = _beater(path)
        if beater is not None:
            beater.beat(-1 if step is None else step)


def _after_fork() -> None:
    _beater.cache_clear()  # a forked child is another process: map again, with its pid


os.register_at_fork(after_in_child=_after_fork)


def read_heartbeat(path: str) -> tuple[int, int, int]:
    """(monotonic ns of the last beat or 0, step or -1, pid or 0): the agent's side."""
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, RECORD.size, 0)
    finally:
        os.close(fd)
    return RECORD.unpack(data) if len(data) == RECORD.size else (0, -1, 0)
