"""Checkpoints of model-parallel jobs (pipeline and/or tensor parallel).

Every rank holds a different part of the model, so every rank writes its own module state
(its stage's layers, its tensor-parallel slices, with the slicing recorded) into its rank
file, next to its ZeRO shards; the manifest records the layout. Such a checkpoint resumes
at the same layout (any ZeRO stage), and :func:`consolidate` reassembles the whole model:
the slices of each stage are merged along their split dimension, and the stages' layers
(named by their global index) are joined.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import cast

import torch

from deepshard.errors import UsageError
from deepshard.runtime.checkpoint import format as fmt
from deepshard.runtime.checkpoint.by_name import ByName, in_order, read_by_name
from deepshard.runtime.parallel.topology import Topology
from deepshard.runtime.parallel.tp_shards import ShardSpec, tp_merge_state_dicts


def layout_of(topology: Topology) -> dict[str, int]:
    """The manifest's record of a layout."""
    return {"pipe": topology.pipe, "data": topology.data, "tensor": topology.tensor}


def coordinate_ranks(layout: dict, pipe: int, tensor: int) -> list[int]:
    """Global ranks of the data-parallel replicas at one (pipe, tensor) coordinate."""
    topo = Topology(layout["pipe"], layout["data"], layout["tensor"])
    return [topo.rank(pipe, d, tensor) for d in range(topo.data)]


def by_name(tag_dir: Path, manifest: fmt.Manifest, pipe: int,
            tensor: int, need=None) -> tuple[ByName, dict]:
    """One (pipe, tensor) coordinate's model and optimizer state by name, and its payload."""
    ranks = coordinate_ranks(cast(dict, manifest.layout), pipe, tensor)  # model-parallel: set
    own = fmt.load_file(tag_dir, fmt.rank_file(ranks[0]))["mp"]
    local = replace(manifest, world_size=len(ranks))
    return read_by_name(tag_dir, local, own, ranks, need), own


def check_same_layout(manifest: fmt.Manifest, topology: Topology | None,
                      path: Path) -> None:
    """A model-parallel checkpoint resumes only at the layout that wrote it."""
    here = layout_of(topology) if topology is not None else None
    if manifest.layout != here:
        raise UsageError(f"the checkpoint's layout {manifest.layout or 'data parallel'} is "
                         f"not this job's {here or 'data parallel'}", where=str(path),
                         hint="resume with the same pipeline.stages, tensor_parallel."
                              "autotp_size and world size, or consolidate it with "
                              "deepshard.get_fp32_state_dict() and load that into the model")


def consolidate(tag_dir: Path, manifest: fmt.Manifest) -> dict[str, torch.Tensor]:
    """The whole model's state dict from a model-parallel checkpoint."""
    layout = cast(dict, manifest.layout)  # a model-parallel checkpoint's: set
    full: dict[str, torch.Tensor] = {}
    for pipe in range(layout["pipe"]):
        slices, spec_map = [], {}
        for tensor in range(layout["tensor"]):
            names, own = by_name(tag_dir, manifest, pipe, tensor)
            slices.append(in_order(names.values, own.get("state_names") or ()))
            spec_map = {n: ShardSpec(dim, tuple(sections))
                        for n, (dim, sections) in own["tp_layout"].items()}
        full.update(tp_merge_state_dicts(slices, spec_map) if len(slices) > 1 else slices[0])
    return full
