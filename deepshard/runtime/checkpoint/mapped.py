"""Pages of memory-mapped checkpoint files handed back while a load goes on.

A checkpoint read memory-mapped (``torch.load(mmap=True)``) costs no memory until its
tensors are read; then every page read stays in the process (its RSS) until the mapping
goes, at the end of the load. A ZeRO load of DeepSpeed's partition files reads a little
of every file for each parameter, so by its end it held every page it read: at ZeRO-2
every parameter's value and this rank's optimizer state, once more beside the engine.
:class:`Release` drops those pages (``madvise(MADV_DONTNEED)``: the file is not changed,
a later read finds them in the page cache) after each parameter, so a load holds about
one parameter's pages at a time. Linux only; elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Iterable

from deepshard.runtime.nested import tensors_in

MADV_DONTNEED = 4


class Release:
    """Callable: hand back the pages of the storages of every tensor in ``loaded``
    (objects ``torch.load(mmap=True)`` returned, and nothing else: their pages are the
    files', so dropping them loses nothing)."""

    def __init__(self, loaded: Iterable[object]) -> None:
        page = mmap.PAGESIZE
        spans = set()
        for obj in loaded:
            for t in tensors_in(obj):
                storage = t.untyped_storage()
                start = -(-storage.data_ptr() // page) * page
                end = (storage.data_ptr() + storage.nbytes()) // page * page
                if end > start:
                    spans.add((start, end - start))
        self._spans = sorted(spans)
        self._madvise = None
        if sys.platform == "linux" and self._spans:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            self._madvise = libc.madvise

    def __call__(self) -> None:
        if self._madvise is None:
            return
        for start, length in self._spans:
            self._madvise(start, length, MADV_DONTNEED)
