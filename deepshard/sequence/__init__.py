"""``deepspeed.sequence``: long sequences, Ulysses sequence parallelism and ALST.

``layer`` (DeepSpeed's ``DistributedAttention`` and ``_SeqAllToAll``), ``heads`` (which
heads each rank of a sequence-parallel group attends over), ``loader`` (the sequence
shard of a batch, ALST's ``UlyssesSPDataLoaderAdapter``), ``loss`` (the loss averaged
over a group's valid tokens), ``hf`` (ALST's ``UlyssesSPAttentionHF`` for transformers
models), ``tiled`` and ``offload`` (ALST's memory tricks). The groups come from the
config's ``sequence_parallel_size`` (:mod:`deepshard.runtime.parallel.topology`).

The package also offers, by name, what DeepSpeed's ALST module
``deepspeed.runtime.sequence_parallel.ulysses_sp`` holds (``--deepspeed_compat`` maps that
module here). Importing this package does not import its modules: a name is imported on
first access (PEP 562).
"""

from __future__ import annotations

import importlib

# public name -> the module of this package that defines it
_EXPORTS = {
    "DistributedAttention": "layer",
    "UlyssesSPAttentionHF": "hf",
    "UlyssesSPDataLoaderAdapter": "loader",
    "shard_batch": "loader",
    "sequence_parallel_loss": "loss",
    "TiledMLP": "tiled",
    "TiledFusedLogitsLoss": "tiled",
    "tiled_mlp": "tiled",
    "tiled_logits_loss": "tiled",
}
_SUBMODULES = ("alst", "heads", "hf", "layer", "loader", "loss", "offload", "tiled")

__all__ = [*_EXPORTS, *_SUBMODULES]


def __getattr__(name: str) -> object:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)
