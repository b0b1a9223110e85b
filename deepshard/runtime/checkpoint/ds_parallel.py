"""What DeepSpeed's pipeline and MoE checkpoints add to its data-parallel ones, mapped onto
parameter names (the by-name form :mod:`.from_deepspeed` builds).

Pipelines: every layer's ``state_dict()`` is a file of its own (``layer_NN-...``, keys
without the layer's global index ``NN``, which DeepSpeed's ``PipelineModule`` names its
parameters by: ``NN.weight``); every stage has its model file (``mp_rank_SS``: counters,
schedule, ``param_shapes`` of its parameters by global name) and its optimizer partitions.
So a pipeline checkpoint reads back by name whole, whatever stages saved it.

MoE: every expert is a file of its own under its global id; the model file holds the rest.
At ZeRO 1-2 the experts' fp32 masters and optimizer state are a param group of their own
(DeepSpeed names it ``ep_size_N``) partitioned over each expert's data-parallel group
(the ranks ``e, e + N, e + 2N...`` for expert-parallel rank ``e``, DeepSpeed's default
layout), under the *local* names of that rank's experts: local expert ``i`` of rank ``e``
is global expert ``e * L + i`` (``L`` experts per rank).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from deepshard.errors import UsageError
from deepshard.runtime.checkpoint import ds_files

EXPERT = re.compile(r"(.*\.deepspeed_experts\.)(\d+)(\..*)")
"""An expert parameter's name: (its layer's experts prefix, its id, the rest)."""
MOE_GROUP = "ep_size_"
"""DeepSpeed's name for the param group of an expert-parallel size's experts."""
S = TypeVar("S")


# -- MoE -------------------------------------------------------------------------------
def expert_parallel_size(group: Mapping[str, Any]) -> int:
    """The expert-parallel size of an optimizer param group's experts (1: dense)."""
    name = group.get("name")
    if not group.get("moe") or not isinstance(name, str) or not name.startswith(MOE_GROUP):
        return 1
    size = name.removeprefix(MOE_GROUP)
    return int(size) if size.isdigit() and int(size) > 0 else 1


def partition_ranks(ep_size: int, ep_rank: int, world: int) -> range:
    """The data-parallel ranks whose optimizer files hold expert-parallel rank
    ``ep_rank``'s experts' partitions, in partition order."""
    return range(ep_rank, world, ep_size)


def global_names(shapes: Mapping[str, S], ep_rank: int) -> dict[str, S]:
    """An MoE param group's ``param_shapes`` as saved by expert-parallel rank ``ep_rank``
    (its local experts ``0..L-1`` of each layer) under the experts' global names."""
    local = _experts_per_layer(shapes)
    out = {}
    for name, shape in shapes.items():
        m = EXPERT.fullmatch(name)
        out[name if m is None else f"{m[1]}{ep_rank * local[m[1]] + int(m[2])}{m[3]}"] = shape
    return out


def _experts_per_layer(names: Iterable[str]) -> dict[str, int]:
    """Each MoE layer's (experts prefix's) number of experts among ``names``."""
    counts: dict[str, int] = {}
    for name in names:
        m = EXPERT.fullmatch(name)
        if m is not None:
            counts[m[1]] = max(counts.get(m[1], 0), int(m[2]) + 1)
    return counts


def expert_values(found: ds_files.Files, top: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Every expert's entries from its file, in (layer, global id) order, after checking
    that each MoE layer has the ``num_experts`` files the model file records.

    Raises:
        UsageError: an expert file missing (naming it).
    """
    have: dict[int, int] = {}
    for layer, _, _ in found.experts:
        have[layer] = have.get(layer, 0) + 1
    counts = top.get("num_experts") or []
    for layer, count in enumerate(counts if isinstance(counts, list) else []):
        if have.get(layer, 0) < count:
            name = ds_files.expert_file(layer, have.get(layer, 0))
            raise UsageError(f"{name} is missing (MoE layer {layer} has {count} experts, "
                             f"{have.get(layer, 0)} files here)", where=str(found.tag_dir),
                             hint="copy the whole tag directory (every expert's file)")
    values: dict[str, torch.Tensor] = {}
    for _, _, path in found.experts:
        values.update(ds_files.load(path))
    return values


def rank_experts(values: Mapping[str, torch.Tensor], ep_size: int, ep_rank: int
                 ) -> dict[str, torch.Tensor]:
    """The expert entries of ``values`` (global names) that expert-parallel rank
    ``ep_rank`` of ``ep_size`` holds (each layer's experts cut in ``ep_size`` blocks), in
    order."""
    counts = _experts_per_layer(values)
    out = {}
    for name, value in values.items():
        m = EXPERT.fullmatch(name)
        if m is not None and int(m[2]) // max(counts[m[1]] // ep_size, 1) == ep_rank:
            out[name] = value
    return out


def with_experts(order: Sequence[str], experts: Iterable[str]) -> list[str]:
    """``order`` (a model file's module entries: DeepSpeed leaves experts out) with each MoE
    layer's ``experts`` after the last entry of their layer (its gate), else at the end:
    the order of a module holding every expert."""
    layers: dict[str, list[str]] = {}
    for name in experts:
        m = EXPERT.fullmatch(name)
        prefix = m[1].removesuffix("experts.deepspeed_experts.") if m else ""
        layers.setdefault(prefix, []).append(name)
    out = list(order)
    for prefix, names in layers.items():
        at = max((i + 1 for i, n in enumerate(out) if prefix and n.startswith(prefix)),
                 default=len(out))
        out[at:at] = names
    return out


# -- pipelines ---------------------------------------------------------------------------
def layer_values(found: ds_files.Files) -> dict[str, torch.Tensor]:
    """Every layer file's entries under the global names (``NN.<key>``)."""
    return {f"{index}.{key}": value for index, path in found.layers
            for key, value in ds_files.load(path).items()}


def check_layers(found: ds_files.Files, names: Iterable[str]) -> None:
    """Every layer a stage's parameter ``names`` (``NN.<key>``) belong to has its file.

    Raises:
        UsageError: naming the missing layer file.
    """
    have = {index for index, _ in found.layers}
    for name in names:
        head = name.split(".", 1)[0]
        if head.isdigit() and int(head) not in have:
            raise UsageError(f"{ds_files.layer_file(int(head))} is missing (it holds {name})",
                             where=str(found.tag_dir),
                             hint="copy the whole tag directory (every layer's file)")


def merged_top(tops: Sequence[Mapping[str, Any]], module: dict[str, torch.Tensor]) -> dict:
    """One model file's top level for a pipeline's stages': stage 0's counters, schedule
    and client state, the whole ``module`` (from the layer files), and every stage's
    ``param_shapes`` (group by group), buffers and frozen shapes."""
    groups: list[dict] = []
    for top in tops:
        for g, shapes in enumerate(top.get("param_shapes") or []):
            if g == len(groups):
                groups.append({})
            groups[g].update(shapes)
    frozen: dict = {}
    for top in tops:
        frozen.update(top.get("frozen_param_shapes") or {})
    return {**tops[0], "module": module, "param_shapes": groups or tops[0].get("param_shapes"),
            "buffer_names": [n for top in tops for n in top.get("buffer_names") or ()],
            "frozen_param_shapes": frozen or None}

