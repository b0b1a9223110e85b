"""The ``wandb`` monitor: ``wandb.init(project=, group=, entity=team)`` on rank 0, then
``wandb.log({name: value}, step=global_samples)`` per event (DeepSpeed's calls).

``WANDB_MODE=offline`` keeps the run in ``./wandb`` with no network. The run is finished
at :meth:`WandbMonitor.close` (the engine's ``destroy``, or interpreter exit), which also
stops wandb's background service process.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from deepshard.errors import UsageError
from deepshard.monitor.base import Event, Monitor
from deepshard.monitor.utils import require


class WandbMonitor(Monitor):
    """A wandb run.

    Raises:
        UsageError: the wandb package is not installed, or wandb cannot start a run (no
            API key in online mode).
    """

    def __init__(self, wandb_config: Any):
        super().__init__(wandb_config)
        self._wandb = require("wandb")
        self.enabled = wandb_config.enabled
        self.group = wandb_config.group
        self.team = wandb_config.team
        self.project = wandb_config.project
        try:
            self.run = self._wandb.init(project=self.project, group=self.group,
                                        entity=self.team)
        except self._wandb.errors.Error as exc:  # e.g. no API key: wandb's own UsageError
            raise UsageError(f"wandb could not start a run: {exc}", where="wandb.enabled",
                             hint="run `wandb login` (or set WANDB_API_KEY), or set "
                                  "WANDB_MODE=offline to keep the run local") from None

    def log(self, data: dict, step: int | None = None, commit: bool | None = None):
        """``wandb.log``."""
        if self.run is not None:
            return self.run.log(data, step=step, commit=commit)
        return None

    def write_events(self, event_list: Iterable[Event]) -> None:
        """``log({name: value}, step=step)`` per event."""
        for label, value, step in event_list:
            self.log({label: value}, step=step)

    def close(self) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish()
