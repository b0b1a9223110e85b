"""``ds-run --deepspeed_compat``: a DeepSpeed script's ``import deepspeed`` gets deepshard.

The launcher prepends :data:`SHIM_DIR` to the workers' ``PYTHONPATH`` (their agent does, so
each node uses its own install's path). That directory holds one package, ``deepspeed``,
whose import makes ``deepspeed`` deepshard itself and every ``deepspeed.x.y`` the module
``deepshard.x.y`` (:mod:`.alias`); what deepshard lacks fails with one line naming the
closest deepshard feature (:mod:`.missing`). No distribution named ``deepspeed`` is
installed, so ``importlib.metadata`` (which HF Transformers and Accelerate ask) still says
DeepSpeed is absent. Nothing here imports torch.
"""

from __future__ import annotations

import os

SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim")
"""The directory put first on the workers' ``PYTHONPATH``."""


def prepend_to_path(shim_dir: str, pythonpath: str | None) -> str:
    """``PYTHONPATH`` with ``shim_dir`` first (once), the existing entries kept after it."""
    rest = [p for p in (pythonpath or "").split(os.pathsep) if p and p != shim_dir]
    return os.pathsep.join([shim_dir, *rest])
