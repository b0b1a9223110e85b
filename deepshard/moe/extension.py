"""MoE's hook into the runtime (the ``deepshard.extensions`` entry point ``moe``): the
config's ``expert_parallel`` (AutoEP) section shards an HF model's fused experts over the
expert-parallel ranks before the layout is applied. deepshard's own ``MoE`` layers need no
hook: the runtime finds them by their base class
(:class:`~deepshard.runtime.parallel.expert_groups.ExpertParallelLayer`)."""

from __future__ import annotations

from typing import Any

import torch

from deepshard.runtime.extensions import Extension


def _expert_parallel(module: torch.nn.Module, cfg: Any, group: Any, rank: int
                     ) -> dict[int, torch.nn.Parameter]:
    """By the ``id`` of each fused HF expert parameter, the per-expert parameters now
    standing for it on this rank."""
    del rank
    if not cfg.expert_parallel:
        return {}
    from deepshard.moe.hf import apply_expert_parallel

    return apply_expert_parallel(module, cfg.expert_parallel, group)


EXTENSION = Extension(name="moe", sections=("expert_parallel",),
                      before_layout=_expert_parallel)
