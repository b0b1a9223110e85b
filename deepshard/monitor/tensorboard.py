"""The ``tensorboard`` monitor: ``SummaryWriter.add_scalar(name, value, step)`` per event
into ``<output_path>/<job_name>``, flushed after each batch of events (DeepSpeed's)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from deepshard.monitor.base import Event, Monitor
from deepshard.monitor.utils import require


class TensorBoardMonitor(Monitor):
    """A ``torch.utils.tensorboard.SummaryWriter`` on ``<output_path>/<job_name>``.

    Raises:
        UsageError: the tensorboard package is not installed.
    """

    def __init__(self, tensorboard_config: Any):
        super().__init__(tensorboard_config)
        require("tensorboard")
        self.enabled = tensorboard_config.enabled
        self.output_path = tensorboard_config.output_path
        self.job_name = tensorboard_config.job_name
        self.summary_writer = None
        self.get_summary_writer()

    def get_summary_writer(self):
        """The writer (made on first call, with its directory)."""
        if self.summary_writer is None:
            from torch.utils.tensorboard import SummaryWriter

            log_dir = os.path.join(self.output_path, self.job_name)
            os.makedirs(log_dir, exist_ok=True)
            self.summary_writer = SummaryWriter(log_dir=log_dir)
        return self.summary_writer

    def write_events(self, event_list: Iterable[Event], flush: bool = True) -> None:
        """One scalar per event; then flush, unless ``flush`` is false."""
        if self.summary_writer is None:
            return
        for event in event_list:
            self.summary_writer.add_scalar(*event)
        if flush:
            self.summary_writer.flush()

    def flush(self) -> None:
        """Write buffered events to disk."""
        if self.summary_writer is not None:
            self.summary_writer.flush()

    def close(self) -> None:
        if self.summary_writer is not None:
            self.summary_writer.close()
            self.summary_writer = None
