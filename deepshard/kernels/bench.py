"""What ``benchmarks/kernels.py`` times: one case per op and shape, ours against torch's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchCase:
    """One bandwidth measurement: ``ours()`` and ``torch()`` do the same work on the GPU.

    ``bytes_moved`` is the minimum DRAM traffic of the op (every input read once, every
    output written once), so bytes / time is the achieved bandwidth.
    """

    name: str
    bytes_moved: int
    ours: Callable[..., object]  # no arguments (lambdas binding theirs as defaults)
    torch: Callable[..., object]
    torch_label: str
