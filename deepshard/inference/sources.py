"""Where inference reads weights from, one slice at a time.

A :class:`TensorSource` hands out a tensor, or rows/columns of it, by checkpoint key,
reading no more than asked for: an HF directory's safetensors (one file or several
shards), read by offset, a ``pytorch_model.bin`` memory-mapped, a
deepshard or DeepSpeed training checkpoint (any ZeRO stage, consolidated a block of
parameters at a time from the memory-mapped shard files), or a model already in memory.
So a rank that loads its tensor-parallel shard never holds another rank's part of a
weight, nor the whole model.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from deepshard.errors import UsageError

Ranges = Sequence[tuple[int, int]]


class TensorSource(Protocol):
    """Tensors by key; :meth:`read` returns rows/columns ``ranges`` of ``dim`` concatenated
    (all of it when ``dim`` is None), with ``rows`` (dim 0 only) zero rows appended up to
    that many (a padded vocabulary shard) in the same allocation."""

    def keys(self) -> Iterable[str]: ...

    def shape(self, key: str) -> tuple[int, ...]: ...

    def read(self, key: str, dim: int | None = None, ranges: Ranges = (),
             rows: int | None = None) -> torch.Tensor: ...


def _padded_copy(t: torch.Tensor, rows: int | None) -> torch.Tensor:
    """A copy of ``t`` with zero rows up to ``rows`` (one allocation)."""
    out = torch.zeros(max(rows or 0, t.shape[0]), *t.shape[1:], dtype=t.dtype)
    out[:t.shape[0]] = t
    return out


def _cut(t: Any, dim: int | None, ranges: Ranges) -> torch.Tensor:
    """Slices of ``t`` (a tensor or a safetensors slice) concatenated along ``dim``."""
    if dim is None:
        return t[:] if not isinstance(t, torch.Tensor) else t
    parts = [t[a:b] if dim == 0 else t[:, a:b] for a, b in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


class StateDictSource:
    """Tensors already in memory (a model's state dict): slices are copies."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = dict(tensors)

    def keys(self) -> Iterable[str]:
        return self._tensors.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensors[key].shape)

    def read(self, key: str, dim: int | None = None, ranges: Ranges = (),
             rows: int | None = None) -> torch.Tensor:
        return _padded_copy(_cut(self._tensors[key], dim, ranges), rows)


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_BLOCK = 8 << 20
"""Bytes read at a time when a slice takes columns (every row's part of it)."""


class SafetensorsSource:
    """An HF model directory's ``model.safetensors`` or its sharded form with
    ``model.safetensors.index.json``. Reads go through ``os.pread`` of exactly the rows
    asked for (columns: a few MiB of rows at a time), not a memory map, so the pages of
    other ranks' parts never count in this process's resident memory."""

    def __init__(self, directory: Path, files: Sequence[str] = ()) -> None:
        self._where: dict[str, tuple[int, dict]] = {}
        self._fds: list[int] = []
        self._files: dict[int, str] = {}
        paths = [directory / f for f in files] or sorted(directory.glob("*.safetensors"))
        for f in paths:
            fd = os.open(f, os.O_RDONLY)
            self._fds.append(fd)
            self._files[fd] = str(f)
            size = int.from_bytes(os.pread(fd, 8, 0), "little")
            header = json.loads(os.pread(fd, size, 8))
            header.pop("__metadata__", None)
            for key, info in header.items():
                if info["dtype"] not in _DTYPES:
                    raise UsageError(f"tensor {key} has dtype {info['dtype']}, which "
                                     "deepshard cannot read", where=str(f),
                                     hint="save the model in fp32, fp16 or bf16")
                info["start"] = 8 + size + info["data_offsets"][0]
                self._where[key] = (fd, info)

    def __del__(self) -> None:
        for fd in self._fds:
            os.close(fd)

    def keys(self) -> Iterable[str]:
        return self._where.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._where[key][1]["shape"])

    def _into(self, out: torch.Tensor, key: str, a: int, b: int) -> None:
        """Read rows ``[a, b)`` of ``key`` straight into ``out`` (contiguous, that size)."""
        fd, info = self._where[key]
        target = out.reshape(-1).view(torch.uint8).numpy()
        offset = info["start"] + a * (out.numel() // max(1, b - a)) * out.element_size()
        done = 0
        while done < target.nbytes:
            n = os.preadv(fd, [target[done:]], offset + done)
            if n <= 0:
                raise UsageError(f"{key} ends early", where=self._files[fd],
                                 hint="the safetensors file is truncated: save it again")
            done += n

    def read(self, key: str, dim: int | None = None, ranges: Ranges = (),
             rows: int | None = None) -> torch.Tensor:
        shape = self.shape(key)
        dtype = _DTYPES[self._where[key][1]["dtype"]]
        if dim is None:
            out = torch.empty(shape, dtype=dtype)
            if out.numel():
                self._into(out, key, 0, shape[0] if shape else 1)
            return out
        if dim == 0:
            at = sum(b - a for a, b in ranges)
            out = torch.empty(max(at, rows or 0), *shape[1:], dtype=dtype)
            out[at:] = 0
            at = 0
            for a, b in ranges:
                if b > a:
                    self._into(out[at:at + b - a], key, a, b)
                at += b - a
            return out
        out = torch.empty(shape[0], sum(b - a for a, b in ranges), *shape[2:], dtype=dtype)
        step = max(1, _BLOCK // (dtype.itemsize * max(1, math.prod(shape[1:]))))
        block: torch.Tensor = torch.empty(min(step, shape[0]), *shape[1:], dtype=dtype)
        for r in range(0, shape[0], step):
            chunk = block[:min(step, shape[0] - r)]
            self._into(chunk, key, r, r + chunk.shape[0])
            out[r:r + chunk.shape[0]] = _cut(chunk, 1, ranges)
        return out


class CheckpointSource:
    """A deepshard or DeepSpeed training checkpoint (any ZeRO stage, any world size),
    consolidated on the fly: the parameters of one block (the names sharing a prefix up to
    the block index) are assembled at a time from the memory-mapped shard files, so a rank
    holds at most one block's full tensors besides its own shards."""

    def __init__(self, directory: Path, tag: str | None = None) -> None:
        from deepshard.runtime.checkpoint.inference_reader import BlockReader

        self._reader = BlockReader(directory, tag)

    def keys(self) -> Iterable[str]:
        return self._reader.names()

    def shape(self, key: str) -> tuple[int, ...]:
        return self._reader.shape(key)

    def read(self, key: str, dim: int | None = None, ranges: Ranges = (),
             rows: int | None = None) -> torch.Tensor:
        return _padded_copy(_cut(self._reader.value(key), dim, ranges), rows)


def open_source(path: str | os.PathLike, where: str = "checkpoint") -> TensorSource:
    """The source for a directory: HF safetensors, ``pytorch_model.bin``, or a training
    checkpoint (recognised by its ``latest`` file or tag directories)."""
    directory = Path(path)
    if not directory.is_dir():
        raise UsageError(f"{directory} is not a directory", where=where,
                         hint="pass an HF model directory (save_pretrained) or the directory "
                              "given to engine.save_checkpoint()")
    if any(directory.glob("*.safetensors")):
        return SafetensorsSource(directory)
    bins = sorted(directory.glob("pytorch_model*.bin"))
    if bins:
        tensors: dict[str, torch.Tensor] = {}
        for f in bins:
            tensors.update(torch.load(f, map_location="cpu", mmap=True, weights_only=True))
        return StateDictSource(tensors)
    return CheckpointSource(directory)
