"""``MonitorMaster``, which fans events out to the enabled monitors (DeepSpeed's
``deepspeed.monitor.monitor``, which also offers ``Monitor``, the interface they share).

Only the process of global rank 0 builds monitors and writes; on other ranks a
``MonitorMaster`` holds none and ``write_events`` does nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from deepshard.monitor.base import Event, Monitor


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class MonitorMaster(Monitor):
    """The enabled monitors of a config's ``tensorboard``, ``wandb``, ``csv_monitor`` and
    ``comet`` sections, on global rank 0.

    Args:
        monitor_config: a :class:`~deepshard.config.schema_monitor.MonitorConfig`
            (``engine._config.monitor_config``, or
            :func:`deepshard.monitor.config.get_monitor_config` of a raw dict).
        rank: this process's global rank; None: torch.distributed's (0 when there is no
            process group).

    Raises:
        UsageError: an enabled monitor's package is not installed (on every rank, so a
            job does not go on logging nothing).
    """

    def __init__(self, monitor_config: Any, rank: int | None = None):
        super().__init__(monitor_config)
        from deepshard.monitor import utils

        self.enabled = monitor_config.enabled
        self.tb_monitor: Monitor | None = None
        self.wandb_monitor: Monitor | None = None
        self.csv_monitor: Monitor | None = None
        self.comet_monitor: Monitor | None = None
        for section in ("tensorboard", "wandb", "comet"):
            if getattr(monitor_config, section).enabled:
                utils.require(section)
        self.rank = _global_rank() if rank is None else rank
        if self.rank == 0:
            self._build(monitor_config)

    def _build(self, cfg: Any) -> None:
        if cfg.tensorboard.enabled:
            from deepshard.monitor.tensorboard import TensorBoardMonitor
            self.tb_monitor = TensorBoardMonitor(cfg.tensorboard)
        if cfg.wandb.enabled:
            from deepshard.monitor.wandb import WandbMonitor
            self.wandb_monitor = WandbMonitor(cfg.wandb)
        if cfg.csv_monitor.enabled:
            from deepshard.monitor.csv_monitor import csvMonitor
            self.csv_monitor = csvMonitor(cfg.csv_monitor)
        if cfg.comet.enabled:
            from deepshard.monitor.comet import CometMonitor
            self.comet_monitor = CometMonitor(cfg.comet)

    @property
    def monitors(self) -> list[Monitor]:
        """The monitors this process writes to (none off rank 0), in DeepSpeed's order."""
        found = (self.tb_monitor, self.wandb_monitor, self.csv_monitor, self.comet_monitor)
        return [m for m in found if m is not None]

    def write_events(self, event_list: Iterable[Event]) -> None:
        """Hand ``event_list`` to every monitor of this process."""
        events = list(event_list)
        for monitor in self.monitors:
            monitor.write_events(events)

    def close(self) -> None:
        """Close every monitor (the engine's ``destroy`` and interpreter exit call it)."""
        for monitor in self.monitors:
            monitor.close()


__all__ = ["Event", "Monitor", "MonitorMaster"]
