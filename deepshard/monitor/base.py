"""The interface every monitor implements (DeepSpeed's ``Monitor``) and the event type.

An event is DeepSpeed's tuple ``(name, value, step)``: a tag such as
``"Train/Samples/lr"``, a Python number, and the global sample count as the step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

Event = tuple[str, Any, int]
"""(name, value, global samples)."""


class Monitor(ABC):
    """A destination for events."""

    def __init__(self, monitor_config: Any):
        self.monitor_config = monitor_config

    @abstractmethod
    def write_events(self, event_list: Iterable[Event]) -> None:
        """Record ``event_list``, in order."""

    def close(self) -> None:
        """Flush and release what the monitor holds (files, a run); idempotent. The
        default holds nothing."""
        return None
