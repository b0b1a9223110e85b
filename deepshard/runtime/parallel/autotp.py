"""AutoTP: tensor parallelism for a plain GPT-style model, without rewriting it.

Two steps, in the spirit of DeepSpeed's AutoTP:

- :func:`plan_autotp` (planning; reads the model, changes nothing) decides for every
  ``nn.Linear`` and ``nn.Embedding`` whether it becomes column-parallel, row-parallel,
  vocabulary-parallel or stays replicated, with the reason, and for every attention module
  how its heads are split. The result, a frozen :class:`TPPlan`, prints as a table
  (:meth:`TPPlan.describe`) and gives the checkpoint layout (:meth:`TPPlan.param_layout`).
- :func:`apply_autotp` (the side effect) swaps the modules in place for the layers of
  :mod:`.tensor`, built from the dense weights, and divides the head counts, so that the
  model's own ``forward``, unchanged, computes the same function on every rank of the group.

Rules, inside each transformer block (an item of an ``nn.ModuleList``/``nn.Sequential``),
per module that directly owns the Linears:

- by name (:mod:`.autotp_rules`): layers that read the block's input (q/k/v, fused qkv,
  fc/up/gate) are column-parallel; the ones writing back to the residual stream (proj,
  o_proj, fc_out, down_proj...) row-parallel. Each row layer is paired with its column
  layers by width (its input width = their output width); a layer without a partner stays
  replicated.
- unknown names, outside attention modules: a Linear expanding ``d -> m`` is
  column-parallel when exactly one Linear contracting ``m -> d`` sits beside it (row).
- attention: when the module owning q/k/v has a head-count attribute (``n_head``,
  ``num_heads``, ``num_attention_heads``, ``n_heads``; and ``num_key_value_heads``-like
  ones for grouped-query attention), each rank gets whole heads (a fused qkv is split per
  section, so q, k and v each keep their heads) and the attributes are divided by T (an
  error when they do not divide). A shape-only meta-device trial of the module's forward
  (:mod:`.autotp_trial`) checks that the forward really follows the attribute; when it does
  not (``examples/gpt.py``'s ``Block`` reshapes with its input's full width) or there is
  no attribute, attention falls back to *gather*: q/k/v are computed sharded and
  all-gathered, attention runs on all heads on every rank, and the output projection is
  row-parallel over its replicated input. Both ways are exact.
- outside the blocks: the token embedding is vocabulary-parallel and the LM head
  column-parallel over the vocabulary when T divides the vocabulary, else both replicated.
  With ``gather_logits=True`` (the default) the head all-gathers its logits so a model
  that computes ``F.cross_entropy`` itself (like ``examples/gpt.py``) works unchanged;
  with ``False`` the logits stay sharded and the model must call
  :func:`~.tensor.vocab_parallel_cross_entropy`. Everything else (norms, position
  embeddings, other Linears) is replicated. Tied weights stay tied when both ends split
  the same way, else both are replicated.
- MoE layers (:func:`~deepshard.runtime.parallel.expert_groups.moe_module_names`: the gate,
  the experts, a residual MLP) are left whole, replicated over the tensor-parallel group like a norm
  (DeepSpeed's default, without expert tensor parallelism): the group's ranks route the
  same tokens and compute the same output; the expert-parallel groups are formed inside
  each data-parallel group (the ranks of one tensor-parallel rank).

Use (what ``"tensor_parallel": {"autotp_size": T}`` does)::

    groups = ProcessGroups.create(Topology.from_config(world, tp_size=T))
    plan = plan_autotp(model, T)          # log plan.describe() on rank 0
    apply_autotp(model, plan, groups.tensor_group)

Every rank of a tensor-parallel group must hold the same dense model before
:func:`apply_autotp` (same seed, or the same checkpoint loaded) and feed it the same
batch. Afterwards the parameters named in :meth:`TPPlan.param_layout` are this rank's
shards: their gradients are the exact gradients of those slices and must never be summed
across the tensor group (only across the data group, as any parameter). Every other
parameter (norms, position embeddings, row-parallel biases, replicated Linears) is
replicated and gets the same gradient on every rank of the tensor group, because the
residual stream and its gradient are all-reduced inside the layers; it needs no
tensor-group reduction either. A global gradient norm sums the squares of the sharded
gradients over the tensor group and counts the replicated ones once. Elementwise
optimizers (Adam, AdamW, SGD) act on shards exactly as on the dense model; per-tensor
norms (LAMB's trust ratio) would see a shard's norm instead of the tensor's.
Checkpoints: :func:`~.tensor.gather_full_state_dict` gives the dense state dict (a
collective), :func:`~.tp_shards.tp_merge_state_dicts` merges per-rank ones and
:func:`~.tp_shards.tp_shard_state_dict` cuts a dense one for a rank, with the layout
``plan.param_layout()`` (equal to ``tensor.tp_layout(model)`` after apply).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, cast

from torch import nn

from deepshard.errors import UsageError
from deepshard.runtime.parallel.autotp_rules import (
    COLUMN_ROLES,
    HEAD_NAMES,
    POSITION_EMBEDDING_NAMES,
    Q_NAMES,
    ROW_ROLES,
    TOKEN_EMBEDDING_NAMES,
    WIDTH_ATTRS,
    Role,
    block_names,
    config_heads,
    head_attrs,
    in_block,
    leaf,
    role_of,
)
from deepshard.runtime.parallel.autotp_trial import trial_head_sharding
from deepshard.runtime.parallel.tensor import (
    ColumnParallelLinear,
    Group,
    RowParallelLinear,
    VocabParallelEmbedding,
    tp_rank,
    tp_world_size,
)
from deepshard.runtime.parallel.tp_shards import ShardSpec, check_divisible

Kind = Literal["column", "row", "vocab", "head_split", "replicate"]


@dataclass(frozen=True)
class TPEntry:
    """What AutoTP does with one ``nn.Linear`` / ``nn.Embedding``."""

    name: str
    """Qualified module name (``model.get_submodule(name)``)."""
    kind: Kind
    """column: ColumnParallelLinear; row: RowParallelLinear; vocab:
    VocabParallelEmbedding; head_split: an embedding holding one value per attention head
    (T5's relative position bias), split along its heads, no communication; replicate:
    left as it is on every rank."""
    reason: str
    shape: tuple[int, int]
    """The dense weight's shape: ``(out, in)`` for a Linear, ``(num, dim)`` for an
    Embedding."""
    bias: bool = False
    sections: tuple[int, ...] = ()
    """column: sizes of the fused outputs split separately (q, k, v or gate, up)."""
    gather_output: bool = False
    """column: all-gather the output (the LM head; attention's q/k/v under *gather*)."""
    input_is_parallel: bool = True
    """row: the input is already sharded (False: replicated; the layer slices it)."""
    padded: bool = False
    """vocab / LM-head column: the vocabulary does not divide by T and each rank holds
    ``ceil(V / T)`` rows, the last rank's padded (``plan_autotp(pad_vocab=True)``, inference
    only; :func:`apply_autotp` refuses it)."""

    def weight_spec(self) -> ShardSpec | None:
        """How the weight is split (None: replicated)."""
        return {"column": ShardSpec(0, self.sections), "row": ShardSpec(1),
                "vocab": ShardSpec(0), "head_split": ShardSpec(1)}.get(self.kind)


@dataclass(frozen=True)
class HeadChange:
    """A head-count attribute divided by T."""

    attribute: str
    heads: int
    local_heads: int


@dataclass(frozen=True)
class AttentionPlan:
    """How one attention module (the owner of q, k, v) is split."""

    module: str
    strategy: Literal["heads", "gather"]
    """heads: each rank computes 1/T of the heads; gather: q/k/v are all-gathered and
    every rank computes all heads."""
    reason: str
    heads: tuple[HeadChange, ...] = ()


@dataclass(frozen=True)
class TPPlan:
    """Everything :func:`apply_autotp` will do; pure data, printable."""

    tp_size: int
    entries: tuple[TPEntry, ...]
    attention: tuple[AttentionPlan, ...] = ()
    ties: tuple[tuple[str, ...], ...] = ()
    """Modules sharing one weight that stay tied after sharding."""
    _by_name: dict[str, TPEntry] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {e.name: e for e in self.entries})

    def entry(self, name: str) -> TPEntry:
        """The entry of module ``name``."""
        return self._by_name[name]

    def kinds(self) -> dict[str, Kind]:
        """Module name -> kind, for every planned module."""
        return {e.name: e.kind for e in self.entries}

    def param_layout(self) -> dict[str, ShardSpec]:
        """``state_dict`` name -> split of every parameter the plan shards (others are
        replicated): the layout for :func:`~.tp_shards.tp_shard_state_dict` and
        :func:`~.tp_shards.tp_merge_state_dicts`."""
        layout = {}
        for e in self.entries:
            spec = e.weight_spec()
            if spec is not None:
                layout[f"{e.name}.weight"] = spec
                if e.bias and e.kind == "column":
                    layout[f"{e.name}.bias"] = spec
        return layout

    def describe(self) -> str:
        """A table of the plan, one module per line."""
        width = max((len(e.name) for e in self.entries), default=4)
        lines = [f"AutoTP plan, tensor-parallel size {self.tp_size}"]
        for e in self.entries:
            extra = "".join([f" [sections={list(e.sections)}]" if e.sections else "",
                             " [gather_output]" if e.gather_output else "",
                             " [input replicated]" if e.kind == "row" and not
                             e.input_is_parallel else ""])
            lines.append(f"  {e.name:<{width}}  {e.kind:<9} {e.reason}{extra}")
        for a in self.attention:
            changes = ", ".join(f"{h.attribute} {h.heads} -> {h.local_heads}" for h in a.heads)
            lines.append(f"  attention {a.module or '<root>'}: {a.strategy}"
                         f"{' (' + changes + ')' if changes else ''}: {a.reason}")
        lines.extend(f"  tied: {', '.join(t)}" for t in self.ties)
        return "\n".join(lines)


def plan_autotp(model: nn.Module, tp_size: int, *, gather_logits: bool = True,
                pad_vocab: bool = False) -> TPPlan:
    """Decide how to split ``model`` over ``tp_size`` ranks (reads the model only).

    ``pad_vocab``: split a token embedding / LM head whose vocabulary does not divide by
    ``tp_size`` into ``ceil(V / T)`` rows per rank (:attr:`TPEntry.padded`) instead of
    replicating it; inference's layers support that, :func:`apply_autotp` does not.

    Raises :class:`UsageError` when a layer chosen for splitting does not divide by
    ``tp_size`` (naming the layer and its sizes), or an attention module's head count
    does not.
    """
    if not isinstance(tp_size, int) or tp_size < 1:
        raise UsageError(f"tensor-parallel size must be a positive integer, not {tp_size!r}",
                         where="tensor_parallel.autotp_size", hint="set it to e.g. 2")
    from deepshard.runtime.parallel.expert_groups import moe_module_names

    every = dict(model.named_modules())
    moe = moe_module_names(model)
    modules = {n: m for n, m in every.items() if n not in moe}
    blocks = block_names(model)
    linears = {n: m for n, m in modules.items() if type(m) is nn.Linear}
    embeddings = {n: m for n, m in modules.items() if type(m) is nn.Embedding}
    entries = _plan_vocab(linears, embeddings, blocks, tp_size, gather_logits, pad_vocab)
    for name, module in modules.items():
        if isinstance(module, (nn.Linear, nn.Embedding)) and type(module) not in (
                nn.Linear, nn.Embedding):
            entries[name] = _replicate(name, module, f"{type(module).__name__} subclasses "
                                       "nn.Linear/nn.Embedding: its forward may differ")
    attention = []
    by_parent: defaultdict[str, dict[str, nn.Linear]] = defaultdict(dict)
    for name, linear in linears.items():
        if name not in entries and in_block(name, blocks):
            by_parent[name.rpartition(".")[0]][name] = linear
    for parent in sorted(by_parent, key=lambda p: -p.count(".")):  # inner modules first
        found, attn = _plan_owner(modules[parent], parent, by_parent[parent], entries,
                                  tp_size, embeddings)
        entries.update(found)
        attention.extend(attn)
    for name, module in linears.items() | embeddings.items():
        if name not in entries:
            entries[name] = _replicate(name, module, "outside the transformer blocks"
                                       if not in_block(name, blocks) else "no rule applies")
    for name in moe:
        if isinstance(every[name], (nn.Linear, nn.Embedding)):
            entries[name] = _replicate(name, every[name], "inside an MoE layer (the layer "
                                       "is replicated over the tensor-parallel group)")
    entries, ties = _reconcile_ties(every, entries)
    order = {name: i for i, name in enumerate(every)}
    return TPPlan(tp_size, tuple(sorted(entries.values(), key=lambda e: order[e.name])),
                  tuple(attention), ties)


def _shape(module: nn.Module) -> tuple[int, int]:
    return tuple(module.weight.shape)


def _replicate(name: str, module: nn.Module, reason: str) -> TPEntry:
    return TPEntry(name, "replicate", reason, _shape(module),
                   getattr(module, "bias", None) is not None)


def _column(name: str, linear: nn.Linear, reason: str, tp_size: int, **kw) -> TPEntry:
    entry = TPEntry(name, "column", reason, _shape(linear), linear.bias is not None, **kw)
    check_divisible(f"{name} (Linear {linear.in_features} -> {linear.out_features}, "
                    "column-parallel)", linear.out_features, cast(ShardSpec, entry.weight_spec()),
                    tp_size)
    return entry


def _row(name: str, linear: nn.Linear, reason: str, tp_size: int, **kw) -> TPEntry:
    check_divisible(f"{name} (Linear {linear.in_features} -> {linear.out_features}, "
                    "row-parallel)", linear.in_features, ShardSpec(1), tp_size)
    return TPEntry(name, "row", reason, _shape(linear), linear.bias is not None, **kw)


def _plan_vocab(linears: Mapping[str, nn.Linear], embeddings: Mapping[str, nn.Embedding],
                blocks: frozenset[str], tp_size: int, gather_logits: bool,
                pad_vocab: bool = False) -> dict[str, TPEntry]:
    """The token embedding(s), the LM head(s) and the other embeddings."""
    outside = {n: m for n, m in linears.items() if not in_block(n, blocks)}
    heads = [n for n in outside if leaf(n) in HEAD_NAMES]
    tokens = [n for n in embeddings if leaf(n) in TOKEN_EMBEDDING_NAMES]
    if not tokens and heads:
        tokens = [n for n, e in embeddings.items() if leaf(n) not in POSITION_EMBEDDING_NAMES
                  and e.num_embeddings == linears[heads[0]].out_features]
    if not heads and tokens:
        heads = [n for n, m in outside.items()
                 if m.out_features == embeddings[tokens[0]].num_embeddings]
    entries = {}
    for name in tokens:
        emb = embeddings[name]
        if emb.num_embeddings % tp_size and not pad_vocab:
            entries[name] = _replicate(name, emb, f"token embedding; vocabulary "
                                       f"{emb.num_embeddings} does not divide by {tp_size}")
        elif emb.max_norm is not None or emb.scale_grad_by_freq or emb.sparse:
            entries[name] = _replicate(name, emb, "token embedding with max_norm, "
                                       "scale_grad_by_freq or sparse")
        else:
            entries[name] = TPEntry(name, "vocab", f"token embedding, vocabulary "
                                    f"{emb.num_embeddings} split in {tp_size}"
                                    f"{_padding(emb.num_embeddings, tp_size)}", _shape(emb),
                                    padded=bool(emb.num_embeddings % tp_size))
    for name in heads:
        head = linears[name]
        if head.out_features % tp_size and not pad_vocab:
            entries[name] = _replicate(name, head, f"LM head; vocabulary {head.out_features} "
                                       f"does not divide by {tp_size}")
            continue
        how = ("logits all-gathered, so the model's own loss sees them whole" if gather_logits
               else "logits stay sharded: use vocab_parallel_cross_entropy")
        if head.out_features % tp_size:
            entries[name] = TPEntry(name, "column", f"LM head, vocabulary-parallel ({how})"
                                    f"{_padding(head.out_features, tp_size)}", _shape(head),
                                    head.bias is not None, gather_output=gather_logits,
                                    padded=True)
        else:
            entries[name] = _column(name, head, f"LM head, vocabulary-parallel ({how})",
                                    tp_size, gather_output=gather_logits)
    for name, emb in embeddings.items():
        if name not in entries:
            entries[name] = _replicate(name, emb, "position embedding" if leaf(name) in
                                       POSITION_EMBEDDING_NAMES else "not the token embedding")
    return entries


def _padding(vocab: int, tp_size: int) -> str:
    return (f", {-(-vocab // tp_size)} rows a rank (the last padded)" if vocab % tp_size
            else "")


def _plan_owner(owner: nn.Module, prefix: str, linears: Mapping[str, nn.Linear],
                planned: Mapping[str, TPEntry], tp_size: int,
                embeddings: Mapping[str, nn.Embedding]
                ) -> tuple[dict[str, TPEntry], list[AttentionPlan]]:
    """The Linears directly owned by one module inside a block."""
    roles = {n: role_of(n) for n in linears}
    head, kv = head_attrs(owner)
    attn_in = [n for n in linears if roles[n] in (Role.FUSED_QKV, Role.ATTN_IN)]
    mlp_in = [n for n in linears if roles[n] in (Role.MLP_IN, Role.FUSED_MLP_IN)]
    q_width, qkv_sections = _attention_width(attn_in, linears, roles, head, kv, prefix)
    mlp_width = {n: linears[n].out_features // (2 if roles[n] is Role.FUSED_MLP_IN else 1)
                 for n in mlp_in}
    entries: dict[str, TPEntry] = {}
    closes: dict[str, list[str]] = {"attn": [], "mlp": []}
    for name in (n for n in linears if roles[n] in ROW_ROLES):
        width = linears[name].in_features
        unit = {u for u, ok in (("attn", attn_in and q_width == width),
                                ("mlp", width in mlp_width.values())) if ok}
        unit &= {Role.ATTN_OUT: {"attn"}, Role.MLP_OUT: {"mlp"}}.get(roles[name], unit)
        if len(unit) == 1:
            closes[unit.pop()].append(name)
        else:
            entries[name] = _replicate(name, linears[name], f"no column-parallel layer of "
                                       f"output width {width} to pair with" if not unit else
                                       "cannot tell whether it closes attention or the MLP")
    for row in closes["mlp"]:
        width = linears[row].in_features
        for name in (n for n in mlp_in if mlp_width[n] == width):
            sections = (width, width) if roles[name] is Role.FUSED_MLP_IN else ()
            entries[name] = _column(name, linears[name], f"MLP input, read by {leaf(row)}",
                                    tp_size, sections=sections)
        entries[row] = _row(name=row, linear=linears[row], tp_size=tp_size,
                            reason="MLP output, back to the residual stream")
    attention = []
    if closes["attn"]:
        biases = {n: e for n, e in embeddings.items() if n.rpartition(".")[0] == prefix}
        plan = _plan_attention(owner, prefix, attn_in, closes["attn"], linears,
                               qkv_sections, head, kv, {**planned, **entries}, tp_size,
                               q_width, biases)
        entries.update(plan[0])
        attention.append(plan[1])
    for name in (n for n in linears if n not in entries and roles[n] in COLUMN_ROLES):
        entries[name] = _replicate(name, linears[name], "no row-parallel layer reads its "
                                   "output")
    unknown = [n for n in linears if n not in entries]
    entries.update(_plan_by_shape(unknown, linears, head is not None, prefix, tp_size))
    return entries, attention


def _attention_width(attn_in, linears, roles, head, kv, prefix
                     ) -> tuple[int | None, dict[str, tuple[int, ...]]]:
    """Width of q (what the output projection reads), and the q/k/v sections of a fused
    projection."""
    fused = [n for n in attn_in if roles[n] is Role.FUSED_QKV]
    if fused:
        out = linears[fused[0]].out_features
        if head and kv:
            total = head[1] + 2 * kv[1]
            if out % total:
                raise UsageError(f"output width {out} is not a multiple of {head[0]} + 2 * "
                                 f"{kv[0]} = {total} heads", where=fused[0],
                                 hint="check the attention module's head counts")
            sections = (head[1] * out // total, kv[1] * out // total, kv[1] * out // total)
        elif out % 3 == 0:
            sections = (out // 3,) * 3
        else:
            return None, {}
        return sections[0], {n: sections for n in fused}
    queries = [n for n in attn_in if leaf(n) in Q_NAMES]
    return (linears[queries[0]].out_features if queries else None), {}


def _plan_attention(owner, prefix, attn_in, outs, linears, qkv_sections, head, kv, planned,
                    tp_size, q_width, biases) -> tuple[dict[str, TPEntry], AttentionPlan]:
    if len(outs) > 1:
        reason = f"several output projections ({', '.join(map(leaf, outs))})"
        return ({n: _replicate(n, linears[n], reason) for n in [*attn_in, *outs]},
                AttentionPlan(prefix, "gather", reason))
    out = outs[0]
    from_config = config_heads(owner) if head is None else None
    if head is None and from_config is None:
        return _gather(attn_in, out, linears, tp_size), AttentionPlan(
            prefix, "gather", "no head-count attribute (n_head, num_heads, "
            "num_attention_heads, n_heads) on the module owning q, k, v")
    for attr, heads in from_config or ((head, kv) if kv else (head,)):
        if heads % tp_size:
            raise UsageError(
                f"{attr}={heads} attention heads do not divide by the tensor-parallel size "
                f"{tp_size}", where=prefix or type(owner).__name__,
                hint=f"choose a tensor-parallel size that divides {heads}")
    if from_config is not None:
        sizes = {n: linears[n].out_features for n in attn_in}
        unit = owner.head_dim * tp_size
        if any(size % unit for size in sizes.values()):
            return _gather(attn_in, out, linears, tp_size), AttentionPlan(
                prefix, "gather", f"q/k/v widths {sorted(set(sizes.values()))} are not "
                f"whole heads of head_dim={owner.head_dim} on each of {tp_size} ranks")
        entries = _head_entries(attn_in, out, linears, qkv_sections, tp_size)
        return entries, AttentionPlan(
            prefix, "heads", f"reshapes into -1 heads of head_dim={owner.head_dim}, so each "
            f"rank's whole heads need no attribute changed ({from_config[0][0]}="
            f"{from_config[0][1]}, {from_config[1][0]}={from_config[1][1]})")
    changes = [HeadChange(attr, heads, heads // tp_size)
               for attr, heads in ((head, kv) if kv else (head,))]
    changes += [HeadChange(attr, q_width, q_width // tp_size) for attr in WIDTH_ATTRS
                if q_width and getattr(owner, attr, None) == q_width and q_width % tp_size == 0]
    entries = _head_entries(attn_in, out, linears, qkv_sections, tp_size)
    entries |= {n: TPEntry(n, "head_split", f"one value per attention head of {prefix}, "
                           "split with the heads", _shape(e)) for n, e in biases.items()
                if e.embedding_dim == head[1]}
    verdict = trial_head_sharding(owner, _local_shapes(prefix, {**planned, **entries},
                                                       tp_size),
                                  {c.attribute: c.local_heads for c in changes},
                                  linears[attn_in[0]].in_features, tp_size)
    if verdict.verdict == "incompatible":
        return _gather(attn_in, out, linears, tp_size), AttentionPlan(
            prefix, "gather", f"its forward does not follow {head[0]}: {verdict.detail}")
    return entries, AttentionPlan(prefix, "heads", verdict.detail, tuple(changes))


def _head_entries(attn_in, out, linears, qkv_sections, tp_size) -> dict[str, TPEntry]:
    entries = {n: _column(n, linears[n], "attention q/k/v, split by heads", tp_size,
                          sections=qkv_sections.get(n, ())) for n in attn_in}
    entries[out] = _row(out, linears[out], "attention output, back to the residual stream",
                        tp_size)
    return entries


def _gather(attn_in, out, linears, tp_size) -> dict[str, TPEntry]:
    entries = {n: _column(n, linears[n], "attention q/k/v, gathered for full-head "
                          "attention", tp_size, gather_output=True) for n in attn_in}
    entries[out] = _row(out, linears[out], "attention output, from the replicated attention",
                        tp_size, input_is_parallel=False)
    return entries


def _local_shapes(prefix: str, entries: Mapping[str, TPEntry], tp_size: int
                  ) -> dict[str, tuple[int, ...]]:
    """This rank's parameter shapes under ``prefix`` (names relative to it)."""
    shapes = {}
    start = f"{prefix}." if prefix else ""
    for name, e in entries.items():
        spec = e.weight_spec()
        if spec is None or not name.startswith(start):
            continue
        local = list(e.shape)
        local[spec.dim] = spec.local_size(e.shape[spec.dim], tp_size)
        shapes[f"{name[len(start):]}.weight"] = tuple(local)
        if e.bias:
            shapes[f"{name[len(start):]}.bias"] = (local[0],) if e.kind == "column" else (
                e.shape[0],)
    return shapes


def _plan_by_shape(unknown: list[str], linears: Mapping[str, nn.Linear], in_attention: bool,
                   prefix: str, tp_size: int) -> dict[str, TPEntry]:
    """Unknown names: an expand ``d -> m`` / contract ``m -> d`` pair is column / row."""
    if in_attention:
        return {n: _replicate(n, linears[n], f"unknown name inside attention module "
                              f"{prefix}") for n in unknown}
    entries = {}
    for name in unknown:
        c = linears[name]
        if c.in_features <= c.out_features:
            continue
        expanders = [n for n in unknown if linears[n].in_features == c.out_features
                     and linears[n].out_features == c.in_features]
        contractors = [n for n in unknown if linears[n].in_features == c.in_features
                       and linears[n].out_features == c.out_features]
        if expanders and len(contractors) == 1:
            entries[name] = _row(name, c, f"by shape: contracts {c.in_features} -> "
                                 f"{c.out_features} (name unknown)", tp_size)
            for n in expanders:
                entries[n] = _column(n, linears[n], f"by shape: expands {c.out_features} -> "
                                     f"{c.in_features} (name unknown)", tp_size)
    return entries | {n: _replicate(n, linears[n], "unknown name and no expand/contract "
                                    "partner") for n in unknown if n not in entries}


def _reconcile_ties(modules: Mapping[str, nn.Module], entries: dict[str, TPEntry]
                    ) -> tuple[dict[str, TPEntry], tuple[tuple[str, ...], ...]]:
    """Modules sharing one weight tensor must split it the same way, or all replicate."""
    shared = defaultdict(list)
    for name in modules:
        if name in entries:
            shared[id(modules[name].weight)].append(name)
    ties = []
    for names in (g for g in shared.values() if len(g) > 1):
        specs = {entries[n].weight_spec() for n in names}
        if len(specs) == 1:
            if specs != {None}:
                ties.append(tuple(names))
            continue
        for n in names:
            entries[n] = _replicate(n, modules[n], f"weight tied to "
                                    f"{', '.join(m for m in names if m != n)}, which would "
                                    "split it differently")
    return entries, tuple(ties)


def apply_autotp(model: nn.Module, plan: TPPlan, group: Group) -> nn.Module:
    """Carry out ``plan`` on ``model`` in place, for this rank of ``group``; returns it.

    Every planned Linear/Embedding is replaced by its tensor-parallel layer built from its
    dense weights (``from_dense``), head counts are divided, tied weights re-tied. The
    model is checked against the plan first and left untouched when it does not match
    (e.g. a plan made for another model, or AutoTP applied twice).
    """
    padded = [e.name for e in plan.entries if e.padded]
    if padded:
        raise UsageError("the plan pads a vocabulary that does not divide by the "
                         "tensor-parallel size, which only inference supports",
                         where=padded[0], hint="plan with pad_vocab=False for training")
    world = tp_world_size(group)
    if world != plan.tp_size:
        raise UsageError(f"the plan is for {plan.tp_size} tensor-parallel ranks but the "
                         f"group has {world}", where="apply_autotp",
                         hint="plan with the size of the group you apply it with")
    modules = dict(model.named_modules())
    for e in plan.entries:
        module = modules.get(e.name)
        kind = nn.Embedding if e.kind in ("vocab", "head_split") else nn.Linear
        if e.kind != "replicate" and not (type(module) is kind and _shape(module) == e.shape):
            raise UsageError(f"expected a dense {kind.__name__} of weight shape "
                             f"{list(e.shape)}, found {type(module).__name__}",
                             where=e.name or "<root>",
                             hint="make the plan from this model, and apply it once")
    for a in plan.attention:
        for h in a.heads:
            if getattr(modules[a.module], h.attribute, None) != h.heads:
                raise UsageError(f"expected {h.attribute}={h.heads}", where=a.module,
                                 hint="make the plan from this model, and apply it once")
    for e in plan.entries:
        if e.kind != "replicate":
            _replace(model, e.name, _tp_layer(modules[e.name], e, group))
    for a in plan.attention:
        for h in a.heads:
            setattr(modules[a.module], h.attribute, h.local_heads)
    for names in plan.ties:
        weight = model.get_submodule(names[0]).weight
        for name in names[1:]:
            model.get_submodule(name).weight = weight
    return model


def _tp_layer(module: nn.Module, e: TPEntry, group: Group) -> nn.Module:
    if e.kind == "column":
        return ColumnParallelLinear.from_dense(module, group, gather_output=e.gather_output,
                                               sections=e.sections, name=e.name)
    if e.kind == "row":
        return RowParallelLinear.from_dense(module, group,
                                            input_is_parallel=e.input_is_parallel, name=e.name)
    if e.kind == "head_split":
        return head_split_embedding(module, tp_rank(group), tp_world_size(group))
    return VocabParallelEmbedding.from_dense(module, group, name=e.name)


def head_split_embedding(embedding: nn.Embedding, rank: int, world: int) -> nn.Embedding:
    """This rank's heads of an embedding holding one value per head (a plain
    ``nn.Embedding`` of ``embedding_dim / world`` columns; its gradient is exact, the heads
    being independent)."""
    local = embedding.embedding_dim // world
    part = nn.Embedding(embedding.num_embeddings, local, device=embedding.weight.device,
                        dtype=embedding.weight.dtype)
    part.weight.data.copy_(embedding.weight.data[:, rank * local:(rank + 1) * local])
    return part


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)
