"""The CPU allocator policy of a worker: big buffers go back to the OS when freed.

glibc serves an allocation above its mmap threshold with its own ``mmap`` and returns it
to the OS on ``free``; but after the first such free it raises the threshold to that size,
so later buffers of that size come from the heap, where freed memory stays resident and
fragments. A training step frees and re-allocates many such buffers (activations, ZeRO-3's
gathered parameters, gradient staging), and the resident size then creeps up step after
step. Fixing the threshold keeps it put: measured on the example GPT (2 ranks, CPU), peak
RSS per rank drops by 35 MiB at stage 0, 80 MiB at stage 2 and 190 MiB at stage 3.

``DEEPSHARD_MMAP_THRESHOLD`` (bytes) overrides the default 4 MiB; 0 leaves glibc's
dynamic policy alone. Without glibc (musl, macOS) nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

DEFAULT_THRESHOLD = 4 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def fix_mmap_threshold() -> int:
    """Apply the policy (see the module docstring); returns the threshold set, or 0."""
    raw = os.environ.get("DEEPSHARD_MMAP_THRESHOLD", "")
    threshold = int(raw) if raw.strip().isdigit() else DEFAULT_THRESHOLD
    if threshold <= 0:
        return 0
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return 0
    return threshold if mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(threshold)) == 1 else 0
