"""The ``csv_monitor``: one CSV file per event name, as DeepSpeed 0.19.8 writes them.

``<output_path>/<job_name>/<name with '/' and ' ' as '_'>.csv`` (``Train/Samples/lr`` ->
``Train_Samples_lr.csv``), opened for appending at each event; the first event of a name
in this process writes the header ``step,<last part of the name>``; every event is a row
``<step>,<value>`` through :mod:`csv` (so lines end in ``\\r\\n`` and floats are Python's
shortest repr, ``0.0001``). A second run into the same directory appends, header and all,
as DeepSpeed does.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterable
from typing import Any

from deepshard.monitor.base import Event, Monitor


class csvMonitor(Monitor):  # DeepSpeed's class name
    """CSV files under ``<output_path>/<job_name>`` (made at construction)."""

    def __init__(self, csv_config: Any):
        super().__init__(csv_config)
        self.filenames: list[str] = []
        self.enabled = csv_config.enabled
        self.output_path = csv_config.output_path
        self.job_name = csv_config.job_name
        self.log_dir = self.setup_log_dir()

    def setup_log_dir(self) -> str:
        """Make and return ``<output_path>/<job_name>``."""
        log_dir = os.path.join(self.output_path, self.job_name)
        os.makedirs(log_dir, exist_ok=True)
        return log_dir

    def write_events(self, event_list: Iterable[Event]) -> None:
        """Append one row per event to its name's file."""
        for log_name, value, step in event_list:
            header = log_name.split("/")[-1]
            filename = log_name.replace("/", "_").replace(" ", "_")
            with open(os.path.join(self.log_dir, filename + ".csv"), "a+") as f:
                writer = csv.writer(f)
                if filename not in self.filenames:
                    self.filenames.append(filename)
                    writer.writerow(["step", header])
                writer.writerow([step, value])
