"""The ``deepspeed`` *distribution* deepshard presents: metadata that names deepshard.

transformers, Accelerate, peft and TRL take their DeepSpeed code paths only when
``importlib.metadata`` finds a distribution named ``deepspeed`` (``is_deepspeed_available``,
``dep_version_check("deepspeed>=0.9.3")``), not merely an importable package. deepshard
presents one in two places, with the same metadata (:func:`metadata_text`):

- beside the import shim (:data:`deepshard.contract.SHIM_DIR`), so ``ds-run
  --deepspeed_compat`` workers, which get that directory first on ``PYTHONPATH``, see it;
- in the active environment, only through the explicit, reversible ``ds-compat install``
  (:mod:`.environment`).

Its version is DeepSpeed's whose behaviour deepshard matches, with deepshard's own as the
local label (``0.19.8+deepshard.0.1.0``), so a version check passes and ``pip list`` still
says what it is. Pure strings: torch-free.
"""

from __future__ import annotations

from deepshard import contract

DEEPSPEED_VERSION = contract.DEEPSPEED_VERSION
"""The DeepSpeed release whose API and behaviour deepshard matches (``deepspeed.__version__``
under the compat path, before the local label)."""


GIT_HASH = "unknown"
"""``deepspeed.__git_hash__`` / ``git_version_info.git_hash``: what a pip-installed
DeepSpeed 0.19.8 says."""
GIT_BRANCH = "unknown"
"""``deepspeed.__git_branch__`` / ``git_version_info.git_branch``."""


def version() -> str:
    """The presented distribution's version: ``0.19.8+deepshard.<deepshard's version>``."""
    return f"{DEEPSPEED_VERSION}+deepshard.{contract.DEEPSHARD_VERSION}"


def dist_info_name() -> str:
    """The ``.dist-info`` directory name (PEP 427 escaping: ``+`` is kept, ``-`` is not used)."""
    return f"deepspeed-{version()}.dist-info"


def metadata_text() -> str:
    """``METADATA`` of the presented distribution (core metadata 2.1)."""
    return (
        "Metadata-Version: 2.1\n"
        "Name: deepspeed\n"
        f"Version: {version()}\n"
        f"Summary: {contract.COMPAT_SUMMARY}\n"
        "License: Apache-2.0\n"
        f"Requires-Dist: deepshard=={contract.DEEPSHARD_VERSION}\n"
        "\n"
        "Not DeepSpeed: deepshard presenting itself under DeepSpeed's name, so that\n"
        "transformers', Accelerate's, peft's and TRL's own DeepSpeed code paths run on it.\n"
        "Remove it with `ds-compat uninstall` (or `pip uninstall deepspeed`).\n"
    )


def version_parts() -> tuple[int, int, int]:
    """``(0, 19, 8)``: ``deepspeed.__version_major__`` and its siblings."""
    major, minor, patch = (int(p) for p in DEEPSPEED_VERSION.split("."))
    return major, minor, patch


VERSION = version()
"""``deepspeed.git_version_info.version``."""
