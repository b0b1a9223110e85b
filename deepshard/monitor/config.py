"""DeepSpeed's ``deepspeed.monitor.config``: the monitor config models (deepshard's, from
:mod:`deepshard.config.schema_monitor`) and ``get_monitor_config``."""

from __future__ import annotations

from typing import Any

from deepshard.config.schema_monitor import (
    CometConfig,
    CSVConfig,
    MonitorConfig,
    TensorBoardConfig,
    WandbConfig,
)

DeepSpeedMonitorConfig = MonitorConfig
"""DeepSpeed's name for the four sections together."""


def get_monitor_config(param_dict: dict[str, Any]) -> MonitorConfig:
    """The monitor sections of a raw ds_config dict, validated (missing ones: defaults).

    Raises:
        UsageError: a bad value, naming its key path.
    """
    sections = {key: param_dict.get(key, {}) for key in
                ("tensorboard", "wandb", "csv_monitor", "comet")}
    return MonitorConfig.model_validate(sections)


__all__ = ["CSVConfig", "CometConfig", "DeepSpeedMonitorConfig", "MonitorConfig",
           "TensorBoardConfig", "WandbConfig", "get_monitor_config"]
