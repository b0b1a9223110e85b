"""The ``comms_logger`` config section: DeepSpeed's keys and defaults.

``{"comms_logger": {"enabled": true, "verbose": false, "prof_all": true, "debug": false,
"prof_ops": ["all_reduce"]}}`` in ``ds_config.json``; :mod:`deepshard.comm` applies it.

One difference from DeepSpeed 0.19.8, on purpose: there the mere presence of the section
turns the logger on (``"enabled": false`` is ignored); here ``enabled`` decides.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator
from pydantic_core import PydanticCustomError

from deepshard.config.schema_base import Bool, Section, doc


def _op_names(value: Any) -> tuple[str, ...]:
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise PydanticCustomError("expected", "expected {kind}",
                              {"kind": "a list of op names (e.g. [\"all_reduce\"])"})


OpNames = Annotated[tuple[str, ...], BeforeValidator(_op_names)]


class CommsLoggerConfig(Section):
    """``comms_logger``: time the collectives issued through ``deepshard.comm`` and
    summarise them with ``deepshard.comm.log_summary()``."""

    enabled: Bool = doc("Record collectives (off: no overhead but one attribute test per "
                        "call).", default=False)
    verbose: Bool = doc("Log every recorded op on rank 0 as it completes (latency, size, "
                        "bandwidths).", default=False)
    prof_all: Bool = doc("Record every op; false: only the ops named in prof_ops or called "
                         "with prof=True.", default=True)
    debug: Bool = doc("Record each op under its name and the name of the function that "
                      "called it.", default=False)
    prof_ops: OpNames = doc("Op log names to record when prof_all is false (e.g. "
                            "[\"all_reduce\", \"my_all_reduce\"]).", default=())
