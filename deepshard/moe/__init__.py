"""``deepspeed.moe``: Mixture of Experts with expert parallelism.

``layer.MoE`` (DeepSpeed's layer), ``sharded_moe`` (gate, gating functions, the layer that
exchanges tokens), ``experts.Experts`` (the expert-parallel process groups and the expert
parameters' optimizer groups are the runtime's: :mod:`deepshard.runtime.parallel.expert_groups`,
:mod:`deepshard.runtime.parallel.expert_params`), ``hf`` (HF transformers MoE blocks with
expert parallelism:
:func:`~deepshard.moe.hf.shard_hf_moe`, also importable from here). Importing this package
does not import the layer modules."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "shard_hf_moe":
        from deepshard.moe.hf import shard_hf_moe

        return shard_hf_moe
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
