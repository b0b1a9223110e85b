"""Sequence parallelism's hook into the runtime (the ``deepshard.extensions`` entry point
``sequence``): the config's ``sequence_parallel`` switches (ALST: tiled MLP, tiled logits and
loss, activation offload) applied to the model once the layout is in place."""

from __future__ import annotations

import logging
from typing import Any

import torch

from deepshard.runtime.extensions import Extension


def _apply(module: torch.nn.Module, cfg: Any, group: Any, rank: int
           ) -> dict[int, torch.nn.Parameter]:
    del group
    if not cfg.sequence_parallel.any_enabled():
        return {}
    from deepshard.sequence.alst import apply_alst

    for line in apply_alst(module, cfg.sequence_parallel):
        if rank == 0:
            logging.getLogger("deepshard").info("sequence_parallel: %s", line)
    return {}  # ALST swaps forwards, never parameters


EXTENSION = Extension(name="sequence", sections=("sequence_parallel",), after_layout=_apply)
