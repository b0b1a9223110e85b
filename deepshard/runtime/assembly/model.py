"""Model preparation for ``initialize``: device and training dtype, ``zero.Init``
parameters made whole where the job needs them whole, the model-parallel layout applied
(AutoTP, tied weights), and every data-parallel rank started from rank 0's weights (MoE
experts: from the first rank holding each)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from deepshard.comm import collectives as comm
from deepshard.runtime.extensions import Extensions
from deepshard.runtime.parallel.expert_groups import configure
from deepshard.runtime.parallel.expert_params import is_moe_param
from deepshard.runtime.zero.spec import ZeroSpec


def training_device() -> torch.device:
    """This worker's device: its local rank's GPU, else the CPU."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


@dataclass(frozen=True)
class Prepared:
    """What :func:`prepare_model` made of the user's model."""

    module: torch.nn.Module
    excluded: frozenset[int]
    """ids of parameters the gradient norm leaves out on this rank (replicas counted on
    another model-parallel rank)."""
    replaced: dict[int, torch.nn.Parameter]
    """id of a parameter the user passed (in ``model_parameters`` or a client optimizer)
    -> the parameter that now stands in its place (AutoTP builds new, sharded ones)."""


def prepare_model(model: torch.nn.Module, cfg: Any, zero: ZeroSpec, extensions: Extensions,
                  layout: Any, group: Any, dp_world: int, rank: int,
                  device: torch.device) -> Prepared:
    """The module placed, cast, sharded by the layout and made identical across
    data-parallel ranks; the features' model hooks run before the layout (AutoEP) and
    after it (sequence parallelism)."""
    module = place(model, cfg, device)
    if not zero.shards_parameters or (layout is not None and layout.topology.tensor > 1):
        from deepshard.runtime.zero.init import materialize

        # built under zero.Init: whole again below stage 3, and for AutoTP to cut it
        materialize(module)
    replaced: dict[int, torch.nn.Parameter] = {}
    for hook in extensions.model_hooks("before_layout"):
        replaced.update(hook(module, cfg, group, rank))
    before = list(module.named_parameters(remove_duplicate=False))
    excluded: frozenset[int] = frozenset()
    if layout is not None:
        excluded = layout.prepare(module, broadcast_from_rank0, rank)
    after = dict(module.named_parameters(remove_duplicate=False))
    replaced.update({id(p): after[n] for n, p in before
                     if n in after and after[n] is not p})
    for hook in extensions.model_hooks("after_layout"):
        replaced.update(hook(module, cfg, group, rank))
    broadcast_from_rank0(module, group, dp_world, _broadcast_experts(module, group, dp_world))
    return Prepared(module, excluded, replaced)


@torch.no_grad()
def place(model: torch.nn.Module, cfg, device: torch.device) -> torch.nn.Module:
    """``model`` on ``device``, its floating-point parameters in the config's training
    dtype (fp16 / bf16 / as they are). Buffers keep their dtype, as DeepSpeed 0.19.8's
    engine keeps them (an fp32 rotary ``inv_freq`` stays fp32)."""
    model = model.to(device)
    dtype = torch.float16 if cfg.fp16.enabled else torch.bfloat16 if cfg.bf16.enabled else None
    if dtype is not None:
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
    return model


@torch.no_grad()
def broadcast_from_rank0(module: torch.nn.Module, group, world: int,
                         skip: frozenset[int] = frozenset()) -> None:
    """Every rank starts from rank 0's weights and buffers (as DeepSpeed's engine does),
    but for the tensors whose ``id`` is in ``skip``."""
    if world == 1:
        return
    tensors = [t for t in (*module.parameters(), *module.buffers()) if id(t) not in skip]
    _broadcast(tensors, dist.get_global_rank(group, 0) if group is not None else 0, group)


@torch.no_grad()
def _broadcast_experts(module: torch.nn.Module, group, world: int) -> frozenset[int]:
    """MoE: the expert-parallel groups made (:func:`~deepshard.runtime.parallel.
    expert_groups.configure`) and
    every expert started from the first rank of its expert-data-parallel group (the ranks
    of an expert-parallel group hold different experts); the ids of the expert
    parameters."""
    experts = [p for p in module.parameters() if is_moe_param(p)]
    if not experts or world == 1:
        return frozenset(id(p) for p in experts)
    for name, eg in configure(module, group).items():
        if len(eg.edp_ranks) > 1:
            _broadcast([p for p in experts if p.group_name == name], eg.edp_ranks[0],
                       eg.edp_group)
    return frozenset(id(p) for p in experts)


def _broadcast(tensors, src: int, group) -> None:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group_tensors in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group_tensors])
        comm.broadcast(flat, src=src, group=group)
        offset = 0
        for t in group_tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
