"""Liveness: ``deepshard.heartbeat(step)`` and ``deepshard.report(step=, loss=)``, a
worker's mark that its agent reads.

The agent gives each worker a small file (``DEEPSHARD_HEARTBEAT_FILE``, in ``/dev/shm``
where it exists); the worker maps it into memory once, and every heartbeat is a single
40-byte store of (``CLOCK_MONOTONIC`` in ns, step, pid, last loss): no system call, no
lock, no network, well under a microsecond. The agent reads the file once a second, shows
step, step rate and loss in ds-run's live view, and treats a worker whose heartbeats stop
for ``--hang_timeout`` seconds as hung. A worker that never calls ``heartbeat`` is never
considered hung; outside ds-run the call does nothing. The engine beats at every
micro-batch and reports its loss at every optimizer step.

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

from deepshard import contract

RECORD = struct.Struct("<qqqqd")
"""(monotonic ns of the last beat, step or -1, pid of the beating process, 1 when a loss
was reported else 0, that loss); 0 ns = never beaten. The pid is where the agent sends
:data:`STACK_DUMP_SIGNAL`: the worker's own process may be a wrapper (a shell, a
launcher) that never registered the handler."""
CHECKPOINT = struct.Struct("<q")
"""After :data:`RECORD`: 1 + the step of the last complete checkpoint this worker wrote
(0: none), which tells ds-run ``--elastic_training`` when a returning host may join."""
FILE_SIZE = RECORD.size + CHECKPOINT.size
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
            self._map = mmap.mmap(fd, FILE_SIZE)
        finally:
            os.close(fd)
        self._pid = os.getpid()
        self._loss: float | None = None

    def beat(self, step: int, loss: float | None) -> None:
        if loss is not None:
            self._loss = loss
        last = self._loss
        RECORD.pack_into(self._map, 0, time.monotonic_ns(), step, self._pid,
                         0 if last is None else 1, 0.0 if last is None else last)

    def checkpointed(self, step: int) -> None:
        CHECKPOINT.pack_into(self._map, RECORD.size, step + 1)


@functools.cache
def _beater(path: str) -> _Beater | None:
    try:
        beater = _Beater(path)
    except (OSError, ValueError):
        return None  # not under a deepshard agent, or its file is gone: nothing to mark
    register_stack_dump()
    return beater


def heartbeat(step: int | None = None, loss: float | None = None) -> None:
    """Mark this worker alive at ``step`` (the engine calls it every micro-batch); a
    ``loss`` is shown in ds-run's live view until another is reported (``None`` keeps the
    last one)."""
    path = os.environ.get(contract.HEARTBEAT_FILE)
    if path:
        beater = _beater(path)
        if beater is not None:
            beater.beat(-1 if step is None else step, None if loss is None else float(loss))


def checkpoint_saved(step: int) -> None:
    """Tell the launcher that a complete checkpoint of ``step`` exists (the engine calls it
    once ``save_checkpoint`` has committed one; a script that saves its own checkpoints
    may call it too). ``ds-run --elastic_training`` grows the job back at such a point."""
    path = os.environ.get(contract.HEARTBEAT_FILE)
    if path:
        beater = _beater(path)
        if beater is not None:
            beater.checkpointed(step)


def report(step: int, loss: float | None = None) -> None:
    """A training loop's own progress for ds-run's live view (step, step rate, loss): what
    the engine reports by itself, for scripts that train without it. Also a heartbeat."""
    heartbeat(step, loss)


def _after_fork() -> None:
    _beater.cache_clear()  # a forked child is another process: map again, with its pid


os.register_at_fork(after_in_child=_after_fork)


def read_heartbeat(path: str) -> tuple[int, int, int, float | None]:
    """(monotonic ns of the last beat or 0, step or -1, pid or 0, last loss or None): the
    agent's side."""
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, RECORD.size, 0)
    finally:
        os.close(fd)
    if len(data) != RECORD.size:
        return 0, -1, 0, None
    beat_ns, step, pid, has_loss, loss = RECORD.unpack(data)
    return beat_ns, step, pid, loss if has_loss else None


def read_checkpoint(path: str) -> int:
    """The step of the last complete checkpoint the worker reported, or -1."""
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, CHECKPOINT.size, RECORD.size)
    finally:
        os.close(fd)
    return CHECKPOINT.unpack(data)[0] - 1 if len(data) == CHECKPOINT.size else -1
