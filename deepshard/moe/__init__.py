"""``deepspeed.moe``: Mixture of Experts with expert parallelism.

``layer.MoE`` (DeepSpeed's layer), ``sharded_moe`` (gate, gating functions, the layer that
exchanges tokens), ``experts.Experts``, ``groups`` (expert-parallel process groups,
:func:`~deepshard.moe.groups.configure`), ``utils`` (expert parameters and their optimizer
groups), ``hf`` (HF transformers MoE blocks with expert parallelism:
:func:`~deepshard.moe.hf.shard_hf_moe`, also importable from here). Importing this package
does not import the layer modules."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "shard_hf_moe":
        from .hf import shard_hf_moe

        return shard_hf_moe
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
