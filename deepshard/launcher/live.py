"""The live view: one row per rank (host, state, step, steps/s, loss, heartbeat age, RSS,
CPU, GPU memory), redrawn in place while worker output scrolls above it. A straggler's
state reads ``running, slow 2.3x`` (:mod:`.straggler`). Used when stdout
is a terminal; elsewhere ds-run prints plain ``[host:rank]`` lines."""

from __future__ import annotations

import io
import math
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TextIO

from deepshard.contract import GpuStats, WorkerStats
from deepshard.launcher.plan import LaunchPlan

if TYPE_CHECKING:
    from rich.table import Table


def _bytes(n: object) -> str:
    if not isinstance(n, (int, float)):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"


class StepRate:
    """Optimizer steps per second of one rank over the last ``window`` seconds, from the
    (time of its last beat, step) pairs the ``alive`` events carry."""

    def __init__(self, window: float = 30.0):
        self.window = window
        self._seen: deque[tuple[float, int]] = deque()

    def add(self, beat_time: float, step: int) -> None:
        """A beat at ``beat_time`` (monotonic seconds) at ``step``; a step seen before or a
        step below the last (a restarted worker) starts a new series when lower."""
        if step < 0:
            return
        if self._seen and step < self._seen[-1][1]:
            self._seen.clear()
        if not self._seen or step > self._seen[-1][1]:
            self._seen.append((beat_time, step))
        while len(self._seen) > 2 and self._seen[0][0] < beat_time - self.window:
            self._seen.popleft()

    def rate(self) -> float | None:
        """Steps per second, or ``None`` before two distinct steps."""
        if len(self._seen) < 2:
            return None
        (t0, s0), (t1, s1) = self._seen[0], self._seen[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else None


def _loss(value: object) -> str:
    if not isinstance(value, float):
        return "-"
    return str(value) if not math.isfinite(value) else f"{value:.4g}"


class LiveView:
    """A rich ``Live`` table fed by the agents' ``alive`` and ``exited`` events."""

    def __init__(self, plan: LaunchPlan, stream: TextIO, title: str = ""):
        from rich.console import Console  # rich costs ~70 ms: only for a terminal
        from rich.live import Live

        self.plan = plan
        self.title = title
        self._lock = threading.Lock()
        self._rows: dict[int, dict[str, object]] = {}
        self._rates: dict[int, StepRate] = {}
        self._device: dict[int, int] = {}
        for node in plan.nodes:
            slots = dict(node.env).get("CUDA_VISIBLE_DEVICES", "").split(",")
            for w in node.workers:
                self._rows[w.rank] = {"host": node.host, "state": "starting"}
                if w.local_rank < len(slots) and slots[w.local_rank].isdigit():
                    self._device[w.rank] = int(slots[w.local_rank])
        # worker output is data: no emoji codes (":fire:"), markup or highlighting
        self.console = Console(file=stream, emoji=False, markup=False, highlight=False)
        self._live = Live(self._table(), console=self.console, refresh_per_second=4,
                          transient=False, auto_refresh=True)

    def __enter__(self) -> LiveView:
        self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._live.update(self._table(), refresh=True)
        self._live.stop()

    def writer(self) -> io.TextIOBase:
        """A text stream whose lines are printed above the table."""
        view = self

        class _Writer(io.TextIOBase):
            def write(self, text: str) -> int:
                view.console.print(text.rstrip("\n"), markup=False, highlight=False,
                                   soft_wrap=True)
                return len(text)

        return _Writer()

    def update(self, host: str, workers: Mapping[int, WorkerStats],
               gpus: Sequence[GpuStats]) -> None:
        """An ``alive`` event of ``host``'s agent."""
        by_index = {g.index: g for g in gpus}
        now = time.monotonic()
        with self._lock:
            for rank, stats in workers.items():
                row = self._rows.setdefault(rank, {"host": host})
                row.update(step=stats.step, beat_age=stats.beat_age, state="running",
                           loss=stats.loss)
                if stats.beat_age is not None:
                    rate = self._rates.setdefault(rank, StepRate())
                    rate.add(now - stats.beat_age, stats.step)
                    row["rate"] = rate.rate()
                if stats.rss is not None or stats.cpu is not None:  # else: the last ones read
                    row.update(rss=stats.rss, cpu=stats.cpu)
                device = self._device.get(rank)
                gpu = by_index.get(device) if device is not None else None
                row["gpu_mem"] = gpu.mem_used if gpu else None
        self._live.update(self._table())

    def slow(self, rank: int, ratio: float | None) -> None:
        """Mark ``rank`` a straggler taking ``ratio`` times the others' time, or clear it
        (``None``); the mark stays after it exits."""
        with self._lock:
            self._rows.setdefault(rank, {})["slow"] = ratio
        self._live.update(self._table())

    def exited(self, rank: int, returncode: int) -> None:
        with self._lock:
            self._rows.setdefault(rank, {})["state"] = (
                "done" if returncode == 0 else f"exit {returncode}" if returncode > 0
                else f"signal {-returncode}")
        self._live.update(self._table())

    def _table(self) -> Table:
        from rich.table import Table

        table = Table(title=self.title or None, expand=False)
        columns = ["rank", "host", "state", "step", "steps/s", "loss", "beat", "RSS", "CPU"]
        with self._lock:
            # no GPU column until an agent reports GPU memory (CPU slots, no NVML)
            gpus = any(row.get("gpu_mem") is not None for row in self._rows.values())
            for column in columns + ["GPU mem"] * gpus:
                table.add_column(column, justify="right" if column != "host" else "left",
                                 no_wrap=True, min_width=6 if column == "host" else None,
                                 overflow="ellipsis")
            for rank in sorted(self._rows):
                row = self._rows[rank]
                step = row.get("step")
                age = row.get("beat_age")
                cpu = row.get("cpu")
                rate = row.get("rate")
                slow = row.get("slow")
                state = str(row.get("state", "?")) + (
                    f", slow {slow:.1f}x" if isinstance(slow, float) else "")
                table.add_row(
                    str(rank), str(row.get("host", "?")), state,
                    "-" if step in (None, -1) else str(step),
                    "-" if rate is None else f"{rate:.3g}",
                    _loss(row.get("loss")),
                    "-" if age is None else f"{age:.1f}s",
                    _bytes(row.get("rss")),
                    "-" if cpu is None else f"{cpu:.0f}%",
                    *[_bytes(row.get("gpu_mem"))] * gpus)
        return table
