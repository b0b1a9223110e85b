"""Carry out an AutoTP plan for inference, loading each rank's slices as it goes.

:func:`shard_for_inference` takes a model (its weights real, or on the meta device when a
checkpoint will fill it), plans it with the training side's AutoTP planner
(:func:`~deepshard.runtime.parallel.autotp.plan_autotp`, with ``pad_vocab`` so GPT-2's
50,257-token vocabulary is split too), and replaces every planned module by its layer from
:mod:`.layers`, filled with exactly this rank's rows or columns read from the
:class:`~.sources.TensorSource`. Every other Linear becomes a replicated
:class:`~.layers.ShardedLinear` (so int8 reaches it), every other parameter and persistent
buffer is read whole, and non-persistent buffers left on the meta device (rotary
frequencies) are rebuilt from the module's config.

HF's ``Conv1D`` (GPT-2: a Linear storing its weight transposed, ``[in, out]``) is turned
into an ``nn.Linear`` first, so the planner sees Linears; its checkpoint tensor is read
transposed.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from deepshard.errors import UsageError
from deepshard.inference.collectives import TPComm
from deepshard.inference.layers import ShardedLinear, VocabShardedEmbedding
from deepshard.inference.sources import Ranges, TensorSource
from deepshard.runtime.parallel.autotp import (
    AttentionPlan,
    HeadChange,
    TPEntry,
    TPPlan,
    plan_autotp,
)
from deepshard.runtime.parallel.autotp_rules import WIDTH_ATTRS, block_names, head_attrs, in_block


@dataclass(frozen=True)
class ShardReport:
    """What sharding did on this rank."""

    plan: TPPlan
    local_bytes: int
    """Bytes of this rank's parameters and buffers after sharding."""
    largest_read: int
    """The most elements of one tensor this rank read: a shard, or a replicated tensor."""
    split_read_whole: tuple[str, ...] = ()
    """Parameters the plan splits that this rank nevertheless read whole (should be none:
    the check of "no rank holds the whole model")."""


def linearize_conv1d(model: nn.Module) -> frozenset[str]:
    """Replace every HF ``Conv1D`` (``weight [in, out]``, ``nf`` outputs) by an
    ``nn.Linear`` computing the same function; returns their names. Real weights are
    transposed; meta ones stay on meta."""
    names = []
    for name, module in list(model.named_modules()):
        if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
            w = module.weight
            linear = nn.Linear(w.shape[0], w.shape[1], bias=module.bias is not None,
                               device=w.device, dtype=w.dtype)
            if w.device.type != "meta":
                with torch.no_grad():
                    linear.weight.copy_(w.t())
                    if module.bias is not None:
                        linear.bias.copy_(module.bias)
            _replace(model, name, linear)
            names.append(name)
    return frozenset(names)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


class _Reader:
    """Model names -> checkpoint keys (with or without the HF base-model prefix), reads
    transposed for former ``Conv1D`` weights, cast to the target dtype."""

    def __init__(self, source: TensorSource, model: nn.Module, transposed: frozenset[str],
                 dtype: torch.dtype | None, where: str) -> None:
        self.source = source
        self.keys = set(source.keys())
        self.prefix = getattr(model, "base_model_prefix", "") or ""
        self.transposed = transposed
        self.dtype = dtype
        self.where = where
        self.largest = 0
        self.whole: set[str] = set()
        self.cache: dict[tuple, torch.Tensor] = {}
        self.aliases: dict[str, list[str]] = {}
        by_id: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), []).append(name)
        for names in by_id.values():
            for name in names:
                self.aliases[name] = [n for n in names if n != name]

    def key(self, name: str) -> str:
        candidates = []
        for alias in [name, *self.aliases.get(name, ())]:  # a tied weight is saved once
            candidates.append(alias)
            if self.prefix:
                candidates += [alias.removeprefix(self.prefix + "."), f"{self.prefix}.{alias}"]
        for key in candidates:
            if key in self.keys:
                return str(key)
        raise UsageError(f"the checkpoint has no tensor {name}", where=self.where,
                         hint="load a checkpoint of this model's architecture (its config "
                              "must match the model given to init_inference)")

    def read(self, name: str, dim: int | None = None, ranges: Ranges = (),
             rows: int | None = None) -> torch.Tensor:
        key = self.key(name)
        found = self.cache.get((key, dim, tuple(ranges), rows))
        if found is not None:  # a tied weight: the very tensor its first user got
            return found
        module = name.rpartition(".")[0]
        flip = module in self.transposed and name.endswith(".weight")
        value = self.source.read(key, None if dim is None else (1 - dim if flip else dim),
                                 ranges, None if flip else rows)
        value = value.t() if flip else value  # a transposed view: F.linear takes it as is
        if dim is None:
            self.whole.add(name)
        self.largest = max(self.largest, value.numel())
        value = value.to(self.dtype) if self.dtype and value.is_floating_point() else value
        if self.aliases.get(name):  # tied in the model: read once
            self.cache[(key, dim, tuple(ranges), rows)] = value
        return value


