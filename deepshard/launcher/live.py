"""The live view: one row per rank (host, state, step, heartbeat age, RSS, CPU, GPU memory),
redrawn in place while worker output scrolls above it. Used when stdout is a terminal;
elsewhere ds-run prints plain ``[host:rank]`` lines."""

from __future__ import annotations

import io
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TextIO

from ..contract import GpuStats, WorkerStats
from .plan import LaunchPlan

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


class LiveView:
    """A rich ``Live`` table fed by the agents' ``alive`` and ``exited`` events."""

    def __init__(self, plan: LaunchPlan, stream: TextIO, title: str = ""):
        from rich.console import Console  # rich costs ~70 ms: only for a terminal
        from rich.live import Live

        self.plan = plan
        self.title = title
        self._lock = threading.Lock()
        self._rows: dict[int, dict[str, object]] = {}
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
        with self._lock:
            for rank, stats in workers.items():
                row = self._rows.setdefault(rank, {"host": host})
                row.update(step=stats.step, beat_age=stats.beat_age, state="running")
                if stats.rss is not None or stats.cpu is not None:  # else: the last ones read
                    row.update(rss=stats.rss, cpu=stats.cpu)
                device = self._device.get(rank)
                gpu = by_index.get(device) if device is not None else None
                row["gpu_mem"] = gpu.mem_used if gpu else None
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
        for column in ("rank", "host", "state", "step", "heartbeat", "RSS", "CPU", "GPU mem"):
            table.add_column(column, justify="right" if column != "host" else "left")
        with self._lock:
            for rank in sorted(self._rows):
                row = self._rows[rank]
                step = row.get("step")
                age = row.get("beat_age")
                cpu = row.get("cpu")
                table.add_row(
                    str(rank), str(row.get("host", "?")), str(row.get("state", "?")),
                    "-" if step in (None, -1) else str(step),
                    "-" if age is None else f"{age:.1f} s ago",
                    _bytes(row.get("rss")),
                    "-" if cpu is None else f"{cpu:.0f}%",
                    _bytes(row.get("gpu_mem")))
        return table
