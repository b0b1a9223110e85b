"""The monitor config sections: ``tensorboard``, ``wandb``, ``csv_monitor``, ``comet`` and
the top-level ``wall_clock_breakdown`` switch they share events with.

DeepSpeed 0.19.8's keys and defaults (``deepspeed/monitor/config.py``); :mod:`deepshard.monitor`
writes what they enable, from rank 0. :class:`MonitorConfig` is not a key of
``ds_config.json``: it groups the four sections, as DeepSpeed's ``DeepSpeedMonitorConfig``
does, for :class:`deepshard.monitor.monitor.MonitorMaster`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from deepshard.config.schema_base import (
    Bool,
    Int,
    KeyLog,
    Section,
    doc,
    one_of,
    unknown_key_error,
)


class StrictSection(Section):
    """A section whose unknown keys are errors, not warnings: DeepSpeed 0.19.8's monitor
    models forbid extra keys ("Extra inputs are not permitted"), so a config it refuses
    is refused here too, in one line with the key path."""

    @classmethod
    def coerce(cls, data: Any, log: KeyLog) -> Any:
        if isinstance(data, dict):
            known = cls.known_keys()
            for key in data:
                if key not in known:
                    raise unknown_key_error(cls, str(key), log)
        return data


class TensorBoardConfig(StrictSection):
    """``tensorboard``: scalars through ``torch.utils.tensorboard.SummaryWriter`` (needs the
    ``tensorboard`` package)."""

    enabled: Bool = doc("Write TensorBoard event files.", default=False)
    output_path: str = doc("Directory the job's directory is made in; '': the working "
                           "directory.", default="")
    job_name: str = doc("The job's directory inside output_path.", default="DeepSpeedJobName")


class WandbConfig(StrictSection):
    """``wandb``: scalars logged to Weights & Biases with ``wandb.log`` (needs ``wandb``;
    ``WANDB_MODE=offline`` keeps the run local)."""

    enabled: Bool = doc("Log to Weights & Biases.", default=False)
    group: str | None = doc("The wandb group the run joins; None: none.", default=None)
    team: str | None = doc("The wandb entity (team); None: the user's default.",
                           default=None)
    project: str = doc("The wandb project.", default="deepspeed")


class CSVConfig(StrictSection):
    """``csv_monitor``: one CSV file per scalar, ``<output_path>/<job_name>/<name>.csv``."""

    enabled: Bool = doc("Write CSV files.", default=False)
    output_path: str = doc("Directory the job's directory is made in; '': the working "
                           "directory.", default="")
    job_name: str = doc("The job's directory inside output_path.", default="DeepSpeedJobName")


CometMode = Annotated[Literal["get", "create", "get_or_create"],
                      one_of("get", "create", "get_or_create")]


class CometConfig(StrictSection):
    """``comet``: scalars logged to a Comet experiment (needs ``comet_ml`` >= 3.41;
    ``online: false`` writes an offline experiment archive instead)."""

    enabled: Bool = doc("Log to Comet.", default=False)
    samples_log_interval: Int = doc("Log a metric again only after this many more samples.",
                                    default=100)
    project: str | None = doc("Comet project; None: COMET_PROJECT_NAME or .comet.config.",
                              default=None)
    workspace: str | None = doc("Comet workspace; None: COMET_WORKSPACE or .comet.config.",
                                default=None)
    api_key: str | None = doc("Comet API key; None: COMET_API_KEY or .comet.config.",
                              default=None)
    experiment_name: str | None = doc("Name given to the experiment; None: Comet's.",
                                      default=None)
    experiment_key: str | None = doc("Key of the experiment (32-50 alphanumerics); None: "
                                     "COMET_EXPERIMENT_KEY or a new one.", default=None)
    online: Bool | None = doc("Log to the Comet server (true) or to an offline archive "
                              "(false); None: Comet's default (online).", default=None)
    mode: CometMode | None = doc("'get', 'create' or 'get_or_create' the experiment; None: "
                                 "Comet's default (get_or_create).", default=None)


class MonitorConfig(Section):
    """The four monitor sections together (DeepSpeed's ``DeepSpeedMonitorConfig``)."""

    tensorboard: TensorBoardConfig = doc("TensorBoard.", default_factory=TensorBoardConfig)
    comet: CometConfig = doc("Comet.", default_factory=CometConfig)
    wandb: WandbConfig = doc("Weights & Biases.", default_factory=WandbConfig)
    csv_monitor: CSVConfig = doc("CSV files.", default_factory=CSVConfig)

    @property
    def enabled(self) -> bool:
        """Whether any monitor is enabled."""
        return (self.tensorboard.enabled or self.wandb.enabled or self.csv_monitor.enabled
                or self.comet.enabled)


__all__ = ["CSVConfig", "CometConfig", "MonitorConfig", "StrictSection", "TensorBoardConfig",
           "WandbConfig"]
