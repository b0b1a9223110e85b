"""ALST's ``UlyssesSPAttentionHF``: Ulysses sequence parallelism for transformers models.

:meth:`UlyssesSPAttentionHF.register_with_transformers` (DeepSpeed's arguments) creates the
sequence-parallel groups and puts a wrapper in transformers' ``ALL_ATTENTION_FUNCTIONS``
under the model's own implementation name (``sdpa`` or ``eager``), as DeepSpeed does, so
that every other branch transformers takes on that name still runs. The wrapper receives
each layer's query, key and value for this rank's shard of the sequence (rotary
embeddings already applied from the batch's global ``position_ids``), exchanges them for
the whole sequence of this rank's heads (:mod:`.layer`'s exchange and head plan: any head
count of at least the group size, grouped-query attention with fewer key/value heads than
ranks), runs the real attention causally over the whole sequence and exchanges the
output back. The model's shard-sized attention mask is dropped: batches are right-padded
with ``-100`` labels on the padding (:mod:`.loader`), where causal attention of the real
tokens is exact. :func:`unregister_from_transformers` puts transformers' own back.
deepshard's HF ``Trainer`` makes this call itself when the config's
``sequence_parallel_size`` (or HF's ``parallelism_config.sp_size``) is above 1
(:mod:`deepshard.integrations.hf_trainer`).

Each layer's ``module.num_key_value_groups`` is left alone: the attention sees a stand-in
of the module with the local ratio of query to key/value heads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from deepshard import comm
from deepshard.errors import UsageError
from deepshard.sequence.layer import _plan, gather_heads, scatter_heads

SUPPORTED = ("sdpa", "eager")


class _LocalHeads:
    """``module`` as the attention function sees it, with this rank's query/key-value
    head ratio."""

    def __init__(self, module: torch.nn.Module, groups: int) -> None:
        self._module = module
        self.num_key_value_groups = groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class UlyssesSPAttentionHF(torch.nn.Module):
    """A transformers attention function over a sequence-parallel group (DeepSpeed's
    constructor arguments; the shape ones are checked per call instead)."""

    def __init__(self, attn: Any, batch_size: int, attn_head_count: int, attn_head_size: int,
                 kv_head_count: int, num_hidden_layers: int, process_group: Any,
                 seq_length_is_variable: bool = False, local_seq_length: int | None = None,
                 global_seq_length: int | None = None, disable_in_eval: bool = False) -> None:
        super().__init__()
        self.attn, self.process_group = attn, process_group
        self.world_size = comm.get_world_size(process_group)
        self.sp_rank = comm.get_rank(process_group)
        self.attn_head_count, self.global_kv_head_count = attn_head_count, kv_head_count
        self.attn_head_size, self.batch_size = attn_head_size, batch_size
        self.num_hidden_layers = num_hidden_layers
        self.disable_in_eval = disable_in_eval
        self.core_attn_implementation: str | None = None
        self.plan = _plan(attn_head_count, kv_head_count, self.world_size)  # errors now

    def forward(self, module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        """transformers' attention call: ``[batch, heads, seq/P, head_dim]`` in,
        ``([batch, seq/P, heads, head_dim], None)`` out."""
        if self.world_size == 1 or (self.disable_in_eval and not module.training):
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        plan, rank, group = self.plan, self.sp_rank, self.process_group
        if (query.shape[1], key.shape[1]) != (plan.query_heads, plan.kv_heads):
            raise UsageError(f"the layer has {query.shape[1]} query and {key.shape[1]} "
                             f"key/value heads, registered for {plan.query_heads} and "
                             f"{plan.kv_heads}", where="UlyssesSPAttentionHF",
                             hint="register with the model that is trained")
        q = scatter_heads(query.transpose(1, 2), plan.q_counts, rank, group)
        kv_counts = [len(i) for i in plan.kv_index]
        index = [h for i in plan.kv_index for h in i]
        k, v = (scatter_heads(t.transpose(1, 2), kv_counts, rank, group, index)
                for t in (key, value))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, h_local, seq, d]
        local = _LocalHeads(module, q.shape[1] // k.shape[1])
        out, _ = self.attn(local, q, k, v, self._mask(q), *args, **kwargs)
        return gather_heads(out, plan.q_counts, rank, group), None

    def _mask(self, q: Tensor) -> Tensor | None:
        """sdpa: none (it is causal then); eager: the causal additive mask of the whole
        sequence."""
        if self.core_attn_implementation != "eager":
            return None
        seq = q.shape[2]
        upper = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
        mask = torch.zeros(seq, seq, dtype=q.dtype, device=q.device)
        return mask.masked_fill(upper, torch.finfo(q.dtype).min)[None, None]

    @classmethod
    def register_with_transformers(cls, model_name_or_path: Any, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: int,
                                   seq_length: int | None = None,
                                   seq_length_is_variable: bool = True,
                                   disable_in_eval: bool = False,
                                   max_length: int | None = None) -> Any:
        """Create the groups and wrap ``core_attn_implementation`` (see the module
        docstring); returns the groups as DeepSpeed's ``mpu`` (pass it to
        ``deepshard.initialize(mpu=...)``), ``None`` for ``sequence_parallel_size`` 1.
        ``model_name_or_path``: the model, or its name or path (for its config)."""
        del seq_length, seq_length_is_variable, max_length  # shapes are read per call
        if sequence_parallel_size == 1:
            return None
        from transformers import AutoConfig
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        config = getattr(model_name_or_path, "config", None)
        if config is None:
            config = AutoConfig.from_pretrained(model_name_or_path)
        _check_implementation(config, core_attn_implementation, model_name_or_path)
        groups = sequence_groups(sequence_parallel_size)
        text = config.get_text_config()
        heads = text.num_attention_heads
        uattn = cls(_core(core_attn_implementation), micro_batch_size, heads,
                    getattr(text, "head_dim", None) or text.hidden_size // heads,
                    getattr(text, "num_key_value_heads", None) or heads,
                    text.num_hidden_layers, groups.get_sequence_parallel_group(),
                    disable_in_eval=disable_in_eval)
        uattn.core_attn_implementation = core_attn_implementation

        def uattn_wrapper(module, query, key, value, attention_mask, *args, **kwargs):
            return uattn(module, query, key, value, attention_mask, *args, **kwargs)

        uattn_wrapper.ulysses = uattn  # type: ignore[attr-defined]
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = uattn_wrapper
        return groups


def unregister_from_transformers(core_attn_implementation: str) -> None:
    """Put transformers' own ``core_attn_implementation`` back (after
    :meth:`UlyssesSPAttentionHF.register_with_transformers`)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if core_attn_implementation in ALL_ATTENTION_FUNCTIONS._local_mapping:
        del ALL_ATTENTION_FUNCTIONS[core_attn_implementation]


