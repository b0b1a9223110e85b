"""DeepSpeed's ``required_torch_version``: whether the installed torch is in a range."""

from __future__ import annotations

import torch
from torch.torch_version import TorchVersion

from deepshard.errors import UsageAssertionError

__all__ = ["required_torch_version"]


def required_torch_version(min_version: float | str | None = None,
                           max_version: float | str | None = None) -> bool:
    """Whether ``min_version <= torch.__version__ <= max_version`` (either bound may be
    left out; ``2.1`` and ``"2.1"`` mean the same). Compared as versions: ``2.13`` is
    newer than ``2.4``.

    Raises:
        UsageAssertionError: neither bound is given (DeepSpeed asserts the same).
    """
    if not min_version and not max_version:
        raise UsageAssertionError("give min_version or max_version",
                                  where="required_torch_version",
                                  hint="e.g. required_torch_version(min_version=2.1)")
    installed = TorchVersion(torch.__version__)
    if min_version and installed < str(min_version):
        return False
    return not (max_version and installed > str(max_version))
