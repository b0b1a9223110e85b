"""What the engine reports about each optimizer step: the step's loss, its wall-clock
breakdown, and the events of the enabled monitors.

:class:`EngineMonitor` is called by :class:`~deepshard.runtime.engine.DeepShardEngine` at
five points: around the forward, backward and step (``begin``/``end``), with each loss
``engine.backward`` sees (:meth:`EngineMonitor.record_loss`), and at the end of each
optimizer step (:meth:`EngineMonitor.step_loss`, :meth:`EngineMonitor.after_step`).

- **loss**: the micro-batch losses are summed as a detached tensor (no device sync per
  micro-batch) and read once per optimizer step: this rank's mean for the launcher's
  heartbeat (on CUDA: the previous step's value, through a non-blocking copy, so the step
  never waits for the device), and, only when a monitor is enabled, the mean over the
  data-parallel group (one all-reduce of a scalar) for ``Train/Samples/train_loss``.
- **wall_clock_breakdown**: forward, backward (with its autograd part, ``bwd_inner``, and
  the rest, ``bwd_allreduce``) and step times of each optimizer step (summed over its
  micro-batches, in ms); rank 0 logs ``time (ms) | fwd: .. | bwd: .. | bwd_inner: .. |
  bwd_allreduce: .. | step: ..`` (DeepSpeed's line; the mean per step since the last one) every
  ``steps_per_print`` steps, every step when that is unset as DeepSpeed does.
- **events** (rank 0, at every optimizer step, step = global samples after it):
  DeepSpeed's ``Train/Samples/lr`` (the first group's lr after the scheduler stepped),
  ``Train/Samples/loss_scale`` (fp16; an integral scale as an int, ``65536``, which is
  what DeepSpeed writes until its scale first changes), then deepshard's
  ``Train/Samples/train_loss``,
  ``Train/Samples/grad_norm`` (the global gradient norm, before clipping),
  ``Train/Samples/step_time_ms`` (first forward of the step to the end of its optimizer
  step) and ``Train/Samples/samples_per_second``; with ``wall_clock_breakdown`` also
  DeepSpeed's ``Train/Samples/elapsed_time_ms_forward``, ``_backward``,
  ``_backward_inner``, ``_backward_allreduce`` and ``_step``.

The pipeline engine records its last stage's micro-batch losses here (for the heartbeat)
and writes ``train_loss`` itself, from the mean ``train_batch`` returns on every stage
(:meth:`EngineMonitor.write_train_loss`), as DeepSpeed's pipeline engine does.
"""

from __future__ import annotations

import atexit
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from deepshard.runtime.extensions import Event, EventSink

logger = logging.getLogger("deepshard")

TIMERS = ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")
"""DeepSpeed's global timers, in its order. ``bwd_allreduce`` is derived: ``bwd`` less
``bwd_inner`` (autograd), i.e. the strategy's part of the backward that autograd did not
overlap (the reduction left at its end)."""
EVENT_OF_TIMER = {"fwd": "forward", "bwd": "backward", "bwd_inner": "backward_inner",
                  "bwd_allreduce": "backward_allreduce", "step": "step"}


class StepTimers:
    """Wall-clock time of forward, backward and step within each optimizer step (ms)."""

    def __init__(self, device: torch.device):
        self._sync = device.type == "cuda"
        self._started: dict[str, float] = {}
        self.step = dict.fromkeys(TIMERS, 0.0)
        """This step's times so far."""
        self.last = dict.fromkeys(TIMERS, 0.0)
        """The last finished step's times."""
        self._since_print = dict.fromkeys(TIMERS, 0.0)
        self._steps_since_print = 0

    def begin(self, name: str) -> None:
        if self._sync:
            torch.cuda.synchronize()
        self._started[name] = time.perf_counter()

    def end(self, name: str) -> None:
        started = self._started.pop(name, None)
        if started is None:
            return
        if self._sync:
            torch.cuda.synchronize()
        self.step[name] += (time.perf_counter() - started) * 1000.0

    def finish_step(self) -> None:
        self.step["bwd_allreduce"] = max(0.0, self.step["bwd"] - self.step["bwd_inner"])
        self.last = self.step
        self.step = dict.fromkeys(TIMERS, 0.0)
        for name in TIMERS:
            self._since_print[name] += self.last[name]
        self._steps_since_print += 1

    def line(self) -> str:
        """DeepSpeed's ``time (ms) | fwd: .. | ..`` line: the mean per step since the
        previous line (which it starts counting again)."""
        n = max(1, self._steps_since_print)
        text = "time (ms)" + "".join(f" | {name}: {self._since_print[name] / n:.2f}"
                                     for name in TIMERS)
        self._since_print = dict.fromkeys(TIMERS, 0.0)
        self._steps_since_print = 0
        return text