def sequence_groups(sequence_parallel_size: int) -> Any:
    """The job's sequence-parallel groups (consecutive ranks) with DeepSpeed's ``mpu``
    methods: a :class:`~deepshard.runtime.parallel.topology.ProcessGroups` (a collective
    call)."""
    from deepshard.runtime.parallel.topology import ProcessGroups, Topology

    topo = Topology.from_config(comm.get_world_size(), sp_size=sequence_parallel_size)
    return ProcessGroups.create(topo)


def _core(name: str) -> Any:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":
        from transformers.models.llama.modeling_llama import eager_attention_forward

        found = ALL_ATTENTION_FUNCTIONS.get("eager", eager_attention_forward)
    else:
        found = ALL_ATTENTION_FUNCTIONS[name]
    wrapped = getattr(found, "ulysses", None)  # registered before: wrap the real one
    return found if wrapped is None else wrapped.attn


def _check_implementation(config: Any, name: str, model: Any) -> None:
    if name not in SUPPORTED:
        raise UsageError(f"core_attn_implementation {name!r} is not supported on this "
                         f"build (supported: {', '.join(SUPPORTED)})",
                         where="UlyssesSPAttentionHF.register_with_transformers",
                         hint="load the model with attn_implementation='sdpa'")
    loaded = getattr(config, "_attn_implementation", None)
    if hasattr(model, "config") and loaded is not None and loaded != name:
        raise UsageError(f"core_attn_implementation is {name!r} but the model runs "
                         f"{loaded!r}", where="UlyssesSPAttentionHF.register_with_transformers",
                         hint="pass the model's attn_implementation (or load it with this one)")
