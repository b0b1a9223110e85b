"""Setting the comms logger: DeepSpeed's ``configure(...)`` and the engine's entry point.

:func:`configure_from_config` is what ``deepshard.initialize`` calls with the validated
``comms_logger`` section; :func:`configure` is DeepSpeed's signature, for scripts that turn
the logger on (or off) themselves. Both change only :data:`deepshard.comm.logger.comms_logger`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from deepshard.comm.config import SECTION, CommsLoggerConfig, parse_comms_logger
from deepshard.comm.logger import comms_logger


def configure_from_config(section: Mapping[str, Any] | CommsLoggerConfig | Any) -> None:
    """Take every setting of a ``comms_logger`` section: a :class:`CommsLoggerConfig`, a
    mapping of its keys (validated here; mistakes are UsageErrors), or an object with its
    attributes. Keys left out take DeepSpeed's defaults (off)."""
    comms_logger.configure(parse_comms_logger(section))


def configure(deepspeed_config: Any = None, enabled: bool | None = None,
              prof_all: bool | None = None, prof_ops: Iterable[str] | None = None,
              verbose: bool | None = None, debug: bool | None = None) -> None:
    """DeepSpeed's ``deepspeed.comm.configure``: the ``comms_logger`` section of
    ``deepspeed_config`` (a deepshard config or a ``ds_config`` mapping) when the user gave
    one, then each keyword that is not ``None``."""
    if deepspeed_config is not None:
        section = _section_of(deepspeed_config)
        if section is not None:
            configure_from_config(section)
    if enabled is not None:
        comms_logger.enabled = bool(enabled)
    if prof_all is not None:
        comms_logger.prof_all = bool(prof_all)
    if prof_ops is not None:
        comms_logger.prof_ops = list(prof_ops)
    if verbose is not None:
        comms_logger.verbose = bool(verbose)
    if debug is not None:
        comms_logger.debug = bool(debug)


def _section_of(config: Any) -> Any:
    """The ``comms_logger`` section of a config mapping or object, or None when the user's
    config has none (a pydantic config's default section does not count: as in DeepSpeed,
    a config without the section leaves the logger as the script set it)."""
    if isinstance(config, Mapping):
        return config.get(SECTION)
    given = getattr(config, "model_fields_set", None)
    if given is not None and SECTION not in given:
        return None
    return getattr(config, SECTION, None)
