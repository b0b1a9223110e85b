"""The ``comms_logger`` config section: DeepSpeed's keys and defaults, validated.

``{"comms_logger": {"enabled": true, "verbose": false, "prof_all": true, "debug": false,
"prof_ops": ["all_reduce"]}}`` in ``ds_config.json``. The model is a frozen pydantic model
that imports neither torch nor ``deepshard.runtime``, so the config schema can hold it as a
field without an import cycle. Inside the schema its mistakes carry the schema's key path
(the validation context's ``KeyLog``); on its own (:func:`parse_comms_logger`) they are
one-line UsageErrors at ``comms_logger.<key>``.

One difference from DeepSpeed 0.19.8, on purpose: there the mere presence of the section
turns the logger on (``"enabled": false`` is ignored); here ``enabled`` decides.
"""

from __future__ import annotations

import difflib
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic_core import PydanticCustomError

from deepshard.errors import UsageError

SECTION = "comms_logger"


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):  # DeepSpeed's pydantic takes 0/1 too
        return bool(value)
    raise PydanticCustomError("expected", "expected {kind}", {"kind": "true or false"})


def _names(value: Any) -> tuple[str, ...]:
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise PydanticCustomError("expected", "expected {kind}",
                              {"kind": "a list of op names (e.g. [\"all_reduce\"])"})


Bool = Annotated[bool, BeforeValidator(_bool)]
Names = Annotated[tuple[str, ...], BeforeValidator(_names)]


class CommsLoggerConfig(BaseModel):
    """``comms_logger``: time the collectives issued through ``deepshard.comm`` and
    summarise them with ``deepshard.comm.log_summary()``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: Bool = Field(False, description="Record collectives (off: no overhead but "
                                             "one attribute test per call).")
    verbose: Bool = Field(False, description="Log every recorded op on rank 0 as it "
                                             "completes (latency, size, bandwidths).")
    prof_all: Bool = Field(True, description="Record every op; false: only the ops named "
                                             "in prof_ops or called with prof=True.")
    debug: Bool = Field(False, description="Record each op under its name and the name of "
                                           "the function that called it.")
    prof_ops: Names = Field((), description="Op log names to record when prof_all is false "
                                            "(e.g. [\"all_reduce\", \"my_all_reduce\"]).")

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any, info: ValidationInfo) -> Any:
        if not isinstance(data, dict):
            return data
        for key in data:
            if key not in cls.model_fields:
                raise _unknown_key(str(key), info)
        return data


def _unknown_key(key: str, info: ValidationInfo) -> UsageError:
    accepted = ", ".join(CommsLoggerConfig.model_fields)
    log = info.context.get("keys") if isinstance(info.context, dict) else None
    # inside the config schema its KeyLog knows the full path (and the file)
    where = log.where(key) if log is not None else f"{SECTION}.{key}"
    close = difflib.get_close_matches(key, list(CommsLoggerConfig.model_fields), n=1)
    if close:
        return UsageError(f"unknown key, did you mean {close[0]!r}", where=where,
                          hint=f"rename it to {close[0]!r}; {SECTION} accepts: {accepted}")
    return UsageError("unknown key", where=where,
                      hint=f"remove it or use one of the keys {SECTION} accepts: {accepted}")


def parse_comms_logger(section: Any) -> CommsLoggerConfig:
    """``section`` (a mapping, a :class:`CommsLoggerConfig`, or any object with its
    attributes) as a validated :class:`CommsLoggerConfig`; mistakes are UsageErrors."""
    if isinstance(section, CommsLoggerConfig):
        return section
    if not isinstance(section, dict):
        section = {name: getattr(section, name) for name in CommsLoggerConfig.model_fields
                   if hasattr(section, name)}
    try:
        return CommsLoggerConfig.model_validate(section)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join([SECTION, *(str(p) for p in first["loc"])])
        kind = (first.get("ctx") or {}).get("kind")
        if kind:
            raise UsageError(f"expected {kind}, got {first.get('input')!r}", where=where,
                             hint=f"set it to {kind}") from None
        raise UsageError(first["msg"], where=where, hint="see the comms_logger keys in the "
                         "deepshard config reference") from None