def _ranges(full: int, sections: tuple[int, ...], rank: int, world: int) -> list[tuple[int, int]]:
    out, start = [], 0
    for size in sections or (full,):
        part = size // world
        out.append((start + rank * part, start + (rank + 1) * part))
        start += size
    return out


def _padded(full: int, rank: int, world: int) -> tuple[int, tuple[int, int]]:
    rows = -(-full // world)
    return rows, (min(rank * rows, full), min((rank + 1) * rows, full))


def _build(e: TPEntry, module: nn.Module, reader: _Reader, comm: TPComm, rank: int,
           world: int) -> nn.Module:
    w = f"{e.name}.weight"
    b = f"{e.name}.bias"
    if e.kind == "vocab":
        rows, span = _padded(e.shape[0], rank, world) if e.padded else (
            e.shape[0] // world, (rank * e.shape[0] // world, (rank + 1) * e.shape[0] // world))
        layer = VocabShardedEmbedding(e.shape[0], e.shape[1], rows, comm, rank=rank,
                                      padding_idx=getattr(module, "padding_idx", None))
        layer.weight.data = reader.read(w, 0, [span], rows)
        return layer
    if e.kind == "head_split":
        local = e.shape[1] // world
        part = nn.Embedding(e.shape[0], local, device="meta")
        part.weight = nn.Parameter(reader.read(w, 1, [(rank * local, (rank + 1) * local)]),
                                   requires_grad=False)
        return part
    out_f, in_f = e.shape
    if e.kind == "column":
        if e.padded:
            rows, span = _padded(out_f, rank, world)
            spans: list[tuple[int, int]] = [span]
        else:
            spans = _ranges(out_f, e.sections, rank, world)
            rows = sum(hi - lo for lo, hi in spans)
        layer = ShardedLinear("column", in_f, out_f, (rows, in_f), e.bias, comm,
                              gather_output=e.gather_output, rank=rank, device="meta")
        layer.weight = nn.Parameter(reader.read(w, 0, spans, rows), requires_grad=False)
        if e.bias:
            layer.bias = nn.Parameter(reader.read(b, 0, spans, rows), requires_grad=False)
        return layer
    if e.kind == "row":
        local = in_f // world
        layer = ShardedLinear("row", in_f, out_f, (out_f, local), e.bias, comm,
                              input_is_parallel=e.input_is_parallel, rank=rank, device="meta")
        layer.weight = nn.Parameter(reader.read(w, 1, [(rank * local, (rank + 1) * local)]),
                                    requires_grad=False)
    else:
        layer = ShardedLinear("replicate", in_f, out_f, (out_f, in_f), e.bias, comm,
                              device="meta")
        layer.weight = nn.Parameter(reader.read(w), requires_grad=False)
    if e.bias:
        layer.bias = nn.Parameter(reader.read(b), requires_grad=False)
    return layer


def shard_for_inference(model: nn.Module, source: TensorSource, comm: TPComm, rank: int,
                        world: int,
                        *, dtype: torch.dtype | None = None, where: str = "checkpoint",
                        policy: Mapping[str, str] | None = None) -> ShardReport:
    """Shard ``model`` in place for rank ``rank`` of ``world`` tensor-parallel ranks
    (whose collectives are ``comm``), reading weights from ``source``; see the module
    docstring.

    ``policy`` overrides the planner's kind for named modules (``"row"`` / ``"column"`` /
    ``"replicate"``), DeepSpeed's ``injection_policy`` turned into names by the engine.
    """
    transposed = linearize_conv1d(model)
    plan = plan_autotp(model, world, pad_vocab=True)
    if policy:
        plan = _override(model, plan, policy, world)
    if world > 1:
        _check_split(model, plan)
    reader = _Reader(source, model, transposed, dtype, where)
    modules = dict(model.named_modules())
    built: dict[str, nn.Module] = {}
    for e in plan.entries:
        if e.kind != "replicate" or type(modules[e.name]) is nn.Linear:
            built[e.name] = _build(e, modules[e.name], reader, comm, rank, world)
    for name, module in modules.items():
        if type(module) is nn.Linear and name not in built:
            e = TPEntry(name, "replicate", "", tuple(module.weight.shape),
                        module.bias is not None)
            built[name] = _build(e, module, reader, comm, rank, world)
    for names in plan.ties:
        for name in names[1:]:
            built[name].weight = built[names[0]].weight
    for name, layer in built.items():
        _replace(model, name, layer)
    for a in plan.attention:
        for h in a.heads:
            setattr(modules[a.module], h.attribute, h.local_heads)
    _load_rest(model, reader, set(built))
    _rebuild_meta_buffers(model)
    local = sum(t.numel() * t.element_size() for t in
                {id(t): t for t in [*model.parameters(), *model.buffers()]}.values())
    split = {f"{e.name}.{p}" for e in plan.entries if e.kind != "replicate"
             for p in (("weight", "bias") if e.kind == "column" else ("weight",))}
    return ShardReport(plan, local, reader.largest, tuple(sorted(reader.whole & split)))


def _check_split(model: nn.Module, plan: TPPlan) -> None:
    """At tp_size > 1 a block whose Linears all stay whole means AutoTP has no rule for it:
    an error naming it, never a silent replica."""
    blocks = block_names(model)
    for block in sorted(blocks):
        inside = [e for e in plan.entries if in_block(e.name, frozenset({block}))
                  and e.kind != "head_split" and len(e.shape) == 2]
        if inside and all(e.kind == "replicate" for e in inside):
            cls = type(model.get_submodule(block)).__name__
            raise UsageError(f"AutoTP has no rule to split {cls} ({block}): "
                             f"{', '.join(e.name.rsplit('.', 1)[-1] for e in inside)} "
                             "would all stay whole", where="init_inference: tensor_parallel",
                             hint=f"pass injection_policy={{{cls}: ('<name of each Linear "
                                  "writing back to the residual stream>', ...)}")


def _override(model: nn.Module, plan: TPPlan, policy: Mapping[str, str], world: int
              ) -> TPPlan:
    entries = []
    names = {e.name for e in plan.entries}
    for name in policy:
        if name not in names:
            raise UsageError(f"injection_policy names {name}, which is not a Linear of the "
                             "model", where="init_inference: injection_policy",
                             hint="name the Linears that write back to the residual stream "
                                  "(e.g. 'self_attn.o_proj', 'mlp.down_proj')")
    from dataclasses import replace

    for e in plan.entries:
        kind = policy.get(e.name)
        if kind is None or kind == e.kind:
            entries.append(e)
        elif kind == "row" and e.shape[1] % world == 0:
            entries.append(replace(e, kind="row", reason="injection_policy",
                                   input_is_parallel=True))
        elif kind == "column" and e.shape[0] % world == 0:
            entries.append(replace(e, kind="column", reason="injection_policy"))
        else:
            entries.append(replace(e, kind="replicate", reason="injection_policy"))
    attention = list(plan.attention)
    planned = {a.module for a in plan.attention if a.strategy == "heads"}
    for e in entries:
        owner_name = e.name.rpartition(".")[0]
        if e.kind != "row" or e.reason != "injection_policy" or owner_name in planned:
            continue
        owner = model.get_submodule(owner_name)
        head, kv = head_attrs(owner)
        pairs = [p for p in (head, kv) if p] + [
            (attr, e.shape[1]) for attr in WIDTH_ATTRS if getattr(owner, attr, None) == e.shape[1]]
        attention.append(AttentionPlan(owner_name, "heads", "injection_policy", tuple(
            HeadChange(attr, value, value // world) for attr, value in pairs)))
        planned.add(owner_name)
    return TPPlan(plan.tp_size, tuple(entries), tuple(attention), plan.ties)


def _load_rest(model: nn.Module, reader: _Reader, done: set[str]) -> None:
    """Parameters and persistent buffers outside the built layers: read whole where still on
    the meta device (a model with real weights keeps its own)."""
    seen: dict[int, nn.Parameter] = {}
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        owner, _, attr = name.rpartition(".")
        if owner in done:
            continue
        module = model.get_submodule(owner) if owner else model
        if id(p) in seen:
            setattr(module, attr, seen[id(p)])
            continue
        if p.device.type == "meta":
            new = nn.Parameter(reader.read(name), requires_grad=False)
        else:
            new = nn.Parameter(p.detach().to(reader.dtype) if reader.dtype and
                               p.is_floating_point() else p.detach(), requires_grad=False)
        seen[id(p)] = new
        setattr(module, attr, new)
    for name, buf in list(model.named_buffers()):
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        if buf.device.type == "meta" and attr not in module._non_persistent_buffers_set:
            module._buffers[attr] = reader.read(name)


def _rebuild_meta_buffers(model: nn.Module) -> None:
    """Non-persistent buffers still on meta (HF rotary embeddings' ``inv_freq``): computed
    again by building the module anew from its ``config`` on the CPU."""
    for name, module in model.named_modules():
        meta = [k for k, b in module._buffers.items() if b is not None and b.device.type == "meta"]
        if not meta:
            continue
        params = list(inspect.signature(type(module).__init__).parameters)[1:]
        if getattr(module, "config", None) is None or params[:1] != ["config"]:
            raise UsageError(f"buffer {name}.{meta[0]} is on the meta device and is not in "
                             "the checkpoint", where=name or type(module).__name__,
                             hint="build the model with its buffers on the CPU (accelerate's "
                                  "init_empty_weights(include_buffers=False))")
        with torch.device("cpu"):
            fresh = type(module)(module.config)
        for k in meta:
            module._buffers[k] = fresh._buffers[k]
        for k, v in vars(fresh).items():
            if isinstance(v, (int, float)) and not k.startswith("_"):
                setattr(module, k, v)
