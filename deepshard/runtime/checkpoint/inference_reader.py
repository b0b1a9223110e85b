"""A training checkpoint's full fp32 weights read one block at a time, for inference.

Inference loads a training checkpoint (deepshard's own, any ZeRO stage and world size, or
DeepSpeed's) into tensor-parallel ranks that each keep a slice of every weight.
Consolidating it first (:func:`.consolidate.get_fp32_state_dict`) would hold the whole
model on every rank at once; :class:`BlockReader` assembles the weights of one *block*
(:func:`block_of`: a transformer layer) at a time from the memory-mapped files and drops
them when another block is asked for.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from deepshard.errors import UsageError
from deepshard.runtime.checkpoint import ds_files, ds_parallel, from_deepspeed
from deepshard.runtime.checkpoint import format as fmt
from deepshard.runtime.checkpoint.by_name import Needed, read_by_name
from deepshard.runtime.checkpoint.consolidate import expert_order, get_fp32_state_dict
from deepshard.runtime.checkpoint.ds_partitions import Pieces

Read = Callable[[frozenset[str]], Mapping[str, torch.Tensor]]
"""Reads the values of some names (and maybe others) from the checkpoint's files."""


def block_of(name: str) -> str:
    """The block ``name`` is read with: its prefix up to and including its first integer
    component (``transformer.h.3.attn.c_attn.weight`` -> ``transformer.h.3``, an MoE
    expert's ``...deepspeed_experts.5``), else the name alone (embeddings, final norm)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return name


@dataclass(frozen=True)
class _Index:
    """What a checkpoint holds, known without reading its values."""

    where: str
    shapes: dict[str, tuple[int, ...]]  # every name, in module order
    blocks: dict[str, list[str]]        # block_of(name) -> its names
    aliases: dict[str, str]             # a tied parameter's other name -> the one stored
    read: Read


class BlockReader:
    """The full fp32 value of every model state-dict name of a checkpoint (as
    :func:`.consolidate.get_fp32_state_dict` gives them: fp32 masters where kept, other
    floating tensors cast to fp32, non-float ones unchanged), read one block at a time.

    Only the current block's values are held: asking for a name of another block drops
    them first. A value may be a view of a memory-mapped checkpoint file (a parameter
    that one rank's shard holds whole): copy what you keep. Once the reader and the
    caller let go of a block's values, the files' mappings go with them, handing the
    pages read back (the reader keeps no file open between blocks).

    Memory held, by format:

    * deepshard, data parallel (ZeRO 0-3, any world size): one block's values. Each block
      reads only the rank files holding a piece of it (:class:`.by_name.Needed` restricts
      assembly by name): parameters split over ranks are assembled, whole ones are views.
    * DeepSpeed (ZeRO 0-3, pipelines, MoE): one block's values, but every block opens
      every file again and unpickles its metadata (time grows with blocks x files); at
      ZeRO 3 its frozen parameters are joined on every read.
    * deepshard, model parallel (pipeline / tensor-parallel layouts): NOT bounded. The
      whole checkpoint is consolidated once, at open, and held for the reader's life.

    Raises:
        UsageError: no complete checkpoint (or no ``tag``) in ``checkpoint_dir``.
    """

    def __init__(self, checkpoint_dir: str | os.PathLike, tag: str | None = None) -> None:
        self._index = _open(Path(checkpoint_dir), tag)
        self._block: str | None = None
        self._held: dict[str, torch.Tensor] = {}

    def names(self) -> list[str]:
        """Every model state-dict name in the checkpoint, in module order."""
        return list(self._index.shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        """``name``'s full shape, from the files' metadata (no values read; a model-parallel
        checkpoint's from its consolidation at open). UsageError: a name not held."""
        return self._index.shapes[self._known(name)]

    def value(self, name: str) -> torch.Tensor:
        """``name``'s full value in fp32 (non-float tensors unchanged); reads its block
        (dropping the one held) unless that is held already. UsageError: a name not held."""
        block = block_of(self._known(name))
        if block != self._block:
            self.drop()
            self._held, self._block = self._read(block), block
        return self._held[name]

    @property
    def held(self) -> tuple[str, ...]:
        """The names whose values are held now (one block's)."""
        return tuple(self._held)

    def drop(self) -> None:
        """Let go of the held block's values."""
        self._held, self._block = {}, None

    def _known(self, name: str) -> str:
        if name not in self._index.shapes:
            raise UsageError(f"the checkpoint holds no {name!r}", where=self._index.where,
                             hint="it is another model's checkpoint; names() lists what "
                                  "it holds")
        return name

    def _read(self, block: str) -> dict[str, torch.Tensor]:
        names = self._index.blocks[block]
        stored = {self._index.aliases.get(n, n) for n in names}
        got = self._index.read(frozenset(names) | stored)
        return {n: _fp32(got[n] if n in got else got[self._index.aliases[n]]) for n in names}


def _fp32(value: torch.Tensor) -> torch.Tensor:
    return value.float() if torch.is_floating_point(value) else value


def _open(root: Path, tag: str | None) -> _Index:
    ds_tag = ds_files.find_tag(root, tag)
    if ds_tag is not None:
        return _deepspeed(ds_tag)
    manifest = fmt.resolve_tag(root, tag)
    if manifest is None:
        raise UsageError("no complete checkpoint", where=str(root),
                         hint="pass the directory given to engine.save_checkpoint() (deepshard "
                              "or DeepSpeed), which holds 'latest' and the tag directories")
    if manifest.layout:  # model parallel: consolidated whole, once (see BlockReader)
        whole = get_fp32_state_dict(root, manifest.tag)
        return _index(root / manifest.tag, {n: tuple(v.shape) for n, v in whole.items()},
                      list(whole), {}, lambda need: whole)
    return _deepshard(root / manifest.tag, manifest)


def _deepshard(tag_dir: Path, manifest: fmt.Manifest) -> _Index:
    """A data-parallel deepshard checkpoint: shapes from the shared file's module state
    and the rank files' shard records; which ranks hold a piece of each name."""
    shared = fmt.load_file(tag_dir, fmt.SHARED_FILE, mmap=True)
    stage0 = manifest.zero_stage == 0
    module = fmt.full_precision(shared) if stage0 else shared["module"]
    shapes = {n: tuple(v.shape) for n, v in module.items()}
    holders: dict[str, set[int]] = {}
    for rank in range(manifest.world_size):
        for e in fmt.load_file(tag_dir, fmt.rank_file(rank), mmap=True).get("zero", ()):
            for name, off, n, shape in zip(e["names"], e["offsets"], e["numels"],
                                           e["shapes"], strict=True):
                shapes.setdefault(name, tuple(shape))
                if n == 0 or max(off, e["lo"]) < min(off + n, e["hi"]):
                    holders.setdefault(name, set()).add(rank)
    # stage 0's module state holds tied parameters under every name already
    aliases = {} if stage0 else {a: c for a, c in (shared.get("aliases") or {}).items()
                                 if c in shapes}
    for alias, canonical in aliases.items():
        shapes.setdefault(alias, shapes[canonical])
    order = expert_order(shared.get("state_names") or (), shapes)

    def read(need: frozenset[str]) -> Mapping[str, torch.Tensor]:
        ranks = sorted({r for n in need for r in holders.get(n, ())})
        own = fmt.load_file(tag_dir, fmt.SHARED_FILE, mmap=True)
        return read_by_name(tag_dir, manifest, own, ranks, Needed(need, frozenset())).values

    return _index(tag_dir, shapes, order, aliases, read)


def _deepspeed(tag_dir: Path) -> _Index:
    """A DeepSpeed checkpoint: shapes from a read that assembles nothing (module values
    as views; at ZeRO 3 the recorded ``param_shapes``)."""
    loaded = from_deepspeed.read(tag_dir, need=Needed(frozenset(), frozenset()))
    top, by_name = loaded.top, loaded.by_name
    shapes = {n: tuple(v.shape) for n, v in by_name.values.items()}
    for group in top.get("param_shapes") or ():
        for name, shape in group.items():
            if name in by_name.present:
                shapes.setdefault(name, tuple(shape))
    aliases = {a: c for a, c in (top.get("shared_params") or {}).items() if c in shapes}
    for alias, canonical in aliases.items():
        shapes.setdefault(alias, shapes[canonical])
    order = ds_parallel.with_experts(list(top.get("module") or {}),
                                     [n for n in shapes if ds_parallel.EXPERT.fullmatch(n)])

    def read(need: frozenset[str]) -> Mapping[str, torch.Tensor]:
        values = from_deepspeed.read(tag_dir, need=Needed(need, frozenset())).by_name.values
        return {n: v.whole() if isinstance(v, Pieces) else v
                for n, v in values.items() if n in need}

    return _index(tag_dir, shapes, order, aliases, read)


def _index(tag_dir: Path, shapes: dict[str, tuple[int, ...]], order: list[str],
           aliases: dict[str, str], read: Read) -> _Index:
    """The names of ``shapes`` in ``order``, any others after them as they came (as
    :func:`.by_name.in_order` orders the consolidated state), and their blocks."""
    first = {n: shapes[n] for n in order if n in shapes}
    ordered = {**first, **{n: s for n, s in shapes.items() if n not in first}}
    blocks: dict[str, list[str]] = {}
    for name in ordered:
        blocks.setdefault(block_of(name), []).append(name)
    return _Index(str(tag_dir), ordered, blocks, aliases, read)
