"""The monitors' hook into the runtime (the ``deepshard.extensions`` entry point
``monitor``): the engine writes its events to a
:class:`~deepshard.monitor.monitor.MonitorMaster` over the config's ``tensorboard``,
``wandb``, ``csv_monitor`` and ``comet`` sections."""

from __future__ import annotations

from typing import Any

from deepshard.runtime.extensions import EventSink, Extension


def _event_sink(monitor_config: Any, rank: int) -> EventSink:
    from deepshard.monitor.monitor import MonitorMaster

    return MonitorMaster(monitor_config, rank)


EXTENSION = Extension(name="monitor", event_sink=_event_sink)
