"""DeepSpeed's ``ZeroParamStatus``: where a ZeRO-3 parameter's full value is (its
``param.ds_status``)."""

from __future__ import annotations

from enum import Enum

__all__ = ["ZeroParamStatus"]


class ZeroParamStatus(Enum):
    """Where a ZeRO-3 parameter's full value is, as DeepSpeed's ``param.ds_status`` says.

    A partitioned parameter goes ``NOT_AVAILABLE`` (only its shard is held) -> ``INFLIGHT``
    (an all-gather was started) -> ``AVAILABLE`` (whole, usable in forward and backward)
    -> ``NOT_AVAILABLE`` again when released; a gather without prefetch goes straight from
    ``NOT_AVAILABLE`` to ``AVAILABLE``.
    """

    AVAILABLE = 1
    """Fully present on every rank of its group."""
    NOT_AVAILABLE = 2
    """Partitioned: this rank holds only its shard."""
    INFLIGHT = 3
    """Being gathered."""
