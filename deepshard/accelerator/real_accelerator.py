"""``get_accelerator()`` / ``set_accelerator()``: the one accelerator of this process.

Selection, as in DeepSpeed: ``DS_ACCELERATOR`` when set (``cpu`` or ``cuda`` here; any other
value is a one-line UsageError), else ``cuda`` when torch sees a usable GPU, else ``cpu``.
The choice is made on the first call and kept: DeepSpeed's API makes the accelerator
process-wide, so it lives in one small holder object (:data:`_SELECTED`), and
:func:`set_accelerator` replaces it (a custom accelerator, or a test).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from deepshard.accelerator.abstract_accelerator import Accelerator
from deepshard.errors import UsageError

ENV = "DS_ACCELERATOR"
SUPPORTED = ("cpu", "cuda")
logger = logging.getLogger(__name__)


class _Selection:
    """Holds the process's accelerator (``None`` until the first ``get_accelerator()``)."""

    __slots__ = ("accelerator",)

    def __init__(self) -> None:
        self.accelerator: Accelerator | None = None


_SELECTED = _Selection()


def accelerator_name(environ: Mapping[str, str], cuda_available: bool) -> str:
    """Which accelerator to build: ``DS_ACCELERATOR`` if set, else by CUDA (pure)."""
    value = environ.get(ENV)
    if value is None:
        return "cuda" if cuda_available else "cpu"
    name = value.strip().lower()
    if name not in SUPPORTED:
        raise UsageError(f"{ENV}={value!r} is not an accelerator deepshard supports",
                         where="environment",
                         hint=f"set {ENV} to one of {', '.join(SUPPORTED)}, or unset it to "
                              "use cuda when a GPU is visible and cpu otherwise")
    return name


def build_accelerator(name: str) -> Accelerator:
    """A new accelerator of ``name`` (one of :data:`SUPPORTED`)."""
    if name == "cuda":
        from deepshard.accelerator.cuda_accelerator import CUDAAccelerator

        return CUDAAccelerator()
    assert name == "cpu", name
    from deepshard.accelerator.cpu_accelerator import CPUAccelerator

    return CPUAccelerator()


def get_accelerator() -> Accelerator:
    """This process's accelerator, chosen on the first call (see the module docstring)."""
    if _SELECTED.accelerator is None:
        import torch

        cuda = torch.cuda.device_count() > 0 and torch.cuda.is_available()
        name = accelerator_name(os.environ, cuda)
        _SELECTED.accelerator = build_accelerator(name)
        how = "DS_ACCELERATOR" if ENV in os.environ else "detected"
        logger.debug("deepshard: accelerator %s (%s)", name, how)
    return _SELECTED.accelerator


def set_accelerator(accel_obj: Accelerator | None) -> None:
    """Use ``accel_obj`` from now on (``None``: choose again on the next
    :func:`get_accelerator`)."""
    if accel_obj is not None and not isinstance(accel_obj, Accelerator):
        raise UsageError(f"{type(accel_obj).__name__} is not an accelerator",
                         where="set_accelerator()",
                         hint="pass an instance of a deepshard.accelerator.DeepSpeedAccelerator "
                              "subclass")
    _SELECTED.accelerator = accel_obj


def is_current_accelerator_supported() -> bool:
    """Whether the accelerator in use is one deepshard ships."""
    return get_accelerator().device_name() in SUPPORTED
