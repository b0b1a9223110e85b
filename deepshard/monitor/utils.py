"""Whether a monitor's package is importable, as a one-line error when it is not.

An enabled monitor that cannot run is a :class:`~deepshard.errors.UsageError` at
``initialize`` on every rank (one line, exit code 2), never a silent fallback to no
logging: DeepSpeed raises the ImportError too, on rank 0.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from deepshard.errors import UsageError

INSTALL = {
    "tensorboard": ("tensorboard", "pip install tensorboard (or pip install "
                                   "'deepshard[monitor]')"),
    "wandb": ("wandb", "pip install wandb, then wandb login (or WANDB_MODE=offline)"),
    "comet": ("comet_ml", "pip install 'comet_ml>=3.41.0'"),
}
"""Config section -> (package to import, how to install it)."""

COMET_MIN = (3, 41)


def require(section: str) -> ModuleType:
    """Import the package the ``section`` monitor needs.

    Raises:
        UsageError: it is not installed (or comet_ml is older than 3.41), naming
            ``<section>.enabled`` and the install command.
    """
    package, install = INSTALL[section]
    try:
        module = importlib.import_module(package)
    except ImportError:
        raise UsageError(f"the {package} package this monitor needs is not installed",
                         where=f"{section}.enabled",
                         hint=f"{install}, or set {section}.enabled to false") from None
    if section == "comet" and _version(module) < COMET_MIN:
        raise UsageError(f"comet.enabled needs comet_ml >= 3.41.0, found "
                         f"{module.__version__}", where="comet.enabled", hint=install)
    return module


def _version(module: ModuleType) -> tuple[int, ...]:
    parts = []
    for piece in str(getattr(module, "__version__", "0")).split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)
