"""Megatron's and DeepSpeed's ``MMapIndexedDataset`` files: ragged integer rows on disk.

A data set ``<prefix>`` is two files. ``<prefix>.bin`` holds the rows' elements back to back,
in one integer dtype, native (little-endian) order. ``<prefix>.idx`` describes them::

    b"MMIDIDX\\x00\\x00"   magic, 9 bytes
    <Q  version (1)       <B  dtype code (DTYPE_CODES)
    <Q  number of rows    <Q  number of document-index entries
    int32[rows]  each row's number of elements ("sizes")
    int64[rows]  each row's byte offset in .bin ("pointers")
    int64[docs]  the document index: row numbers where documents start, and the end

The data analyzer writes its metric index in this format, curriculum learning and dynamic
batching read it; files written here equal byte for byte those DeepSpeed's
``MMapIndexedDatasetBuilder`` writes for the same rows, so either side reads the other's.
Reading maps both files (``numpy.memmap``): a row is a read-only view, nothing is loaded.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import struct
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple, overload

import numpy as np

from deepshard.errors import UsageError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# DeepSpeed's codes (indexed_dataset.dtypes); Megatron's own table differs from 6 on
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16),
    4: np.dtype(np.int32), 5: np.dtype(np.int64), 6: np.dtype(np.uint16),
    7: np.dtype(np.uint32), 8: np.dtype(np.uint64),
}
_CODE_OF = {dtype: code for code, dtype in DTYPE_CODES.items()}
_HEADER = struct.Struct("<9sQBQQ")
_INT32_MAX = 2**31 - 1


def index_dtype(dtype: Any) -> np.dtype:
    """``dtype`` (a numpy dtype or type, its name, or a ``torch`` integer dtype) as the numpy
    dtype an index file stores; only the 8 integer dtypes of :data:`DTYPE_CODES` are."""
    if type(dtype).__module__ == "torch":
        dtype = str(dtype).removeprefix("torch.")
    try:
        found: np.dtype | None = np.dtype(dtype)
    except TypeError:
        found = None
    if found is None or found not in _CODE_OF:
        names = ", ".join(d.name for d in DTYPE_CODES.values())
        raise UsageError(f"dtype {dtype!r} cannot be stored in an index file",
                         hint=f"use one of {names}")
    return found


def fit_int_dtype(min_value: int, max_value: int) -> np.dtype:
    """The smallest integer dtype holding every value in ``[min_value, max_value]``: unsigned
    when ``min_value >= 0`` (as DeepSpeed's ``find_fit_int_dtype``)."""
    if min_value >= 0:
        candidates: Sequence[type] = (np.uint8, np.uint16, np.uint32, np.uint64)
    else:
        candidates = (np.int8, np.int16, np.int32, np.int64)
    for candidate in candidates:
        info = np.iinfo(candidate)
        if info.min <= min_value and max_value <= info.max:
            return np.dtype(candidate)
    return np.dtype(candidates[-1])  # DeepSpeed's answer past the range, too


def index_paths(path_prefix: str | os.PathLike[str]) -> tuple[Path, Path]:
    """The ``.idx`` and ``.bin`` files of the data set ``path_prefix``."""
    prefix = os.fspath(path_prefix)
    return Path(prefix + ".idx"), Path(prefix + ".bin")


def index_exists(path_prefix: str | os.PathLike[str]) -> bool:
    """Whether both files of ``path_prefix`` exist."""
    return all(p.is_file() for p in index_paths(path_prefix))


class IndexedArrays(Sequence[np.ndarray]):
    """The rows of an index file pair, read-only and memory-mapped (see :func:`open_index`).

    ``len()`` is the number of rows; ``[i]`` is row ``i`` (negative counts from the end) as a
    1-D read-only array view; ``[a:b]`` a list of rows. Pickles as its path, so DataLoader
    workers map the files themselves.
    """

    def __init__(self, path_prefix: str | os.PathLike[str]):
        self.path_prefix = os.fspath(path_prefix)
        self._load()

    def _load(self) -> None:
        idx_path, bin_path = index_paths(self.path_prefix)
        header = _read_header(idx_path, bin_path)
        self.dtype: np.dtype = header.dtype
        index = np.memmap(idx_path, dtype=np.uint8, mode="r")
        offset = _HEADER.size
        self.sizes: np.ndarray = _view(index, np.int32, offset, header.rows)
        offset += 4 * header.rows
        self.pointers: np.ndarray = _view(index, np.int64, offset, header.rows)
        offset += 8 * header.rows
        self.doc_idx: np.ndarray = _view(index, np.int64, offset, header.docs)
        self._data = (np.memmap(bin_path, dtype=np.uint8, mode="r") if header.data_bytes
                      else np.zeros(0, dtype=np.uint8))
        _check_layout(self, idx_path, bin_path, header.data_bytes)

    def __getstate__(self) -> str:
        return self.path_prefix

    def __setstate__(self, state: str) -> None:
        self.path_prefix = state
        self._load()

    def __len__(self) -> int:
        return len(self.sizes)

    @overload
    def __getitem__(self, index: int) -> np.ndarray: ...

    @overload
    def __getitem__(self, index: slice) -> list[np.ndarray]: ...

    def __getitem__(self, index: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        i = int(index)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"row {index} of {len(self)} in {self.path_prefix}")
        start, count = int(self.pointers[i]), int(self.sizes[i])
        return self._data[start:start + count * self.dtype.itemsize].view(self.dtype)

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"IndexedArrays({self.path_prefix!r}, rows={len(self)}, dtype={self.dtype})"


def open_index(path_prefix: str | os.PathLike[str]) -> IndexedArrays:
    """Open the index file pair ``<path_prefix>.idx``/``.bin`` for reading.

    A missing file, a header that is not ``MMIDIDX`` version 1, an unknown dtype code or a
    file shorter or longer than its index says is a :class:`UsageError` naming the file.
    """
    return IndexedArrays(path_prefix)


def write_index(path_prefix: str | os.PathLike[str], rows: Iterable[Any], dtype: Any, *,
                doc_idx: Sequence[int] | None = None) -> None:
    """Write ``rows`` (arrays or tensors, each flattened) as ``<path_prefix>.idx``/``.bin``.

    Every value must be representable in ``dtype`` (no silent wrap-around). ``doc_idx`` is
    the document index; by default ``[0, len(rows)]``, what DeepSpeed's analyzer writes for a
    file it builds in one go. Each file is written to a temporary name beside it and moved
    into place (``.bin`` first, then ``.idx``), so a reader sees old or new files, never a
    partial one; a crash between the two moves leaves a pair :func:`open_index` rejects.
    """
    target = index_dtype(dtype)
    idx_path, bin_path = index_paths(path_prefix)
    sizes: list[int] = []
    with atomic_file(bin_path) as out:
        for row in rows:
            values = _cast_row(row, target, path_prefix, len(sizes))
            out.write(values.tobytes(order="C"))
            sizes.append(values.size)
    _write_idx(idx_path, np.asarray(sizes, dtype=np.int64), target, doc_idx)


def write_index_concatenated(path_prefix: str | os.PathLike[str], data: Any, sizes: Any,
                             dtype: Any, *, doc_idx: Sequence[int] | None = None) -> None:
    """:func:`write_index` for rows given as one flat array ``data`` cut into rows of
    ``sizes`` elements (``sum(sizes) == data.size``); fast for millions of short rows."""
    target = index_dtype(dtype)
    counts = np.asarray(sizes, dtype=np.int64).reshape(-1)
    values = _cast_row(data, target, path_prefix, None)
    if int(counts.sum()) != values.size or (counts < 0).any():
        raise UsageError(f"row sizes add up to {int(counts.sum())} but the data has "
                         f"{values.size} elements", where=os.fspath(path_prefix))
    idx_path, bin_path = index_paths(path_prefix)
    with atomic_file(bin_path) as out:
        out.write(values.tobytes(order="C"))
    _write_idx(idx_path, counts, target, doc_idx)


class _Header(NamedTuple):
    dtype: np.dtype
    rows: int
    docs: int
    data_bytes: int


def _read_header(idx_path: Path, bin_path: Path) -> _Header:
    hint = ("write the pair again (deepshard's analyzer or DeepSpeed's "
            "MMapIndexedDatasetBuilder); the path is the prefix both .idx and .bin extend")
    for path in (idx_path, bin_path):
        if not path.is_file():
            raise UsageError("index file not found", where=str(path), hint=hint)
    with open(idx_path, "rb") as f:
        raw = f.read(_HEADER.size)
    if len(raw) < _HEADER.size or raw[:9] != MAGIC:
        raise UsageError("not an MMIDIDX index file (bad header)", where=str(idx_path), hint=hint)
    _, version, code, rows, docs = _HEADER.unpack(raw)
    if version != VERSION:
        raise UsageError(f"index file version {version}, only {VERSION} is known",
                         where=str(idx_path), hint=hint)
    if code not in DTYPE_CODES:
        raise UsageError(f"unknown dtype code {code}", where=str(idx_path), hint=hint)
    expected = _HEADER.size + 12 * rows + 8 * docs
    if idx_path.stat().st_size != expected:
        raise UsageError(f"index file has {idx_path.stat().st_size} bytes, its header says "
                         f"{expected}", where=str(idx_path), hint=hint)
    return _Header(DTYPE_CODES[code], rows, docs, bin_path.stat().st_size)


def _view(buffer: np.ndarray, dtype: type, offset: int, count: int) -> np.ndarray:
    return buffer[offset:offset + count * np.dtype(dtype).itemsize].view(dtype)


def _check_layout(arrays: IndexedArrays, idx_path: Path, bin_path: Path,
                  data_bytes: int) -> None:
    """The rows must tile the .bin file exactly (catches a .idx paired with another .bin)."""
    itemsize = arrays.dtype.itemsize
    if len(arrays):
        ends = arrays.pointers.astype(np.int64) + arrays.sizes.astype(np.int64) * itemsize
        tiled = (arrays.pointers[0] == 0 and (arrays.sizes >= 0).all()
                 and np.array_equal(arrays.pointers[1:], ends[:-1]) and ends[-1] == data_bytes)
    else:
        tiled = data_bytes == 0
    if not tiled:
        raise UsageError(f"data file has {data_bytes} bytes, which do not match the rows "
                         f"{idx_path.name} describes", where=str(bin_path),
                         hint="the .idx and .bin come from different writes; write them again")


def _cast_row(row: Any, dtype: np.dtype, path_prefix: str | os.PathLike[str],
              number: int | None) -> np.ndarray:
    if hasattr(row, "detach"):  # a torch tensor
        row = row.detach().cpu().numpy()
    values = np.asarray(row).reshape(-1)
    cast = values.astype(dtype)
    if values.dtype != dtype and not np.array_equal(cast, values):
        what = "data" if number is None else f"row {number}"
        raise UsageError(f"{what} has values that {dtype.name} cannot hold exactly",
                         where=os.fspath(path_prefix),
                         hint="pick a wider dtype (fit_int_dtype(min, max) finds one)")
    if cast.size > _INT32_MAX:
        raise UsageError(f"a row of {cast.size} elements is past the format's int32 sizes",
                         where=os.fspath(path_prefix), hint="split it into several rows")
    return cast


def _write_idx(idx_path: Path, sizes: np.ndarray, dtype: np.dtype,
               doc_idx: Sequence[int] | None) -> None:
    docs = np.asarray([0, len(sizes)] if doc_idx is None else doc_idx, dtype=np.int64)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1] * dtype.itemsize, out=pointers[1:])
    with atomic_file(idx_path) as out:
        out.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[dtype], len(sizes), len(docs)))
        out.write(sizes.astype(np.int32).tobytes())
        out.write(pointers.tobytes())
        out.write(docs.tobytes())


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """A binary file opened for writing under a temporary name beside ``path``, flushed to
    disk and moved onto ``path`` when the block ends; removed if the block raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
