"""``get_fp32_state_dict``: one whole fp32 state dict from any checkpoint (DeepSpeed's
``zero_to_fp32``), whatever stage, precision, world size or layout wrote it."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from deepshard.errors import UsageError
from deepshard.runtime.checkpoint import ds_files, from_deepspeed
from deepshard.runtime.checkpoint import format as fmt
from deepshard.runtime.checkpoint.by_name import in_order, read_by_name
from deepshard.runtime.checkpoint.model_parallel import consolidate


def get_fp32_state_dict(checkpoint_dir: str | os.PathLike,
                        tag: str | None = None) -> dict[str, torch.Tensor]:
    """The full model state dict in fp32 from a checkpoint, whatever precision it trained in.

    Floating tensors come from the fp32 master weights when the job kept them, else from the
    module's own values cast to fp32; other tensors (e.g. integer buffers) are unchanged.
    ZeRO checkpoints (any stage) are consolidated from every rank's shards, model-parallel
    ones from every stage's and slice's. Entries come in the module's ``state_dict()`` order;
    an MoE layer's experts (``...deepspeed_experts.{global id}...``, every expert once,
    whatever ``ep_size`` saved them) in order of their global id (:func:`expert_order`).

    Raises:
        UsageError: no complete checkpoint (or no ``tag``) in ``checkpoint_dir``.
    """
    ds_tag = ds_files.find_tag(checkpoint_dir, tag)
    if ds_tag is not None:
        return _fp32(from_deepspeed.consolidated(ds_tag))
    manifest = fmt.resolve_tag(checkpoint_dir, tag)
    if manifest is None:
        raise UsageError("no complete checkpoint", where=str(checkpoint_dir),
                         hint="pass the directory given to engine.save_checkpoint()")
    tag_dir = Path(checkpoint_dir) / manifest.tag
    shared = fmt.load_file(tag_dir, fmt.SHARED_FILE)
    if manifest.layout:
        values = consolidate(tag_dir, manifest)
    else:
        values = read_by_name(tag_dir, manifest, shared).values
    return _fp32(in_order(values, expert_order(shared.get("state_names") or (), values)))


def _fp32(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value.float() if torch.is_floating_point(value) else value
            for name, value in state.items()}



_EXPERT = re.compile(r"(.*\.deepspeed_experts\.)(\d+)(\..*)")


def expert_order(order: Sequence[str], names: Iterable[str]) -> list[str]:
    """``order`` (rank 0's module ``state_dict()`` names: its local experts only) with
    each MoE layer's experts replaced by every one of ``names`` of that layer, sorted by
    global expert id and then as the local experts' entries came: the order of a module
    holding every expert (``ep_size`` 1)."""
    layers: dict[str, list[tuple[int, str, str]]] = {}
    for name in names:
        m = _EXPERT.fullmatch(name)
        if m is not None:
            layers.setdefault(m.group(1), []).append((int(m.group(2)), m.group(3), name))
    tails: dict[str, dict[str, int]] = {}
    for name in order:
        m = _EXPERT.fullmatch(name)
        if m is not None and m.group(1) in layers:
            seen = tails.setdefault(m.group(1), {})
            seen.setdefault(m.group(3), len(seen))
    out: list[str] = []
    for name in order:
        m = _EXPERT.fullmatch(name)
        if m is None or m.group(1) not in layers:
            out.append(name)
        elif m.group(1) in tails:  # the layer's first entry: all of its experts here
            seen = tails.pop(m.group(1))
            out.extend(n for _, _, n in sorted(
                layers[m.group(1)], key=lambda e: (e[0], seen.get(e[1], len(seen)), e[1])))
    return out
