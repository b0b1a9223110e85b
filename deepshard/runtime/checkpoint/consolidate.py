"""``get_fp32_state_dict``: one whole fp32 state dict from any checkpoint (DeepSpeed's
``zero_to_fp32``), whatever stage, precision, world size or layout wrote it."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ...errors import UsageError
from . import format as fmt
from .by_name import in_order, read_by_name
from .model_parallel import consolidate


def get_fp32_state_dict(checkpoint_dir: str | os.PathLike,
                        tag: str | None = None) -> dict[str, torch.Tensor]:
    """The full model state dict in fp32 from a checkpoint, whatever precision it trained in.

    Floating tensors come from the fp32 master weights when the job kept them, else from the
    module's own values cast to fp32; other tensors (e.g. integer buffers) are unchanged.
    ZeRO checkpoints (any stage) are consolidated from every rank's shards, model-parallel
    ones from every stage's and slice's. Entries come in the module's ``state_dict()`` order.

    Raises:
        UsageError: no complete checkpoint (or no ``tag``) in ``checkpoint_dir``.
    """
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
    ordered = in_order(values, shared.get("state_names") or ())
    return {name: value.float() if torch.is_floating_point(value) else value
            for name, value in ordered.items()}