class EngineMonitor:
    """One engine's step loss, timers and monitor events (see the module docstring).

    Args:
        config: the engine's config (``wall_clock_breakdown``, ``steps_per_print``, the
            monitor sections).
        rank: global rank (only rank 0 writes and logs).
        group: the data-parallel process group the loss is averaged over (None: the
            default group).
        dp_world: that group's size.
        device: the training device (CUDA: timers synchronise, the heartbeat loss is
            read without a sync).
        sink: where the events go (the monitor feature's ``MonitorMaster`` over the
            config's monitor sections: :meth:`~deepshard.runtime.extensions.Extensions.
            event_sink`).
    """

    def __init__(self, config, rank: int, group, dp_world: int, device: torch.device,
                 sink: EventSink):
        self._config, self.rank = config, rank
        self._group, self._dp_world, self._device = group, dp_world, device
        self.master = sink
        self.timers = StepTimers(device) if config.wall_clock_breakdown else None
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._step_mean: torch.Tensor | None = None
        self._pending: tuple[torch.Tensor, Any] | None = None  # CUDA: host copy, event
        self._iter_start: float | None = None
        self.loss_by_caller = False
        """True when the engine writes ``train_loss`` itself (:meth:`write_train_loss`):
        the pipeline engine, whose loss is averaged and broadcast over all stages."""
        if self.master.monitors:
            atexit.register(self.close)

    @property
    def enabled(self) -> bool:
        """Whether any monitor is enabled (on every rank alike)."""
        return self.master.enabled

    # -- the engine's calls ----------------------------------------------------------------
    def begin(self, name: str) -> None:
        """Start timer ``name`` (``fwd``, ``bwd``, ``step``); the step's clock starts at its
        first call."""
        if self._iter_start is None:
            self._iter_start = time.perf_counter()
        if self.timers is not None:
            self.timers.begin(name)

    def end(self, name: str) -> None:
        """Stop timer ``name``."""
        if self.timers is not None:
            self.timers.end(name)

    def timed(self, name: str, fn: Callable[[], None]) -> Callable[[], None]:
        """``fn`` under timer ``name`` (``fn`` itself when not timing)."""
        timers = self.timers
        if timers is None:
            return fn

        def run() -> None:
            timers.begin(name)
            try:
                fn()
            finally:
                timers.end(name)
        return run

    def record_loss(self, loss: torch.Tensor) -> None:
        """Add a micro-batch's loss (detached; no device sync)."""
        value = loss.detach().float()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_count += 1

    def step_loss(self) -> float | None:
        """This rank's mean loss of the step just applied, for the heartbeat (None when
        ``engine.backward`` saw no loss); it starts the next step's sum. On CUDA: the
        latest step whose value has reached the host without waiting (None if none)."""
        if self._loss_sum is None:
            self._step_mean = None
            return None
        self._step_mean = self._loss_sum / self._loss_count
        self._loss_sum, self._loss_count = None, 0
        if self._step_mean.device.type != "cuda":
            return float(self._step_mean)
        return self._host_loss(self._step_mean)

    def _host_loss(self, mean: torch.Tensor) -> float | None:
        ready = None
        if self._pending is not None and self._pending[1].query():
            ready = float(self._pending[0])
            self._pending = None
        if self._pending is None:
            host = torch.empty((), dtype=torch.float32, pin_memory=True)
            host.copy_(mean, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending = (host, event)
        return ready

    def after_step(self, engine) -> None:
        """At the end of an optimizer step (counters updated): the timer line and the
        monitor events. Collective over the data-parallel group when a monitor is
        enabled and the step had a loss."""
        step_ms = None
        if self._iter_start is not None:
            step_ms = (time.perf_counter() - self._iter_start) * 1000.0
            self._iter_start = None
        if self.timers is not None:
            self.timers.finish_step()
            every = self._config.steps_per_print
            if self.rank == 0 and (not every or engine.global_steps % every == 0):
                logger.info("%s", self.timers.line())
        if self.master.enabled:
            train_loss = None if self.loss_by_caller else self._global_loss()
            if self.rank == 0:
                self.master.write_events(self.events(engine, train_loss, step_ms))

    def write_train_loss(self, mean: torch.Tensor, samples: int) -> None:
        """Rank 0, monitor enabled: ``Train/Samples/train_loss`` of a mean the caller has
        already averaged over the batch (read only then: no sync otherwise)."""
        if self.master.enabled and self.rank == 0:
            self.master.write_events([("Train/Samples/train_loss", float(mean), samples)])

    def _global_loss(self) -> float | None:
        mean = self._step_mean
        if mean is None:
            return None
        if self._dp_world > 1:
            mean = mean.clone()
            dist.all_reduce(mean, group=self._group)
            mean /= self._dp_world
        return float(mean)

    def events(self, engine, train_loss: float | None, step_ms: float | None
               ) -> list[Event]:
        """The events of the step just finished (see the module docstring)."""
        samples = engine.global_samples
        lrs = engine.get_lr()
        found: list[Event] = []
        if lrs:
            found.append(("Train/Samples/lr", lrs[0], samples))
        if engine.loss_scaler is not None:
            scale = engine.loss_scaler.loss_scale
            found.append(("Train/Samples/loss_scale",
                          int(scale) if float(scale).is_integer() else scale, samples))
        if train_loss is not None:
            found.append(("Train/Samples/train_loss", train_loss, samples))
        if engine.get_global_grad_norm() is not None:
            found.append(("Train/Samples/grad_norm", engine.get_global_grad_norm(), samples))
        if step_ms is not None:
            found.append(("Train/Samples/step_time_ms", step_ms, samples))
            found.append(("Train/Samples/samples_per_second",
                          engine.train_batch_size() * 1000.0 / max(step_ms, 1e-9), samples))
        if self.timers is not None:
            found.extend((f"Train/Samples/elapsed_time_ms_{EVENT_OF_TIMER[name]}",
                          self.timers.last[name], samples) for name in TIMERS)
        return found

    def wall_clock_timers(self) -> dict[str, float]:
        """The last optimizer step's times in ms (:data:`TIMERS`); empty without
        ``wall_clock_breakdown``."""
        return dict(self.timers.last) if self.timers is not None else {}

    def close(self) -> None:
        """Close the monitors (idempotent)."""
        self.master.close()
