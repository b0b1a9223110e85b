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

Step times, for ds-run's straggler detection: a beat that moves to a new step appends
(step, wall time since the previous step ended, own work before arriving) to a small ring in
the same file, which the agent drains once a second. "Arriving" is :func:`arrive`: the rank
has done its own work of the step and enters its synchronisation (the gradient all-reduce).
Under synchronous data parallelism every rank's step takes the same wall time (the
collective waits for the slowest), so only the time *before* arriving tells the straggler
apart; a worker that never calls :func:`arrive` reports its step time only.

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
STEPS = struct.Struct("<q")
"""After :data:`CHECKPOINT`: how many :data:`STEP_RECORD` s were ever written; record ``i``
is in slot ``i % RING``."""
STEP_RECORD = struct.Struct("<qqqq")
"""(step, ns since the previous step ended, ns of own work from then until :func:`arrive`
or -1, step again): the step is written twice, so that a reader can tell a torn record."""
RING = 64
"""Step records kept: the agent reads every second, so steps faster than 64/s are sampled."""
_STEPS_AT = RECORD.size + CHECKPOINT.size
FILE_SIZE = _STEPS_AT + STEPS.size + RING * STEP_RECORD.size
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
            # an older agent's file has no step ring: beat without recording step times
            size = min(FILE_SIZE, os.fstat(fd).st_size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._timed = size == FILE_SIZE
        self._pid = os.getpid()
        self._loss: float | None = None
        self._step = -1
        self._step_end = 0  # monotonic ns when the step last moved on; 0: not yet
        self._arrived = 0  # monotonic ns of the first arrive() since then; 0: none
        self._records = 0

    def beat(self, step: int, loss: float | None) -> None:
        if loss is not None:
            self._loss = loss
        last = self._loss
        now = time.monotonic_ns()
        RECORD.pack_into(self._map, 0, now, step, self._pid,
                         0 if last is None else 1, 0.0 if last is None else last)
        if step != self._step and step >= 0 and self._timed:
            if self._step_end and step > self._step:
                busy = self._arrived - self._step_end if self._arrived else -1
                STEP_RECORD.pack_into(self._map, _STEPS_AT + STEPS.size
                                      + self._records % RING * STEP_RECORD.size,
                                      step, now - self._step_end, busy, step)
                self._records += 1
                STEPS.pack_into(self._map, _STEPS_AT, self._records)  # last: publishes it
            self._step, self._step_end, self._arrived = step, now, 0

    def arrive(self) -> None:
        if not self._arrived:
            self._arrived = time.monotonic_ns()

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


def arrive() -> None:
    """Mark that this worker has done its own work of the current step and now enters the
    step's synchronisation (call it just before the gradient all-reduce; the engine does).
    ds-run compares the time from the end of the previous step to here across ranks to
    find a straggler (``--straggler_factor``); only the first call of a step counts.
    Outside ds-run it does nothing."""
    path = os.environ.get(contract.HEARTBEAT_FILE)
    if path:
        beater = _beater(path)
        if beater is not None:
            beater.arrive()


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


def read_steps(path: str, after: int) -> tuple[int, list[tuple[int, int, int]]]:
    """(how many step records the worker has written, its records numbered ``after`` and
    up that are still in the ring, as (step, step ns, own-work ns or -1)): the agent's
    side. Torn records (being overwritten while read) are left out."""
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, FILE_SIZE - _STEPS_AT, _STEPS_AT)
    finally:
        os.close(fd)
    if len(data) != FILE_SIZE - _STEPS_AT:
        return after, []
    (count,) = STEPS.unpack_from(data, 0)
    found = []
    for i in range(max(after, count - RING), count):
        step, step_ns, busy_ns, again = STEP_RECORD.unpack_from(
            data, STEPS.size + i % RING * STEP_RECORD.size)
        if step == again and step_ns > 0:
            found.append((step, step_ns, busy_ns))
    return count, found


def read_checkpoint(path: str) -> int:
    """The step of the last complete checkpoint the worker reported, or -1."""
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, CHECKPOINT.size, RECORD.size)
    finally:
        os.close(fd)
    return CHECKPOINT.unpack(data)[0] - 1 if len(data) == CHECKPOINT.size else -1
