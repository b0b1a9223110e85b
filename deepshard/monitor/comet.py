"""The ``comet`` monitor: ``comet_ml.start(...)`` with the section's keys on rank 0, then
each event as a metric at ``step=global_samples``, a name logged again only once
``samples_log_interval`` more samples have passed (DeepSpeed's ``EventsLogScheduler``).

``online: false`` makes an offline experiment (an archive under ``COMET_OFFLINE_DIRECTORY``,
default ``./.cometml-runs``), no network needed. The experiment is ended at
:meth:`CometMonitor.close`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from deepshard.errors import UsageError
from deepshard.monitor.base import Event, Monitor
from deepshard.monitor.utils import require


class CometMonitor(Monitor):
    """A Comet experiment.

    Raises:
        UsageError: comet_ml (>= 3.41) is not installed, or it cannot start an
            experiment (online without an API key).
    """

    def __init__(self, comet_config: Any):
        super().__init__(comet_config)
        comet_ml = require("comet")
        self.enabled = comet_config.enabled
        self._samples_log_interval = comet_config.samples_log_interval
        try:
            self._experiment = comet_ml.start(
                api_key=comet_config.api_key, project=comet_config.project,
                workspace=comet_config.workspace, experiment_key=comet_config.experiment_key,
                mode=comet_config.mode, online=comet_config.online)
        except ValueError as exc:  # e.g. online without an API key
            raise UsageError(f"comet could not start an experiment: {exc}".strip(),
                             where="comet.enabled",
                             hint="set comet.api_key or COMET_API_KEY, or comet.online to "
                                  "false for an offline experiment") from None
        if comet_config.experiment_name is not None:
            self._experiment.set_name(comet_config.experiment_name)
        self._events_log_scheduler = EventsLogScheduler(comet_config.samples_log_interval)

    @property
    def experiment(self):
        """The ``comet_ml`` experiment (None once closed)."""
        return self._experiment

    @property
    def samples_log_interval(self) -> int:
        return self._samples_log_interval

    def write_events(self, event_list: Iterable[Event]) -> None:
        """Log each event due by ``samples_log_interval`` as a metric."""
        if self._experiment is None:
            return
        for name, value, samples in event_list:
            if self._events_log_scheduler.needs_logging(name, samples):
                self._experiment.log_metric(name, value, step=samples)

    def close(self) -> None:
        if self._experiment is not None:
            experiment, self._experiment = self._experiment, None
            experiment.end()


class EventsLogScheduler:
    """Whether a name is due: its first event always, later ones once ``samples_log_interval``
    samples have passed since it was last logged."""

    def __init__(self, samples_log_interval: int):
        self._samples_log_interval = samples_log_interval
        self._last_logged_events_samples: dict[str, int] = {}

    def needs_logging(self, name: str, current_sample: int) -> bool:
        """True (and remember ``current_sample``) when ``name`` is due."""
        last = self._last_logged_events_samples.get(name)
        if last is None or current_sample - last >= self._samples_log_interval:
            self._last_logged_events_samples[name] = current_sample
            return True
        return False
