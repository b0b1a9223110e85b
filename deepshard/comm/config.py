"""The ``comms_logger`` section as ``deepshard.comm`` takes it: the config schema's
:class:`~deepshard.config.schema_comm.CommsLoggerConfig`, and
:func:`parse_comms_logger` for a section a script passes itself, whose mistakes are
one-line UsageErrors at ``comms_logger.<key>`` (an unknown key too: with no config file
to warn about, it is an error here)."""

from __future__ import annotations

from typing import Any

from deepshard.config.schema_base import KeyLog, unknown_key_error
from deepshard.config.schema_comm import CommsLoggerConfig

SECTION = "comms_logger"

__all__ = ["SECTION", "CommsLoggerConfig", "parse_comms_logger"]


def parse_comms_logger(section: Any) -> CommsLoggerConfig:
    """``section`` (a mapping, a :class:`CommsLoggerConfig`, or any object with its
    attributes) as a validated :class:`CommsLoggerConfig`; mistakes are UsageErrors."""
    if isinstance(section, CommsLoggerConfig):
        return section
    if not isinstance(section, dict):
        section = {name: getattr(section, name) for name in CommsLoggerConfig.model_fields
                   if hasattr(section, name)}
    log = KeyLog(origin="", path=[SECTION])
    config = CommsLoggerConfig.model_validate(section, context={"keys": log})
    if log.unknown:
        raise unknown_key_error(CommsLoggerConfig, log.unknown[0].rpartition(".")[2], log)
    return config
