"""DeepSpeed's ``deepspeed.utils.timer``: named wall-clock timers and a throughput meter, for
scripts that time their own phases the way DeepSpeed's engine times its own.

``timers = SynchronizedWallClockTimer(); timers("fwd").start(); ...; timers("fwd").stop();
timers.log(["fwd"])`` logs ``time (ms) | fwd: 12.34`` on rank 0. Each start and stop
synchronizes the accelerator first (a no-op on CPU), so a timer measures the work queued
before it stops, not just its launch. :class:`ThroughputTimer` counts samples per second
over optimizer steps. The engine's own ``wall_clock_breakdown`` timers are
:class:`deepshard.runtime.engine_monitor.StepTimers`; the names below are the ones it
reports (``FORWARD_GLOBAL_TIMER`` is ``"fwd"``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from deepshard.accelerator import get_accelerator
from deepshard.comm.logger import trim_mean
from deepshard.errors import UsageAssertionError
from deepshard.runtime.logs import print_dist

logger = logging.getLogger("deepshard")

FORWARD_MICRO_TIMER = "fwd_microstep"
FORWARD_GLOBAL_TIMER = "fwd"
BACKWARD_MICRO_TIMER = "bwd_microstep"
BACKWARD_GLOBAL_TIMER = "bwd"
BACKWARD_INNER_MICRO_TIMER = "bwd_inner_microstep"
BACKWARD_INNER_GLOBAL_TIMER = "bwd_inner"
BACKWARD_REDUCE_MICRO_TIMER = "bwd_allreduce_microstep"
BACKWARD_REDUCE_GLOBAL_TIMER = "bwd_allreduce"
STEP_MICRO_TIMER = "step_microstep"
STEP_GLOBAL_TIMER = "step"
TIME_EPSILON = 1e-6
"""Seconds added to a step's duration before dividing by it."""
PSUTILS_INSTALLED = True
"""psutil is one of deepshard's dependencies (``ThroughputTimer(monitor_memory=True)``)."""

GIB = 1024**3


class _Timer:
    """One named timer: the durations between its starts and stops, in ms."""

    def __init__(self, name: str):
        self.name_ = name
        self.started_ = False
        self.start_time = 0.0
        self.records: list[float] = []
        """Durations of the stopped intervals since the last reset, in ms."""

    def start(self) -> None:
        """Start an interval.

        Raises:
            UsageAssertionError: it is already running.
        """
        if self.started_:
            raise UsageAssertionError(f"timer {self.name_!r} has already been started",
                                      where="SynchronizedWallClockTimer",
                                      hint="stop() it before starting it again")
        get_accelerator().synchronize()
        self.start_time = time.perf_counter()
        self.started_ = True

    def stop(self, reset: bool = False, record: bool = False) -> None:
        """End the running interval (``reset``/``record``: DeepSpeed's arguments, unused).

        Raises:
            UsageAssertionError: it is not running.
        """
        del reset, record
        if not self.started_:
            raise UsageAssertionError(f"timer {self.name_!r} is not started",
                                      where="SynchronizedWallClockTimer",
                                      hint="start() it before stopping it")
        get_accelerator().synchronize()
        self.records.append((time.perf_counter() - self.start_time) * 1000.0)
        self.started_ = False

    def reset(self) -> None:
        """Forget the intervals (and a running one)."""
        self.started_ = False
        self.records.clear()

    def elapsed(self, reset: bool = True) -> float:
        """The total of the intervals in ms, a running one included up to now (and left
        running); ``reset`` forgets them after."""
        running = self.started_
        if running:
            self.stop()
        total = sum(self.records)
        if reset:
            self.reset()
        if running:
            self.start()
        return total

    def mean(self) -> float:
        """The intervals' mean in ms, the lowest and highest 10% left out."""
        self.elapsed(reset=False)
        return trim_mean(self.records, 0.1)


class SynchronizedWallClockTimer:
    """Named timers, created on first use: ``timers("fwd").start()`` (see the module
    docstring)."""

    Timer = _Timer

    def __init__(self) -> None:
        self.timers: dict[str, _Timer] = {}

    def __call__(self, name: str) -> _Timer:
        if name not in self.timers:
            self.timers[name] = self.Timer(name)
        return self.timers[name]

    def get_timers(self) -> dict[str, _Timer]:
        """Every timer by name."""
        return self.timers

    @staticmethod
    def memory_usage() -> str:
        """`` | mem_allocated: .. GB | max_mem_allocated: .. | cache_allocated: .. |
        max_cache_allocated: ..`` of the current device."""
        acc = get_accelerator()
        values = (("mem_allocated", acc.memory_allocated()),
                  ("max_mem_allocated", acc.max_memory_allocated()),
                  ("cache_allocated", acc.memory_cached()),
                  ("max_cache_allocated", acc.max_memory_cached()))
        return "".join(f" | {name}: {value / GIB:.4f} GB" for name, value in values)

    def log(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True,
            memory_breakdown: bool = False, ranks: Sequence[int] | None = None) -> None:
        """Print ``time (ms) | name: ms | ...`` for the named timers that exist, each
        divided by ``normalizer``, on ``ranks`` (default rank 0); ``memory_breakdown``
        appends :meth:`memory_usage`."""
        text = "time (ms)" + "".join(
            f" | {name}: {self.timers[name].elapsed(reset=reset) / _positive(normalizer):.2f}"
            for name in names if name in self.timers)
        if memory_breakdown:
            text += self.memory_usage()
        print_dist(text, ranks=ranks or [0])

    def get_mean(self, names: Iterable[str], normalizer: float = 1.0,
                 reset: bool = True) -> dict[str, float]:
        """The trimmed mean interval of each named timer that exists, in ms, divided by
        ``normalizer`` (DeepSpeed 0.19.8 multiplies its ms by 1000 once more).
        ``reset`` is accepted; the intervals are kept."""
        del reset
        return {name: self.timers[name].mean() / _positive(normalizer)
                for name in names if name in self.timers}


class _NoopTimerOne:
    """A timer that measures nothing."""

    def start(self) -> None:
        """Nothing."""

    def reset(self) -> None:
        """Nothing."""

    def stop(self, **kwargs: Any) -> None:
        """Nothing."""

    def elapsed(self, **kwargs: Any) -> float:
        """Always 0."""
        return 0

    def mean(self) -> float:
        """Always 0."""
        return 0


class NoopTimer:
    """:class:`SynchronizedWallClockTimer`'s interface, measuring nothing (the engine's
    timers when ``wall_clock_breakdown`` is off)."""

    Timer = _NoopTimerOne

    def __init__(self) -> None:
        self.timer = self.Timer()

    def __call__(self, name: str) -> _NoopTimerOne:
        return self.timer

    def get_timers(self) -> dict[str, Any]:
        """No timers."""
        return {}

    def log(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True,
            memory_breakdown: bool = False, ranks: Sequence[int] | None = None) -> None:
        """Nothing."""

    def get_mean(self, names: Iterable[str], normalizer: float = 1.0,
                 reset: bool = True) -> None:
        """Nothing."""


def _positive(normalizer: float) -> float:
    if not normalizer > 0:
        raise UsageAssertionError(f"normalizer must be positive, got {normalizer!r}",
                                  where="SynchronizedWallClockTimer",
                                  hint="pass the number of steps the timers covered")
    return normalizer


class ThroughputTimer:
    """Samples per second over optimizer steps, from step ``start_step`` on.

    Call :meth:`start` before each micro-step and :meth:`stop` after it (``global_step``
    on the micro-step that ends an optimizer step); every ``steps_per_output`` optimizer
    steps a line with the running and current samples per second is logged through
    ``logging_fn`` (default: the ``deepshard`` logger's ``info``).

    Args:
        config: an object with ``enabled`` and ``synchronized`` (DeepSpeed's
            ``timers.throughput`` section).
        batch_size: samples per optimizer step (``None``: 1).
        monitor_memory: also log the host's virtual memory and swap use.
    """

    def __init__(self, config: Any, batch_size: int | None, start_step: int = 2,
                 steps_per_output: int | None = None, monitor_memory: bool = False,
                 logging_fn: Callable[[str], Any] | None = None):
        self.config = config
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step, self.steps_per_output = start_step, steps_per_output
        self.monitor_memory = monitor_memory
        self.logging = logging_fn or logger.info
        self.start_time = self.end_time = 0.0
        self.started = self.initialized = False
        self.epoch_count = self.micro_step_count = self.global_step_count = 0
        self.total_elapsed_time = self.step_elapsed_time = 0.0

    def update_epoch_count(self) -> None:
        """A new epoch: count it, and micro-steps from 0 again."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        """Start timing a micro-step (from ``start_step`` on)."""
        if not self.config.enabled:
            return
        self.initialized = self.started = True
        if self.global_step_count >= self.start_step:
            if self.config.synchronized:
                get_accelerator().synchronize()
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """End the micro-step; ``global_step``: it ended an optimizer step."""
        if not self.config.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        self.global_step_count += bool(global_step)
        if self.start_time <= 0:
            return
        if self.config.synchronized:
            get_accelerator().synchronize()
        self.end_time = time.time()
        duration = self.end_time - self.start_time
        self.total_elapsed_time += duration
        self.step_elapsed_time += duration
        if global_step:
            if report_speed and self.steps_per_output \
                    and self.global_step_count % self.steps_per_output == 0:
                self._report()
            self.step_elapsed_time = 0.0

    def _report(self) -> None:
        acc = get_accelerator()
        where = (f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/"
                 f"global_step={self.global_step_count}")
        self.logging(
            f"{where}, RunningAvgSamplesPerSec={self.avg_samples_per_sec()}, "
            f"CurrSamplesPerSec={self.batch_size / (self.step_elapsed_time + TIME_EPSILON)}, "
            f"MemAllocated={round(acc.memory_allocated() / GIB, 2)}GB, "
            f"MaxMemAllocated={round(acc.max_memory_allocated() / GIB, 2)}GB")
        if self.monitor_memory:
            import psutil

            self.logging(f"{where}, vm %: {psutil.virtual_memory().percent}, "
                         f"swap %: {psutil.swap_memory().percent}")

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the timed optimizer steps (``-inf`` before any)."""
        steps = self.global_step_count - self.start_step
        if self.global_step_count > 0 and steps > 0 and self.total_elapsed_time > 0:
            return self.batch_size / (self.total_elapsed_time / steps)
        return float("-inf")
